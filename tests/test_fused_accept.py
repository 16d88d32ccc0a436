"""The native acceptance step: the extension's strict step (``kernels/csrc/step.cpp``)
gives the values of the loop's tensor operations.

* on random log-probs with planted drafts (accepted prefixes of every
  length, a drafted EOS inside the accepted prefix, ragged drafts, NaNs, the
  ``--min-len`` and length-limit rules) its tokens, log-probs, running scores
  and counts equal the tensor operations' bitwise, and it leaves the
  log-probs as they were;
* a tie for a greedy pick (which fairseq's top-2 decides) is left to the
  tensor operations, which then take the iteration;
* decodings through it equal fairseq's ``--beam 1`` and the tensor
  operations' decodings;
* the backend chooses it where it runs (strict, no ``--unkpen``, a CPU, not ``reference``).
"""
import types

import pytest
import torch

import specdec_helpers as H
from specdec_helpers import OPTION_SETS, assert_identical, run_generator, seq_gen
import fairseq_specdec  # noqa: F401
from fairseq_specdec.generation import NATBlockDrafter, NoDrafter, SpeculativeGenerator, StrictAcceptance, TopBetaAcceptance
from fairseq_specdec.generation.tree import chain_tree
from fairseq_specdec.kernels import rowgemm

pytestmark = pytest.mark.skipif(
    rowgemm.strict_step_unavailable_reason() is not None, reason=str(rowgemm.strict_step_unavailable_reason())
)


@pytest.fixture(scope="module")
def model_and_dict(toy_bin):
    from test_lean_verifier import untrained_transformer

    model, task = untrained_transformer(toy_bin)
    return model, task


class CountingStep:
    """Counts the extension's strict steps and the ties it reported."""

    def __init__(self, monkeypatch):
        self.calls = self.ties = 0
        real = rowgemm.strict_step

        def counted(*args, **kwargs):
            self.calls += 1
            out = real(*args, **kwargs)
            self.ties += out is None
            return out

        monkeypatch.setattr(rowgemm, "strict_step", counted)


def generator(model, d, accept_impl="auto", acceptance=None, **opts):
    """``accept_impl``: ``torch`` switches the native step off (the benchmark's ``accept`` part)."""
    opts = dict(dict(max_len_a=0, max_len_b=200, min_len=1), **opts)
    return H.make_generator(model, NoDrafter(), d, 8, acceptance=acceptance,
                            off=("accept",) if accept_impl == "torch" else (), **opts)


#: the rules the native step computes: strict, and top-beta with the verifier's scores
RULES = {"strict": None, "b3t1": (3, 1.0), "b5t3": (5, 3.0), "b2t0.5": (2, 0.5)}


def rule_of(name):
    return StrictAcceptance() if RULES[name] is None else TopBetaAcceptance(*RULES[name])


def planted_case(seed, d, bsz, k, second=False):
    """Log-probs whose greedy picks follow planted drafts for a random number
    of slots per row, then differ; some rows draft an EOS in that prefix,
    some draft fewer tokens (pads, their later slots -inf as the verify pass
    leaves unprojected slots), some entries are NaN.  With ``second``, the
    draft at the first slot that differs is the slot's second choice, 0.3
    below the first (what top-beta verification accepts, strict does not)."""
    g = torch.Generator().manual_seed(seed)
    V, pad, eos = len(d), d.pad(), d.eos()
    logits = torch.randn(bsz, k + 1, V, generator=g) * 2
    drafts = torch.randint(d.nspecial, V, (bsz, k), generator=g)
    drafted = []
    for r in range(bsz):
        right = int(torch.randint(0, k + 1, (1,), generator=g))  # drafts the verifier agrees with
        if k and torch.rand(1, generator=g) < 0.3:
            drafts[r, int(torch.randint(0, max(1, right), (1,), generator=g))] = eos
        for j in range(right):
            logits[r, j, drafts[r, j]] += 20.0
        if second and right < k:
            row = logits[r, right]
            row[drafts[r, right]] = row.max() - 0.3
        count = k
        if k and torch.rand(1, generator=g) < 0.3:  # a ragged row: fewer drafts
            count = int(torch.randint(0, k, (1,), generator=g))
            drafts[r, count:] = pad
        drafted.append(count)
    lprobs = torch.log_softmax(logits, dim=-1)
    for r, count in enumerate(drafted):
        lprobs[r, count + 1:] = -float("inf")  # not projected
    nans = torch.rand(lprobs.shape, generator=g) < 0.01
    nans[..., eos] = False  # at the length limit a NaN EOS would leave every token -inf: a tie
    lprobs[nans & (lprobs < -3)] = float("nan")
    lengths = torch.randint(0, 12, (bsz,), generator=g)
    cum = -torch.rand(bsz, generator=g) * 10
    last = drafts.new_zeros(bsz, 1)
    state = types.SimpleNamespace(lengths=lengths, lengths_host=lengths.tolist(), cum=cum, size=bsz,
                                  device=torch.device("cpu"), last_tokens=lambda: last)
    return lprobs, drafts, drafted, state


