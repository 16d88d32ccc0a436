"""Half precision on the CPU paths: every speculative decoding runs with the
verifier in float16 or bfloat16, the drafter cast to the verifier's dtype
(its parameters and its buffers: specdec_vsd's embed_weight/output_weight),
and its output is compared with fairseq's --beam 1 run in the same precision.

fairseq-generate casts models only under --fp16 (model.half()); its --bf16
means "implies --tpu" and leaves the models in float32 on a CPU, so bfloat16
is tested in-process, with the models cast as --fp16 casts them.

Half-precision greedy decoding depends on the shapes of the computation:
fairseq's own --beam 1 in float16 gives other tokens for 8 of the toy set's
1,000 sentences at batch 8 than at batch 1.  The verify pass computes k + 1
rows at once and, at batch > 1, over a cache padded to the longest row: the
same arithmetic in other shapes, so its rounding can differ.  Measured on
the toy models (1,000 sentences): float16 batch 1: 0 sentences differ for
every decoding; bfloat16 batch 1: 1; batch 8: float16 4-8, bfloat16 46-59.
greedy through the loop (loop-greedy: one row, no padding) is identical in
both at both batch sizes.  The bounds below are those measurements with a
margin; a real dtype fault (a drafter or buffer left in float32, a wrong
rollback) fails loudly or changes most sentences.
"""
import pytest
import torch

import specdec_helpers as H

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
#: most sentences of the 50-sentence test split allowed to differ from --beam 1 in the same precision
ALLOWED = {1: 1, 8: 5}


def load(path, data, dtype):
    """A checkpoint loaded for --task draft_verify, cast to ``dtype``, eval mode."""
    from fairseq import checkpoint_utils, tasks

    task = tasks.setup_task(H.generation_cfg(data, "--task", "draft_verify").task)
    models, _ = checkpoint_utils.load_model_ensemble([path], task=task)
    return models[0].to(dtype).eval(), task


def build(data, model, *argv):
    from fairseq import tasks

    cfg = H.generation_cfg(data, "--task", "draft_verify", "--beam", "1", *argv)
    return tasks.setup_task(cfg.task).build_generator([model], cfg.generation)


def floating_dtypes(module):
    return {t.dtype for t in list(module.parameters()) + list(module.buffers()) if t.is_floating_point()}


def decodings(nat, vsd):
    return {
        "draft-verify-nat": ("verifier", ["--decoding", "draft-verify", "--drafter-path", nat]),
        "draft-verify-vsd": ("verifier", ["--decoding", "draft-verify", "--drafter-path", vsd]),
        "input-guided": ("verifier", ["--decoding", "input-guided"]),
        "blockwise": ("blockwise", ["--decoding", "blockwise"]),
        "loop-greedy": ("verifier", ["--decoding", "loop-greedy"]),
    }


@pytest.mark.slow
@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_every_decoding_in_half_precision_matches_beam1_in_the_same_precision(
        dtype, toy_bin, ar_checkpoint, nat_checkpoint, vsd_checkpoint, blockwise_checkpoint):
    models = {"verifier": load(ar_checkpoint, toy_bin, DTYPES[dtype])[0],
              "blockwise": load(blockwise_checkpoint, toy_bin, DTYPES[dtype])[0]}
    task = load(ar_checkpoint, toy_bin, torch.float32)[1]
    report = []
    for bs in (1, 8):
        samples = H.batches(task, "test", bs)
        with torch.no_grad():
            refs = {name: H.run_generator(build(toy_bin, m), m, samples) for name, m in models.items()}
            for decoding, (which, argv) in decodings(nat_checkpoint, vsd_checkpoint).items():
                model = models[which]
                gen = build(toy_bin, model, *argv)
                drafter = getattr(getattr(gen, "drafter", None), "model", None)
                if drafter is not None and drafter is not model:
                    # loaded from --drafter-path in float32, cast to the verifier's dtype, buffers too
                    assert floating_dtypes(drafter) == {DTYPES[dtype]}, (decoding, floating_dtypes(drafter))
                got = H.run_generator(gen, model, samples)
                ref = refs[which]
                assert sorted(got) == sorted(ref)
                differ = [i for i in ref if got[i]["tokens"].tolist() != ref[i]["tokens"].tolist()]
                report.append(f"{decoding} batch {bs}: {len(differ)} of {len(ref)} differ")
                if decoding == "loop-greedy":
                    assert not differ, report[-1]
                assert len(differ) <= ALLOWED[bs], report
                for i in ref:
                    assert got[i]["positional_scores"].dtype == ref[i]["positional_scores"].dtype
                    if i not in differ:  # same tokens: the same log-probs up to half-precision rounding
                        assert torch.allclose(got[i]["positional_scores"].float(), ref[i]["positional_scores"].float(),
                                              atol=0.1), (decoding, bs, i)
    print("\n".join(report))


