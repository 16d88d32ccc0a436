"""How much each row of a batch drafts: the draft length (fixed, adaptive,
the confidence cut) and whether a batch with so many unfinished rows drafts
at all (a :class:`RowsRule`).

None of it changes what strict verification outputs, only what is verified
and so how fast.  :class:`MeasuredRows` decides by timings, so it is used
only where the output cannot depend on whether a row drafted (strict
acceptance): the choice of rule is the builder's
(:func:`fairseq_specdec.generation.build.draft_rows_rule`).
"""
import math
from typing import Dict, List, Optional

import torch
from torch import Tensor


class RowsRule:
    """Whether an iteration with ``rows`` unfinished rows, of a batch of
    ``batch`` sentences, drafts.  The loop asks :meth:`drafts_at` before
    each iteration and reports the iteration to :meth:`observe` after it."""

    def drafts_at(self, rows: int, batch: int) -> bool:
        raise NotImplementedError

    def observe(self, rows: int, batch: int, drafted: bool, tokens: int, seconds: float) -> None:
        """An iteration of ``rows`` rows, drafting or not, committed
        ``tokens`` tokens (all rows together) in ``seconds``."""

    def charge(self, rows: int, batch: int, drafted: bool, seconds: float) -> None:
        """Work of ``seconds`` that iterations of ``rows`` rows in the mode
        ``drafted`` caused but did not time themselves: the deferred scores
        of screened greedy steps (``ScreenedGreedy.settle``), computed after
        the iterations that deferred them, at a row's end or before the next
        step that reads the scores.  The loop reports it after it ran, and
        leaves it out of the iteration it ran in (see
        ``SpeculativeGenerator``)."""

    def describe(self) -> Optional[str]:
        """A phrase for the policy's description (None: says nothing)."""
        return None


class AllRows(RowsRule):
    """Every iteration drafts, whatever the batch."""

    def drafts_at(self, rows: int, batch: int) -> bool:
        return True


class FixedRows(RowsRule):
    """No row drafts while more than ``max_rows`` rows of the batch are
    unfinished (``--draft-max-rows N``): the loop then takes one verifier
    token per row and iteration, and drafting starts once enough rows have
    finished (the tail of a batch).  ``max_rows`` >= 1 (the options refuse
    less; 0 there is :class:`AllRows`)."""

    def __init__(self, max_rows: int):
        self.max_rows = max_rows

    def drafts_at(self, rows: int, batch: int) -> bool:
        return rows <= self.max_rows

    def describe(self) -> str:
        return f"drafts once at most {self.max_rows} rows are unfinished"


class _Bucket:
    """What :class:`MeasuredRows` knows of one size of batch: per mode
    (drafting or not) the iterations and tokens timed since the mode's
    measurement began, and decayed sums of their seconds and of their
    committed tokens, whose ratio is the mode's cost per token (the ratio of
    the sums, not the mean of each iteration's ratio, which would count a
    drafting iteration that committed one token as heavily as one that
    committed ten; and, being sums, no iteration weighs more for having come
    first); the trial in progress; when to try the losing mode again."""

    __slots__ = ("seconds", "tokens", "count", "timed_tokens", "trial", "visits", "retry_at", "wait")

    def __init__(self, first_wait: int):
        self.seconds: Dict[bool, float] = {}
        self.tokens: Dict[bool, float] = {}
        self.count = {True: 0, False: 0}
        self.timed_tokens = {True: 0, False: 0}
        self.trial: Optional[bool] = None  # the mode being measured now
        self.visits = 0
        self.wait = first_wait
        self.retry_at = first_wait

    def cost(self, mode: bool) -> float:
        """Seconds per committed token of ``mode`` (measured at least once)."""
        return self.seconds[mode] / self.tokens[mode]

    def start_trial(self, mode: bool) -> bool:
        """Measure ``mode`` anew (its old sums may be stale) until it is
        :meth:`measured`."""
        self.trial = mode
        self.count[mode] = self.timed_tokens[mode] = 0
        self.seconds.pop(mode, None)
        self.tokens.pop(mode, None)
        return mode

    def measured(self, mode: bool, least: int, tokens: int) -> bool:
        """Whether ``mode`` has been timed over ``least`` iterations and
        ``tokens`` committed tokens since its measurement began."""
        return self.count[mode] >= least and self.timed_tokens[mode] >= tokens

    def drafting_wins(self, least: int, tokens: int) -> bool:
        return (self.measured(True, least, tokens) and self.measured(False, least, tokens)
                and self.cost(True) < self.cost(False))


