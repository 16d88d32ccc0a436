"""The registry of decodings, the draft-length policy and the statistics line.

* A decoding registered in one place, by a ``--user-dir`` plugin written
  here (an oracle drafter that proposes the ``--beam 1`` output read from a
  file), is a ``--decoding`` choice of fairseq-generate and decodes every
  sentence as ``--beam 1`` does, with nothing else edited.
* ``--adaptive-draft`` and ``--draft-min-confidence`` change what is drafted,
  never the strict output: fairseq's SequenceGenerator ``--beam 1`` at batch
  1 and 16, with the NAT drafter and with input-guided drafting.
* DraftLengthPolicy on its own.
* A second run in the same process logs its own statistics line.
"""
import json
import logging
import math
import re
import textwrap

import pytest
import torch

import specdec_helpers as H
from specdec_helpers import OPTION_SETS, assert_identical, run_generator, seq_gen
import fairseq_specdec  # noqa: F401
from fairseq import tasks
from fairseq_specdec.generation import (
    DraftLengthPolicy,
    MeasuredRows,
    NATBlockDrafter,
    SourceCopyDrafter,
    SpeculativeGenerator,
    StrictAcceptance,
)

DV = ("--decoding", "draft-verify")


# ---------------------------------------------------------------- MeasuredRows


def test_measured_rows_groups_batches_by_unfinished_rows():
    group = MeasuredRows.group
    assert [group(r) for r in range(1, 9)] == list(range(1, 9))
    assert {group(r) for r in (9, 10, 11)} == {9} and {group(r) for r in (12, 16)} == {10}
    assert {group(r) for r in (17, 22)} == {11} and {group(r) for r in (23, 32)} == {12} and group(33) == 13


def visit(rule, rows, cost_draft, cost_greedy, times, batch=32):
    """``times`` iterations at ``rows`` rows, each timed at the mode's cost
    per token; returns the modes the rule chose."""
    modes = []
    for _ in range(times):
        drafted = rule.drafts_at(rows, batch)
        modes.append(drafted)
        rule.observe(rows, batch, drafted, rows, rows * (cost_draft if drafted else cost_greedy))
    return modes


def test_measured_rows_measure_a_batch_of_one_sentence_too():
    """A sentence decoded alone is measured like the last row of a batch (one
    group): greedy first, then a trial of drafting, then the faster mode."""
    losing = MeasuredRows(least=3, first_wait=16, tokens=0)
    assert visit(losing, 1, 2.0, 1.0, 12, batch=1) == [False] * 3 + [True] * 3 + [False] * 6
    winning = MeasuredRows(least=3, first_wait=16, tokens=0)
    assert visit(winning, 1, 0.5, 1.0, 12, batch=1) == [False] * 3 + [True] * 9
    # what batches of one sentence measured holds for the last row of a larger batch
    assert winning.drafts_at(1, 32) and not losing.drafts_at(1, 32)


def test_measured_rows_cost_is_seconds_over_tokens_not_the_mean_of_ratios():
    """Drafting iterations that commit 10 tokens in 4 s and 1 token in 2 s,
    in turn, cost 6 s per 11 tokens (0.55 s a token): faster than greedy's
    0.7 s, although the mean of their ratios (1.2 s a token) is slower."""
    rule = MeasuredRows(least=4, first_wait=1000, tokens=0)
    for _ in range(4):
        assert not rule.drafts_at(1, 1)
        rule.observe(1, 1, False, 1, 0.7)
    for i in range(4):
        assert rule.drafts_at(1, 1)
        rule.observe(1, 1, True, *((10, 4.0) if i % 2 == 0 else (1, 2.0)))
    assert rule.drafts_at(1, 1) and rule.drafts_at(1, 1)


def test_measured_rows_measure_a_mode_over_tokens_not_over_a_few_sentences():
    """At one row an iteration is about a sentence.  Drafting costs 0.8 s a
    token and greedy 1.0 s, each iteration 2 s more: greedy timed on three
    sentences of 20 tokens (1.1 s a token) and drafting on three of 4 (1.3 s)
    would measure the lengths, and greedy would run from then on; timed over
    ``tokens`` committed tokens each, drafting wins, as it does on any
    sentence."""
    lengths = [20, 20, 20, 4, 4, 4] + [20, 4] * 20

    def run(tokens):
        rule = MeasuredRows(least=3, first_wait=1000, tokens=tokens)
        modes = []
        for n in lengths:
            drafted = rule.drafts_at(1, 1)
            modes.append(drafted)
            rule.observe(1, 1, drafted, n, 2.0 + (0.8 if drafted else 1.0) * n)
        return modes

    modes = run(MeasuredRows.TOKENS)
    assert modes[:4] == [False] * 4  # greedy until 64 tokens: 20 + 20 + 20 + 4
    assert modes[-20:] == [True] * 20
    assert run(0)[-20:] == [False] * 20  # three iterations each: the lengths were measured


