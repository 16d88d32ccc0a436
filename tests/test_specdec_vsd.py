"""specdec_vsd: the drafter that reads its verifier's states.

Block inputs at several cuts per sentence, training through stock
fairseq-train (glat_block, the frozen verifier from --init-from-verifier),
and strict draft-verify decoding with it identical to fairseq's --beam 1
(fixed k, adaptive draft length, confidence cut, float32 and bfloat16
drafter weights, batch 1 and 16).
"""
import math

import pytest
import torch

import specdec_helpers as H
from fairseq_specdec.generation.drafters import VerifierStateDrafter, drafter_for_model
from fairseq_specdec.kernels import rowgemm

VSD_ARGS = H.VSD_ARGS


def test_state_block_inputs_cover_cuts_targets_and_context():
    from fairseq_specdec.models.specdec_vsd import make_state_block_inputs

    pad, bos, mask = 1, 2, 99
    # two sentences: lengths 4 and 2 (EOS = 2 ends each)
    target = torch.tensor([[10, 11, 12, 2], [20, 2, pad, pad]])
    blocks = make_state_block_inputs(target, pad, bos, mask, k=3, cuts_per_sentence=0)
    got = {(r, c): (t, b) for r, c, t, b in zip(
        blocks["rows"].tolist(), blocks["cuts"].tolist(), blocks["ctx_tokens"].tolist(), blocks["block_target"].tolist())}
    # every cut 0..L-1 of each sentence, no other
    assert sorted(got) == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1)]
    # context token: BOS before any output, else the newest accepted token y[c]
    assert got[(0, 0)] == (bos, [10, 11, 12])
    assert got[(0, 2)] == (11, [12, 2, pad])
    assert got[(0, 3)] == (12, [2, pad, pad])
    assert got[(1, 1)] == (20, [2, pad, pad])
    assert blocks["prev_output_tokens"].eq(mask).all() and blocks["block_mask"].all()


def test_state_block_inputs_sample_cuts_and_fix_them_by_draws():
    from fairseq_specdec.models.specdec_vsd import make_state_block_inputs

    pad = 1
    target = torch.tensor([[5] * 19 + [2], [6] * 9 + [2] + [pad] * 10])
    g = torch.Generator().manual_seed(0)
    blocks = make_state_block_inputs(target, pad, 2, 99, k=4, cuts_per_sentence=3, generator=g)
    assert blocks["rows"].tolist() == [0, 0, 0, 1, 1, 1]
    for r, c in zip(blocks["rows"].tolist(), blocks["cuts"].tolist()):
        assert 0 <= c < (20 if r == 0 else 10)
    draws = torch.tensor([0.3, 0.7], dtype=torch.double)
    a = make_state_block_inputs(target, pad, 2, 99, 4, 3, draws=draws)
    b = make_state_block_inputs(target, pad, 2, 99, 4, 3, draws=draws)
    assert torch.equal(a["cuts"], b["cuts"])
    # evenly spread: three different cuts per sentence
    assert len(set(a["cuts"][:3].tolist())) == 3


@pytest.mark.slow
def test_vsd_trains_above_chance_and_is_small(vsd_training, ar_checkpoint):
    path, log = vsd_training
    import re

    accs = [float(a) for a in re.findall(r"valid on 'valid' subset .*?block_acc ([0-9.]+)", log)]
    assert accs, log[-3000:]
    # the toy vocabulary has hundreds of types: chance is far below 20%
    assert accs[-1] > 20.0, accs
    state = torch.load(path, weights_only=False)
    # the verifier is not saved inside the drafter
    assert not any(name.startswith("verifier") or name.startswith("encoder") for name in state["model"])


@pytest.mark.slow
@pytest.mark.parametrize("bsz", [1, 16])
@pytest.mark.parametrize("extra", [[], ["--adaptive-draft"], ["--adaptive-draft", "--draft-min-confidence", "0.3"],
                                   ["--specdec-backend", "reference"]])
