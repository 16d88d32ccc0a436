"""SpeculativeGenerator in-process: strict verification reproduces fairseq's
own ``--beam 1`` SequenceGenerator exactly, whatever the drafter proposes.

The reference is fairseq's SequenceGenerator on the same batches; the drafters
are an oracle (proposes the reference continuation: every draft accepted), a
rejecting drafter (proposes pad, which the verifier never picks: every draft
rejected) and an untrained specdec_nat drafter (mostly wrong, sometimes right).
"""
import math

import pytest
import torch

import specdec_helpers as H
from specdec_helpers import OPTION_SETS, assert_identical, check_stats, run_generator, seq_gen, spec_gen, speculative_run
import fairseq_specdec  # noqa: F401
from fairseq_specdec.generation import (
    NATBlockDrafter,
    SpecDecStats,
    SpeculativeGenerator,
    StrictAcceptance,
    TopBetaAcceptance,
)

pytestmark = pytest.mark.slow  # needs the trained verifier (fairseq-train)


def oracle(ref, d):
    """Proposes the reference continuation (every draft accepted); checks the prefix it is given."""
    return H.reference_drafter(H.output_tokens(ref), d.index("b0"), check_prefix=True, with_scores=True)


def rejecting(d):
    """Always proposes pad: fairseq masks it, so strict verification rejects it."""
    return H.reference_drafter({}, d.pad(), cut=lambda sid, k: 0)


@pytest.fixture(scope="module")
def reference(beam1_reference):
    """(option set, batch size) -> {id: hypo} from fairseq's SequenceGenerator."""
    return beam1_reference


def test_reference_is_sane(reference, verifier):
    """The trained verifier ends its outputs by itself (EOS inside a block needs that)."""
    _, task = verifier
    ref = reference("default", 16)
    assert sorted(ref) == list(range(50))
    lengths = [len(h["tokens"]) for h in ref.values()]
    assert max(lengths) < 30
    assert all(h["tokens"][-1] == task.target_dictionary.eos() for h in ref.values())
    assert all(len(h["tokens"]) >= 16 for h in reference("min_len_15", 16).values())
    assert all(len(h["tokens"]) <= 4 for h in reference("max_len_3", 16).values())


@pytest.mark.parametrize("opts", list(OPTION_SETS))
@pytest.mark.parametrize("bsz", [1, 3, 16])
def test_oracle_drafter_exact_and_all_accepted(verifier, reference, tmp_path, opts, bsz):
    model, task = verifier
    d = task.target_dictionary
    k = 4
    ref = reference(opts, bsz)
    drafter = oracle(ref, d)
    got, stats = speculative_run(model, drafter, d, k, OPTION_SETS[opts], H.batches(task, "test", bsz), tmp_path / "stats.jsonl")
    assert_identical(ref, got)
    check_stats(stats, got, k)
    for i, s in stats.items():
        n = len(got[i]["tokens"])
        # every draft accepted: k + 1 tokens per iteration until the EOS
        assert s["iterations"] == math.ceil(n / (k + 1)), (i, s)
        assert all(a == k + 1 for a in s["accepted"][:-1]), (i, s)


@pytest.mark.parametrize("bsz", [1, 3, 16])
def test_eos_inside_the_block(verifier, reference, tmp_path, bsz):
    """k larger than every output: one iteration per sentence, EOS mid-block."""
    model, task = verifier
    d = task.target_dictionary
    ref = reference("default", bsz)
    k = 40
    assert all(len(h["tokens"]) < k for h in ref.values())
    drafter = oracle(ref, d)
    got, stats = speculative_run(model, drafter, d, k, OPTION_SETS["default"], H.batches(task, "test", bsz), tmp_path / "stats.jsonl")
    assert_identical(ref, got)
    assert all(s["iterations"] == 1 for s in stats.values())


@pytest.mark.parametrize("opts", list(OPTION_SETS))
@pytest.mark.parametrize("bsz", [1, 3, 16])
def test_rejecting_drafter_exact(verifier, reference, tmp_path, opts, bsz):
    """Every draft rejected: k = 1 gives one iteration per output token (EOS included)."""
    model, task = verifier
    d = task.target_dictionary
    ref = reference(opts, bsz)
    for k in (1, 3):
        drafter = rejecting(d)
        got, stats = speculative_run(model, drafter, d, k, OPTION_SETS[opts], H.batches(task, "test", bsz), tmp_path / f"stats{k}.jsonl")
        assert_identical(ref, got)
        check_stats(stats, got, k)
        for i, s in stats.items():
            assert s["iterations"] == len(got[i]["tokens"])
            assert all(a == 1 for a in s["accepted"])


@pytest.mark.parametrize("opts", list(OPTION_SETS))
@pytest.mark.parametrize("bsz", [1, 3, 16])
@pytest.mark.parametrize("k", [1, 4])
def test_untrained_nat_drafter_exact(verifier, reference, tiny_drafter, tmp_path, opts, bsz, k):
    model, task = verifier
    drafter_model = tiny_drafter[0]
    d = task.target_dictionary
    ref = reference(opts, bsz)
    drafter = NATBlockDrafter(drafter_model)
    got, stats = speculative_run(model, drafter, d, k, OPTION_SETS[opts], H.batches(task, "test", bsz), tmp_path / "stats.jsonl")
    assert_identical(ref, got)
    check_stats(stats, got, k)


def test_oracle_k1_iterations(verifier, reference, tmp_path):
    model, task = verifier
    d = task.target_dictionary
    ref = reference("default", 3)
    drafter = oracle(ref, d)
    got, stats = speculative_run(model, drafter, d, 1, OPTION_SETS["default"], H.batches(task, "test", 3), tmp_path / "stats.jsonl")
    assert_identical(ref, got)
    for i, s in stats.items():
        assert s["iterations"] == math.ceil(len(got[i]["tokens"]) / 2)


def test_relaxed_acceptance_accepts_more_than_strict(verifier, tiny_drafter, tmp_path):
    """A very permissive top-beta rule keeps every draft the verifier does not
    forbid: fewer iterations than strict, one hypothesis per sentence, and the
    output follows the drafter where it was accepted."""
    model, task = verifier
    d = task.target_dictionary
    samples = H.batches(task, "test", 8)
    counts = {}
    for name, rule in (("strict", StrictAcceptance()), ("loose", TopBetaAcceptance(len(d), 1e9))):
        stats = SpecDecStats(str(tmp_path / f"{name}.jsonl"))
        drafter = NATBlockDrafter(tiny_drafter[0])
        gen = spec_gen(model, drafter, d, 4, OPTION_SETS["default"], stats=stats, acceptance=rule)
        got = run_generator(gen, model, samples)
        assert sorted(got) == list(range(50))
        assert all(h["tokens"][-1] == d.eos() for h in got.values())
        counts[name] = stats.iterations
    assert counts["loose"] < counts["strict"]


def test_rejects_prefix_and_constraints(verifier, tiny_drafter):
    model, task = verifier
    gen = spec_gen(model, NATBlockDrafter(tiny_drafter[0]), task.target_dictionary, 2, OPTION_SETS["default"])
    sample = H.batches(task, "test", 2)[0]
    with pytest.raises(ValueError, match="prefix"):
        gen.generate([model], sample, prefix_tokens=sample["target"][:, :1])
    with pytest.raises(ValueError, match="constraints"):
        gen.generate([model], sample, constraints=torch.zeros(2, 1, dtype=torch.long))


def test_generator_argument_checks(verifier, tiny_drafter):
    model, task = verifier
    with pytest.raises(ValueError, match="drafter"):
        NATBlockDrafter(model)  # a Transformer is not a block drafter
