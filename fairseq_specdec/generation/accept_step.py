"""The acceptance step: from a verify pass's log-probs to the tokens a row appends.

After the verify pass has scored a row's newest token and its drafts (a
:class:`~fairseq_specdec.generation.tree.DraftTree`; a chain is the tree
whose slot i hangs from slot i - 1), one step:

1. applies fairseq's ``--beam 1`` rules to the log-probs
   (:class:`FairseqRules`: pad masked, ``--unkpen``, EOS forbidden before
   ``--min-len``, only EOS at the length limit), at each slot's depth;
2. takes each slot's greedy token exactly as ``SequenceGenerator`` takes it:
   the first of the top 2 of log-prob plus the running score, the running
   score summed along the slot's root path in float32, one token at a time;
3. asks the acceptance rule (:mod:`~fairseq_specdec.generation.acceptance`)
   whether each node is acceptable at its parent, keeps the deepest root
   path of acceptable nodes (the first in slot order), then the verifier's
   token after it, and cuts the output after a first EOS.

Two implementations, chosen by the backend
(:meth:`~fairseq_specdec.generation.backend.Backend.acceptance_step`):
:class:`TensorStep`, torch operations on any device, and :class:`NativeStep`,
one call of the extension's ``strict_step`` (strict and top-beta rules
with the verifier's scores, float32 log-probs on a CPU), which hands an
iteration with a tie for a greedy pick to the tensor step.  Both return the
same values (tests/test_fused_accept.py).
"""
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import List, NamedTuple, Optional

import torch
from torch import Tensor

from ..kernels import rowgemm
from .acceptance import AcceptanceRule, StrictAcceptance, TopBetaAcceptance
from .tree import DraftTree


@dataclass(frozen=True)
class FairseqRules:
    """fairseq's ``--beam 1`` rules for a target dictionary and the run's
    options, as ``SequenceGenerator`` applies them at every step."""

    pad: int
    unk: int
    eos: int
    vocab_size: int
    min_len: int = 1
    unk_penalty: float = 0.0

    def mask(self, lprobs: Tensor, state, max_len: int, always: bool = False,
             depths: Optional[Tensor] = None) -> None:
        """The rules, in place.  Slot j of row r predicts output index
        ``state.lengths[r] + j`` (in a draft tree, ``state.lengths[r] +
        depths[r, j]``).  The length rules are applied where the host lengths
        say a slot can reach them, or ``always`` (a captured step, which reads
        no host length: where no slot reaches them they change nothing)."""
        # fairseq's lprobs[lprobs != lprobs] = -inf, in one pass (isnan + masked_fill costs 4-20x more)
        torch.nan_to_num_(lprobs, nan=-math.inf, posinf=math.inf, neginf=-math.inf)
        lprobs[:, :, self.pad] = -math.inf
        if self.unk_penalty != 0:
            lprobs[:, :, self.unk] -= self.unk_penalty
        m = lprobs.size(1)
        if always or min(state.lengths_host) < self.min_len or max(state.lengths_host) + m - 1 >= max_len:
            offsets = torch.arange(m, device=lprobs.device) if depths is None else depths
            steps = state.lengths.unsqueeze(1) + offsets
            lprobs[:, :, self.eos].masked_fill_(steps < self.min_len, -math.inf)
            at_limit = (steps >= max_len).unsqueeze(-1)
            lprobs[:, :, : self.eos].masked_fill_(at_limit, -math.inf)
            lprobs[:, :, self.eos + 1 :].masked_fill_(at_limit, -math.inf)

    def greedy(self, candidates: Tensor) -> Tensor:
        """Each slot's greedy token from its log-probs plus running score, as
        SequenceGenerator takes it: the first of its top 2."""
        return candidates.topk(min(2, self.vocab_size - 1), dim=-1).indices[..., 0]


class StepResult(NamedTuple):
    """What an iteration appends, per row: ``new_tokens`` (their first
    ``n_new``; later columns are scratch), their log-probs, ``n_new``, the
    running score ``cum`` after them, the ``counts`` the loop reads back in
    one read (4 x B: tokens added, finished, drafts accepted, drafts
    verified), after a draft tree ``path``: the slot each appended
    token was picked at (B x (1 + D); None after a chain), and ``passes``:
    the verifier passes the result is made of, each of which appended one
    token to every row (a run of screened greedy steps:
    :mod:`~fairseq_specdec.generation.screened_greedy`), or 1: one pass."""

    new_tokens: Tensor
    new_lprobs: Tensor
    n_new: Tensor
    cum: Tensor
    counts: Tensor
    path: Optional[Tensor] = None
    passes: int = 1


