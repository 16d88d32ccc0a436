"""``--decoding self-draft``: the verifier's own int8 copy drafts, the
float32 verifier checks.

Strict output against stock fairseq's ``--beam 1`` through fairseq-generate
(batch 1, 8 and 64, ``--max-tokens``, both backends), the drafts accepted,
the copy's cache after rejections (a copy that drafts wrong tokens on
purpose still decodes exactly), the int8 products against float32, and the
refusals.  The seven stock architectures are in tests/test_verifier_variants.py.
"""
import math
import re

import pytest
import torch

import specdec_helpers as H
from fairseq_specdec.kernels import rowgemm
from fairseq_specdec.utils.int8 import Int8Linear, int8_unavailable_reason

pytestmark = pytest.mark.skipif(int8_unavailable_reason() is not None, reason=str(int8_unavailable_reason()))

SD = ("--decoding", "self-draft")
STATS = re.compile(r"self-draft: (\d+) sentences, (\d+) tokens \(EOS included\), (\d+) iterations, Tok\. ([\d.]+)")


def test_int8_linear_is_close_to_float32():
    """The int8 product is an approximation of F.linear within the
    quantization error (7-bit activations, 8-bit weights per row), with the
    bias and the fused ReLU; a product that ignored the scales, the bias or
    the ReLU would be far off."""
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(96, 64, generator=g), torch.randn(96, generator=g)
    x = torch.randn(5, 3, 64, generator=g)
    want = torch.nn.functional.linear(x, weight, bias)
    got = Int8Linear(weight, bias)(x)
    assert got.shape == want.shape and got.dtype == torch.float32
    err = (got - want).abs().max().item()
    assert err < 0.05 * want.abs().max().item(), err
    relu = Int8Linear(weight, bias, relu=True)(x)
    assert bool((relu >= 0).all()) and (relu - want.clamp(min=0)).abs().max().item() < 0.05 * want.abs().max().item()
    assert (Int8Linear(weight, None)(x) - (want - bias)).abs().max().item() < 0.05 * want.abs().max().item()