@pytest.mark.slow
@pytest.mark.parametrize("decoding", ["draft-verify-nat", "draft-verify-vsd", "drafter-in-path", "blockwise"])
def test_fairseq_generate_fp16_on_cpu_identical_to_beam1_fp16_at_batch_1(
        decoding, toy_bin, ar_checkpoint, nat_checkpoint, vsd_checkpoint, blockwise_checkpoint, stock_beam1):
    """The user's path: fairseq-generate --fp16 --cpu; the drafter of
    --drafter-path is cast by the plugin, models in --path by fairseq."""
    verifier = blockwise_checkpoint if decoding == "blockwise" else ar_checkpoint
    ref, ref32 = stock_beam1(verifier, "--fp16"), stock_beam1(verifier)
    # float16 is really used: some log-prob differs from float32 decoding
    assert any(ref[i][2] != ref32[i][2] for i in ref)
    path, extra = verifier, ["--decoding", "draft-verify"]
    if decoding == "draft-verify-nat":
        extra += ["--drafter-path", nat_checkpoint]
    elif decoding == "draft-verify-vsd":
        extra += ["--drafter-path", vsd_checkpoint]
    elif decoding == "drafter-in-path":
        path = f"{ar_checkpoint}:{nat_checkpoint}"
    else:
        extra = ["--decoding", "blockwise"]
    got = H.parse_generate(H.generate(toy_bin, path, "--fp16", *extra, task="draft_verify").stdout)
    H.assert_same_hypotheses(ref, got, atol=1e-2)


def test_benchmark_fp16_reaches_fairseq_generate():
    from fairseq_specdec.bench import loading

    spec = dict(data="bin", path="v.pt", batch_size=1, beam=1, src="en", tgt="de", extra=[])
    assert "--fp16" in loading.generate_argv(dict(spec, fp16=True))
    assert "--fp16" not in loading.generate_argv(spec)


@pytest.mark.slow
def test_benchmark_fp16_rows(toy_bin, ar_checkpoint, nat_checkpoint, tmp_path, stock_beam1):
    """scripts/benchmark.py --fp16: fairseq's beam 1 row is fairseq-generate
    --fp16's output, strict draft-verify at batch 1 is identical to it."""
    import json
    from pathlib import Path

    out = tmp_path / "bench"
    H.run([H.cli("python"), H.ROOT / "scripts" / "benchmark.py", "--data", toy_bin, "--src", "src", "--tgt", "tgt",
           "--verifier", ar_checkpoint, "--drafter", nat_checkpoint, "--rows", "beam5,beam1,strict", "--batch-sizes", "1",
           "--fp16", "--raw-ref", Path(toy_bin).parent / "raw" / "test.tgt", "--detok-lang", "en", "--warmup", "3",
           "--out", out])
    results = json.loads((out / "results.json").read_text())
    assert results["precision"] == "float16"
    rows = {r["name"]: r for r in results["rows"]}
    assert rows["strict@bs1"]["identical_to_beam1"]
    ref = stock_beam1(ar_checkpoint, "--fp16")
    assert (out / "hyp.beam1@bs1.txt").read_text().splitlines() == [ref[i][1] for i in sorted(ref)]
    assert "float16" in (out / "results.md").read_text()
