"""Acceptance rules on hand-built log-probs."""
import math

import pytest
import torch

import specdec_helpers as H
from fairseq_specdec.generation.acceptance import (
    StrictAcceptance,
    TopBetaAcceptance,
    build_acceptance,
)

NEG_INF = -math.inf


def lp(*rows):
    """B x k x V log-probs from nested lists of probabilities (0 -> -inf)."""
    t = torch.tensor(rows, dtype=torch.float)
    return torch.where(t > 0, t.log(), torch.full_like(t, NEG_INF))


# one row, k = 4 slots, V = 5; per slot the verifier's ranking is spelled out
LPROBS = lp(
    [
        [0.50, 0.30, 0.15, 0.05, 0.00],  # rank: 0 > 1 > 2 > 3; 4 forbidden
        [0.10, 0.60, 0.25, 0.05, 0.00],  # rank: 1 > 2 > 0 > 3
        [0.40, 0.39, 0.20, 0.01, 0.00],  # 0 and 1 nearly tied
        [0.00, 0.00, 0.00, 0.00, 1.00],  # only token 4 allowed (e.g. forced EOS)
    ]
)
GREEDY = torch.tensor([[0, 1, 0, 4]])


def test_strict_is_draft_equals_greedy():
    rule = StrictAcceptance()
    draft = torch.tensor([[0, 2, 1, 4]])
    assert rule(draft, None, LPROBS, GREEDY).tolist() == [[True, False, False, True]]
    # strict ignores the log-probs entirely: only the greedy token counts
    greedy = torch.tensor([[3, 2, 1, 0]])
    assert rule(draft, None, LPROBS, greedy).tolist() == [[False, True, True, False]]


def test_top_beta_membership():
    rule = TopBetaAcceptance(beta=2, tau=100.0)
    # slot 0 top-2 = {0, 1}; slot 1 {1, 2}; slot 2 {0, 1}; slot 3 {4, any -inf}
    draft = torch.tensor([[1, 2, 2, 4]])
    assert rule(draft, None, LPROBS, GREEDY).tolist() == [[True, True, False, True]]
    draft = torch.tensor([[2, 0, 1, 0]])
    assert rule(draft, None, LPROBS, GREEDY).tolist() == [[False, False, True, False]]


def test_top_beta_tau_on_verifier_score():
    # slot 0: log .5 - log .3 = 0.51; slot 1: top-1 itself; slot 2: log .40 - log .39 = 0.025
    draft = torch.tensor([[1, 1, 1, 4]])
    tight = TopBetaAcceptance(beta=3, tau=0.1)
    assert tight(draft, None, LPROBS, GREEDY).tolist() == [[False, True, True, True]]
    loose = TopBetaAcceptance(beta=3, tau=0.6)
    assert loose(draft, None, LPROBS, GREEDY).tolist() == [[True, True, True, True]]
    # slot 1, token 2: log .6 - log .25 = 0.88
    draft = torch.tensor([[0, 2, 0, 4]])
    assert loose(draft, None, LPROBS, GREEDY).tolist() == [[True, False, True, True]]
    assert TopBetaAcceptance(3, 0.9)(draft, None, LPROBS, GREEDY).tolist() == [[True, True, True, True]]
    # tau = 0: only ties with the top-1 (the top-1 itself included)
    zero = TopBetaAcceptance(beta=3, tau=0.0)
    assert zero(torch.tensor([[0, 1, 1, 4]]), None, LPROBS, GREEDY).tolist() == [[True, True, False, True]]


