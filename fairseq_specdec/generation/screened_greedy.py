"""Greedy steps without the float32 vocabulary product: screened picks, deferred scores.

A verify pass of one token for each of a few rows (an iteration with no
drafts: ``--decoding loop-greedy``, or a drafter that proposed nothing, at
batch 1 or in the tail of a batch) reads every float32 weight of the
decoder once, and on a CPU it waits for them; the
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
:meth:`ScreenedGreedy.settle` projects all the rows' kept states at once
(one product of B x T rows, which reads the float32 weights once) before
anything reads the scores: the next step that is not screened, and any
row's hypothesis (so before a finished row leaves the state). A row's
projection, log-softmax, positional scores and running score (summed in
float32 one token at a time) are bitwise those of the step that would have
computed them (the products' contract: a row's result depends on that row
alone).

Invariant: while ``state.deferred`` holds entries, they belong to the
state's rows as they are now (no row left since the first of them); each
row's positional scores at their columns are placeholders and
``state.cum`` lacks their log-probs; everything else in the state (tokens,
lengths, caches) is as after ordinary steps.

A step is screened where :meth:`ScreenedGreedy.applies`: at most
:attr:`ScreenedGreedy.MAX_ROWS` unfinished rows, no drafts, no row at the
length limit (before ``--min-len`` the screen never picks EOS, as fairseq's
rule sets its log-prob to -inf after the log-softmax: the pick's log-prob is
unchanged), the strict rule (the backend builds it only
for strict verification with the native acceptance step, so no
``--unkpen``). Where any row's pick is not certified (a near tie), the
step's log-probs are projected from the same states and the ordinary
acceptance step runs.
"""
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import numpy as np
import torch
from torch import Tensor

from .accept_step import FairseqRules, StepResult


@dataclass
class DeferredScores:
    """The rows' screened steps whose scores are not yet computed: per
    step, the rows' final states (B x C), each row's column of
    ``state.tokens`` its pick was written to, and the picks; ``bounds``,
    per row, at least the magnitude its running score may have with them
    (the settled score's plus each pick's bound)."""

    bounds: List[float]
    states: List[Tensor] = field(default_factory=list)
    columns: List[List[int]] = field(default_factory=list)
    tokens: List[List[int]] = field(default_factory=list)


class ScreenedGreedy:
    """Screened greedy steps of one generator (see the module docstring):
    ``verifier`` a :class:`~fairseq_specdec.generation.lean_verifier.LeanVerifier`
    whose ``screens`` holds, ``rules`` fairseq's rules of the run."""

    #: the most unfinished rows a screened step takes: a pass of so few
    #: one-token rows still waits on the weights, so the float32 projection
    #: it skips is mostly read time (docs/verify-kernels.md)
    MAX_ROWS = 4

    def __init__(self, verifier, rules: FairseqRules, max_rows: int = MAX_ROWS):
        self.verifier = verifier
        self.rules = rules
        self.max_rows = max_rows
        #: steps screened, and steps whose pick was not certified (the statistics)
        self.screened = 0
        self.uncertified = 0
        self._taken = (0, 0)
        #: the counts of a screened step, by the rows' EOS picks, per device (read only)
        self._counts = {}

    def take_counts(self) -> Tuple[int, int]:
        """``(screened, uncertified)`` since the last call (the statistics line's)."""
        counts = (self.screened - self._taken[0], self.uncertified - self._taken[1])
        self._taken = (self.screened, self.uncertified)
        return counts

    def applies(self, state, max_len: int, host_checks: bool) -> bool:
        """Whether an iteration with no drafts is screened."""
        return (host_checks and 0 < state.size <= self.max_rows and self.verifier.screens
                and all(n < max_len for n in state.lengths_host))

    def __call__(self, state, tokens: Tensor) -> Tuple[Optional[StepResult], Optional[Tensor]]:
        """The pass over each row's newest token (``tokens``: B x 1; its final
        states are the verifier's ``last_features``), then ``(result, None)``
        where every row's pick is certified (their log-probs and running
        scores deferred), else ``(None, log-probs)``: the pass's log-probs,
        for the ordinary step, the deferred scores settled first."""
        features = self.verifier.final_states(tokens, state)
        rows = features.view(state.size, -1)
        deferred = state.deferred
        if deferred is None:
            deferred = state.deferred = DeferredScores([abs(c) for c in state.cum.tolist()])
        rules = self.rules
        bans = [rules.eos if n < rules.min_len else -1 for n in state.lengths_host]  # --min-len: no EOS yet
        columns, lp_bounds = self.verifier.screen(rows, rules.pad, self.verifier.temperature, deferred.bounds, bans)
        if min(columns) < 0:
            self.uncertified += 1
            self.settle(state)
            return None, self.verifier.log_probs(features)
        self.screened += 1
        deferred.states.append(rows)
        deferred.columns.append([n + 1 for n in state.lengths_host])
        deferred.tokens.append(columns)
        deferred.bounds = [b + lp for b, lp in zip(deferred.bounds, lp_bounds)]
        eos = tuple(int(c == rules.eos) for c in columns)
        counts = self._counts.get((eos, tokens.device))
        if counts is None:
            n = len(eos)
            counts = self._counts[(eos, tokens.device)] = torch.tensor([[1] * n, list(eos), [0] * n, [0] * n],
                                                                       device=tokens.device)
        new_tokens = torch.tensor(columns, device=tokens.device).unsqueeze(1)
        # the log-probs are placeholders until settle(); the running scores stay the settled ones
        return StepResult(new_tokens, state.pos_scores.new_zeros((state.size, 1)), counts[0], state.cum, counts), None

    def settle(self, state) -> None:
        """Compute the rows' deferred scores: their kept states' log-probs in
        one projection, each pick's written at its column of
        ``state.pos_scores``, and added to its row's ``state.cum`` in
        float32 one token at a time, in order."""
        deferred = state.deferred
        if deferred is None:
            return
        state.deferred = None
        if not deferred.states:
            return
        lprobs = self.verifier.log_probs(torch.stack(deferred.states, 1))  # B x T x V
        device = lprobs.device
        picks = torch.tensor(deferred.tokens, device=device).t()  # B x T
        picked = lprobs.gather(2, picks.unsqueeze(2)).squeeze(2)
        state.pos_scores.scatter_(1, torch.tensor(deferred.columns, device=device).t(), picked)
        cum = state.cum.numpy().astype(np.float32)  # a copy
        for value in picked.t().numpy():  # the rows' log-probs of one step, in order: float32 sums
            cum = cum + value
        state.cum = torch.from_numpy(cum).to(state.cum.device)
