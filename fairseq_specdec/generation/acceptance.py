"""Acceptance rules: which drafted tokens the verifier keeps.

A rule maps, for a batch of B rows and k drafted tokens,

* ``draft_tokens`` (B x k) and the drafter's log-probs of them (B x k, may be None),
* ``lprobs`` (B x k x V): the verifier's log-probs at the k draft slots, after
  fairseq's masks (pad, unk penalty, min/max length),
* ``greedy`` (B x k): the token fairseq's ``--beam 1`` would pick at each slot,

to a B x k bool tensor "draft j is acceptable at its slot".  The loop keeps the
longest acceptable prefix and then the verifier's own token.

In a draft tree the same holds node by node: ``lprobs`` and ``greedy`` are
those of each node's parent slot, where the node's token was predicted.

A rule states ``uses_draft_scores`` (it reads the drafter's log-probs).  How
a native step computes a rule is the step's concern
(:mod:`~fairseq_specdec.generation.accept_step`), not the rule's.
"""
from abc import ABC, abstractmethod

import torch
from torch import Tensor

VERIFY_SCORES = ("verifier", "drafter")


class AcceptanceRule(ABC):
    """Which drafted tokens are acceptable (see the module docstring)."""

    #: whether the rule reads the drafter's log-probs of its tokens
    uses_draft_scores = False

    @abstractmethod
    def __call__(self, draft_tokens: Tensor, draft_lprobs, lprobs: Tensor, greedy: Tensor) -> Tensor:
        """B x n bool: draft j acceptable at its slot."""


class StrictAcceptance(AcceptanceRule):
    """Accept a draft only if it is the verifier's greedy token: lossless."""

    def __call__(self, draft_tokens: Tensor, draft_lprobs, lprobs: Tensor, greedy: Tensor) -> Tensor:
        return draft_tokens.eq(greedy)

    def __repr__(self):
        return "strict"


class TopBetaAcceptance(AcceptanceRule):
    """Relaxed verification (Xia et al. 2023, Eq. 8-9; the SpecDec ICLR 2023 submission, Eq. 6-7).

    A draft is acceptable when it is among the verifier's top-``beta``
    candidates and its score is within ``tau`` of the verifier's top-1
    log-prob.  The score is the verifier's log-prob of the draft
    (``score="verifier"``, Xia et al. 2023 and the authors' code) or the drafter's
    (``score="drafter"``, the SpecDec ICLR 2023 submission).  Tokens fairseq forbids at that step
    (log-prob -inf: pad, EOS before --min-len, anything but EOS at the length
    limit) are never accepted.  ``beta`` >= 1, ``tau`` >= 0 and ``score``
    one of :data:`VERIFY_SCORES`, as the options
    (:class:`~fairseq_specdec.generation.options.SpeculativeOptions`) check them.
    """

    def __init__(self, beta: int, tau: float, score: str = "verifier"):
        self.beta, self.tau, self.score = beta, tau, score
        self.uses_draft_scores = score == "drafter"

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


def build_acceptance(beta: int, tau: float, score: str):
    """The rule of ``--verify-beta``/``--verify-tau``/``--verify-score``
    (values checked with the options:
    :class:`~fairseq_specdec.generation.options.SpeculativeOptions`); beta =
    1 is strict verification whatever tau and score say."""
    return StrictAcceptance() if beta == 1 else TopBetaAcceptance(beta, tau, score)