def int8_reference(x, weight, bias, relu):
    """What the kernel's int8 panels compute (``kernels/csrc/rowgemm.cpp``),
    written out in torch: the weight rows rounded to int8 at scale
    s = max |row| / 127; each row of x rounded (half to even) to integers
    within Q = min(32767, (2^31 - 1) // (127 K)) at scale a / Q (a = max |x
    row|; a row of zeros stays zeros); their integer products summed
    exactly; then float32 (d * s) * (a / Q) + b, the last multiply and the
    bias rounded once (a float64 sum of the exact float32 product here)."""
    n, k = weight.shape
    s = (weight.abs().amax(1) / 127).clamp(min=1e-12)
    q = (weight / s[:, None]).round().clamp(-127, 127).long()
    big_q = min(32767, (2**31 - 1) // (127 * k))
    fq = torch.tensor(float(big_q))
    rows = []
    for row in x:
        a = row.abs().max()
        if a > 0:
            xq, sx = (row * (fq / a)).round().clamp(-big_q, big_q).long(), a / fq
        else:
            xq, sx = torch.zeros(k, dtype=torch.long), torch.tensor(0.0)
        ds = (q * xq).sum(1).float() * s  # exact integer sums (int64 here), then float32
        y = ds * sx if bias is None else (ds.double() * sx.double() + bias.double()).float()
        rows.append(y.clamp(min=0) if relu else y)
    return torch.stack(rows)


@pytest.mark.skipif(not rowgemm.int8_available(), reason="the C++ extension's int8 panels do not run here")
@pytest.mark.parametrize("shape", [(96, 64, 1), (37, 33, 5), (300, 256, 8), (20, 50, 13), (24, 1, 3), (41, 1025, 17)],
                         ids=str)
def test_int8_panels_compute_the_quantized_weight_and_rows(shape):
    """The kernel's int8 panels: int8 weights (q * s per row) against each
    row of x quantized to 16-bit integers at its own scale, summed exactly
    in integers (:func:`int8_reference`), for blocks of 1-8 rows and the
    row groups past 8, ragged N, odd and even K, a row of zeros, with and
    without the bias and the ReLU; and each row's result is the same
    whatever else the call holds.  A kernel that dropped a k-row of a
    pair, read another panel's scales or another row's scale would be far
    off; one that summed in float32 would differ in the last bits."""
    n, k, m = shape
    g = torch.Generator().manual_seed(n + k + m)
    w, b, x = torch.randn(n, k, generator=g), torch.randn(n, generator=g), torch.randn(m, k, generator=g) * 3
    x[m // 2] = 0.0
    for bias in (b, None):
        for act in (None, "relu"):
            lin = rowgemm.PackedLinear(w, bias, act, "int8")
            got = lin(x)
            want = int8_reference(x, w, bias, act == "relu")
            if bias is None:
                assert torch.equal(got, want)
            else:  # at most the float64 sum's second rounding apart: one unit in the last place
                ulp = (torch.nextafter(want.abs(), torch.tensor(math.inf)) - want.abs())
                assert bool(((got - want).abs() <= ulp).all())
            for i in range(m):
                assert torch.equal(lin(x[i : i + 1]), got[i : i + 1]), i
                assert torch.equal(lin(x[: i + 1]), got[: i + 1]), i


@pytest.mark.skipif(not rowgemm.int8_available(), reason="the C++ extension's int8 panels do not run here")
def test_int8_sums_do_not_overflow_at_the_largest_values():
    """Every weight and input at its largest magnitude, K odd and large: the
    integer sum 127 * K * Q stays below 2^31 (Q shrinks with K), so the
    result is the exact product, of either sign."""
    k = 4099
    big_q = min(32767, (2**31 - 1) // (127 * k))
    w = torch.ones(16, k)
    w[8:] = -1.0
    x = torch.full((2, k), 2.5)
    got = rowgemm.PackedLinear(w, None, None, "int8")(x)
    assert 127 * k * big_q < 2**31
    torch.testing.assert_close(got, x @ w.t(), rtol=1e-6, atol=0.0)
    assert torch.equal(got, int8_reference(x, w, None, False))


@pytest.mark.parametrize("backend", sorted(H.BACKEND_ARGS))
def test_the_backend_chooses_the_int8_products(toy_bin, ar_checkpoint, backend):
    """auto: int8 panels in the fused C++ layers where the extension runs;
    reference: torch's quantized library (no native code)."""
    from fairseq import tasks

    model, _ = H.load_model(ar_checkpoint, toy_bin)
    cfg = H.generation_cfg(toy_bin, "--beam", "1", "--task", "draft_verify", *SD, *H.BACKEND_ARGS[backend])
    gen = tasks.setup_task(cfg.task).build_generator([model], cfg.generation)
    native = backend == "auto" and rowgemm.int8_available()
    assert gen.drafter.native is native
    assert gen.drafter.copy.gemm == ("rowgemm" if native else "torch-int8")
    assert gen.drafter.copy.fused is native


def stats_of(proc):
    found = STATS.findall(proc.stdout + proc.stderr)
    assert found, (proc.stdout + proc.stderr)[-3000:]
    sentences, tokens, iterations, _ = found[-1]
    return int(sentences), int(tokens), int(iterations)


@pytest.mark.slow
@pytest.mark.parametrize("backend", sorted(H.BACKEND_ARGS))
@pytest.mark.parametrize("batch", [["--batch-size", "1"], ["--batch-size", "8"], ["--batch-size", "64"],
                                   ["--max-tokens", "300"]], ids=["bs1", "bs8", "bs64", "max-tokens"])
def test_self_draft_is_beam1_and_accepts_drafts(toy_bin, ar_checkpoint, baseline, backend, batch):
    """Identical to stock --beam 1 (tokens; scores within the helpers'
    tolerance) with every row drafting (--draft-max-rows 0), and the copy's
    drafts accepted: far fewer iterations than tokens."""
    proc = H.run(
        [H.cli("fairseq-generate"), toy_bin, "--path", ar_checkpoint, "--gen-subset", "test", "--task", "draft_verify",
         "--beam", "1", "--cpu", "--user-dir", H.USER_DIR, *SD, "--draft-max-rows", "0", *batch,
         *H.BACKEND_ARGS[backend]])
    got = H.parse_generate(proc.stdout)
    H.assert_same_hypotheses(baseline(1), got)
    sentences, tokens, iterations = stats_of(proc)
    assert sentences == H.SPLIT_SIZES["test"]
    # the toy verifier's int8 copy agrees with it on most tokens: a drafter
    # that never drafted, or whose drafts were all rejected, has iterations == tokens
    assert iterations * 1.5 < tokens, (tokens, iterations)


class _WrongCopy:
    """Wraps the int8 copy's pass: every ``every``-th pass's log-probs are
    replaced so that it drafts a wrong token (the least likely one), as a
    bad copy would."""

    def __init__(self, inner, every=3):
        self.inner, self.every, self.calls = inner, every, 0

    def forward(self, tokens, rows, needed=None):
        lprobs = self.inner.forward(tokens, rows, needed)
        self.calls += 1
        if self.calls % self.every == 0:
            lprobs[:, -1] = -lprobs[:, -1]
            lprobs[:, -1, :4] = -float("inf")  # never a special symbol
        return lprobs

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("bsz", [1, 8])
@pytest.mark.parametrize("backend", sorted(H.BACKEND_ARGS))
def test_rejected_drafts_leave_the_copy_cache_consistent(toy_bin, ar_checkpoint, bsz, backend):
    """Drafts the verifier rejects (a wrong token every third pass of the
    copy), drafts all accepted (the copy's cache one token behind) and
    rows leaving the batch: the output is still fairseq's --beam 1, and
    the copy's cache counts never pass the verifier's."""
    from fairseq import tasks

    model, _ = H.load_model(ar_checkpoint, toy_bin)
    cfg = H.generation_cfg(toy_bin, "--beam", "1", "--task", "translation")
    task = tasks.setup_task(cfg.task)
    stock = task.build_generator([model], cfg.generation)
    want = H.output_tokens(H.run_generator(stock, model, H.batches(task, "test", bsz)))

    cfg = H.generation_cfg(toy_bin, "--beam", "1", "--task", "draft_verify", *SD, "--draft-max-rows", "0", "--block-size", "2",
                           "--draft-min-confidence", "0", *H.BACKEND_ARGS[backend])
    task = tasks.setup_task(cfg.task)
    gen = task.build_generator([model], cfg.generation)
    drafter = gen.drafter
    drafter.copy = _WrongCopy(drafter.copy)
    seen = []
    update = drafter.update

    def checked_update(state, feedback):
        update(state, feedback)
        assert all(c <= n for c, n in zip(drafter.cached, state.lengths_host)), (drafter.cached, state.lengths_host)
        seen.append((list(feedback.drafted), list(feedback.accepted)))

    drafter.update = checked_update
    got = H.output_tokens(H.run_generator(gen, model, H.batches(task, "test", bsz)))
    assert got == want
    pairs = [(d, a) for drafted, accepted in seen for d, a in zip(drafted, accepted) if d > 0]
    assert any(a < d for d, a in pairs), "no draft was rejected: the test exercises nothing"
    assert any(a == d for d, a in pairs), "no draft was accepted whole: the catch-up pass is not exercised"


@pytest.mark.skipif(not rowgemm.decoder_steps_available(), reason="the C++ extension's draft steps are not built here")
def test_draft_steps_pick_as_torch_max_with_pad_masked():
    """The native steps' pick (one step, no pass fed): each row's first
    largest log-prob other than pad's, a NaN before any number, as
    ``lprobs[:, pad] = -inf; lprobs.max(-1)``; the pick's log-prob beside it."""
    V, pad, eos = 50, 1, 2
    g = torch.Generator().manual_seed(0)
    first = torch.randn(7, V, generator=g)
    first[0, pad] = 100.0  # pad is never picked
    first[1, [5, 9, 40]] = 50.0  # ties: the first
    first[2, 7], first[2, 30] = float("nan"), 60.0  # a NaN wins, the first of them
    first[2, 33] = float("nan")
    first[3] = -math.inf  # every type impossible: index 0, as torch's max
    first[4, eos] = 70.0  # EOS may be picked (the row then stops drafting)
    first[5, V - 1] = 80.0  # the last type
    empty = torch.empty(0)
    picks, scores, features = rowgemm._ext.decoder_steps(
        first, 1, pad, eos, -math.inf, list(range(7)), empty, 1.0, None, [], [], [], [], [], [], None, None, None,
        1e-5, empty, V, None, 1.0)
    want = first.clone()
    want[:, pad] = -math.inf
    best, token = want.max(-1)
    assert picks.tolist() == token.unsqueeze(1).tolist()
    assert torch.equal(scores[:, 0].nan_to_num(-1.0), best.nan_to_num(-1.0))
    assert features is None  # one step: no pass ran


@pytest.mark.skipif(not rowgemm.decoder_steps_available(), reason="the C++ extension's draft steps are not built here")
@pytest.mark.parametrize("bsz, argv", [(1, ()), (8, ()), (8, ("--draft-min-confidence", "0.5"))],
                         ids=["bs1", "bs8", "bs8-cut"])
def test_native_draft_steps_are_the_python_steps(toy_bin, ar_checkpoint, bsz, argv):
    """The copy's steps in one native call propose what the Python loop
    over its passes proposes (the ``steps`` part switched off): the same
    drafts and bitwise the same log-probs at every iteration of a decoding
    (so the cache they leave behind feeds the next iteration alike), steps
    cut where the Python loop cuts them (a confidence cut, EOS, k)."""
    from fairseq import tasks

    model, _ = H.load_model(ar_checkpoint, toy_bin)

    def proposals(native):
        cfg = H.generation_cfg(toy_bin, "--beam", "1", "--task", "draft_verify", *SD, "--draft-max-rows", "0", *argv)
        task = tasks.setup_task(cfg.task)
        task.generation_services.parts_off = frozenset() if native else frozenset({"steps"})
        gen = task.build_generator([model], cfg.generation)
        assert gen.drafter.native_steps is native
        assert gen.drafter.copy.steps_in_one_call, "the copy's pass is not one native call: nothing to compare"
        seen, propose = [], gen.drafter.propose

        def recorded(state, k):
            drafts, scores = propose(state, k)
            seen.append((k, drafts.clone(), scores.clone()))
            return drafts, scores

        gen.drafter.propose = recorded
        out = H.output_tokens(H.run_generator(gen, model, H.batches(task, "test", bsz)))
        return out, seen

    got, native = proposals(True)
    want, python = proposals(False)
    assert got == want
    assert len(native) == len(python) > 0
    for (k, d, s), (k2, d2, s2) in zip(native, python):
        assert k == k2 and torch.equal(d, d2) and torch.equal(s, s2), (k, d, d2, s, s2)
    steps = [d.size(1) for _, d, _ in native]
    assert any(n < k for (k, _, _), n in zip(native, steps)), "no steps were cut short: the test exercises nothing"
    assert any(n > 1 for n in steps)


def test_the_verifier_and_its_copy_check_their_weights_once_and_both_follow_a_change(toy_bin, ar_checkpoint, monkeypatch):
    """The verify pass and the int8 copy lay out the same decoder layers:
    one weight check per batch serves both (the encoder has its own); a
    change of the verifier's weights between batches (through ``.data``, as
    an optimizer writes) lays both out again, and the output is the
    changed model's --beam 1."""
    from fairseq import tasks
    from fairseq_specdec.utils.projection import WeightsWatch

    model, _ = H.load_model(ar_checkpoint, toy_bin)
    cfg = H.generation_cfg(toy_bin, "--beam", "1", "--task", "draft_verify", *SD, "--draft-max-rows", "0")
    task = tasks.setup_task(cfg.task)
    gen = task.build_generator([model], cfg.generation)
    sample = H.batches(task, "test", 4)[0]
    gen.generate([model], sample)
    looked, changed = [], WeightsWatch.changed
    monkeypatch.setattr(WeightsWatch, "changed", lambda self, weights: looked.append(self) or changed(self, weights))
    gen.generate([model], sample)
    verifier, copy = gen.verifier, gen.drafter.copy
    assert verifier._weights is copy._weights
    decoder_looks = [w for w in looked if w is verifier._weights.watch]
    assert len(decoder_looks) == 1, looked
    layers = (verifier.layers, copy.layers)
    with torch.no_grad():
        for p in model.decoder.layers[0].fc2.parameters():
            p.data.mul_(1.5)
    got = H.output_tokens(H.run_generator(gen, model, [sample]))
    assert verifier.layers is not layers[0] and copy.layers is not layers[1]
    stock_cfg = H.generation_cfg(toy_bin, "--beam", "1", "--task", "translation")
    stock = tasks.setup_task(stock_cfg.task).build_generator([model], stock_cfg.generation)
    want = H.output_tokens(H.run_generator(stock, model, [sample]))
    assert got == want


def test_refusals(toy_bin, ar_checkpoint, tmp_path):
    """A drafter checkpoint or --draft-tree is refused by name before any output."""
    proc = H.generate(toy_bin, ar_checkpoint, *SD, "--drafter-path", str(tmp_path / "x.pt"), task="draft_verify",
                      check=False)
    assert proc.returncode != 0 and "--decoding self-draft" in proc.stderr and not H.parse_generate(proc.stdout)
    proc = H.generate(toy_bin, ar_checkpoint, *SD, "--draft-tree", "4", task="draft_verify", check=False)
    assert proc.returncode != 0 and "--draft-tree" in proc.stderr and not H.parse_generate(proc.stdout)


@pytest.mark.parametrize("argv, cut", [((), 0.0), (("--draft-min-confidence", "0.3"), 0.3)], ids=["default", "given"])
def test_self_draft_confidence_cut_default_is_its_own(toy_bin, ar_checkpoint, argv, cut):
    """--draft-min-confidence left out: self-draft's own default (no cut,
    chosen on the valid split), while the other decodings keep 0.2; given,
    it applies to every decoding."""
    from fairseq import tasks

    model, _ = H.load_model(ar_checkpoint, toy_bin)

    def policy_cut(*args):
        cfg = H.generation_cfg(toy_bin, "--beam", "1", "--task", "draft_verify", *args)
        return tasks.setup_task(cfg.task).build_generator([model], cfg.generation)

    gen = policy_cut(*SD, *argv)
    assert gen.policy.min_confidence == cut and gen.drafter.min_confidence == cut
    other = policy_cut("--decoding", "ngram", *argv)
    assert other.policy.min_confidence == (cut if argv else 0.2)
