"""Device -> host reads of the speculative loop (issue 15: on a GPU each one
stalls the queue).

Counted on the CPU by wrapping every Python-level way a tensor's value
reaches the host (``bool``, ``int``, ``float``, ``.item()``, ``.tolist()``,
``.numpy()``, ``.cpu()``): between two verify passes of the loop with no row
retired, the loop reads once (the stacked per-row counts) when its host
checks are off (``host_checks = False``, the default on CUDA: no skip-work
reads, running scores summed on the device), and the output is the same
either way.  A batch's start reads the verifier's
weight fingerprints once, not once per weight.
"""
import contextlib

import pytest
import torch

import specdec_helpers as H
from specdec_helpers import OPTION_SETS, assert_identical, run_generator, seq_gen
import fairseq_specdec  # noqa: F401
from fairseq_specdec.generation import SpeculativeGenerator, StrictAcceptance

pytestmark = pytest.mark.slow  # needs the trained toy verifier

READS = ("__bool__", "__int__", "__float__", "__index__", "item", "tolist", "numpy", "cpu")


@contextlib.contextmanager
def counting_reads(log):
    """Appends one entry to ``log`` per host read of a tensor's value."""
    saved = {name: getattr(torch.Tensor, name) for name in READS}

    def wrap(name, original):
        def counted(self, *args, **kwargs):
            log.append(name)
            return original(self, *args, **kwargs)

        return counted

    try:
        for name, original in saved.items():
            setattr(torch.Tensor, name, wrap(name, original))
        yield log
    finally:
        for name, original in saved.items():
            setattr(torch.Tensor, name, original)


def ragged(ref, d):
    """Drafts the reference continuation, wrong (or padded: no draft) from a
    slot that depends on the row: ragged acceptance, drafted EOS followed by
    more drafts, and rows without drafts."""
    wrong, pad = d.index("b0"), d.pad()
    return H.reference_drafter(
        H.output_tokens(ref), wrong, cut=lambda sid, k: sid % (k + 1), after_cut=lambda sid: pad if sid % 3 == 0 else wrong
    )


def generator(model, drafter, d, host_checks, opts="default", k=4):
    gen = H.make_generator(model, drafter, d, k, **OPTION_SETS[opts])
    gen.host_checks = host_checks
    return gen


@pytest.fixture(scope="module")
def reference(beam1_reference):
    return {(opts, bsz): beam1_reference(opts, bsz) for opts in ("default", "max_len_3", "min_len_15") for bsz in (1, 16)}


@pytest.mark.parametrize("opts", ["default", "max_len_3", "min_len_15"])
@pytest.mark.parametrize("bsz", [1, 16])
@pytest.mark.parametrize("host_checks", [True, False])
def test_output_is_greedy_with_and_without_host_checks(verifier, reference, opts, bsz, host_checks):
    model, task = verifier
    d = task.target_dictionary
    ref = reference[(opts, bsz)]
    drafter = ragged(ref, d)
    got = run_generator(generator(model, drafter, d, host_checks, opts), model, H.batches(task, "test", bsz))
    assert_identical(ref, got)


def reads_per_window(model, task, drafter, host_checks, bsz):
    """Host reads between consecutive verify passes in which no row retired,
    from the second pass of a batch on (the first pass also reads what a
    batch needs once: the encoder's padding mask, the cached projections'
    fingerprints)."""
    d = task.target_dictionary
    gen = generator(model, drafter, d, host_checks)
    log, windows = [], []
    forward = gen.verifier.forward

    def marked(tokens, state, needed=None):
        windows.append((len(log), state.size))
        return forward(tokens, state, needed)

    gen.verifier.forward = marked
    for sample in H.batches(task, "test", bsz):
        windows.clear()
        with counting_reads(log):
            gen.generate([model], sample)
        for (start, size), (end, next_size) in zip(windows[1:], windows[2:]):
            if size == next_size:
                yield end - start


@pytest.mark.parametrize("bsz", [1, 16])
def test_one_host_read_per_iteration_without_host_checks(verifier, reference, bsz):
    model, task = verifier
    d = task.target_dictionary
    ref = reference[("default", bsz)]
    drafter = ragged(ref, d)
    counts = list(reads_per_window(model, task, drafter, False, bsz))
    assert len(counts) >= 5
    assert set(counts) == {1}, counts
    # with the host checks (a CPU's default) the loop also reads the stop and
    # ragged-row checks and sums the running scores through numpy: at most
    # 3 + 4 (.cpu() and .numpy() of the scores and the drafts' log-probs) + 1
    with_checks = list(reads_per_window(model, task, drafter, True, bsz))
    assert 1 < max(with_checks) <= 8, with_checks


@pytest.mark.parametrize("kind", ["ngram", "source-copy"])
@pytest.mark.parametrize("bsz", [1, 16])
def test_a_host_drafter_reads_every_rows_context_at_once(verifier, kind, bsz):
    # the drafters that draft on the host read each row's last tokens: one
    # read for the whole batch, so the loop's one read per iteration becomes two
    from fairseq_specdec.generation.drafters import SourceCopyDrafter
    from fairseq_specdec.generation.ngram import NgramDrafter, load_ngram_corpus
    from fairseq_specdec.generation.options import NgramOptions

    model, task = verifier
    d = task.target_dictionary
    if kind == "ngram":
        drafter = NgramDrafter(load_ngram_corpus(task, NgramOptions("train", 3, 4, 0.0, task.cfg.data, task.cfg.source_lang,
                                                                    task.cfg.target_lang)), neighbours=4, pad=d.pad(), eos=d.eos(),
                               min_confidence=0.0)
    else:
        drafter = SourceCopyDrafter(d.pad(), d.eos())
    counts = list(reads_per_window(model, task, drafter, False, bsz))
    assert len(counts) >= 5
    assert set(counts) == {2}, counts


def test_a_batch_start_reads_the_weight_fingerprints_once(verifier):
    from fairseq_specdec.generation.lean_verifier import LeanVerifier

    model, _ = verifier
    lean = LeanVerifier(model)
    lean.start()
    log = []
    with counting_reads(log):
        lean.start()
    assert len(log) <= 1, log  # one comparison of all sampled values (in C++: torch.equal), not one per weight
    # and a changed weight is still seen (through p.data, as optimizers write),
    # the vocabulary projection's too
    for w in (model.decoder.layers[0].fc1.weight, model.decoder.output_projection.weight):
        layers, output = lean.layers, lean.output
        with torch.no_grad():
            first = w.data.view(-1)[0].clone()  # restored exactly: the verifier is the session's (x + 1 - 1 may not be x)
            w.data.view(-1)[0] += 1.0
            lean.start()
            assert lean.layers is not layers and lean.output is not output
            w.data.view(-1)[0] = first
