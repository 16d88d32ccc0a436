"""``--decoding ngram-draft``: the corpus's draft where it has one, the
drafter checkpoint's elsewhere (:class:`FallbackDrafter`).  The merge
against drafts written out here by hand, the second drafter's pass skipped
where the first covered every row, the options refused by name, and the
strict output identical to fairseq's ``--beam 1`` through the stock
fairseq-generate."""
import re
import types

import pytest
import torch

import specdec_helpers as H
from fairseq_specdec.generation.drafters import Drafter, FallbackDrafter

PAD = 1


class Scripted(Drafter):
    """Drafts the rows of ``script`` (lists, [] = no draft), at most k tokens;
    records every call it hears."""

    def __init__(self, script, lprob=None):
        self.script, self.lprob = script, lprob
        self.calls = []

    def start_batch(self, state):
        self.calls.append("start")

    def propose(self, state, k):
        self.calls.append(("propose", k))
        rows = [r[:k] for r in self.script]
        width = max((len(r) for r in rows), default=0)
        tokens = torch.tensor([r + [PAD] * (width - len(r)) for r in rows], dtype=torch.long).view(len(rows), width)
        if self.lprob is None:
            return tokens, None
        return tokens, torch.full(tokens.shape, self.lprob)

    def update(self, state, feedback):
        self.calls.append("update")

    def reorder(self, order, order_host):
        self.calls.append(("reorder", order_host))
        self.script = [self.script[i] for i in order_host]


def state_of(rows):
    return types.SimpleNamespace(size=rows)


def test_each_row_takes_the_first_draft_where_there_is_one():
    first = Scripted([[5], [], [6, 7, 8, 9]])
    second = Scripted([[10, 11, 12], [13, 14], [15]], lprob=-0.5)
    drafter = FallbackDrafter(first, second, PAD)
    tokens, lprobs = drafter.propose(state_of(3), 4)
    # row 0: the first's one token, then pad (none of the second's tokens after it)
    assert tokens.tolist() == [[5, PAD, PAD, PAD], [13, 14, PAD, PAD], [6, 7, 8, 9]]
    # the second's log-probs on its rows (its 3 slots; 0 on the slot past them), 0 (sure) on the first's drafts
    assert lprobs.tolist() == [[0.0] * 4, [-0.5, -0.5, -0.5, 0.0], [0.0] * 4]
    assert drafter.first_rows == 2 and drafter.second_passes == 1


def test_the_second_pass_is_skipped_where_the_first_drafted_every_row():
    first = Scripted([[5, 6], [7]])
    second = Scripted([[10], [11]], lprob=-0.1)
    drafter = FallbackDrafter(first, second, PAD)
    tokens, lprobs = drafter.propose(state_of(2), 3)
    assert tokens.tolist() == [[5, 6], [7, PAD]] and lprobs is None
    assert ("propose", 3) not in second.calls and drafter.second_passes == 0


def test_the_second_drafts_alone_where_the_first_has_nothing():
    first = Scripted([[], []])
    second = Scripted([[10, 11], [12]], lprob=-0.25)
    drafter = FallbackDrafter(first, second, PAD)
    tokens, lprobs = drafter.propose(state_of(2), 3)
    assert tokens.tolist() == [[10, 11], [12, PAD]]
    assert lprobs.tolist() == [[-0.25, -0.25], [-0.25, -0.25]]
    assert drafter.first_rows == 0 and drafter.second_passes == 1


def test_each_drafter_drafts_at_most_its_own_k():
    first = Scripted([[5, 6, 7, 8, 9], []])
    second = Scripted([[10, 11, 12, 13], [14, 15, 16, 17]], lprob=-0.1)
    drafter = FallbackDrafter(first, second, PAD, first_k=5, second_k=2)
    tokens, _ = drafter.propose(state_of(2), 5)
    assert ("propose", 5) in first.calls and ("propose", 2) in second.calls
    assert tokens.tolist() == [[5, 6, 7, 8, 9], [14, 15, PAD, PAD, PAD]]
    # the loop's k caps both
    drafter.propose(state_of(2), 1)
    assert first.calls[-1] == ("propose", 1) and second.calls[-1] == ("propose", 1)


