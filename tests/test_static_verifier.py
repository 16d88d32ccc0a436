"""The static-shape verify pass (what ``--specdec-backend auto`` replays as CUDA graphs on a GPU), run eagerly on the CPU.

* pass by pass its log-probs and final states equal the lean pass's on the
  same state (ragged batches, rows retiring into smaller buckets), and the
  strict output equals fairseq's ``--beam 1``;
* the spare rows of a bucket and the cache positions past each row's input
  never reach the output, whatever they hold;
* the backend's choice reaches the generator fairseq-generate builds, and
  what cannot run is refused by name (graphs on a CPU);
* on a GPU (skipped without one): graphs are captured once per shape and
  replayed, with the static pass's output.
"""
import pytest
import torch

import specdec_helpers as H
from specdec_helpers import OPTION_SETS, assert_identical, partly_right, run_generator, strict_generator
import fairseq_specdec  # noqa: F401
from fairseq_specdec.generation.lean_verifier import LeanVerifier
from fairseq_specdec.generation.static_verifier import StaticVerifier, bucket_rows


class PairedStatic(H.PairedPass):
    """The static pass (followed by the loop) and the lean pass on the same
    state; records (rows, bucket) of every pass."""

    def __init__(self, model):
        super().__init__(StaticVerifier(model), LeanVerifier(model, gemm="torch"))
        self.buckets = set()

    @property
    def static(self):
        return self.main

    @property
    def lean(self):
        return self.ref

    def after_pass(self, state):
        self.buckets.add((state.size, self.static.rows))


class SparePoisoningStatic(StaticVerifier):
    """After every pass, fills the bucket's spare rows and every cache
    position past each row's prefix with large finite garbage."""

    def rollback(self, state, keep, keep_host, path=None):
        super().rollback(state, keep, keep_host, path)
        new_lengths = [n + k for n, k in zip(state.lengths_host, keep_host)]
        for store in (self.keys, self.values):
            for t in store:
                t[state.size:] = torch.empty_like(t[state.size:]).uniform_(-1e4, 1e4)
                for r, n in enumerate(new_lengths):
                    t[r, :, n:] = torch.empty_like(t[r, :, n:]).uniform_(-1e4, 1e4)
        for pair in self.cross:
            for t in pair:
                spare = t.view(self.rows, -1, *t.shape[1:])[state.size:]
                spare.copy_(torch.empty_like(spare).uniform_(-1e4, 1e4))


def test_buckets():
    assert [bucket_rows(n) for n in (1, 2, 3, 4, 5, 16, 17)] == [1, 2, 4, 4, 8, 16, 32]


@pytest.mark.slow  # needs the trained toy verifier
@pytest.mark.parametrize("opts", ["default", "max_len_3", "lenpen_unkpen_temp"])
@pytest.mark.parametrize("bsz", [1, 3, 16])
def test_static_pass_equals_the_lean_pass_and_beam1(verifier, beam1_reference, opts, bsz):
    model, task = verifier
    d = task.target_dictionary
    ref = beam1_reference(opts, bsz)
    paired = PairedStatic(model)
    paired.static.temperature = paired.lean.temperature = OPTION_SETS[opts].get("temperature", 1.0)
    got = run_generator(strict_generator(model, partly_right(ref, d), d, paired, opts), model, H.batches(task, "test", bsz))
    assert_identical(ref, got)
    assert paired.passes > 0
    if bsz == 3:
        # three rows run in a bucket of four; as rows finish they move into smaller buckets
        assert (3, 4) in paired.buckets and any(rows < 4 for _, rows in paired.buckets)
    assert all(bucket_rows(n) == rows for n, rows in paired.buckets)


@pytest.mark.slow
@pytest.mark.parametrize("bsz", [3, 16])
def test_spare_rows_and_scratch_never_reach_the_output(verifier, beam1_reference, bsz):
    model, task = verifier
    d = task.target_dictionary
    ref = beam1_reference("default", bsz)
    drafter = partly_right(ref, d)
    clean = run_generator(strict_generator(model, drafter, d, StaticVerifier(model)), model, H.batches(task, "test", bsz))
    poisoned = run_generator(strict_generator(model, drafter, d, SparePoisoningStatic(model)), model,
                             H.batches(task, "test", bsz))
    assert_identical(clean, poisoned, atol=0)
    assert_identical(ref, poisoned)