def test_vsd_strict_identical_to_beam1(toy_bin, ar_checkpoint, vsd_training, stock_beam1, bsz, extra):
    ref = stock_beam1(ar_checkpoint, batch_size=bsz)
    proc = H.generate(
        toy_bin, ar_checkpoint, "--decoding", "draft-verify", "--drafter-path", vsd_training[0], *extra,
        "--draft-max-rows", "0", task="draft_verify", batch_size=bsz,
    )
    H.assert_same_hypotheses(ref, H.parse_generate(proc.stdout))
    out = proc.stdout + proc.stderr
    assert "specdec_vsd drafter" in out
    # natively the drafter's weights are bfloat16 wherever the kernel runs with them
    if "reference" in extra or rowgemm.unavailable_reason() is not None:
        assert "torch operations" in out
    else:
        assert ("bfloat16 weights" if rowgemm.bfloat16_available() else "float32 weights") in out
    # drafts get accepted: more than one token per verifier call
    import re

    tok = float(re.search(r"Tok\. ([0-9.]+)", out).group(1))
    assert tok > 1.2, out[-2000:]


@pytest.mark.slow
def test_vsd_trains_in_half_precision_beside_its_float32_verifier(toy_bin, vsd_training):
    """fairseq-train --fp16 casts the drafter to float16, not the frozen
    verifier it reads (it ran on a GPU: "expected mat1 and mat2 to have the
    same dtype"); a training step computes its loss."""
    from fairseq import checkpoint_utils

    models, cfg, task = checkpoint_utils.load_model_ensemble_and_task([vsd_training[0]], arg_overrides={"data": toy_bin})
    drafter = models[0].half().train()
    criterion = task.build_criterion(cfg.criterion)
    task.load_dataset("valid")
    sample = H.batches(task, "valid", 8)[0]
    assert next(task.frozen_verifier().parameters()).dtype == torch.float32
    loss, sample_size, _ = criterion(drafter, task.add_block_inputs(sample, drafter))
    assert torch.isfinite(loss) and sample_size > 0


@pytest.mark.slow
def test_vsd_refuses_another_verifier(toy_bin, ar_checkpoint, vsd_training):
    """A drafter is built for the verifier it was trained on, and refused
    for a verifier whose output projection differs."""
    from fairseq import checkpoint_utils

    verifier, task = H.load_model(ar_checkpoint, toy_bin)
    models, _ = checkpoint_utils.load_model_ensemble([vsd_training[0]], task=task)
    drafter_model = models[0].eval()
    drafter = drafter_for_model(drafter_model, verifier, False, "the test's drafter")
    assert isinstance(drafter, VerifierStateDrafter) and "specdec_vsd" in drafter.describe()
    with torch.no_grad():
        verifier.decoder.output_projection.weight[5, 0] += 1.0
    with pytest.raises(ValueError, match=r"the drafter \(the test.s drafter\) is a specdec_vsd drafter trained on another verifier"):
        drafter_for_model(drafter_model, verifier, False, "the test's drafter")


@pytest.mark.slow
def test_profile_breaks_down_the_vsd_iteration(toy_bin, ar_checkpoint, vsd_training, tmp_path):
    """scripts/profile-draft-verify.py with a specdec_vsd drafter: its own
    components (block layers, feedback) are timed and everything adds up."""
    import json

    out = tmp_path / "profile.json"
    H.run([
        H.cli("python"), H.ROOT / "scripts" / "profile-draft-verify.py", "--data", toy_bin, "--src", "src", "--tgt", "tgt",
        "--verifier", ar_checkpoint, "--drafter", vsd_training[0], "--limit", "20", "--warmup", "3", "--json", out,
        "--extra=--adaptive-draft",
    ])
    rows = [r for r in json.loads(out.read_text())["rows"] if r["decoder"] == "draft-verify strict"]
    by_name = {r["component"].split(" (")[0]: r for r in rows}
    assert {"drafter pass", "of which: drafter block layers", "drafter feedback", "verifier pass"} <= set(by_name)
    parts = [r for r in rows if r["component"] != "total" and not r["component"].startswith("of which")]
    assert sum(r["ms_per_sentence"] for r in parts) == pytest.approx(by_name["total"]["ms_per_sentence"])
    # one feedback per iteration: a verify pass, or a screened greedy step (an iteration that did not draft)
    assert by_name["drafter feedback"]["calls"] == H.profiled_passes(by_name)


