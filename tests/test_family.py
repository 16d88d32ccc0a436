"""The other drafters of the one loop: input-guided aggressive decoding (the
source is the draft, paper 003) and blockwise parallel decoding (heads on the
verifier, paper 004).  Both must give fairseq's own ``--beam 1`` output, in
process and through the stock fairseq-generate, at batch 1 and batch > 1.
"""
import pytest

import specdec_helpers as H
from specdec_helpers import OPTION_SETS, assert_identical, check_stats, run_generator, seq_gen, speculative_run
from fairseq_specdec.generation import BlockwiseHeadsDrafter, SourceCopyDrafter

pytestmark = pytest.mark.slow  # trains a tiny corrector and blockwise heads

ALL_TOKENS = 10_000  # input-guided drafts the whole rest of the source


def mean_accepted(stats):
    tokens = sum(s["length"] + 1 for s in stats.values())  # EOS included
    return tokens / sum(s["iterations"] for s in stats.values())


@pytest.fixture(scope="module")
def greedy(corrector_checkpoint, correction_bin, blockwise_checkpoint, toy_bin):
    """{(model name, option set, batch size): {id: hypo}} of fairseq's SequenceGenerator."""
    models = {
        "corrector": H.load_model(corrector_checkpoint, correction_bin),
        "blockwise": H.load_model(blockwise_checkpoint, toy_bin),
    }
    cache = {}

    def get(name, opts, bsz):
        key = (name, opts, bsz)
        if key not in cache:
            model, task = models[name]
            gen = seq_gen(model, task.target_dictionary, OPTION_SETS[opts])
            cache[key] = run_generator(gen, model, H.batches(task, "test", bsz))
        return cache[key]

    get.models = models
    return get


def test_toy_corrector_mostly_copies(greedy):
    """The premise of the input-guided tests: outputs overlap the sources."""
    model, task = greedy.models["corrector"]
    d = task.target_dictionary
    ref = greedy("corrector", "default", 16)
    samples = {i: s for b in H.batches(task, "test", 16) for i, s in zip(b["id"].tolist(), b["net_input"]["src_tokens"].tolist())}
    copied = sum(len(set(ref[i]["tokens"].tolist()) & set(samples[i]) - {d.pad(), d.eos()}) for i in ref)
    produced = sum(len(set(ref[i]["tokens"].tolist()) - {d.eos()}) for i in ref)
    assert copied / produced > 0.7


@pytest.mark.parametrize("opts", list(OPTION_SETS))
@pytest.mark.parametrize("bsz", [1, 3, 16])
def test_input_guided_exact(greedy, tmp_path, opts, bsz):
    model, task = greedy.models["corrector"]
    d = task.target_dictionary
    ref = greedy("corrector", opts, bsz)
    drafter = SourceCopyDrafter(d.pad(), d.eos())
    got, stats = speculative_run(model, drafter, d, ALL_TOKENS, OPTION_SETS[opts], H.batches(task, "test", bsz), tmp_path / "s.jsonl")
    assert_identical(ref, got)
    check_stats(stats, got, ALL_TOKENS)
    if opts == "default":
        # a drafter that never helps gives exactly 1 token per pass; copying the
        # source gives about 2 here (short sentences, about 2 edits each, and
        # every misspelling costs one extra greedy step before drafting resumes)
        assert mean_accepted(stats) > 1.5, mean_accepted(stats)


def test_input_guided_resynchronizes_after_a_correction(greedy, tmp_path):
    """After the verifier rewrites a token, drafting resumes from the source:
    some sentence accepts a long draft in a later iteration, not only the first."""
    model, task = greedy.models["corrector"]
    d = task.target_dictionary
    drafter = SourceCopyDrafter(d.pad(), d.eos())
    _, stats = speculative_run(model, drafter, d, ALL_TOKENS, OPTION_SETS["default"], H.batches(task, "test", 1), tmp_path / "s.jsonl")
    assert any(max(s["accepted"][1:], default=0) >= 3 for s in stats.values())


@pytest.mark.parametrize("opts", list(OPTION_SETS))
@pytest.mark.parametrize("bsz", [1, 3, 16])
def test_blockwise_exact(greedy, tmp_path, opts, bsz):
    """The heads draft, the base model verifies: fairseq's greedy output of the
    base (the same checkpoint run by SequenceGenerator)."""
    model, task = greedy.models["blockwise"]
    d = task.target_dictionary
    ref = greedy("blockwise", opts, bsz)
    k = model.blockwise_k - 1
    got, stats = speculative_run(model, BlockwiseHeadsDrafter(model), d, k, OPTION_SETS[opts], H.batches(task, "test", bsz), tmp_path / "s.jsonl")
    assert_identical(ref, got)
    check_stats(stats, got, k)
    if opts == "default":
        # a drafter that never helps adds exactly 1 token per pass; the toy
        # heads (validation accuracy about 40% and 25%) sometimes do
        assert mean_accepted(stats) > 1.05, mean_accepted(stats)
        assert any(a >= 2 for s in stats.values() for a in s["accepted"])


# decoding -> (checkpoint fixture, data fixture)
CLI_MODELS = {"input-guided": ("corrector_checkpoint", "correction_bin"), "blockwise": ("blockwise_checkpoint", "toy_bin")}


@pytest.mark.parametrize("bsz", [1, 16])
@pytest.mark.parametrize("decoding", list(CLI_MODELS))
def test_cli_matches_beam1(request, decoding, bsz):
    """Through the stock fairseq-generate: identical H-/P- lines, one statistics line."""
    checkpoint, data = (request.getfixturevalue(name) for name in CLI_MODELS[decoding])
    ref = H.generate(data, checkpoint, "--decoding", "autoregressive", task="draft_verify", batch_size=bsz)
    got = H.generate(data, checkpoint, "--decoding", decoding, task="draft_verify", batch_size=bsz)
    H.assert_same_hypotheses(H.parse_generate(ref.stdout), H.parse_generate(got.stdout))
    assert f"{decoding}: 50 sentences" in got.stdout + got.stderr  # the statistics line
