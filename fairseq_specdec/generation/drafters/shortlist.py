"""A drafter's output projection onto a shortlist of types, through the plugin's kernels where they run."""
import math
from functools import partial
from typing import Optional, Tuple

import torch
from torch import Tensor

from ...kernels import rowgemm
from ...utils.projection import DerivedWeight, TransposedWeight
from .base import NO_KERNELS, DraftKernels


class ShortlistProjection:
    """A drafter's output projection for one batch: onto the ``size`` most
    frequent types (dictionary order) plus the batch's source tokens when the
    dictionaries are ``joined``, or onto every type (``size`` 0, or not below
    ``num_types``).  A type left out only costs a rejected draft, never a
    wrong output.

    :meth:`start_batch` only keeps its arguments: the batch's projection is
    made at its first use (a batch that never drafts, as the loop decides
    where drafting does not pay, never makes it).  After that: ``bias``
    (N: the projection's bias or zeros,
    -inf at the ``never`` types) and ``vocab`` (the N type ids: the frequent
    types in dictionary order, then the batch's other source types; None for
    every type).  The weight's layout for the frequent (or every) type is
    derived once per weight and kept while the weight is unchanged (a
    :class:`DerivedWeight`): packed for the row-blocked kernel where it runs
    (:mod:`fairseq_specdec.kernels.rowgemm`; drafts may round differently, the
    strict output cannot change; in ``precision``, float32 or bfloat16), else
    a contiguous transpose.  Only the few source types outside the frequent
    ones are gathered per batch (float32)."""

    def __init__(self, size: int, num_types: int, joined: bool, never: Tuple[int, ...],
                 kernels: DraftKernels = NO_KERNELS):
        self.size = size if 0 < size < num_types else 0
        self.joined = joined
        self.never = never
        self._vocab: Optional[Tensor] = None
        self._bias: Optional[Tensor] = None
        # the frequent (or every) type's layout, callable on x: a rowgemm.PackedLinear where the kernel runs
        self._base = None
        self._extra_t: Optional[Tensor] = None  # C x E: the batch's other source types
        self.kernels = kernels
        self._packed = DerivedWeight(partial(rowgemm.PackedLinear, precision=kernels.precision))
        self._transposed = TransposedWeight()
        self._static = {}  # (padded extra types, dtype, device) -> fixed buffers (make_static)
        self._first = None  # ((types, dtype, device), their ids, their zero bias with -inf at never types)
        self._pending = None  # start_batch's arguments, until the batch's projection is made

    def start_batch(self, weight: Tensor, bias: Optional[Tensor], src_tokens: Tensor) -> None:
        """A new batch, whose source tokens are ``src_tokens`` (all its rows,
        whichever finish first) and whose projection is ``weight`` and
        ``bias``: made at the first call that reads it."""
        self._pending = (weight, bias, src_tokens)

    @property
    def vocab(self) -> Optional[Tensor]:
        self._made()
        return self._vocab

    @property
    def bias(self) -> Optional[Tensor]:
        self._made()
        return self._bias

    def _made(self) -> None:
        """The pending batch's projection, made now (nothing if made)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._make(*pending)

    def _make(self, weight: Tensor, bias: Optional[Tensor], src_tokens: Tensor) -> None:
        base = weight[: self.size] if self.size else weight
        if self.kernels.products and rowgemm.applies_to(weight):
            self._base = self._packed.get(base)
        else:
            base_t = self._transposed.get(base)
            self._base = lambda x: torch.matmul(x, base_t)
        # the first types' ids and zero bias (-inf at the never types), made once per shape
        key = (base.size(0), weight.dtype, weight.device)
        if self._first is None or self._first[0] != key:
            ids = torch.arange(base.size(0), device=weight.device)
            self._first = (key, ids, self._never_masked(torch.zeros(ids.size(0), dtype=weight.dtype, device=weight.device), ids))
        _, ids, zero_bias = self._first
        self._vocab, self._extra_t = None, None
        extra = None
        if self.size:
            if self.joined:
                src = torch.unique(src_tokens.flatten())
                extra = src[src >= self.size]
                if extra.numel() > 0:
                    self._extra_t = weight.detach().index_select(0, extra).t().contiguous()
                    ids = torch.cat([ids, extra])
                else:
                    extra = None
            self._vocab = ids
        if bias is not None:
            self._bias = self._never_masked(bias.detach().index_select(0, ids), ids)
        elif extra is None:
            self._bias = zero_bias
        else:
            tail = torch.zeros(extra.size(0), dtype=weight.dtype, device=weight.device)
            if any(t >= self.size for t in self.never):  # a never type can be among the source's types
                tail = self._never_masked(tail, extra)
            self._bias = torch.cat([zero_bias, tail])

    def _never_masked(self, bias: Tensor, ids: Tensor) -> Tensor:
        """``bias`` with -inf where ``ids`` is one of the never types."""
        mask = torch.zeros_like(ids, dtype=torch.bool)
        for t in self.never:
            mask |= ids == t
        return bias.masked_fill(mask, -math.inf)

    def make_static(self, step: int = 16) -> int:
        """After :meth:`start_batch`: the batch's source types outside the
        frequent ones, its bias and type ids moved into fixed buffers, the
        extra types padded to a multiple of ``step`` (a padding column has a
        zero weight, bias -inf and never wins).  Returns the padded count of
        extra types (the buffers' key)."""
        self._made()
        if not self.size:
            return 0
        base = self._bias.size(0) - (self._extra_t.size(1) if self._extra_t is not None else 0)
        extra = self._bias.size(0) - base
        padded = -(-extra // step) * step
        buffers = self._static
        key = (padded, self._bias.dtype, self._bias.device)
        if key not in buffers:
            buffers[key] = {
                "extra_t": None if padded == 0 else torch.zeros(self._extra_t.size(0), padded, dtype=self._bias.dtype,
                                                              device=self._bias.device),
                "bias": torch.empty(base + padded, dtype=self._bias.dtype, device=self._bias.device),
                "vocab": torch.empty(base + padded, dtype=torch.long, device=self._bias.device),
            }
        buf = buffers[key]
        buf["bias"].fill_(-math.inf)
        buf["bias"][: base + extra] = self._bias
        buf["vocab"].fill_(self.never[0] if self.never else 0)
        buf["vocab"][: base + extra] = self._vocab
        if buf["extra_t"] is not None:
            buf["extra_t"].zero_()
            if self._extra_t is not None:
                buf["extra_t"][:, :extra] = self._extra_t
        self._bias, self._vocab, self._extra_t = buf["bias"], buf["vocab"], buf["extra_t"]
        return padded

    def __call__(self, x: Tensor) -> Tensor:
        """``x @ weight[vocab].t() + bias`` over the last axis of ``x``."""
        self._made()
        out = self._base(x)
        if self._extra_t is not None:
            out = torch.cat([out, torch.matmul(x, self._extra_t)], dim=-1)
        return out + self._bias

    def types(self, index: Tensor) -> Tensor:
        """Type ids of positions ``index`` along the projected axis."""
        vocab = self.vocab
        return vocab[index] if vocab is not None else index

    def pick(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        """The best type (an id of the dictionary) and its log-probability
        under the projection's softmax, for each row of ``x``: one call of
        the extension where the weight is packed for it
        (:func:`~fairseq_specdec.kernels.rowgemm.draft_pick`, a vectorized
        exp), else ``log_softmax`` and ``max`` of :meth:`__call__`; the two
        round differently, which changes drafts at most."""
        self._made()
        if self.kernels.pick and isinstance(self._base, rowgemm.PackedLinear) and x.dtype == torch.float32 \
                and rowgemm.draft_pick_available():
            best, lprobs = rowgemm.draft_pick(x, self._base, self._extra_t, self._bias)
        else:
            lprobs, best = torch.log_softmax(self(x).float(), dim=-1).max(dim=-1)
        return self.types(best), lprobs

    def top(self, x: Tensor, count: int) -> Tuple[Tensor, Tensor]:
        """The ``count`` best types (ids of the dictionary) and their
        log-probabilities under the projection's softmax, best first, for each
        row of ``x`` (``... x count``): a draft tree's candidates."""
        logits = self(x).float()
        lprobs, best = torch.log_softmax(logits, dim=-1).topk(min(count, logits.size(-1)), dim=-1)
        return self.types(best), lprobs


#: candidates per position a parallel drafter offers a draft tree (the
#: tree keeps the --draft-tree most probable prefixes of their combinations)
TREE_CANDIDATES = 4