@pytest.mark.parametrize("option", ["--shortlist", "--cuts-per-sentence"])
def test_negative_shortlist_or_cuts_are_refused_by_name(toy_bin, option):
    from fairseq import tasks

    _, cfg = H.train_args_namespace(toy_bin, *VSD_ARGS, "--block-size", "4", "--cpu", option, "-1")
    with pytest.raises(ValueError, match=f"{option} must be >= 0"):
        tasks.setup_task(cfg.task).build_model(cfg.model)


def _random_vsd_model():
    from fairseq.data import Dictionary
    from fairseq_specdec.models.specdec_vsd import SpecDecVSDConfig, SpecDecVSDModel

    torch.manual_seed(3)
    d = Dictionary()
    for i in range(40):
        d.add_symbol(f"w{i}")
    cfg = SpecDecVSDConfig(embed_dim=32, attention_heads=4, ffn_embed_dim=64, max_positions=48)
    model = SpecDecVSDModel(cfg, d).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
        model.embed_weight.normal_()
    src = torch.randn(2, 7, 32)
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[1, 5:] = True  # a padded row
    encoder_out = {"encoder_out": [src.transpose(0, 1)], "encoder_embedding": [torch.randn(2, 7, 32)],
                   "encoder_padding_mask": [pad]}
    return model, encoder_out


def test_decoding_gathers_the_slots_position_rows_and_soft_copy_from_a_table():
    """At decoding (no slot tokens), a drafting pass gathers each slot's
    position row plus soft copy from the batch's table (source_memory with
    positions) instead of computing them: the same block states, before and
    after a weight the table comes from changes in place (as an optimizer
    writes), at positions up to the table's last row."""
    model, encoder_out = _random_vsd_model()
    ctx_states, ctx_tokens = torch.randn(2, 32), torch.tensor([5, 9])
    k = 4
    with torch.no_grad():
        for step in range(2):
            plain = model.source_memory(encoder_out)
            table = model.source_memory(encoder_out, positions=30)
            assert "copy_base" in table and "copy_base" not in plain
            for cuts in (torch.tensor([0, 3]), torch.tensor([26, 11])):  # 26 + 3: the table's last row
                expected = model.block_states(plain, ctx_states, ctx_tokens, cuts, None, k)
                got = model.block_states(table, ctx_states, ctx_tokens, cuts, None, k)
                torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
            reordered = model.select_memory(table, torch.tensor([1, 1, 0]))
            assert reordered["copy_base"].shape[0] == 3
            torch.testing.assert_close(reordered["copy_base"][2], table["copy_base"][0])
            model.copy_query.weight.data.view(-1)[0] += 5.0  # element 0 is among the watched samples
            model.positions.weight.data.mul_(-1.0)


@pytest.mark.skipif(rowgemm.unavailable_reason() is not None, reason=str(rowgemm.unavailable_reason()))
def test_native_pass_computes_the_models_block_states(monkeypatch):
    """The drafter's native pass (NativeBlockPass: its input rows in one call
    of rowgemm.block_input, each block layer in one call) gives the block
    states of the model's own operations within float rounding, at positions
    past the table's last row too (they take its last row), in a padded batch."""
    from fairseq_specdec.generation.drafters.vsd_native import NativeBlockPass, native_block_pass_reason

    model, encoder_out = _random_vsd_model()
    assert native_block_pass_reason(model) is None
    native = NativeBlockPass(model)
    ctx_states, ctx_tokens = torch.randn(2, 32), torch.tensor([5, 9])
    calls = []
    fused_call = rowgemm.block_input
    monkeypatch.setattr(rowgemm, "block_input", lambda *a: calls.append(1) or fused_call(*a))
    with torch.no_grad():
        table = model.source_memory(encoder_out, positions=30)
        for k, cuts in ((4, torch.tensor([0, 3])), (3, torch.tensor([28, 11])), (1, torch.tensor([40, 0]))):
            got = native.block_states(table, ctx_states, ctx_tokens, cuts, k)
            expected = model.block_states(table, ctx_states, ctx_tokens, cuts, None, k)
            assert got.shape == (2, k, 32)
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert len(calls) == 3