def test_measured_rows_times_greedy_first_then_tries_drafting_where_smaller_batches_gained():
    rule = MeasuredRows(least=3, first_wait=16, tokens=0)
    # rows 3 are timed greedy, and not tried: rows 2 have not shown that drafting pays
    assert visit(rule, 3, 0.5, 1.0, 6) == [False] * 6
    # nor rows 2 before the last row of a batch has
    assert visit(rule, 2, 0.5, 1.0, 6) == [False] * 6
    # the last row of a batch: greedy first, then a trial of drafting at once, which wins
    assert visit(rule, 1, 0.5, 1.0, 8) == [False] * 3 + [True] * 5
    # then rows 2 try drafting, which wins there too
    assert visit(rule, 2, 0.5, 1.0, 5) == [True] * 5
    # now rows 3 try drafting; it loses there, so they go back to greedy
    assert visit(rule, 3, 2.0, 1.0, 6) == [True] * 3 + [False] * 3
    # and rows 4 are never tried: drafting lost at rows 3
    assert visit(rule, 4, 0.1, 1.0, 20) == [False] * 20


def test_measured_rows_try_the_slower_mode_again_after_doubling_waits():
    rule = MeasuredRows(least=2, first_wait=8, tokens=0)
    modes = visit(rule, 1, 2.0, 1.0, 40)  # drafting always loses at the last row of a batch
    tried = [i for i, m in enumerate(modes) if m]
    assert tried[:2] == [2, 3]  # the first trial, after the greedy timings
    # trials at the 8th visit and later at ever longer intervals, 2 iterations each
    starts = [i for i in tried if i - 1 not in tried]
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert len(starts) >= 3 and all(g2 > g1 for g1, g2 in zip(gaps, gaps[1:])), starts
    # a drafter that becomes faster is followed
    modes = visit(rule, 1, 0.2, 1.0, 200)
    assert modes[-10:] == [True] * 10


def test_measured_rows_charge_deferred_work_to_the_mode_that_deferred_it():
    """Greedy iterations that time 1.0 s a token but each leave 0.5 s of work
    (a sentence's deferred scores) for later cost 1.5 s a token: drafting at
    1.2 s a token wins once the work is charged to them, and loses where it
    is not."""
    def run(charged):
        rule = MeasuredRows(least=3, first_wait=1000, tokens=0)
        modes = []
        for _ in range(12):
            drafted = rule.drafts_at(1, 1)
            modes.append(drafted)
            rule.observe(1, 1, drafted, 1, 1.2 if drafted else 1.0)
            if charged and not drafted:
                rule.charge(1, 1, False, 0.5)
        return modes

    assert run(charged=True) == [False] * 3 + [True] * 9
    assert run(charged=False) == [False] * 3 + [True] * 3 + [False] * 6


def test_measured_rows_charge_amends_the_newest_iteration_of_its_group():
    """A charge moves a mode's sums as the same seconds in its newest
    iteration would have; a mode or a group not yet timed is charged
    nothing."""
    rule = MeasuredRows(least=1, tokens=0)
    rule.charge(1, 1, False, 5.0)  # nothing timed yet
    assert rule.buckets == {}
    rule.observe(2, 8, False, 4, 1.0)
    rule.charge(2, 8, True, 5.0)  # drafting not timed in the group
    rule.charge(3, 8, False, 5.0)  # another group
    bucket = rule.buckets[MeasuredRows.group(2)]
    assert bucket.seconds[False] == 1.0 and True not in bucket.seconds
    rule.charge(2, 8, False, 0.5)  # the only iteration timed: as if it took 1.5 s
    assert bucket.seconds[False] == 1.5
    rule.observe(2, 8, False, 4, 2.0)
    rule.charge(2, 8, False, 0.5)  # as if that one took 2.5 s
    same = MeasuredRows(least=1, tokens=0)
    same.observe(2, 8, False, 4, 1.5)
    same.observe(2, 8, False, 4, 2.5)
    assert math.isclose(bucket.seconds[False], same.buckets[MeasuredRows.group(2)].seconds[False])
    assert bucket.tokens[False] == same.buckets[MeasuredRows.group(2)].tokens[False]