def test_top_beta_tau_on_drafter_score():
    draft = torch.tensor([[1, 2, 1, 4]])  # all within top-3 of the verifier
    # drafter is confident on slots 0/1, unsure on slot 2
    draft_lprobs = torch.tensor([[math.log(0.49), math.log(0.6), math.log(0.01), 0.0]])
    drafter_rule = TopBetaAcceptance(beta=3, tau=0.1, score="drafter")
    verifier_rule = TopBetaAcceptance(beta=3, tau=0.1, score="verifier")
    # drafter score: top1(verifier) - drafter lp: .69-.71=-.02 ok, .51-.51=0 ok, .92-4.6 no
    assert drafter_rule(draft, draft_lprobs, LPROBS, GREEDY).tolist() == [[True, True, False, True]]
    # verifier score: .51 no, log .6 - log .25 = .88 no, .025 ok
    assert verifier_rule(draft, draft_lprobs, LPROBS, GREEDY).tolist() == [[False, False, True, True]]


def test_drafter_score_needs_drafter_log_probs():
    rule = TopBetaAcceptance(beta=2, tau=1.0, score="drafter")
    with pytest.raises(ValueError):
        rule(torch.tensor([[0, 1, 0, 4]]), None, LPROBS, GREEDY)


def test_forbidden_tokens_never_accepted():
    """A -inf candidate is never accepted, even when beta covers the vocabulary
    and tau is huge, and even when the drafter is confident."""
    draft = torch.tensor([[4, 4, 4, 0]])
    for score, dl in (("verifier", None), ("drafter", torch.zeros(1, 4))):
        rule = TopBetaAcceptance(beta=5, tau=1e9, score=score)
        assert rule(draft, dl, LPROBS, GREEDY).tolist() == [[False, False, False, False]]


def test_batch_rows_are_independent():
    lprobs = torch.cat([LPROBS, LPROBS.flip(-1)], 0)
    draft = torch.tensor([[1, 2, 1, 4], [3, 2, 3, 0]])
    rule = TopBetaAcceptance(beta=2, tau=1.0)
    both = rule(draft, None, lprobs, torch.zeros(2, 4, dtype=torch.long))
    for r in range(2):
        alone = rule(draft[r : r + 1], None, lprobs[r : r + 1], torch.zeros(1, 4, dtype=torch.long))
        assert both[r].tolist() == alone[0].tolist()


def test_beta_one_is_strict():
    rule = build_acceptance(1, 5.0, "drafter")
    assert isinstance(rule, StrictAcceptance)
    g = torch.Generator().manual_seed(0)
    lprobs = torch.log_softmax(torch.randn(6, 5, 9, generator=g), -1)
    greedy = lprobs.argmax(-1)
    # even slots draft the greedy token, odd slots another one
    draft = greedy.clone()
    draft[:, 1::2] = (greedy[:, 1::2] + 1) % 9
    expected = [[True, False, True, False, True]] * 6
    assert rule(draft, None, lprobs, greedy).tolist() == expected
    # and a top-1 rule with tau 0 agrees with strict when there are no ties
    top1 = TopBetaAcceptance(1, 0.0)
    assert top1(draft, None, lprobs, greedy).tolist() == expected


def test_build_acceptance_relaxed():
    rule = build_acceptance(3, 2.0, "verifier")
    assert isinstance(rule, TopBetaAcceptance)
    assert (rule.beta, rule.tau, rule.score) == (3, 2.0, "verifier")


@pytest.mark.parametrize(
    "beta,tau,score,word",
    [(0, 1.0, "verifier", "beta"), (-2, 1.0, "verifier", "beta"),
     (2, -1.0, "verifier", "tau"), (1, -0.5, "verifier", "tau"),
     (2, 1.0, "bogus", "score"), (1, 1.0, "bogus", "score")],
)
def test_invalid_settings_raise(toy_bin, beta, tau, score, word):
    """The options refuse them by name, whatever the acceptance rule would do."""
    from fairseq_specdec.generation.options import SpeculativeOptions

    cfg = H.generation_cfg(toy_bin, "--task", "draft_verify", "--decoding", "self-draft", "--beam", "1")
    cfg.task.verify_beta, cfg.task.verify_tau, cfg.task.verify_score = beta, tau, score
    with pytest.raises(ValueError, match=f"--verify-{word}"):
        SpeculativeOptions.from_config(cfg.task, cfg.generation)