def accept(gen, fused, lprobs, drafts, drafted, state, max_len):
    """The generator's native step (``fused``) or the tensor step it falls back to."""
    step = gen.step if fused else gen.step.fallback
    return step(state, lprobs, chain_tree(drafts), drafted if drafts.size(1) else None, max_len, True)


def assert_same_step(a, b):
    tokens_a, lprobs_a, n_a, cum_a, counts_a, path_a, passes_a = a
    tokens_b, lprobs_b, n_b, cum_b, counts_b, path_b, passes_b = b
    assert path_a is None and path_b is None  # a chain
    assert passes_a == passes_b == 1  # one verify pass
    assert n_a.tolist() == n_b.tolist()
    assert counts_a.tolist() == counts_b.tolist()
    assert torch.equal(cum_a, cum_b)  # bitwise: the same float32 additions
    for r, n in enumerate(n_a.tolist()):  # past n_new the columns are scratch
        assert tokens_a[r, :n].tolist() == tokens_b[r, :n].tolist()
        assert torch.equal(lprobs_a[r, :n], lprobs_b[r, :n])


@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("rules", [dict(), dict(min_len=6), dict(max_len=9)])
@pytest.mark.parametrize("bsz,k", [(1, 0), (1, 1), (1, 5), (4, 0), (4, 3), (9, 7)])
def test_fused_step_gives_the_tensor_operations_values(model_and_dict, monkeypatch, rules, bsz, k, rule):
    model, task = model_and_dict
    d = task.target_dictionary
    gen = generator(model, d, acceptance=rule_of(rule), min_len=rules.get("min_len", 1))
    assert gen.step.native
    counting = CountingStep(monkeypatch)
    max_len = rules.get("max_len", 200)
    accepted = set()
    for seed in range(12):
        lprobs, drafts, drafted, state = planted_case(seed, d, bsz, k, second=rule != "strict")
        before = lprobs.clone()
        fused = accept(gen, True, lprobs, drafts, drafted, state, max_len)
        assert torch.equal(lprobs.nan_to_num(), before.nan_to_num()) and torch.equal(lprobs.isnan(), before.isnan())
        ops = accept(gen, False, lprobs, drafts, drafted, state, max_len)
        assert_same_step(fused, ops)
        accepted.update(fused[4][2].tolist())
    assert counting.calls == 12 and counting.ties == 0
    if k and not rules and rule == "strict":
        assert len(accepted) >= min(3, k + 1)  # the cases cover several accepted lengths


def test_a_tie_is_left_to_the_tensor_operations(model_and_dict, monkeypatch):
    model, task = model_and_dict
    d = task.target_dictionary
    gen = generator(model, d)
    counting = CountingStep(monkeypatch)
    lprobs, drafts, drafted, state = planted_case(0, d, 3, 2)
    drafts[:] = d.nspecial  # row 1 ties at its first slot between two tokens, both not drafted
    lprobs[1, 0, d.nspecial + 1] = lprobs[1, 0, d.nspecial + 2] = 5.0
    fused = accept(gen, True, lprobs.clone(), drafts, drafted, state, 200)
    assert counting.calls == 1 and counting.ties == 1 and gen.step.ties == 1
    assert_same_step(fused, accept(gen, False, lprobs.clone(), drafts, drafted, state, 200))
    # a tie in a slot after the first rejection is never read: no fallback
    lprobs[1, 0, d.nspecial + 2] = 4.0
    lprobs[1, 1, d.nspecial + 1] = lprobs[1, 1, d.nspecial + 2] = 5.0
    accept(gen, True, lprobs.clone(), drafts, drafted, state, 200)
    assert counting.calls == 2 and counting.ties == 1
    # a NaN running score is a tie too (top-2 ranks NaN first)
    state.cum[0] = float("nan")
    accept(gen, True, lprobs.clone(), drafts, drafted, state, 200)
    assert counting.ties == 2


@pytest.mark.parametrize("opts", ["default", "max_len_3", "min_len_15"])
@pytest.mark.parametrize("bsz", [1, 5])
def test_decodings_through_the_fused_step_equal_beam1(model_and_dict, tiny_drafter, monkeypatch, opts, bsz):
    model, task = model_and_dict
    d = task.target_dictionary
    counting = CountingStep(monkeypatch)
    options = dict(OPTION_SETS[opts], max_len_b=min(OPTION_SETS[opts]["max_len_b"], 20))
    ref = run_generator(seq_gen(model, d, options), model, H.batches(task, "test", bsz))
    got = {}
    for impl in ("fused", "torch"):
        gen = H.make_generator(model, NATBlockDrafter(tiny_drafter[0]), d, 3,
                               off=("accept",) if impl == "torch" else (), **options)
        assert gen.step.native == (impl == "fused")
        got[impl] = run_generator(gen, model, H.batches(task, "test", bsz))
        assert_identical(ref, got[impl])
    assert_identical(got["torch"], got["fused"], atol=0)
    assert counting.calls > 0 and counting.ties == 0