class AcceptanceStep(ABC):
    """Steps 1-3 above for one acceptance rule and fairseq's rules.

    Called with the decoding state (its ``lengths``, ``lengths_host``,
    ``cum`` and ``last_tokens()``), the B x (1 + n) x V log-probs of the
    pass (changed in place by the rules), the drafts, each row's drafted
    count as host ints where the loop read them (else None), the batch's
    length limit, whether host-side work is allowed (``host_checks``) and
    whether the length rules apply unconditionally (a captured step)."""

    #: whether this step is a native call (for the log and the tests)
    native = False

    def __init__(self, rule: AcceptanceRule, rules: FairseqRules):
        self.rule = rule
        self.rules = rules

    @abstractmethod
    def __call__(self, state, lprobs: Tensor, drafts: DraftTree, drafted: Optional[List[int]], max_len: int,
                 host_checks: bool, always_mask: bool = False) -> StepResult:
        """See the class docstring."""


class TensorStep(AcceptanceStep):
    """The step as torch operations, for a chain or a tree alike (a chain's
    :class:`~fairseq_specdec.generation.tree.ChainTree` slices where a tree
    gathers)."""

    def __call__(self, state, lprobs, drafts, drafted, max_len, host_checks, always_mask=False):
        rules = self.rules
        rules.mask(lprobs, state, max_len, always_mask, None if drafts.chain else drafts.depths)
        if drafts.size == 0:
            return self._greedy_only(state, lprobs)
        counted = torch.tensor(drafted, device=lprobs.device) if drafted is not None else drafts.drafted_counts(rules.pad)
        parent_lprobs = drafts.parent_values(lprobs)  # B x n x V: where each node was predicted
        draft_vlp = parent_lprobs.gather(2, drafts.tokens.unsqueeze(-1)).squeeze(-1)
        running = drafts.running_scores(state.cum, draft_vlp, on_host=host_checks)  # B x (1 + n)
        greedy = rules.greedy(lprobs + running.unsqueeze(-1))
        ok = self.rule(drafts.tokens, drafts.lprobs, parent_lprobs, drafts.parent_values(greedy))
        n_accepted, path = drafts.deepest_acceptable(ok)
        # the accepted path's tokens, then the verifier's token at the first rejection
        slots = drafts.along(torch.cat([state.last_tokens(), drafts.tokens], dim=1), path)
        greedy_path = drafts.along(greedy, path)
        new_tokens = torch.cat([slots[:, 1:], greedy_path[:, -1:]], dim=1)
        at = n_accepted.unsqueeze(1)
        new_tokens.scatter_(1, at, greedy_path.gather(1, at))
        new_lprobs = drafts.along(lprobs, path).gather(2, new_tokens.unsqueeze(-1)).squeeze(-1)
        return self._appended(new_tokens, new_lprobs, drafts.along(running, path), n_accepted, counted, path)

    def _appended(self, new_tokens: Tensor, new_lprobs: Tensor, running: Tensor, n_accepted: Tensor,
                  drafted: Tensor, path: Optional[Tensor]) -> StepResult:
        """From a row's accepted drafts and the verifier's token after them
        (their log-probs, the running score before each) to the result:
        output cut after the first EOS, the running score after the last
        appended token."""
        offsets = torch.arange(new_tokens.size(1), device=new_tokens.device)
        at = n_accepted.unsqueeze(1)
        is_eos = new_tokens.eq(self.rules.eos) & (offsets.unsqueeze(0) <= at)
        has_eos = is_eos.any(dim=1)
        n_new = torch.where(has_eos, is_eos.int().argmax(dim=1) + 1, n_accepted + 1)
        last_new = (n_new - 1).unsqueeze(1)
        cum = running.gather(1, last_new).squeeze(1) + new_lprobs.gather(1, last_new).squeeze(1)
        counts = torch.stack([n_new, has_eos.long(), n_accepted, drafted])
        return StepResult(new_tokens, new_lprobs, n_new, cum, counts, path)

    def _greedy_only(self, state, lprobs: Tensor) -> StepResult:
        """No drafts (B x 1 x V log-probs, the rules applied): each row's
        greedy token, its log-prob, the running score after it (the same
        float32 addition), one token added, the row finished at an EOS: the
        values of the general case, in fewer operations."""
        greedy = self.rules.greedy(lprobs + state.cum.view(-1, 1, 1))
        new_lprobs = lprobs[:, 0].gather(1, greedy)  # B x 1
        cum = state.cum + new_lprobs[:, 0]
        has_eos = greedy[:, 0].eq(self.rules.eos).long()
        n_new = torch.ones_like(state.lengths)
        zeros = torch.zeros_like(state.lengths)
        return StepResult(greedy, new_lprobs, n_new, cum, torch.stack([n_new, has_eos, zeros, zeros]))


