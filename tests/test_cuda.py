"""Every decoding on a GPU (skipped without one): the toy models decoded on
CUDA through the benchmark's loader (exactly as fairseq-generate builds
them), each strict decoding compared with fairseq's --beam 1 on CUDA at
batch 1 and 8, with and without CUDA graphs (the verify pass's, and whole
iterations).  The count of differing
sentences is in the failure message: on a GPU, kernels chosen by shape may
round a near-tie differently."""
import pytest
import torch

import specdec_helpers  # noqa: F401  (puts the checkout on sys.path)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (torch.cuda.is_available() is False)"),
]


def decode(toy_bin, path, batch_size, *extra):
    from fairseq_specdec.bench.loading import load_decoder

    spec = dict(data=toy_bin, src="src", tgt="tgt", threads=1, device="cuda", path=path, beam=1,
                batch_size=batch_size, extra=list(extra))
    task, models, generator, batches = load_decoder(spec)
    out = {}
    for sample in batches():
        hypos = task.inference_step(generator, models, sample)
        for i, sid in enumerate(sample["id"].tolist()):
            out[sid] = hypos[i][0]["tokens"].tolist()
    return out, generator


@pytest.mark.parametrize("bsz", [1, 8])
def test_every_strict_decoding_on_cuda_is_beam1(toy_bin, ar_checkpoint, vsd_checkpoint, nat_checkpoint,
                                                blockwise_checkpoint, bsz):
    ref, _ = decode(toy_bin, ar_checkpoint, bsz, "--decoding", "autoregressive")
    rows = {
        "loop-greedy": (ar_checkpoint, "--decoding", "loop-greedy"),
        "vsd": (f"{ar_checkpoint}:{vsd_checkpoint}", "--decoding", "draft-verify"),
        "nat": (f"{ar_checkpoint}:{nat_checkpoint}", "--decoding", "draft-verify"),
        "blockwise": (blockwise_checkpoint, "--decoding", "blockwise"),
        "ngram": (ar_checkpoint, "--decoding", "ngram"),  # drafts made on the host from the train split
    }
    differ = {}
    for name, (path, *extra) in rows.items():
        # the backend's default (whole iterations at batch 1 on a float32 verifier),
        # the verify pass's graphs alone, no graphs, and the reference backend
        for graphs in ("auto", "FAIRSEQ_SPECDEC_OFF=iteration", "FAIRSEQ_SPECDEC_OFF=graphs", "reference"):
            backend = ["--specdec-backend", "reference"] if graphs == "reference" else []
            env = [graphs] if graphs.startswith("FAIRSEQ") else []
            got, generator = decode(toy_bin, path, bsz, *extra, *backend, *env)
            assert sorted(got) == sorted(ref), name
            differ[f"{name} {graphs}"] = sum(got[i] != ref[i] for i in ref)
            whole = graphs == "auto" and bsz == 1 and name in ("loop-greedy", "vsd")
            if whole:  # whole iterations, the verify pass captured inside them
                cache = generator.iteration_graphs.graph_cache
                assert cache.captures > 0 and cache.replays > cache.captures
            elif graphs in ("auto", "FAIRSEQ_SPECDEC_OFF=iteration"):  # the verify pass's own graphs
                cache = generator.verifier.graph_cache
                assert cache.captures > 0 and cache.replays > cache.captures
    assert not any(differ.values()), differ
