"""Whole iterations of a batch of one sentence on fixed buffers
(static shapes run them eagerly, here on the CPU; ``--specdec-backend
auto`` captures them on a GPU, tested where one is).

* strict decoding through the static iteration equals fairseq's ``--beam 1``
  (loop-greedy and the ``specdec_vsd`` drafter), and the iterations do run
  there; batches of several sentences and drafters that cannot work on fixed
  buffers (the paper's drafter) decode as before;
* the ``specdec_vsd`` drafter's fixed buffers (source memory padded to a
  bucket, the shortlist's extra types padded with columns that never win)
  give the drafts its own buffers give, within float rounding;
* on a GPU: graphs are captured once per shape and replayed, with the eager
  static step's output.
"""
import pytest
import torch

import specdec_helpers as H
from specdec_helpers import assert_identical, run_generator
from fairseq_specdec.generation.drafters import NoDrafter, ShortlistProjection, drafter_for_model

pytestmark = pytest.mark.slow  # the trained toy verifier and drafters


def generator(model, drafter, d, graphs, k=4, **opts):
    """``graphs``: the static choice (``static``: whole iterations eagerly; ``iteration``: as CUDA graphs;
    ``off``: the backend's own choice on this device, the lean pass on a CPU)."""
    return H.make_generator(model, drafter, d, k, static=None if graphs == "off" else graphs,
                            **{**H.OPTION_SETS["default"], **opts})


def vsd_drafter(toy_bin, vsd_checkpoint, verifier_model):
    drafter_model, _ = H.load_model(vsd_checkpoint, toy_bin)
    return drafter_for_model(drafter_model, verifier_model, True, "the test's drafter")


@pytest.mark.parametrize("kind", ["loop-greedy", "vsd"])
def test_static_iterations_decode_like_beam1(toy_bin, verifier, beam1_reference, vsd_checkpoint, kind):
    model, task = verifier
    d = task.target_dictionary
    ref = beam1_reference("default", 1)
    drafter = NoDrafter() if kind == "loop-greedy" else vsd_drafter(toy_bin, vsd_checkpoint, model)
    gen = generator(model, drafter, d, "static", k=1 if kind == "loop-greedy" else 4)
    assert gen.iteration_graphs is not None and not gen.iteration_graphs.graphs
    got = run_generator(gen, model, H.batches(task, "test", 1))
    assert_identical(ref, got)
    assert gen.iteration_graphs.runs == gen.stats.iterations > len(ref)  # every iteration ran there
    if kind == "vsd":
        assert gen.stats.mean_accepted > 1.2  # the drafts from the fixed buffers get accepted


def test_other_batches_and_drafters_decode_as_before(toy_bin, verifier, beam1_reference, vsd_checkpoint, nat_checkpoint):
    model, task = verifier
    d = task.target_dictionary
    # a batch of several sentences: the drafter keeps its fixed buffers, the iteration is not captured
    gen = generator(model, vsd_drafter(toy_bin, vsd_checkpoint, model), d, "static")
    assert_identical(beam1_reference("default", 3), run_generator(gen, model, H.batches(task, "test", 3)))
    assert gen.iteration_graphs.runs == 0
    # the paper's drafter recomputes a growing prefix: no fixed buffers, no iteration graphs
    nat_model, _ = H.load_model(nat_checkpoint, toy_bin)
    gen = generator(model, drafter_for_model(nat_model, model, False, "nat"), d, "static")
    assert gen.iteration_graphs is None
    assert_identical(beam1_reference("default", 1), run_generator(gen, model, H.batches(task, "test", 1)))
    # capturing needs a GPU
    with pytest.raises(ValueError, match="CUDA graphs need the verifier on a CUDA device"):
        generator(model, NoDrafter(), d, "iteration")


