"""Greedy steps without the float32 vocabulary product: screened picks, deferred scores.

At batch 1 a verify pass of one token (an iteration with no drafts:
``--decoding loop-greedy``, or a drafter that proposed nothing) reads every
float32 weight of the decoder once, and on a CPU it waits for them; the
vocabulary projection is the largest of them in a small model
(docs/verify-kernels.md). Its greedy pick needs no float32 product of every
column, only the knowledge of which column is largest:
:class:`~fairseq_specdec.kernels.rowgemm.GreedyScreen` estimates every
column from the projection's int8 copy (a quarter of the bytes) with a
bound on the error, sums exactly only the columns that can be the largest,
and *certifies* the pick (the bound and the margin are in
``kernels/csrc/rowgemm.cpp``, ``screen_greedy``). The pick is then the
column fairseq's rules would take from the pass's log-probs (the largest
log-prob plus running score, pad excluded), whatever the running score.

What the pick's log-prob and the running score need, the log-softmax over
every column, is **deferred**: the step's final states are kept, and
:meth:`ScreenedGreedy.settle` projects all a row's kept states at once (one
product of T rows, which reads the float32 weights once) before
anything reads the scores: the next step that is not screened, and the
row's hypothesis. A row's projection, log-softmax, positional scores and
running score (summed in float32 one token at a time) are bitwise those
of the step that would have computed them (the products' contract: a row's
result depends on that row alone).

Invariant: while ``state.deferred`` holds entries, row 0's positional
scores at their columns are placeholders and ``state.cum`` lacks their
log-probs; everything else in the state (tokens, lengths, caches) is as
after ordinary steps.

A step is screened where :meth:`ScreenedGreedy.applies`: one unfinished row,
no drafts, no length rule of fairseq's applies at its step (``--min-len``
reached, the length limit not), the strict rule (the backend builds it only
for strict verification with the native acceptance step, so no
``--unkpen``). Where the pick is not certified (a near tie), the step's log-probs
are projected from the same states and the ordinary acceptance step runs.
"""
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import numpy as np
import torch
from torch import Tensor

from .accept_step import FairseqRules, StepResult


@dataclass
class DeferredScores:
    """Row 0's screened steps whose scores are not yet computed: each
    step's final states (C), the column of ``state.tokens`` its pick was
    written to, the pick; and ``bound``, at least the magnitude the running
    score may have with them (the settled score's plus each pick's bound)."""

    states: List[Tensor] = field(default_factory=list)
    columns: List[int] = field(default_factory=list)
    tokens: List[int] = field(default_factory=list)
    bound: float = 0.0


class ScreenedGreedy:
    """Screened greedy steps of one generator (see the module docstring):
    ``verifier`` a :class:`~fairseq_specdec.generation.lean_verifier.LeanVerifier`
    whose ``screens`` holds, ``rules`` fairseq's rules of the run."""

    def __init__(self, verifier, rules: FairseqRules):
        self.verifier = verifier
        self.rules = rules
        #: steps screened, and steps whose pick was not certified (the statistics)
        self.screened = 0
        self.uncertified = 0
        #: the counts of a screened step, by whether it picked EOS, per device (read only)
        self._counts = {}

    def applies(self, state, max_len: int, host_checks: bool) -> bool:
        """Whether an iteration with no drafts is screened."""
        return (host_checks and state.size == 1 and self.verifier.screens
                and self.rules.min_len <= state.lengths_host[0] < max_len)

    def __call__(self, state, tokens: Tensor) -> Tuple[Optional[StepResult], Optional[Tensor]]:
        """The pass over row 0's newest token (``tokens``: 1 x 1; its final
        states are the verifier's ``last_features``), then ``(result, None)``
        where the pick is certified (its log-prob and the running score
        deferred), else ``(None, log-probs)``: the pass's log-probs, for the
        ordinary step, the deferred scores settled first."""
        features = self.verifier.final_states(tokens, state)
        deferred = state.deferred
        if deferred is None:
            deferred = state.deferred = DeferredScores(bound=abs(float(state.cum[0])))
        column, lp_bound = self.verifier.screen(features.view(-1), self.rules.pad, self.verifier.temperature,
                                                deferred.bound)
        if column < 0:
            self.uncertified += 1
            self.settle(state)
            return None, self.verifier.log_probs(features)
        self.screened += 1
        deferred.states.append(features.view(-1))
        deferred.columns.append(state.lengths_host[0] + 1)
        deferred.tokens.append(column)
        deferred.bound += lp_bound
        eos = int(column == self.rules.eos)
        counts = self._counts.get((eos, tokens.device))
        if counts is None:
            counts = self._counts[(eos, tokens.device)] = torch.tensor([[1], [eos], [0], [0]], device=tokens.device)
        new_tokens = torch.tensor([[column]], device=tokens.device)
        # the log-prob is a placeholder until settle(); the running score stays the settled one
        return StepResult(new_tokens, state.pos_scores.new_zeros((1, 1)), counts[0], state.cum, counts), None

    def settle(self, state) -> None:
        """Compute row 0's deferred scores: its kept states' log-probs in one
        projection, each pick's written at its column of
        ``state.pos_scores``, and added to ``state.cum`` in float32 one
        token at a time, in order."""
        deferred = state.deferred
        if deferred is None:
            return
        state.deferred = None
        if not deferred.states:
            return
        lprobs = self.verifier.log_probs(torch.stack(deferred.states).unsqueeze(0))[0]  # T x V
        picked = lprobs.gather(1, torch.tensor(deferred.tokens, device=lprobs.device).unsqueeze(1)).squeeze(1)
        state.pos_scores[0, deferred.columns] = picked
        cum = np.float32(state.cum[0].item())
        for value in picked.tolist():
            cum = np.float32(cum + np.float32(value))
        state.cum = state.cum.new_tensor([float(cum)])