@pytest.mark.skipif(not rowgemm.bfloat16_available(), reason="the kernel or its bfloat16 panels are not available")
def test_bfloat16_drafting_pass_reads_the_weights_rounded_to_bfloat16():
    """A native pass with bfloat16 weights gives bitwise the float32 native
    pass of a model whose packed products' weights (the fuse product and the
    block layers' six) are rounded to bfloat16; the other weights (the
    memory's projection, the tables) are unchanged."""
    import copy

    from fairseq_specdec.generation.drafters.vsd_native import NativeBlockPass

    model, encoder_out = _random_vsd_model()
    rounded = copy.deepcopy(model)
    with torch.no_grad():
        linears = [rounded.fuse] + [getattr(layer, name) for layer in rounded.layers
                                    for name in ("self_qkv", "self_out", "cross_q", "cross_out", "fc1", "fc2")]
        for linear in linears:
            linear.weight.copy_(linear.weight.to(torch.bfloat16).float())
        ctx_states, ctx_tokens, cuts = torch.randn(2, 32), torch.tensor([5, 9]), torch.tensor([0, 3])
        table = model.source_memory(encoder_out, positions=30)
        rounded_table = rounded.source_memory(encoder_out, positions=30)
        for name in ("copy_base", "mask"):
            assert torch.equal(table[name], rounded_table[name])
        half = NativeBlockPass(model, "bfloat16").block_states(table, ctx_states, ctx_tokens, cuts, 3)
        assert torch.equal(half, NativeBlockPass(rounded).block_states(rounded_table, ctx_states, ctx_tokens, cuts, 3))
        full = NativeBlockPass(model).block_states(table, ctx_states, ctx_tokens, cuts, 3)
        assert not torch.equal(half, full)
        # an in-place change of a weight (an optimizer's) reaches the packed layouts
        native, rounded_native = NativeBlockPass(model, "bfloat16"), NativeBlockPass(rounded)
        native.block_states(table, ctx_states, ctx_tokens, cuts, 3)
        model.layers[0].fc2.weight.mul_(2.0)
        rounded.layers[0].fc2.weight.mul_(2.0)
        assert torch.equal(native.block_states(table, ctx_states, ctx_tokens, cuts, 3),
                           rounded_native.block_states(rounded_table, ctx_states, ctx_tokens, cuts, 3))


@pytest.mark.skipif(not rowgemm.bfloat16_available(), reason="the kernel or its bfloat16 panels are not available")
def test_shortlist_projection_in_bfloat16_projects_with_the_rounded_weight():
    """The drafter's output projection onto the shortlist in bfloat16 is
    bitwise the float32 projection of the rounded weight, source types
    outside the shortlist included (those stay float32 products)."""
    from fairseq_specdec.generation.drafters import DraftKernels, ShortlistProjection

    torch.manual_seed(2)
    weight = torch.randn(50, 32)
    rounded = weight.clone()
    rounded[:20] = weight[:20].to(torch.bfloat16).float()  # the 20 frequent types are packed
    src = torch.tensor([[3, 30, 44, 1]])
    x = torch.randn(1, 3, 32)
    half = ShortlistProjection(20, 50, True, (1,), DraftKernels(products=True, precision="bfloat16"))
    full = ShortlistProjection(20, 50, True, (1,), DraftKernels(products=True))
    half.start_batch(weight, None, src)
    full.start_batch(rounded, None, src)
    assert torch.equal(half.vocab, full.vocab) and half.vocab.tolist()[20:] == [30, 44]
    assert torch.equal(half(x), full(x))