def test_fixed_buffers_give_the_same_drafts(toy_bin, verifier, vsd_checkpoint):
    from fairseq_specdec.generation.state import DecodingState
    from fairseq_specdec.generation import StrictAcceptance, resolve_backend

    model, task = verifier
    d = task.target_dictionary
    pass_ = resolve_backend("auto", model, StrictAcceptance()).verifier
    plain, static = (vsd_drafter(toy_bin, vsd_checkpoint, model) for _ in range(2))
    assert static.static_inputs()
    for bsz in (1, 5):
        for sample in H.batches(task, "test", bsz)[:3]:
            pass_.start()
            state = DecodingState(sample, pass_.encode(sample["net_input"]), width=40, pad=d.pad(), bos=d.eos(), draft_k=4)
            plain.start_batch(state)
            static.start_batch(state)
            source = sample["net_input"]["src_tokens"].size(1)
            assert static.memory["copy_values"].size(1) == -(-source // 16) * 16  # the bucket
            with torch.no_grad():
                want_tokens, want_lprobs = plain.propose(state, 4)
                got_tokens, got_lprobs = static.propose(state, 4)
            assert torch.equal(got_tokens, want_tokens)
            assert torch.allclose(got_lprobs, want_lprobs, atol=1e-5)


def test_shortlist_padding_columns_never_win():
    torch.manual_seed(0)
    weight = torch.randn(50, 8)
    src = torch.tensor([[3, 41, 45, 2]])
    plain, static = ShortlistProjection(30, 50, True, (1,)), ShortlistProjection(30, 50, True, (1,))
    plain.start_batch(weight, None, src)
    static.start_batch(weight, None, src)
    assert static.make_static(step=16) == 16  # 2 extra source types, padded to 16
    x = torch.randn(4, 8)
    want, got = plain(x), static(x)
    assert got.shape == (4, 30 + 16)
    assert torch.allclose(got[:, :32], want) and torch.isinf(got[:, 32:]).all()
    assert torch.equal(static.types(got.argmax(-1)), plain.types(want.argmax(-1)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (none visible)")
@pytest.mark.parametrize("kind", ["loop-greedy", "vsd"])
def test_captured_iterations_replay_the_static_step(toy_bin, verifier, vsd_checkpoint, kind):
    import copy

    from fairseq.utils import move_to_cuda

    model, task = verifier
    d = task.target_dictionary
    gpu_model = copy.deepcopy(model).cuda()
    samples = [move_to_cuda(s) for s in H.batches(task, "test", 1)]

    def drafter():
        if kind == "loop-greedy":
            return NoDrafter()
        drafter_model, _ = H.load_model(vsd_checkpoint, toy_bin)
        return drafter_for_model(drafter_model.cuda(), gpu_model, True, "the test's drafter")

    eager = run_generator(generator(gpu_model, drafter(), d, "static"), gpu_model, samples)
    gen = generator(gpu_model, drafter(), d, "iteration")
    got = run_generator(gen, gpu_model, samples)
    cache = gen.iteration_graphs.graph_cache
    assert cache.captures > 0 and cache.replays > cache.captures
    assert_identical(eager, got, atol=0)


def test_growing_table_of_slot_rows_gives_the_drafts_of_the_whole_table(toy_bin, verifier, beam1_reference,
                                                                         vsd_checkpoint):
    """The eager drafter starts with a short table of slot rows and grows it
    as rows get longer: starting from 2 positions (so that it grows several
    times) it drafts the tokens of a drafter whose first table spans the
    whole width, pass by pass, in batches of 1 and 3, and decodes like
    --beam 1."""
    model, task = verifier
    d = task.target_dictionary
    drafts = {}
    sizes = []
    for first in (2, 10**6):
        drafter = vsd_drafter(toy_bin, vsd_checkpoint, model)
        drafter.FIRST_POSITIONS = first
        seen = drafts[first] = []
        propose = drafter.propose

        def recording(state, k, propose=propose, drafter=drafter, seen=seen):
            tokens, lprobs = propose(state, k)
            seen.append((tokens.clone(), lprobs.clone()))
            sizes.append((first, drafter.memory["copy_base"].size(1), max(state.lengths_host) + k))
            return tokens, lprobs

        drafter.propose = recording
        for bsz in (1, 3):
            gen = generator(model, drafter, d, "off")
            assert_identical(beam1_reference("default", bsz), run_generator(gen, model, H.batches(task, "test", bsz)))
    assert len(drafts[2]) == len(drafts[10**6]) > 0
    for (tokens, lprobs), (want_tokens, want_lprobs) in zip(drafts[2], drafts[10**6]):
        assert torch.equal(tokens, want_tokens)
        torch.testing.assert_close(lprobs, want_lprobs, rtol=1e-5, atol=1e-5)
    grown = [size for first, size, need in sizes if first == 2]
    assert max(grown) > 4  # it grew, more than once
    assert all(size >= need for first, size, need in sizes if first == 2)  # every slot inside the table


def test_vsd_makes_the_source_memory_of_the_rows_left_at_their_first_draft(toy_bin, verifier, beam1_reference,
                                                                           vsd_checkpoint):
    """An eager specdec_vsd drafter makes its source memory at a batch's
    first draft, not at its start: where the loop drafts only once at most
    2 rows are unfinished, the memory first made is that of the rows left
    (the whole batch's memory, as the start of the batch would have made it,
    at those rows' places in the batch), and the decoding is --beam 1's."""
    from fairseq_specdec.generation.draft_policy import DraftLengthPolicy, FixedRows

    model, task = verifier
    d = task.target_dictionary
    drafter = vsd_drafter(toy_bin, vsd_checkpoint, model)
    whole, made = {}, []
    start_batch, propose = drafter.start_batch, drafter.propose

    def starting(state):
        start_batch(state)
        assert drafter.memory is None  # nothing made before a draft is asked for
        whole["encoder_out"] = state.encoder_out

    def proposing(state, k):
        fresh = drafter.memory is None
        out = propose(state, k)
        if fresh:
            memory = drafter.memory
            expected = drafter.model.select_memory(
                drafter.model.source_memory(whole["encoder_out"], positions=memory["copy_base"].size(1)),
                torch.tensor(state.rows))
            for name in ("mask", "copy_keys", "copy_values", "copy_pad", "copy_base"):
                torch.testing.assert_close(memory[name], expected[name], rtol=1e-5, atol=1e-5)
            for got, want in zip(memory["layers"], expected["layers"]):
                for g, w in zip(got, want):
                    torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
            made.append((state.size, state.batch_size))
        return out

    drafter.start_batch, drafter.propose = starting, proposing
    policy = DraftLengthPolicy(4, rows=FixedRows(2))
    gen = generator(model, drafter, d, "off", draft_policy=policy)
    assert_identical(beam1_reference("default", 5), run_generator(gen, model, H.batches(task, "test", 5)))
    assert made and all(size <= 2 for size, _ in made)
    assert any(batch > size for size, batch in made)  # rows had retired before the first draft