def test_both_drafters_hear_every_call():
    first, second = Scripted([[5], []]), Scripted([[10], [11]])
    drafter = FallbackDrafter(first, second, PAD)
    drafter.start_batch(None)
    drafter.update(None, None)
    drafter.reorder(torch.tensor([1]), [1])
    for d in (first, second):
        assert d.calls == ["start", "update", ("reorder", [1])]


def test_limits_are_the_tighter_of_the_two():
    first, second = Scripted([]), Scripted([])
    second.max_positions, second.max_block, second.precision = 40, 10, "bfloat16"
    drafter = FallbackDrafter(first, second, PAD)
    assert (drafter.max_positions, drafter.max_block, drafter.precision) == (40, 10, "bfloat16")
    first.max_block = 6
    assert FallbackDrafter(first, second, PAD).max_block == 6


@pytest.mark.slow
@pytest.mark.parametrize("bsz", [1, 16])
def test_cli_identical_to_beam1(toy_bin, ar_checkpoint, vsd_checkpoint, bsz):
    ref = H.parse_generate(H.generate(toy_bin, ar_checkpoint, task="draft_verify", batch_size=bsz).stdout)
    proc = H.generate(toy_bin, ar_checkpoint, "--decoding", "ngram-draft", "--drafter-path", vsd_checkpoint,
                      "--ngram-split", "train", "--draft-max-rows", "0", task="draft_verify", batch_size=bsz)
    H.assert_same_hypotheses(ref, H.parse_generate(proc.stdout))
    out = proc.stdout + proc.stderr
    assert "n-gram continuations" in out and "where it has no draft, specdec_vsd drafter" in out
    tok = float(re.search(r"Tok\. ([0-9.]+)", out).group(1))
    assert tok > 1.2, out[-2000:]


def test_cli_refuses_what_cannot_apply(toy_bin, ar_checkpoint, vsd_checkpoint):
    got = H.generate(toy_bin, ar_checkpoint, "--decoding", "ngram-draft", task="draft_verify", check=False)
    assert got.returncode != 0 and "--decoding ngram-draft needs a drafter: --drafter-path" in got.stderr
    got = H.generate(toy_bin, ar_checkpoint, "--decoding", "ngram-draft", "--drafter-path", vsd_checkpoint,
                     "--verify-beta", "3", "--verify-score", "drafter", task="draft_verify", check=False)
    assert got.returncode != 0 and "--verify-score drafter" in got.stderr and "--verify-score verifier" in got.stderr


@pytest.mark.slow
def test_profile_counts_the_drafters_pass_only_where_the_corpus_has_no_draft(toy_bin, ar_checkpoint, vsd_checkpoint,
                                                                              tmp_path):
    """scripts/profile-draft-verify.py --ngram-draft: both drafters' parts are
    timed, the drafter's pass runs in fewer iterations than the verifier's
    (the corpus drafted the others), and everything adds up."""
    import json

    out = tmp_path / "profile.json"
    H.run([
        H.cli("python"), H.ROOT / "scripts" / "profile-draft-verify.py", "--data", toy_bin, "--src", "src", "--tgt", "tgt",
        "--verifier", ar_checkpoint, "--drafter", vsd_checkpoint, "--ngram-draft", "--limit", "20", "--warmup", "3",
        "--json", out,
    ])
    rows = [r for r in json.loads(out.read_text())["rows"] if r["decoder"] == "n-gram corpus, then draft-verify strict"]
    by_name = {r["component"].split(" (")[0]: r for r in rows}
    assert {"n-gram lookups", "drafter pass", "drafter feedback", "verifier pass"} <= set(by_name), sorted(by_name)
    passes, iterations = by_name["drafter pass"]["calls"], by_name["verifier pass"]["calls"]
    assert by_name["n-gram lookups"]["calls"] > passes > 0 and passes < iterations
    assert by_name["drafter feedback"]["calls"] == iterations
    parts = [r for r in rows if r["component"] != "total" and not r["component"].startswith("of which")]
    assert sum(r["ms_per_sentence"] for r in parts) == pytest.approx(by_name["total"]["ms_per_sentence"])