class MeasuredRows(RowsRule):
    """Drafting at a batch of ``rows`` unfinished rows only where it has
    been measured, in this generator, to commit tokens faster than not
    drafting (the default for strict decodings on a CPU).

    A verify pass of k + 1 tokens for every row costs more than a pass of
    one token, and more so the more rows it holds; on a CPU an iteration
    without drafts is cheaper still where its greedy pick is screened (the
    int8 copy of the vocabulary projection: ``ScreenedGreedy``), at one row
    as at four.  Whether the drafts a pass accepts pay for that depends on
    the drafter, the model, the machine and the batch, so it is measured
    rather than set, for a batch of one sentence as for larger ones.
    Batches are grouped by their unfinished rows (exactly up to 8 rows,
    then in steps of about sqrt(2)); a sentence decoded alone and the last
    row of a larger batch share the group of one row.  For each group the
    rule keeps, for drafting and for not drafting, decayed sums of its
    iterations' seconds and of the tokens they committed, whose ratio is the
    mode's cost per token (the loop's own timings, :meth:`observe`, with
    the work an iteration deferred charged to it when it runs,
    :meth:`charge`).  Each iteration's decay is ``(1 - ALPHA)`` to the power
    of its tokens over :attr:`DECAY_TOKENS` (at most 1): an iteration that
    commits many tokens (a batch of many rows) moves the cost as much as
    ``ALPHA`` says, while at one row, where an iteration is about a
    sentence and sentences differ in length, the cost spans some 60 tokens:

    * a group is first measured without drafting (a batch starts with all
      its rows, so the large groups are measured first), then drafting is
      tried there (the trial), but only once drafting has won at the next
      smaller group (one row: at once): a large batch is not made to
      draft before smaller ones showed that it pays.  A measurement lasts
      ``least`` iterations and ``tokens`` committed tokens, so that at one
      row it spans several sentences, not the few that ``least`` iterations
      of drafting commit (a comparison of a few short sentences with a few
      long ones measured their lengths, not the modes);
    * after that the faster mode runs; the slower one is tried again after
      ``first_wait`` visits of the group, then after twice as many, and so
      on (at most ``1024``), its sums started anew: a drifting machine or a
      drafter that warms up is followed, at a bounded cost.

    The output never depends on it under strict verification; the
    statistics (Tok.) may differ from run to run.
    """

    #: iterations of a mode in a group before its cost counts
    LEAST = 3
    #: tokens a mode in a group commits before its cost counts
    TOKENS = 64
    #: visits of a group before its slower mode is tried again (doubling)
    FIRST_WAIT = 16
    MOST_WAIT = 1024
    #: the decay of the sums per iteration that commits DECAY_TOKENS or more tokens
    ALPHA = 0.25
    DECAY_TOKENS = 16

    def __init__(self, least: int = LEAST, first_wait: int = FIRST_WAIT, tokens: int = TOKENS):
        self.least = least
        self.first_wait = first_wait
        self.tokens = tokens
        self.buckets: Dict[int, _Bucket] = {}

    @staticmethod
    def group(rows: int) -> int:
        """The group of a batch of ``rows`` unfinished rows: ``rows`` up to
        8, then one group per factor of about sqrt(2) (9-11, 12-16, 17-22,
        23-32, ...)."""
        return rows if rows <= 8 else 8 + math.ceil(2 * math.log2(rows / 8) - 1e-9)

    def _bucket(self, group: int) -> _Bucket:
        if group not in self.buckets:
            self.buckets[group] = _Bucket(self.first_wait)
        return self.buckets[group]

    def drafts_at(self, rows: int, batch: int) -> bool:
        group = self.group(rows)
        b = self._bucket(group)
        b.visits += 1
        if b.trial is not None:
            return b.trial
        if not b.measured(False, self.least, self.tokens):
            return False
        if not b.measured(True, self.least, self.tokens):
            smaller = group - 1
            if smaller < 1 or (smaller in self.buckets and self.buckets[smaller].drafting_wins(self.least, self.tokens)):
                return b.start_trial(True)
            return False
        winner = b.cost(True) < b.cost(False)
        if b.visits >= b.retry_at:
            b.wait = min(2 * b.wait, self.MOST_WAIT)
            b.retry_at = b.visits + b.wait
            return b.start_trial(not winner)
        return winner

    def observe(self, rows: int, batch: int, drafted: bool, tokens: int, seconds: float) -> None:
        if tokens <= 0:
            return
        b = self._bucket(self.group(rows))
        keep = (1.0 - self.ALPHA) ** min(1.0, tokens / self.DECAY_TOKENS)
        b.seconds[drafted] = keep * b.seconds.get(drafted, 0.0) + seconds
        b.tokens[drafted] = keep * b.tokens.get(drafted, 0.0) + tokens
        b.count[drafted] += 1
        b.timed_tokens[drafted] += tokens
        if b.trial is not None and b.trial == drafted and b.measured(drafted, self.least, self.tokens):
            b.trial = None

    def charge(self, rows: int, batch: int, drafted: bool, seconds: float) -> None:
        """Add ``seconds`` to the newest timed iteration of the mode in the
        group of ``rows``, as if that iteration had taken them too: without
        it a greedy iteration at batch 1, which defers its scores to the end
        of the sentence, looked about a sixth cheaper than it was, and
        drafting that paid was measured not to.  Where several iterations
        deferred the work, it is charged to the newest of them; a mode not
        yet timed in the group is charged nothing."""
        if seconds <= 0:
            return
        b = self.buckets.get(self.group(rows))
        if b is None or b.count[drafted] == 0:
            return
        b.seconds[drafted] += seconds

    def describe(self) -> str:
        return "drafts only where measured to commit tokens faster than not drafting, at every batch size"