@pytest.mark.slow
def test_batches_over_max_rows_run_the_lean_pass_as_it_is(verifier, beam1_reference):
    """What --specdec-backend auto does with a half-precision verifier on a GPU (max_rows 1), here without graphs."""
    model, task = verifier
    d = task.target_dictionary
    for bsz, dynamic in ((1, False), (3, True)):
        ref = beam1_reference("default", bsz)
        static = StaticVerifier(model, max_rows=1)
        got = run_generator(strict_generator(model, partly_right(ref, d), d, static), model, H.batches(task, "test", bsz))
        assert_identical(ref, got)
        assert static.dynamic == dynamic and (static.rows == 0) == dynamic
    assert "for batches of at most 1 sentence" in static.describe()


def test_auto_resolves_to_what_was_measured():
    """--specdec-backend auto on a CUDA verifier: whole iterations and the
    verify pass's graphs at every batch size in float32 (measured on an
    H200), the verify pass's graphs at batch 1 in half precision; the
    benchmark's parts switch them off."""
    from fairseq_specdec.generation.backend import AUTO_GRAPH_ROWS, cuda_graph_choice

    assert cuda_graph_choice(torch.float32) == ("iteration", None)
    for half in (torch.float16, torch.bfloat16):
        assert cuda_graph_choice(half) == ("on", AUTO_GRAPH_ROWS) == ("on", 1)
    assert cuda_graph_choice(torch.float32, frozenset({"iteration"})) == ("on", None)
    assert cuda_graph_choice(torch.float32, frozenset({"graphs"})) == (None, None)


def test_the_loop_runs_whole_iterations_where_the_backend_chose_them(verifier):
    """Whole iterations (eager on a CPU with static shapes) for a drafter on
    fixed buffers; none on the CPU's own choices."""
    model, task = verifier
    d = task.target_dictionary
    from fairseq_specdec.generation.drafters import NoDrafter

    for static, whole in (("static", True), ("on", False), (None, False)):
        if static == "on":
            continue  # graphs need a CUDA device (test_refusals)
        gen = H.make_generator(model, NoDrafter(), d, 1, static=static)
        assert (gen.iteration_graphs is not None) == whole, static
        if whole:
            assert gen.verifier.choice == "static" and not gen.iteration_graphs.graphs


def test_refusals(verifier):
    from fairseq_specdec.generation import StrictAcceptance, resolve_backend

    model, _ = verifier
    strict = StrictAcceptance()
    assert type(resolve_backend("auto", model, strict).verifier) is LeanVerifier  # no graphs on a CPU
    static = resolve_backend("auto", model, strict, static="static").verifier
    assert type(static) is StaticVerifier and not static.graphs
    assert static.describe() == "lean (static shapes, torch products)"
    with pytest.raises(ValueError, match="CUDA graphs need the verifier on a CUDA device"):
        resolve_backend("auto", model, strict, static="on")


@pytest.mark.slow
def test_backend_option_reaches_the_generator(ar_checkpoint, random_drafter_checkpoint, toy_bin):
    from fairseq import checkpoint_utils, tasks

    from fairseq_specdec.generation import CachedVerifier

    cfg = H.generation_cfg(toy_bin, "--task", "draft_verify", "--path", ar_checkpoint, "--decoding", "draft-verify",
                           "--drafter-path", random_drafter_checkpoint, "--beam", "1", "--specdec-backend", "reference")
    task = tasks.setup_task(cfg.task)
    models, _ = checkpoint_utils.load_model_ensemble([ar_checkpoint], task=task)
    gen = task.build_generator(models, cfg.generation)
    assert type(gen.verifier) is CachedVerifier and not gen.step.native
    assert gen.backend.name == "reference"
    cfg = H.generation_cfg(toy_bin, "--task", "draft_verify", "--path", ar_checkpoint, "--specdec-backend", "reference")
    with pytest.raises(ValueError, match="--specdec-backend reference applies to speculative decodings only"):
        tasks.setup_task(cfg.task).build_generator(models, cfg.generation)


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (none visible)")
@pytest.mark.parametrize("bsz", [1, 3])
def test_cuda_graphs_replay_the_static_pass(verifier, beam1_reference, bsz):
    model, task = verifier
    d = task.target_dictionary
    ref = beam1_reference("default", bsz)
    import copy

    from fairseq.utils import move_to_cuda

    gpu_model = copy.deepcopy(model).cuda()
    drafter = partly_right(ref, d)
    samples = [move_to_cuda(s) for s in H.batches(task, "test", bsz)]
    static = run_generator(strict_generator(gpu_model, drafter, d, StaticVerifier(gpu_model)), gpu_model, samples)
    graphed = StaticVerifier(gpu_model, graphs=True)
    got = run_generator(strict_generator(gpu_model, drafter, d, graphed), gpu_model, samples)
    cache = graphed.graph_cache
    assert cache.captures > 0 and cache.replays > cache.captures
    assert_identical(static, got, atol=0)