def test_the_backend_decides_what_drafters_compute_natively(toy_bin):
    """auto: drafters' products natively, in bfloat16 where the kernel has
    bfloat16 panels, the pick and the vsd pass through the kernels; the
    benchmark's parts switch each off; reference: torch's operations only."""
    from fairseq_specdec.generation import StrictAcceptance, resolve_backend
    from fairseq_specdec.generation.drafters import NO_KERNELS

    from test_lean_verifier import untrained_transformer

    verifier, _ = untrained_transformer(toy_bin)
    strict = StrictAcceptance()
    assert resolve_backend("reference", verifier, strict).drafting == NO_KERNELS
    auto = resolve_backend("auto", verifier, strict).drafting
    if rowgemm.unavailable_reason() is not None:
        assert auto == NO_KERNELS
        return
    assert auto.products and auto.pick and auto.block
    assert auto.precision == ("bfloat16" if rowgemm.bfloat16_available() else "float32")
    assert resolve_backend("auto", verifier, strict, off={"bf16"}).drafting.precision == "float32"
    assert not resolve_backend("auto", verifier, strict, off={"pick"}).drafting.pick
    assert not resolve_backend("auto", verifier, strict, off={"block"}).drafting.block
    assert resolve_backend("auto", verifier, strict, off={"products"}).drafting == NO_KERNELS


def test_shortlist_projection_is_the_batch_that_reads_it():
    """A batch's projection is made when something reads it: a batch that
    was started and never drafted leaves nothing behind, and the next
    batch's projection holds its own weight and source types."""
    from fairseq_specdec.generation.drafters import ShortlistProjection

    torch.manual_seed(4)
    first, second = torch.randn(50, 32), torch.randn(50, 32)
    projection = ShortlistProjection(20, 50, True, (1,))
    projection.start_batch(first, None, torch.tensor([[3, 31, 45, 2]]))  # never read
    projection.start_batch(second, None, torch.tensor([[5, 22, 40, 2], [22, 9, 2, 0]]))
    assert projection.vocab.tolist() == list(range(20)) + [22, 40]
    x = torch.randn(3, 32)
    expected = x @ second[projection.vocab].t()
    expected[:, 1] = -math.inf  # the never type
    assert torch.allclose(projection(x), expected, atol=1e-5)


@pytest.mark.skipif(not rowgemm.draft_pick_available(), reason="the kernel or its draft_pick is not available")
def test_shortlist_pick_in_one_call_matches_log_softmax_max(monkeypatch):
    """The drafter's pick through the extension gives the types and
    log-probs of log_softmax + max over the projection (the source types
    outside the shortlist included, BOS and padding never picked), and the
    torch path is taken where the call is not available."""
    from fairseq_specdec.generation.drafters import DraftKernels, ShortlistProjection

    torch.manual_seed(5)
    weight = torch.randn(60, 32) * 0.5
    src = torch.tensor([[3, 30, 44, 57]])
    projection = ShortlistProjection(25, 60, True, (0, 1), DraftKernels(products=True, pick=True))
    projection.start_batch(weight, None, src)
    x = torch.randn(4, 3, 32)
    x[0, 0] = weight[44] * 3  # a source type outside the shortlist wins
    x[0, 1] = weight[1] * 3  # BOS would win, but never may
    types, lprobs = projection.pick(x)
    expected_lp, best = torch.log_softmax(projection(x), -1).max(-1)
    assert torch.equal(types, projection.types(best))
    assert types[0, 0] == 44 and types[0, 1] != 1
    torch.testing.assert_close(lprobs, expected_lp, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(rowgemm, "draft_pick", lambda *a: pytest.fail("the torch path was expected"))
    monkeypatch.setattr(rowgemm, "draft_pick_available", lambda: False)
    types2, lprobs2 = projection.pick(x)
    assert torch.equal(types2, types)
    torch.testing.assert_close(lprobs2, lprobs, rtol=1e-5, atol=1e-5)