def _native_rule(rule: AcceptanceRule) -> bool:
    """Whether the extension's ``strict_step`` computes ``rule``: strict, or
    top-beta with the verifier's scores."""
    return isinstance(rule, StrictAcceptance) or (isinstance(rule, TopBetaAcceptance) and rule.score == "verifier")


def native_encoding(rule: AcceptanceRule) -> Optional[tuple]:
    """What the extension's ``strict_step`` is told for ``rule``: None for
    strict, ``(beta, tau)`` for top-beta with the verifier's scores."""
    if not _native_rule(rule):
        raise ValueError(f"the native acceptance step does not compute {rule!r}")
    return None if isinstance(rule, StrictAcceptance) else (rule.beta, rule.tau)


def native_step_unavailable(rule: AcceptanceRule, unk_penalty: float) -> Optional[str]:
    """Why :class:`NativeStep` cannot run ``rule`` (None: it can, on a CPU
    verifier's float32 log-probs): the extension's one call computes strict
    and top-beta acceptance with the verifier's scores under fairseq's rules
    without ``--unkpen``."""
    if not _native_rule(rule):
        return f"it computes strict and top-beta verification with the verifier's scores, and the rule is {rule!r}"
    if unk_penalty != 0:
        return f"it applies no --unkpen, and --unkpen is {unk_penalty}"
    return rowgemm.strict_step_unavailable_reason()


class NativeStep(AcceptanceStep):
    """The step as one call of the extension
    (:func:`~fairseq_specdec.kernels.rowgemm.strict_step`, its chain form
    for a chain), on float32 log-probs of a CPU pass with host checks on;
    elsewhere, and where a greedy pick ties (``ties`` counts those), the
    ``fallback`` tensor step takes the iteration from the same unchanged
    log-probs."""

    native = True

    def __init__(self, fallback: TensorStep):
        super().__init__(fallback.rule, fallback.rules)
        reason = native_step_unavailable(fallback.rule, fallback.rules.unk_penalty)
        if reason is not None:
            raise ValueError(f"the native acceptance step cannot run: {reason}")
        self.fallback = fallback
        self.encoding = native_encoding(fallback.rule)
        #: iterations left to the tensor step (a tie for a greedy pick)
        self.ties = 0

    def __call__(self, state, lprobs, drafts, drafted, max_len, host_checks, always_mask=False):
        runs = (host_checks and lprobs.dtype == torch.float32 and lprobs.device.type == "cpu"
                and (drafted is not None or drafts.size == 0 or not drafts.chain))
        if runs:
            rules = self.rules
            out = rowgemm.strict_step(lprobs, drafts.tokens, state.cum, state.lengths, drafted or [], rules.pad,
                                      rules.eos, rules.min_len, max_len, None if drafts.chain else drafts.parents,
                                      self.encoding)
            if out is not None and drafts.chain:
                return StepResult(*out)
            if out is not None:  # a tree: a row appends at most max depth + 1 tokens
                new_tokens, new_lprobs, n_new, cum, counts, path = out
                width = drafts.max_depth + 1
                counts[3] = drafts.drafted_counts(rules.pad)
                return StepResult(new_tokens[:, :width], new_lprobs[:, :width], n_new, cum, counts, path[:, :width])
            self.ties += 1
        return self.fallback(state, lprobs, drafts, drafted, max_len, host_checks, always_mask)