def test_measured_rows_ignore_iterations_that_commit_nothing():
    rule = MeasuredRows(least=1, tokens=0)
    rule.observe(2, 8, True, 0, 1.0)
    assert rule.buckets == {} or all(sum(b.count.values()) == 0 for b in rule.buckets.values())


# ---------------------------------------------------------------- DraftLengthPolicy


def test_policy_adapts_each_row_within_one_and_k():
    policy = DraftLengthPolicy(6, adaptive=True)
    assert policy.initial() == 5  # min(5, k)
    draft_k = [5, 5, 5, 3, 1, 6]
    # rows: all 5 accepted; 2 of 5; nothing drafted; all 3; 0 of 1; all 6
    policy.update(draft_k, drafted=[5, 5, 0, 3, 1, 6], accepted=[5, 2, 0, 3, 0, 6])
    assert draft_k == [6, 4, 5, 5, 1, 6]  # +2 capped at k, -1, unchanged, +2, floor 1, cap
    assert DraftLengthPolicy(3, adaptive=True).initial() == 3
    assert DraftLengthPolicy(8, adaptive=True, init=20).initial() == 8
    assert DraftLengthPolicy(8, adaptive=True, init=0).initial() == 1


def test_policy_without_adaptive_keeps_k():
    policy = DraftLengthPolicy(4)
    assert policy.initial() == 4
    draft_k = [4, 4]
    policy.update(draft_k, drafted=[4, 4], accepted=[0, 4])
    assert draft_k == [4, 4]


def test_policy_pads_drafts_past_their_length_and_from_the_first_unconfident_slot():
    pad = 1
    tokens = torch.tensor([[10, 11, 12, 13], [20, 21, 22, 23], [30, 31, 32, 33]])
    probs = torch.tensor([[0.9, 0.2, 0.9, 0.9], [0.9, 0.9, 0.9, 0.6], [0.1, 0.9, 0.9, 0.9]])
    cut = DraftLengthPolicy(4, min_confidence=0.5).limit(tokens, probs.log(), [4, 4, 4], pad)
    # a slot below 0.5 and every slot after it are padded, confident ones after it too
    assert cut.tolist() == [[10, pad, pad, pad], [20, 21, 22, 23], [pad, pad, pad, pad]]
    both = DraftLengthPolicy(4, adaptive=True, min_confidence=0.5).limit(tokens, probs.log(), [4, 2, 1], pad)
    assert both.tolist() == [[10, pad, pad, pad], [20, 21, pad, pad], [pad, pad, pad, pad]]
    # a drafter that returns no log-probs is not cut
    assert DraftLengthPolicy(4, min_confidence=0.5).limit(tokens, None, [4, 4, 4], pad).equal(tokens)


# ---------------------------------------------------------------- the statistics line of every run


@pytest.fixture(scope="module")
def untrained_verifier(toy_bin):
    _, cfg = H.train_args_namespace(toy_bin, "--task", "translation", *H.AR_ARCH_ARGS, "--cpu")
    return tasks.setup_task(cfg.task).build_model(cfg.model).eval()


def test_second_run_in_one_process_logs_its_statistics(toy_bin, untrained_verifier, random_drafter_checkpoint, caplog):
    """As fairseq-generate does it, twice on one task: a generator, then the
    split's batch iterator; each run logs its own line."""
    cfg = H.generation_cfg(toy_bin, "--task", "draft_verify", "--beam", "1", *DV, "--drafter-path",
                           random_drafter_checkpoint, "--max-len-b", "4")
    task = tasks.setup_task(cfg.task)
    task.load_dataset("test")
    with caplog.at_level(logging.INFO, logger="fairseq_specdec.generation"):
        for _ in range(2):
            gen = task.build_generator([untrained_verifier], cfg.generation)
            itr = task.get_batch_iterator(dataset=task.dataset("test"), max_sentences=16,
                                          disable_iterator_cache=True).next_epoch_itr(shuffle=False)
            for sample in itr:
                gen.generate([untrained_verifier], sample)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("draft-verify: ")]
    assert len(lines) == 2, lines
    assert all(line.startswith("draft-verify: 50 sentences") for line in lines), lines


# ---------------------------------------------------------------- the policy keeps strict output