def test_the_backend_chooses_the_native_step_where_it_runs(model_and_dict):
    """Strict and top-beta verification with the verifier's scores, without
    --unkpen, on a CPU: the native step; the drafter's scores, --unkpen, the
    reference backend: tensor operations."""
    model, task = model_and_dict
    d = task.target_dictionary

    def build(acceptance, backend="auto", **opts):
        return H.make_generator(model, NoDrafter(), d, 3, acceptance, backend=backend, **opts)

    assert build(StrictAcceptance()).step.native
    assert not build(StrictAcceptance(), "reference").step.native
    assert build(TopBetaAcceptance(3, 1.0)).step.native
    assert not build(TopBetaAcceptance(3, 1.0, "drafter")).step.native
    assert not build(StrictAcceptance(), unk_penalty=1.5).step.native


def _committed(append, steps, bsz=4, width=16, pad=1, bos=2):
    """A decoding state after ``steps`` (each: new tokens, their log-probs,
    n_new, and the rows kept after it), committed through ``append``; every
    column, the scratch ones included, and each row's newest token."""
    from fairseq_specdec.generation.state import DecodingState

    sample = {"net_input": {"src_tokens": torch.zeros((bsz, 3), dtype=torch.long)}}
    state = DecodingState(sample, None, width=width, pad=pad, bos=bos, draft_k=3, append=append)
    seen = []
    for new_tokens, new_lprobs, n_new, keep in steps:
        rows = state.size
        new_tokens, new_lprobs, n_new = new_tokens[:rows], new_lprobs[:rows], n_new[:rows]
        before = state.lengths
        state.commit(new_tokens, new_lprobs, n_new, n_new.tolist(), new_lprobs.sum(1))
        assert torch.equal(before, before.clone()) and before is not state.lengths  # the old lengths unchanged
        seen.append(state.last_tokens().clone())
        state.keep([i for i in keep if i < rows])
        seen.append(state.last_tokens().clone())
    return state, seen


def test_native_commit_is_the_tensor_commit():
    """``rowgemm.append_rows`` (the backend's commit on a CPU) leaves the
    decoding state as the tensor operations do: tokens and log-probs after
    each row's length (scratch columns included), lengths, host lengths,
    running scores, and each row's newest token, through commits of ragged
    widths and retired rows; a commit past the state's width is refused."""
    if not rowgemm.append_rows_available():
        pytest.skip("the extension has no append_rows")
    g = torch.Generator().manual_seed(11)
    steps = []
    for n, keep in ((1, [0, 1, 2, 3]), (4, [0, 2, 3]), (2, [1, 2]), (3, [0, 1])):
        tokens = torch.randint(3, 50, (4, n), generator=g)
        lprobs = -torch.rand((4, n), generator=g)
        n_new = torch.randint(1, n + 1, (4,), generator=g)
        steps.append((tokens, lprobs, n_new, keep))
    native, native_seen = _committed(rowgemm.append_rows, steps)
    tensors, tensors_seen = _committed(None, steps)
    for name in ("tokens", "pos_scores", "lengths", "cum"):
        assert torch.equal(getattr(native, name), getattr(tensors, name)), name
    assert native.lengths_host == tensors.lengths_host == native.lengths.tolist()
    assert all(torch.equal(a, b) for a, b in zip(native_seen, tensors_seen))
    # the newest token is where the row's length says, after every commit and keep
    for got, state in ((native_seen[-1], native), (tensors_seen[-1], tensors)):
        assert torch.equal(got, state.tokens.gather(1, state.lengths.unsqueeze(1)))
    with pytest.raises(RuntimeError, match="cannot take"):
        rowgemm.append_rows(native.tokens, native.pos_scores, native.lengths + 10,
                            torch.ones((2, 5), dtype=torch.long), torch.zeros((2, 5)), torch.ones(2, dtype=torch.long))
    with pytest.raises(RuntimeError, match="appends 0 of 5"):
        rowgemm.append_rows(native.tokens, native.pos_scores, native.lengths,
                            torch.ones((2, 5), dtype=torch.long), torch.zeros((2, 5)), torch.zeros(2, dtype=torch.long))


def test_the_backend_commits_natively_where_it_runs(model_and_dict):
    """On a CPU with the extension the loop commits with one native call,
    and decodes as with the tensor commit (``FAIRSEQ_SPECDEC_OFF=commit``)."""
    from fairseq_specdec.generation import resolve_backend

    model, task = model_and_dict
    d = task.target_dictionary
    assert resolve_backend("auto", model, StrictAcceptance()).append is rowgemm.append_rows
    assert resolve_backend("auto", model, StrictAcceptance(), off=frozenset({"commit"})).append is None
    assert resolve_backend("reference", model, StrictAcceptance()).append is None
    ref = run_generator(seq_gen(model, d, dict(max_len_a=0, max_len_b=12)), model, H.batches(task, "test", 5))
    got = []
    for off in ((), ("commit",)):
        gen = H.make_generator(model, NoDrafter(), d, 3, off=off, max_len_a=0, max_len_b=12)
        assert (gen.backend.append is None) == bool(off)
        got.append(run_generator(gen, model, H.batches(task, "test", 5)))
        assert_identical(ref, got[-1])
    assert_identical(got[1], got[0], atol=0)