class DraftLengthPolicy:
    """How many tokens each row may draft, for every drafter.

    * ``adaptive``: a per-row draft length, the heuristic of Hugging Face's
      assisted generation: it starts at ``init`` (default ``min(5, k)``), grows
      by 2 after an iteration whose drafts were all accepted, shrinks by 1
      after one that rejected a draft, and stays within ``[1, k]``; a row that
      proposed nothing keeps its length.  Without it every row drafts ``k``.
    * ``min_confidence`` (0 = off): a draft stops before its first token whose
      drafter probability is below this; needs a drafter that returns
      log-probs (others are not cut).
    * ``rows`` (a :class:`RowsRule`; default :class:`AllRows`): whether a
      batch with so many unfinished rows drafts at all.  Where a verify pass costs in proportion to its
      rows (a CPU at batch 32), verifying drafts for many rows at once can
      cost more than the drafts save.

    None of them changes what strict verification outputs, only what is verified.
    ``k`` >= 1 and ``min_confidence`` in [0, 1), as the options
    (:class:`~fairseq_specdec.generation.options.SpeculativeOptions`) check them.
    """

    def __init__(self, k: int, adaptive: bool = False, min_confidence: float = 0.0, init: Optional[int] = None,
                 rows: Optional[RowsRule] = None):
        self.k = k
        self.adaptive = adaptive
        self.min_confidence = min_confidence
        self.log_min_confidence = math.log(min_confidence) if min_confidence > 0 else -math.inf
        self.init = min(k, 5) if init is None else max(1, min(k, init))
        self.rows: RowsRule = rows or AllRows()

    def drafts_at(self, rows: int, batch: int = 1) -> bool:
        """Whether an iteration with this many unfinished rows (of a batch of
        ``batch`` sentences) drafts at all."""
        return self.rows.drafts_at(rows, batch)

    def observe(self, rows: int, batch: int, drafted: bool, tokens: int, seconds: float) -> None:
        """The loop's timing of an iteration (see :meth:`RowsRule.observe`)."""
        self.rows.observe(rows, batch, drafted, tokens, seconds)

    def charge(self, rows: int, batch: int, drafted: bool, seconds: float) -> None:
        """Deferred work of a mode's iterations (see :meth:`RowsRule.charge`)."""
        self.rows.charge(rows, batch, drafted, seconds)

    @property
    def needs_scores(self) -> bool:
        return self.min_confidence > 0

    def initial(self) -> int:
        return self.init if self.adaptive else self.k

    def limit(self, draft_tokens: Tensor, draft_lprobs: Optional[Tensor], draft_k: List[int], pad: int) -> Tensor:
        """Pad out each row's draft past its length and its confidence cut."""
        width = draft_tokens.size(1)
        if width == 0:
            return draft_tokens
        cut = None
        if self.adaptive and min(draft_k) < width:
            cut = torch.arange(width, device=draft_tokens.device).unsqueeze(0) >= torch.tensor(
                draft_k, device=draft_tokens.device
            ).unsqueeze(1)
        if draft_lprobs is not None and self.min_confidence > 0:
            low = (draft_lprobs < self.log_min_confidence).long().cumsum(1) > 0
            cut = low if cut is None else cut | low
        return draft_tokens if cut is None else draft_tokens.masked_fill(cut, pad)

    def update(self, draft_k: List[int], drafted: List[int], accepted: List[int]) -> None:
        if not self.adaptive:
            return
        for i, (d, a) in enumerate(zip(drafted, accepted)):
            if d == 0:
                continue
            draft_k[i] = min(self.k, draft_k[i] + 2) if a == d else max(1, draft_k[i] - 1)

    def __repr__(self):
        parts = [f"k={self.k}"]
        if self.adaptive:
            parts.append(f"adaptive from {self.init}")
        if self.min_confidence > 0:
            parts.append(f"confidence cut {self.min_confidence}")
        rows = self.rows.describe()
        if rows is not None:
            parts.append(rows)
        return ", ".join(parts)