class Spy:
    """Records the k the loop asks for and how many drafts were verified."""

    def setup_spy(self):
        self.ks, self.drafted = [], 0

    def propose(self, state, k):
        self.ks.append(k)
        return super().propose(state, k)

    def update(self, state, feedback):
        self.drafted += sum(feedback.drafted)
        super().update(state, feedback)


class SpyNAT(Spy, NATBlockDrafter):
    def __init__(self, model):
        super().__init__(model, None, with_scores=True)
        self.setup_spy()


class SpyCopy(Spy, SourceCopyDrafter):
    def __init__(self, d):
        super().__init__(d.pad(), d.eos())
        self.setup_spy()


@pytest.fixture(scope="module")
def setups(verifier, nat_checkpoint, toy_bin, corrector_checkpoint, correction_bin):
    """{name: (verifier, task, make drafter, k)}, and fairseq's --beam 1 per (name, batch size)."""
    nat_model, _ = H.load_model(nat_checkpoint, toy_bin)
    corrector, corrector_task = H.load_model(corrector_checkpoint, correction_bin)
    out = {
        "nat": (verifier[0], verifier[1], lambda: SpyNAT(nat_model), 6),
        # --block-size 8 caps the source copy (uncapped, k is whatever the length limit leaves)
        "input-guided": (corrector, corrector_task, lambda: SpyCopy(corrector_task.target_dictionary), 8),
    }
    refs = {}

    def reference(name, bsz):
        if (name, bsz) not in refs:
            model, task, _, _ = out[name]
            gen = seq_gen(model, task.target_dictionary, OPTION_SETS["default"])
            refs[(name, bsz)] = run_generator(gen, model, H.batches(task, "test", bsz))
        return refs[(name, bsz)]

    return out, reference


@pytest.mark.slow
@pytest.mark.parametrize("bsz", [1, 16])
@pytest.mark.parametrize("name", ["nat", "input-guided"])
@pytest.mark.parametrize("option", ["--adaptive-draft", "--draft-min-confidence"])
def test_draft_policy_keeps_the_beam1_output(setups, name, bsz, option):
    """Strict output identical to --beam 1 with the policy and without it;
    the policy changes what is drafted (the k the loop asks for, or the drafts
    verified), which shows it ran."""
    out, reference = setups
    model, task, make, k = out[name]
    samples = H.batches(task, "test", bsz)
    policies = {
        "--adaptive-draft": DraftLengthPolicy(k, adaptive=True),
        "--draft-min-confidence": DraftLengthPolicy(k, min_confidence=0.5),
        "fixed": DraftLengthPolicy(k),
    }
    drafters = {}
    for policy in (option, "fixed"):
        drafters[policy] = make()
        gen = H.make_generator(model, drafters[policy], task.target_dictionary, k, draft_policy=policies[policy],
                               **OPTION_SETS["default"])
        assert_identical(reference(name, bsz), run_generator(gen, model, samples))
    used, fixed = drafters[option], drafters["fixed"]
    assert set(fixed.ks) == {k}
    if option == "--adaptive-draft":
        assert used.ks[0] == 5  # starts at min(5, k), not at k
        assert max(used.ks) > 5 or min(used.ks) < 5, used.ks  # and moves
    elif name == "nat":  # fewer drafts verified, some still
        assert 0 < used.drafted < fixed.drafted, (used.drafted, fixed.drafted)
    else:  # the source copy has no probabilities: nothing to cut
        assert used.drafted == fixed.drafted


# ---------------------------------------------------------------- a decoding registered by a plugin

PLUGIN = '''
"""A throwaway decoding: drafts the --beam 1 output read from a file."""
import json

import torch

import fairseq_specdec  # noqa: F401  (the draft_verify task)
from fairseq_specdec.generation.drafters import Drafter
from fairseq_specdec.generation.registry import BuiltDrafter, Decoding, register_decoding

REFERENCE = {reference!r}


class OracleDrafter(Drafter):
    def __init__(self, refs, pad):
        self.refs, self.pad = refs, pad

    def describe(self):
        return "the reference (an oracle)"

    def start_batch(self, state):
        self.ids = state.sample["id"].tolist()

    def propose(self, state, k):
        out = state.tokens.new_full((state.size, k), self.pad)
        for i, row in enumerate(state.rows):
            n = state.lengths_host[i]
            cont = self.refs[self.ids[row]][n : n + k]
            if cont:
                out[i, : len(cont)] = torch.tensor(cont)
        return out, None

    def reorder(self, order, order_host):
        pass


def build(ctx):
    d = ctx.task.target_dictionary
    with open(REFERENCE) as f:
        lines = json.load(f)
    refs = {{int(i): d.encode_line(line, add_if_not_exist=False).tolist() for i, line in lines.items()}}
    return BuiltDrafter(OracleDrafter(refs, d.pad()), block_size=4, description="the --beam 1 output")


register_decoding(Decoding(name="oracle", help="drafts the --beam 1 output read from a file",
                           build=build, relaxed=False))
'''


