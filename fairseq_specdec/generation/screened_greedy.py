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

**Runs of steps.** Where an iteration drafts nothing by design (the drafter
never drafts, as ``--decoding loop-greedy``'s, or the draft policy or a
length limit leaves it no draft), its screened steps run several in one
call of the extension (:meth:`ScreenedGreedy.run_length`): each step's
picks are fed back as the next tokens until :attr:`ScreenedGreedy.MAX_STEPS`
steps, a step in which any row picks EOS (so only a run's last step
finishes rows), or a step whose picks are not all certified (that pass is
not kept; the next iteration runs it again, alone, and takes the ordinary
step). One iteration then appends the run's tokens at once, as one of
accepted drafts; the statistics count each of its passes as an iteration
of one token. The tokens, scores and caches are those of the steps one at
a time.  The native part ``runs`` off (``FAIRSEQ_SPECDEC_OFF=runs``):
every iteration one step.
"""
import time
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import numpy as np
import torch
from torch import Tensor

from .accept_step import FairseqRules, StepResult


@dataclass
class DeferredScores:
    """The rows' screened steps whose scores are not yet computed, in
    blocks of consecutive steps: per block, the rows' final states
    (B x t x C), the columns of ``state.tokens`` the picks were written to
    (B x t) and the picks (B x t); ``bounds``, per row, at least the
    magnitude its running score may have with them (the settled score's plus
    each pick's bound)."""

    bounds: List[float]
    states: List[Tensor] = field(default_factory=list)
    columns: List[Tensor] = field(default_factory=list)
    picks: List[Tensor] = field(default_factory=list)


class ScreenedGreedy:
    """Screened greedy steps of one generator (see the module docstring):
    ``verifier`` a :class:`~fairseq_specdec.generation.lean_verifier.LeanVerifier`
    whose ``screens`` holds, ``rules`` fairseq's rules of the run;
    ``max_steps``: the most steps one iteration runs (in one call of the
    extension) where it drafts nothing by design (see :meth:`run_length`)."""

    #: the most unfinished rows a screened step takes: a pass of so few
    #: one-token rows still waits on the weights, so the float32 projection
    #: it skips is mostly read time (docs/verify-kernels.md)
    MAX_ROWS = 4
    #: the most screened steps one iteration runs where it drafts nothing by
    #: design: enough that the loop's own work between the calls is a small
    #: part of a sentence's steps
    MAX_STEPS = 32

    def __init__(self, verifier, rules: FairseqRules, max_rows: int = MAX_ROWS, max_steps: int = MAX_STEPS):
        self.verifier = verifier
        self.rules = rules
        self.max_rows = max_rows
        self.max_steps = max_steps
        #: steps screened, and steps whose pick was not certified (the statistics)
        self.screened = 0
        self.uncertified = 0
        self._taken = (0, 0)
        #: the counts of a run of screened steps, by its steps and the rows' EOS picks, per device (read only)
        self._counts = {}
        #: seconds :meth:`settle` spent since the last :meth:`take_settle_seconds`
        self._settle_seconds = 0.0

    def take_settle_seconds(self) -> float:
        """Seconds spent settling deferred scores since the last call: work
        of the screened (greedy) iterations that deferred them, wherever it
        ran (the loop charges it to them: ``RowsRule.charge``)."""
        seconds, self._settle_seconds = self._settle_seconds, 0.0
        return seconds

    def take_counts(self) -> Tuple[int, int]:
        """``(screened, uncertified)`` since the last call (the statistics line's)."""
        counts = (self.screened - self._taken[0], self.uncertified - self._taken[1])
        self._taken = (self.screened, self.uncertified)
        return counts

    def applies(self, state, max_len: int, host_checks: bool) -> bool:
        """Whether an iteration with no drafts is screened."""
        return (host_checks and 0 < state.size <= self.max_rows and self.verifier.screens
                and all(n < max_len for n in state.lengths_host))

    def run_length(self, state, max_len: int) -> int:
        """The most steps an iteration that drafts nothing by design (the
        drafter never drafts, or the draft policy or a length limit left it
        no draft) runs where it :meth:`applies`: :attr:`max_steps`, and no
        row past ``max_len - 1`` (the step at the limit is the ordinary
        one).  An iteration whose drafter was asked and proposed nothing
        runs one step: the drafter may propose at the next."""
        return max(1, min(self.max_steps, max_len - max(state.lengths_host)))

    def __call__(self, state, tokens: Tensor, steps: int = 1) -> Tuple[Optional[StepResult], Optional[Tensor]]:
        """Up to ``steps`` greedy steps of every row from its newest token
        (``tokens``: B x 1), in one call (their final states are the
        verifier's ``last_features``).  Returns ``(result, None)`` where at
        least one step's picks were all certified: the result appends them
        (their log-probs and running scores deferred; the steps end after
        any row's EOS, so only a last step finishes rows); else ``(None,
        log-probs)``: the first pass's log-probs, for the ordinary step, the
        deferred scores settled first."""
        deferred = state.deferred
        if deferred is None:
            deferred = state.deferred = DeferredScores([abs(c) for c in state.cum.tolist()])
        rules = self.rules
        picks, bounds, features = self.verifier.screened_steps(tokens, state, steps, rules.pad, rules.eos,
                                                               rules.min_len, deferred.bounds)
        s = picks.size(1)
        if s == 0:
            self.uncertified += 1
            self.settle(state)
            return None, self.verifier.log_probs(features)
        self.screened += s
        deferred.states.append(features[:, :s])
        first = torch.tensor(state.lengths_host, device=picks.device).unsqueeze(1) + 1
        deferred.columns.append(first + torch.arange(s, device=picks.device) if s > 1 else first)
        deferred.picks.append(picks)
        deferred.bounds = bounds
        eos = tuple(int(c == rules.eos) for c in picks[:, -1].tolist())
        counts = self._counts.get((s, eos, picks.device))
        if counts is None:
            n = len(eos)
            counts = self._counts[(s, eos, picks.device)] = torch.tensor([[s] * n, list(eos), [0] * n, [0] * n],
                                                                         device=picks.device)
        # the log-probs are placeholders until settle(); the running scores stay the settled ones
        return StepResult(picks, state.pos_scores.new_zeros((state.size, s)), counts[0], state.cum, counts,
                          passes=s), None

    def settle(self, state) -> None:
        """Compute the rows' deferred scores: their kept states' log-probs in
        one projection, each pick's written at its column of
        ``state.pos_scores``, and added to its row's ``state.cum`` in
        float32 one token at a time, in order.  Its seconds are kept for
        :meth:`take_settle_seconds`: the draft policy counts them as the
        greedy iterations' cost."""
        deferred = state.deferred
        if deferred is None:
            return
        state.deferred = None
        if not deferred.states:
            return
        began = time.perf_counter()
        self._settle(state, deferred)
        self._settle_seconds += time.perf_counter() - began

    def _settle(self, state, deferred: DeferredScores) -> None:
        """:meth:`settle`'s work for a non-empty ``deferred``."""
        def joined(blocks):  # one block (a sentence's run) needs no copy
            return blocks[0] if len(blocks) == 1 else torch.cat(blocks, 1)

        lprobs = self.verifier.log_probs(joined(deferred.states))  # B x T x V
        picks = joined(deferred.picks)  # B x T
        picked = lprobs.gather(2, picks.unsqueeze(2)).squeeze(2)
        state.pos_scores.scatter_(1, joined(deferred.columns), picked)
        cum = state.cum.numpy().astype(np.float32)  # a copy
        for value in picked.t().numpy():  # the rows' log-probs of one step, in order: float32 sums
            cum = cum + value
        state.cum = torch.from_numpy(cum).to(state.cum.device)
