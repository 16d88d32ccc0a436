"""Acceptance rules: which drafted tokens the verifier keeps.

A rule maps, for a batch of B rows and k drafted tokens,

* ``draft_tokens`` (B x k) and the drafter's log-probs of them (B x k, may be None),
* ``lprobs`` (B x k x V): the verifier's log-probs at the k draft slots, after
  fairseq's masks (pad, unk penalty, min/max length),
* ``greedy`` (B x k): the token fairseq's ``--beam 1`` would pick at each slot,

to a B x k bool tensor "draft j is acceptable at its slot".  The loop keeps the
longest acceptable prefix and then the verifier's own token.

A rule also states ``uses_draft_scores`` (it reads the drafter's log-probs),
``fused`` (the native extension's one-call step computes it, where the
backend chose that step) and ``native`` (what that step is told: None for
strict, ``(beta, tau)`` for top-beta with the verifier's scores).
"""
from typing import Optional

import torch
from torch import Tensor

from ..kernels import rowgemm

VERIFY_SCORES = ("verifier", "drafter")


class StrictAcceptance:
    """Accept a draft only if it is the verifier's greedy token: lossless."""

    uses_draft_scores = False
    #: the extension's ``strict_step`` (the native acceptance step) computes this rule
    fused = True
    #: the native step's rule: strict
    native = None

    def __call__(self, draft_tokens: Tensor, draft_lprobs, lprobs: Tensor, greedy: Tensor) -> Tensor:
        return draft_tokens.eq(greedy)

    def __repr__(self):
        return "strict"


class TopBetaAcceptance:
    """Relaxed verification (Xia et al. 2023, Eq. 8-9; the SpecDec ICLR 2023 submission, Eq. 6-7).

    A draft is acceptable when it is among the verifier's top-``beta``
    candidates and its score is within ``tau`` of the verifier's top-1
    log-prob.  The score is the verifier's log-prob of the draft
    (``score="verifier"``, Xia et al. 2023 and the authors' code) or the drafter's
    (``score="drafter"``, the SpecDec ICLR 2023 submission).  Tokens fairseq forbids at that step
    (log-prob -inf: pad, EOS before --min-len, anything but EOS at the length
    limit) are never accepted.
    """

    def __init__(self, beta: int, tau: float, score: str = "verifier"):
        if beta < 1:
            raise ValueError(f"--verify-beta must be >= 1, got {beta}")
        if not tau >= 0:  # NaN too: it would accept nothing, silently
            raise ValueError(f"--verify-tau must be a number >= 0 (inf: no limit), got {tau}")
        if score not in VERIFY_SCORES:
            raise ValueError(f"--verify-score must be one of {VERIFY_SCORES}, got {score!r}")
        self.beta, self.tau, self.score = beta, tau, score
        self.uses_draft_scores = score == "drafter"
        #: the native step computes the rule with the verifier's scores
        self.fused = score == "verifier"
        self.native = (beta, tau)

    def __call__(self, draft_tokens, draft_lprobs, lprobs, greedy):
        top_values, top_indices = lprobs.topk(min(self.beta, lprobs.size(-1)), dim=-1)
        in_top = top_indices.eq(draft_tokens.unsqueeze(-1)).any(-1)
        verifier_score = lprobs.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)
        if self.score == "drafter":
            if draft_lprobs is None:
                raise ValueError("--verify-score drafter needs a drafter that returns log-probs")
            score = draft_lprobs
        else:
            score = verifier_score
        close = (top_values[..., 0] - score) <= self.tau
        return in_top & close & torch.isfinite(verifier_score)

    def __repr__(self):
        return f"top-beta(beta={self.beta}, tau={self.tau}, score={self.score})"


def fused_accept_reason(rule, unk_penalty: float) -> Optional[str]:
    """Why the native acceptance step cannot run ``rule`` (None: it can, on a
    CPU verifier's float32 log-probs): the extension's one call computes
    strict acceptance under fairseq's rules without ``--unkpen``."""
    if not rule.fused:
        return f"it computes strict and top-beta verification with the verifier's scores, and the rule is {rule!r}"
    if unk_penalty != 0:
        return f"it applies no --unkpen, and --unkpen is {unk_penalty}"
    return rowgemm.strict_step_unavailable_reason()


def build_acceptance(beta: int, tau: float, score: str):
    """beta = 1 is strict verification whatever tau and score say."""
    rule = TopBetaAcceptance(beta, tau, score)  # validates the values
    return StrictAcceptance() if beta == 1 else rule