@pytest.fixture(scope="module")
def oracle_plugin(toy_bin, ar_checkpoint, stock_beam1, tmp_path_factory):
    """(plugin directory, fairseq's --beam 1 hypotheses)."""
    root = tmp_path_factory.mktemp("plugin")
    hyps = stock_beam1(ar_checkpoint, "--decoding", "autoregressive", batch_size=16)
    assert sorted(hyps) == list(range(50))
    reference = root / "beam1.json"
    reference.write_text(json.dumps({i: tokens for i, (_, tokens, _) in hyps.items()}))
    plugin = root / "specdec_oracle_plugin"
    plugin.mkdir()
    (plugin / "__init__.py").write_text(textwrap.dedent(PLUGIN.format(reference=str(reference))))
    return str(plugin), hyps


@pytest.mark.slow
def test_registered_decoding_is_a_choice(toy_bin, ar_checkpoint, oracle_plugin):
    plugin, _ = oracle_plugin
    with_plugin = H.generate(toy_bin, ar_checkpoint, "--user-dir", plugin, "--decoding", "no-such-decoding",
                             plugin=False, task="draft_verify", check=False)
    out = with_plugin.stdout + with_plugin.stderr
    assert with_plugin.returncode != 0
    choices = re.search(r"--decoding 'no-such-decoding' is not a decoding; choose from (.*)", out)
    assert choices, out[-2000:]
    assert "oracle" in choices.group(1).split(", ")
    without = H.generate(toy_bin, ar_checkpoint, "--decoding", "no-such-decoding", task="draft_verify", check=False)
    assert "oracle" not in without.stdout + without.stderr  # the plugin, and only it, adds the choice


@pytest.mark.slow
@pytest.mark.parametrize("bsz", [1, 16])
def test_registered_decoding_decodes_like_beam1(toy_bin, ar_checkpoint, oracle_plugin, tmp_path, bsz):
    plugin, beam1 = oracle_plugin
    stats = tmp_path / "stats.jsonl"
    proc = H.generate(toy_bin, ar_checkpoint, "--user-dir", plugin, "--decoding", "oracle", "--draft-max-rows", "0",
                      "--specdec-stats", stats, plugin=False, task="draft_verify", batch_size=bsz)
    H.assert_same_hypotheses(beam1, H.parse_generate(proc.stdout))
    assert "oracle: 50 sentences" in proc.stdout
    # the oracle's drafts are all accepted: k + 1 = 5 tokens per iteration until the EOS
    for i, record in H.read_stats(stats).items():
        n = len(beam1[i][1].split()) + 1  # the EOS included
        assert record["iterations"] == math.ceil(n / 5), (i, record)


def test_the_architecture_docs_decoding_example_runs(toy_bin, untrained_verifier):
    """docs/architecture.md's example of a new decoding: registered as
    written, built by the task, output identical to fairseq's --beam 1."""
    from fairseq_specdec.generation.registry import unregister_decoding

    doc = (H.ROOT / "docs" / "architecture.md").read_text()
    section = doc[doc.index("### Adding a decoding"):]
    code = section[section.index("```python\n") + len("```python\n"):section.index("```", section.index("```python\n") + 3)]
    model = untrained_verifier
    try:
        exec(compile(code, "docs/architecture.md", "exec"), {})
        cfg = H.generation_cfg(toy_bin, "--task", "draft_verify", "--beam", "1", "--decoding", "repeat",
                               "--block-size", "3", "--max-len-b", "6")
        task = tasks.setup_task(cfg.task)
        gen = task.build_generator([model], cfg.generation)
        assert type(gen.drafter).__name__ == "RepeatDrafter"
        samples = H.batches(task, "test", 8)
        ref = run_generator(seq_gen(model, task.target_dictionary, dict(max_len_a=0, max_len_b=6, min_len=1)), model, samples)
        assert_identical(ref, run_generator(gen, model, samples))
    finally:
        unregister_decoding("repeat")
