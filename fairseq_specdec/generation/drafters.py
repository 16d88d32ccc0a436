"""Drafters: what proposes the next k tokens in the speculative loop.

A drafter is a small object the loop calls at four points, the one drafter
contract; a new drafting method is a new class here (and one entry in
:mod:`~fairseq_specdec.generation.registry`), never a new loop:

* ``start_batch(state)``: once per batch, with the new
  :class:`~fairseq_specdec.generation.state.DecodingState` (the source, the
  verifier's encoder output, no output yet);
* ``propose(state, k) -> (draft_tokens B x k', draft_log_probs B x k' or None)``
  with ``k' <= k``: the next tokens after each row's accepted prefix
  (``state.tokens[i, 1 : state.lengths[i] + 1]``); pad means "no draft here"
  (the verifier never picks pad, so a pad slot and everything after it is
  rejected);
* ``update(state, feedback)``: after every verification, with the committed
  state and a :class:`~fairseq_specdec.generation.state.Feedback` (per-row
  drafted/accepted counts, the verifier's decoder states of the pass);
* ``reorder(order, order_host)``: keep only these rows (finished rows
  leave), given as a device tensor and as host ints; the state calls it from
  ``keep`` after it has reordered itself and the verifier.

A drafter that can propose several continuations at once declares
``drafts_trees = True`` and gives ``propose_tree(state, k, nodes) ->
DraftTree``: at most ``nodes`` nodes at most ``k`` deep
(:mod:`~fairseq_specdec.generation.tree`); the loop calls it instead of
``propose`` where ``--draft-tree`` asks for trees.

Drafters read the state; they never write it.  A drafter that can run
inside a captured CUDA graph of a whole iteration says so:
``static_inputs() -> bool`` switches it, for good, to buffers whose shapes and
addresses stay fixed between the iterations of a batch of one sentence (and
between batches whose source falls in the same bucket), and
``static_key()`` names what the current batch's buffers are, so that the
loop captures one graph per key (:mod:`~fairseq_specdec.generation.iteration_graphs`).
Its ``propose`` then reads only those buffers and the state's
``last_tokens()`` and ``lengths``, and reads nothing back to the host.
A drafter checkpoint (a
:class:`~fairseq_specdec.models.protocol.DrafterModel`) becomes a drafter
through :func:`drafter_for_model`.
"""
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import partial
from typing import Iterator, List, Optional, Tuple

import torch
from torch import Tensor

from ..models.protocol import (
    BlockwiseHeadsModel,
    DrafterModel,
    SourceReadingDrafterModel,
    VerifierStateDrafterModel,
)
from ..kernels import rowgemm
from ..utils.dictionary import joined_dictionaries
from ..utils.projection import DerivedWeight, TransposedWeight, WeightsWatch
from .tree import chain_tree, tree_from_candidates
from .vsd_native import NativeBlockPass, native_block_pass_reason


@dataclass(frozen=True)
class DraftKernels:
    """What drafters may compute with the plugin's kernels: the backend
    (:mod:`~fairseq_specdec.generation.backend`) decides, once per generator.
    ``products``: packed row-blocked products where a weight allows them;
    ``precision``: the element type of those packings (float32, bfloat16);
    ``pick``: a shortlist projection's best type in one call; ``block``: the
    ``specdec_vsd`` pass through :class:`NativeBlockPass`."""

    products: bool = False
    precision: str = "float32"
    pick: bool = False
    block: bool = False


#: torch's operations only (the reference backend, devices the kernels do not run on)
NO_KERNELS = DraftKernels()


class Drafter(ABC):
    """The drafter contract (see the module docstring): what the loop, the
    generator's builder and the benchmark call on every drafter.  The four
    calls of the loop, ``describe`` and ``timed_parts`` are declared here;
    a drafter must give ``start_batch``, ``propose``, ``reorder`` and
    ``describe``, and may override the rest."""

    #: largest prefix + block length the drafter accepts (None: unlimited)
    max_positions: Optional[int] = None
    #: most tokens one pass can draft (None: any); a larger --block-size is
    #: refused when the generator is built
    max_block: Optional[int] = None
    #: whether :meth:`propose_tree` proposes draft trees (--draft-tree)
    drafts_trees: bool = False
    #: whether it drafts trees only (:meth:`propose` is not available)
    trees_only: bool = False

    def default_block(self, trained: int) -> int:
        """k when --block-size is not given, for a drafter trained with
        block size ``trained`` (default: ``trained``)."""
        return trained

    @abstractmethod
    def describe(self) -> str:
        """The drafter in a few words, for the log and the benchmark."""

    @abstractmethod
    def start_batch(self, state) -> None:
        """Once per batch, with the new state (see the module docstring)."""

    @abstractmethod
    def propose(self, state, k: int) -> Tuple[Tensor, Optional[Tensor]]:
        """B x k' drafts (k' <= k; pad: no draft) and their log-probs or None."""

    def propose_tree(self, state, k: int, nodes: int):
        """A :class:`~fairseq_specdec.generation.tree.DraftTree` of at most
        ``nodes`` nodes, at most ``k`` deep, per row (drafters that declare
        :attr:`drafts_trees`)."""
        raise NotImplementedError(f"{type(self).__name__} drafts chains only (drafts_trees is False)")

    def update(self, state, feedback) -> None:
        """Called after every verification pass (see the module docstring)."""

    @abstractmethod
    def reorder(self, order: Tensor, order_host: List[int]) -> None:
        """Keep only the rows ``order`` (a device tensor, and as host ints)."""

    def static_inputs(self) -> bool:
        """Switch to fixed buffers so that ``propose`` can be captured in a
        CUDA graph (see the module docstring); False: this drafter cannot."""
        return False

    def static_key(self) -> tuple:
        """What the current batch's fixed buffers are (their buckets)."""
        return ()

    def timed_parts(self, k: int) -> Iterator[tuple]:
        """``(object, method name, label[, required])`` of the calls the
        profiler times for this drafter (``scripts/profile-draft-verify.py``):
        by default its start of batch, its pass and its feedback; a label
        starting "of which: " is a part of the rows above it."""
        yield self, "start_batch", "drafter start of batch"
        yield self, "propose", f"drafter pass (up to {k} drafts)", not self.drafts_trees
        if self.drafts_trees:
            yield self, "propose_tree", f"drafter tree (up to {k} deep)", False
        yield self, "update", "drafter feedback", False


def row_tails(state, size: int, first: int = 0) -> List[List[int]]:
    """Each row's last ``size`` tokens up to its length (``state.tokens[i,
    max(first, n + 1 - size) : n + 1]`` for a row of length ``n``), read in one
    read of the columns they span: one device sync on a GPU, not one per row."""
    lengths = state.lengths_host
    if not lengths:
        return []
    lo, hi = max(first, min(lengths) + 1 - size), max(lengths) + 1
    block = state.tokens[:, lo:hi].tolist()
    return [block[i][max(first, n + 1 - size) - lo : n + 1 - lo] for i, n in enumerate(lengths)]


def padded_drafts(drafts: List[List[int]], pad: int, like: Tensor) -> Tensor:
    """Host-made drafts (one list per row, of any lengths) as one B x k'
    tensor, pad after each row's draft, on ``like``'s device and dtype."""
    width = max((len(d) for d in drafts), default=0)
    rows = [d + [pad] * (width - len(d)) for d in drafts]
    return torch.tensor(rows, dtype=like.dtype).view(len(drafts), width).to(like.device)


class NoDrafter(Drafter):
    """Never drafts: the loop then takes one verifier token per iteration
    (greedy decoding through the speculative loop)."""

    def describe(self) -> str:
        return "none: one verifier token per iteration"

    def timed_parts(self, k: int):
        return iter(())

    def start_batch(self, state) -> None:
        pass

    def propose(self, state, k):
        return state.tokens.new_zeros((state.size, 0)), None

    def reorder(self, order, order_host) -> None:
        pass

    def static_inputs(self) -> bool:
        return True


def same_encoder(drafter, verifier) -> bool:
    """Whether ``drafter``'s encoder computes exactly ``verifier``'s: same
    module types and settings, equal tensors (the drafter's extra mask row of
    the embedding aside)."""
    d_enc, v_enc = drafter.encoder, verifier.encoder
    if type(d_enc) is not type(v_enc) or getattr(d_enc, "embed_scale", None) != getattr(v_enc, "embed_scale", None):
        return False
    d_state, v_state = d_enc.state_dict(), v_enc.state_dict()
    if set(d_state) != set(v_state):
        return False
    for name, v_tensor in v_state.items():
        d_tensor = d_state[name]
        if name == "embed_tokens.weight" and d_tensor.size(0) == v_tensor.size(0) + 1:
            d_tensor = d_tensor[:-1]
        if d_tensor.shape != v_tensor.shape or not torch.equal(d_tensor, v_tensor):
            return False
    return all(
        type(a) is type(b) and getattr(a, "normalize_before", None) == getattr(b, "normalize_before", None)
        for a, b in zip(d_enc.layers, v_enc.layers)
    )


class NATBlockDrafter(Drafter):
    """The Spec-Drafter (``specdec_nat``): one non-autoregressive pass over
    ``prefix + k masks``.  Its encoder runs once per batch, and not at all when
    it is identical to the verifier's (trained with ``--freeze-encoder``):
    the state's encoder output (the verifier's) is reused.  The drafter's
    log-probs are computed only ``with_scores`` (acceptance by drafter score
    or a confidence cut); otherwise a draft is the argmax of the logits.

    A row whose source is longer than the drafter can read
    (``model.max_source_length()``: trained with smaller
    ``--max-source-positions``/``--max-target-positions`` than the verifier)
    is never drafted: the loop takes greedy steps for it, as it does once a
    prefix outgrows the drafter (``max_positions``).  Its own encoder reads
    such a row as an empty source (EOS only), so that no position table is
    indexed past its end."""

    def __init__(self, model, verifier_model=None, with_scores: bool = True):
        if not isinstance(model, SourceReadingDrafterModel):
            raise ValueError(f"the drafter must be a specdec_nat model, got {type(model).__name__}")
        self.model = model
        self.max_positions = model.decoder.max_positions()
        self.max_source_length = model.max_source_length()
        self.encoder_out = None  # own encoder's output; None: read the state's
        self.shares_encoder = verifier_model is not None and same_encoder(model, verifier_model)
        self.with_scores = with_scores
        self.fits = None  # B bool: rows whose source the drafter reads (None: all)

    def describe(self) -> str:
        shared = ", sharing the verifier's encoder" if self.shares_encoder else ""
        return f"specdec_nat drafter{shared}"

    def timed_parts(self, k: int):
        yield self, "start_batch", "drafter start of batch (own encoder, or memory from the verifier's)"
        yield self, "propose", f"drafter pass (prefix + up to {k} masks)"
        yield self.model.decoder, "output_layer", f"of which: drafter vocabulary projection (up to {k} rows)"

    def start_batch(self, state) -> None:
        net_input = state.net_input
        src_tokens = net_input["src_tokens"]
        pad = self.model.encoder.padding_idx
        fits = src_tokens.ne(pad).long().sum(dim=1) <= self.max_source_length
        self.fits = None if bool(fits.all()) else fits
        if self.shares_encoder:
            self.encoder_out = None
            return
        if self.fits is not None:
            # rows too long for the drafter: an EOS-only source (never drafted)
            src_tokens = src_tokens.masked_fill(~fits.unsqueeze(1), pad)
            src_tokens[~fits, -1] = self.model.encoder.dictionary.eos()
            net_input = {**net_input, "src_tokens": src_tokens, "src_lengths": src_tokens.ne(pad).long().sum(dim=1)}
        self.encoder_out = self.model.encoder.forward_torchscript(net_input)

    def propose(self, state, k):
        encoder_out = self.encoder_out if self.encoder_out is not None else state.encoder_out
        return self.model.draft(encoder_out, state.tokens[:, 1:], state.lengths, k, self.with_scores, active=self.fits)

    def reorder(self, order, order_host):
        if self.encoder_out is not None:
            self.encoder_out = self.model.encoder.reorder_encoder_out(self.encoder_out, order)
        if self.fits is not None:
            self.fits = self.fits.index_select(0, order)


class SourceCopyDrafter(Drafter):
    """Input-guided aggressive decoding (Ge et al. 2022, section 3.1, Algorithm 1).

    The draft is the source itself: at the start, the whole source; later,
    when the output's last 1, 2 or 3 tokens occur exactly once in the source
    (the shortest unique n-gram wins), the rest of the source after that
    occurrence; otherwise no draft (the loop then takes one greedy step).
    The loop always appends the verifier's own token after the last accepted
    draft, which plays the role of the paper's never-matching sentinel.
    Source and target must share one dictionary.
    """

    def __init__(self, pad: int, eos: int, max_ngram: int = 3):
        self.pad, self.eos, self.max_ngram = pad, eos, max_ngram
        self.sources = []
        self.index = []

    def describe(self) -> str:
        return "the source (input-guided)"

    def start_batch(self, state) -> None:
        self.sources, self.index = [], []
        for row in state.net_input["src_tokens"].tolist():
            src = [t for t in row if t != self.pad]
            if src and src[-1] == self.eos:
                src = src[:-1]
            occurrences = {}
            for n in range(1, self.max_ngram + 1):
                for end in range(n, len(src) + 1):
                    occurrences.setdefault(tuple(src[end - n : end]), []).append(end)
            self.sources.append(src)
            self.index.append(occurrences)

    def _continuation(self, row: int, output):
        src, occurrences = self.sources[row], self.index[row]
        if not output:
            return src
        for n in range(1, min(self.max_ngram, len(output)) + 1):
            ends = occurrences.get(tuple(output[-n:]))
            if ends is None:
                return []  # a longer suffix cannot occur either
            if len(ends) == 1:
                return src[ends[0] :]
        return []

    def propose(self, state, k):
        # each row's output suffix (BOS left out), all rows in one read
        suffixes = row_tails(state, self.max_ngram, first=1)
        drafts = [self._continuation(i, suffix)[:k] for i, suffix in enumerate(suffixes)]
        return padded_drafts(drafts, self.pad, state.tokens), None

    def reorder(self, order, order_host):
        self.sources = [self.sources[i] for i in order_host]
        self.index = [self.index[i] for i in order_host]


class ShortlistProjection:
    """A drafter's output projection for one batch: onto the ``size`` most
    frequent types (dictionary order) plus the batch's source tokens when the
    dictionaries are ``joined``, or onto every type (``size`` 0, or not below
    ``num_types``).  A type left out only costs a rejected draft, never a
    wrong output.

    After :meth:`start_batch`: ``bias`` (N: the projection's bias or zeros,
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
        self.vocab: Optional[Tensor] = None
        self.bias: Optional[Tensor] = None
        # the frequent (or every) type's layout, callable on x: a rowgemm.PackedLinear where the kernel runs
        self._base = None
        self._extra_t: Optional[Tensor] = None  # C x E: the batch's other source types
        self.kernels = kernels
        self._packed = DerivedWeight(partial(rowgemm.PackedLinear, precision=kernels.precision))
        self._transposed = TransposedWeight()
        self._static = {}  # (padded extra types, dtype, device) -> fixed buffers (make_static)
        self._first = None  # ((types, dtype, device), their ids, their zero bias with -inf at never types)

    def start_batch(self, weight: Tensor, bias: Optional[Tensor], src_tokens: Tensor) -> None:
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
        self.vocab, self._extra_t = None, None
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
            self.vocab = ids
        if bias is not None:
            self.bias = self._never_masked(bias.detach().index_select(0, ids), ids)
        elif extra is None:
            self.bias = zero_bias
        else:
            tail = torch.zeros(extra.size(0), dtype=weight.dtype, device=weight.device)
            if any(t >= self.size for t in self.never):  # a never type can be among the source's types
                tail = self._never_masked(tail, extra)
            self.bias = torch.cat([zero_bias, tail])

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
        if not self.size:
            return 0
        base = self.bias.size(0) - (self._extra_t.size(1) if self._extra_t is not None else 0)
        extra = self.bias.size(0) - base
        padded = -(-extra // step) * step
        buffers = self._static
        key = (padded, self.bias.dtype, self.bias.device)
        if key not in buffers:
            buffers[key] = {
                "extra_t": None if padded == 0 else torch.zeros(self._extra_t.size(0), padded, dtype=self.bias.dtype,
                                                              device=self.bias.device),
                "bias": torch.empty(base + padded, dtype=self.bias.dtype, device=self.bias.device),
                "vocab": torch.empty(base + padded, dtype=torch.long, device=self.bias.device),
            }
        buf = buffers[key]
        buf["bias"].fill_(-math.inf)
        buf["bias"][: base + extra] = self.bias
        buf["vocab"].fill_(self.never[0] if self.never else 0)
        buf["vocab"][: base + extra] = self.vocab
        if buf["extra_t"] is not None:
            buf["extra_t"].zero_()
            if self._extra_t is not None:
                buf["extra_t"][:, :extra] = self._extra_t
        self.bias, self.vocab, self._extra_t = buf["bias"], buf["vocab"], buf["extra_t"]
        return padded

    def __call__(self, x: Tensor) -> Tensor:
        """``x @ weight[vocab].t() + bias`` over the last axis of ``x``."""
        out = self._base(x)
        if self._extra_t is not None:
            out = torch.cat([out, torch.matmul(x, self._extra_t)], dim=-1)
        return out + self.bias

    def types(self, index: Tensor) -> Tensor:
        """Type ids of positions ``index`` along the projected axis."""
        return self.vocab[index] if self.vocab is not None else index

    def pick(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        """The best type (an id of the dictionary) and its log-probability
        under the projection's softmax, for each row of ``x``: one call of
        the extension where the weight is packed for it
        (:func:`~fairseq_specdec.kernels.rowgemm.draft_pick`, a vectorized
        exp), else ``log_softmax`` and ``max`` of :meth:`__call__`; the two
        round differently, which changes drafts at most."""
        if self.kernels.pick and isinstance(self._base, rowgemm.PackedLinear) and x.dtype == torch.float32 \
                and rowgemm.draft_pick_available():
            best, lprobs = rowgemm.draft_pick(x, self._base, self._extra_t, self.bias)
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


class BlockwiseHeadsDrafter(Drafter):
    """Blockwise parallel decoding (Stern et al. 2018): the k-1 heads of a
    ``blockwise_transformer`` read the verifier's state at the last accepted
    draft slot of the previous pass, whose base prediction is the token the
    loop just appended, and propose the k-1 tokens after it (the merged
    verify-and-predict step of section 4).  The first iteration has no draft.

    Per batch it lays the heads' weights out for one product each (the first
    layers of all heads side by side, the second layers as a batched product)
    and picks the shortlist (:class:`ShortlistProjection` of the model's
    ``blockwise_shortlist``), so an update costs three small products and one
    projection of k-1 rows onto the shortlist.  Padding and BOS are never
    drafted."""

    def __init__(self, model, shortlist: Optional[int] = None, kernels: DraftKernels = NO_KERNELS):
        if not isinstance(model, BlockwiseHeadsModel):
            raise ValueError(f"--decoding blockwise needs a blockwise_transformer, got {type(model).__name__}")
        self.model = model
        dictionary = model.decoder.dictionary
        size = model.blockwise_shortlist if shortlist is None else shortlist
        self.projection = ShortlistProjection(
            size, len(dictionary), joined_dictionaries(model), (dictionary.pad(), dictionary.bos()), kernels
        )
        self.pending = None  # B x (k-1) drafts for the next iteration
        self.pending_top = None  # their candidates for a draft tree: (types, log-probs), B x (k-1) x c
        self.w1 = self.b1 = self.w2 = self.b2 = None

    @property
    def shortlist(self) -> int:
        """The shortlist's size (0: every type)."""
        return self.projection.size

    def describe(self) -> str:
        return f"{self.model.blockwise_k - 1} blockwise heads of the verifier (shortlist {self.shortlist or 'off'})"

    def timed_parts(self, k: int):
        yield self, "start_batch", "drafter start of batch (the heads' layout, the shortlist)"
        yield self, "update", f"blockwise heads (up to {k} drafts from the verifier's state, shortlist projection)"

    def start_batch(self, state):
        self.pending = self.pending_top = None
        heads = self.model.heads
        num_heads, dim, hidden = heads.fc1.shape
        self.w1 = heads.fc1.detach().permute(1, 0, 2).reshape(dim, num_heads * hidden)
        self.b1 = heads.b1.detach().reshape(-1)
        self.w2, self.b2 = heads.fc2.detach(), heads.b2.detach().unsqueeze(1)
        output = self.model.decoder.output_projection
        self.projection.start_batch(output.weight, output.bias, state.net_input["src_tokens"])

    def update(self, state, feedback):
        x = feedback.newest_states()  # B x C
        bsz, num_heads = x.size(0), self.w2.size(0)
        hidden = torch.relu(torch.addmm(self.b1, x, self.w1)).view(bsz, num_heads, -1).transpose(0, 1)
        out = torch.baddbmm(self.b2, hidden, self.w2).transpose(0, 1) + x.unsqueeze(1)  # B x (k-1) x C
        p = self.projection
        if self.trees:
            types, lprobs = p.top(out.reshape(bsz * num_heads, -1), TREE_CANDIDATES)
            self.pending_top = (types.view(bsz, num_heads, -1), lprobs.view(bsz, num_heads, -1))
            self.pending = self.pending_top[0][:, :, 0]
            return
        best = p(out.reshape(bsz * num_heads, -1)).argmax(-1).view(bsz, num_heads)
        self.pending = p.types(best)

    def propose(self, state, k):
        if self.pending is None:
            return state.tokens.new_zeros((state.size, 0)), None
        return self.pending[:, :k], None

    #: the heads' candidates make draft trees (once the generator asks for them)
    drafts_trees = True
    #: whether update() keeps candidates for trees (set by the first propose_tree)
    trees = False

    def propose_tree(self, state, k, nodes):
        self.trees = True
        if self.pending_top is None:  # the first iteration (or the first since trees were asked for)
            return chain_tree(state.tokens.new_zeros((state.size, 0)))
        types, lprobs = self.pending_top
        return tree_from_candidates(types[:, :k], lprobs[:, :k], nodes, self.model.decoder.dictionary.pad())

    def reorder(self, order, order_host):
        if self.pending is not None:
            self.pending = self.pending.index_select(0, order)
        if self.pending_top is not None:
            self.pending_top = tuple(t.index_select(0, order) for t in self.pending_top)


class VerifierStateDrafter(Drafter):
    """The ``specdec_vsd`` drafter: drafts k tokens from the verifier's own
    work (its encoder output, and the final decoder state that predicted each
    row's newest token, handed over in every :class:`Feedback`), in one pass
    of ``1 + k`` rows; see :mod:`fairseq_specdec.models.specdec_vsd`.

    Per batch it projects the cross-attention memory once and picks the
    shortlist (:class:`ShortlistProjection`: the ``shortlist`` most frequent
    types plus the batch's source tokens when source and target share the
    dictionary).  It returns drafts with their (shortlist) log-probs, so the
    confidence cut of ``--draft-min-confidence`` applies.

    ``kernels``: what it may compute with the plugin's kernels (the
    backend's choice): its pass through :class:`NativeBlockPass` and its
    shortlist through packed products, in ``kernels.precision``."""

    def __init__(self, model, verifier_model, shortlist: int = 0, source: str = "--drafter-path",
                 kernels: DraftKernels = NO_KERNELS):
        model.check_verifier(verifier_model, source)
        self.model = model
        self.kernels = kernels
        self.max_block = model.offsets.num_embeddings  # one slot offset per drafted token
        self.projection = ShortlistProjection(
            shortlist, model.num_types, joined_dictionaries(verifier_model), (model.padding_idx, model.dictionary.bos()),
            kernels,
        )
        #: the drafting pass through the kernels, where the backend allows it and they run
        self.native = None
        if kernels.block and native_block_pass_reason(model) is None:
            self.native = NativeBlockPass(model, kernels.precision)
        self.memory = None
        self.ctx_states = None
        self.static = False
        self._static = {}  # (rows, source bucket, dtype) -> fixed memory and context buffers
        self._key = ()
        self._extra = 0  # the shortlist's padded count of the batch's extra source types
        self._weights = WeightsWatch()  # the model's weights; its generation joins the graphs' key

    #: positions of a batch's first table of slot rows (eager passes): it
    #: grows, doubling, once a row's slots reach past it (:meth:`_cover`)
    FIRST_POSITIONS = 32

    def start_batch(self, state) -> None:
        model = self.model
        # the slots' position table, for eager passes (the fixed buffers of static ones leave it out)
        first = 0 if self.static else min(state.width, self.FIRST_POSITIONS)
        self.memory = model.source_memory(state.encoder_out, positions=first)
        self.ctx_states = model.start_state.unsqueeze(0).expand(state.size, -1)
        self.projection.start_batch(model.output_weight, None, state.net_input["src_tokens"])
        if self.static:
            self._extra = self.projection.make_static()
            # a graph captured with other weights reads their old layouts: a new key
            self._weights.changed(model.parameters())
            self._to_static()

    def static_inputs(self) -> bool:
        self.static = True
        return True

    def static_key(self) -> tuple:
        return self._key

    def _to_static(self) -> None:
        """The rows' source memory padded to a multiple of 16 source tokens
        (the padding masked for the block layers' cross-attention and for
        the soft copy), and their context states, in fixed buffers (the
        shortlist's are made once per batch, in start_batch)."""
        memory, ctx = self.memory, self.ctx_states
        rows, length = memory["copy_values"].shape[:2]
        padded = -(-length // 16) * 16
        key = (rows, padded, ctx.dtype)
        if key not in self._static:
            self._static[key] = {
                "layers": [tuple(torch.zeros(t.shape[:2] + (padded,) + t.shape[3:], dtype=t.dtype, device=t.device)
                                 for t in pair) for pair in memory["layers"]],
                "mask": torch.zeros(rows, 1, 1, padded, dtype=torch.bool, device=ctx.device),
                "copy_keys": memory["copy_keys"].new_zeros(memory["copy_keys"].shape[:2] + (padded,)),
                "copy_values": memory["copy_values"].new_zeros((rows, padded) + memory["copy_values"].shape[2:]),
                "copy_pad": torch.ones(rows, 1, padded, dtype=torch.bool, device=ctx.device),
                "ctx": torch.empty_like(ctx),
            }
        buf = self._static[key]
        for pair, static_pair in zip(memory["layers"], buf["layers"]):
            for t, static in zip(pair, static_pair):  # N x H x S x d
                static.zero_()
                static[:, :, :length] = t
        buf["mask"].fill_(False)
        buf["mask"][..., :length] = memory["mask"]
        buf["copy_keys"].zero_()
        buf["copy_keys"][..., :length] = memory["copy_keys"]
        buf["copy_values"].zero_()
        buf["copy_values"][:, :length] = memory["copy_values"]
        buf["copy_pad"].fill_(True)
        buf["copy_pad"][..., :length] = memory["copy_pad"]
        buf["ctx"].copy_(ctx)
        self.memory = {name: buf[name] for name in ("layers", "mask", "copy_keys", "copy_values", "copy_pad")}
        self.ctx_states = buf["ctx"]
        self._key = (rows, padded, self._extra, self._weights.generation)

    def update(self, state, feedback) -> None:
        if self.static:
            self.ctx_states.copy_(feedback.newest_states())
        else:
            self.ctx_states = feedback.newest_states()

    def _cover(self, state, k: int) -> None:
        """Grow the batch's table of slot rows (``copy_base``) until it holds
        every slot of this pass (positions up to the longest row's length +
        k - 1), doubling, up to the batch's width and the model's position
        table: the slots then read the rows that a table of the whole width
        holds, and the first, short table spares the soft copy of positions
        no row reaches."""
        table = self.memory["copy_base"]
        size = table.size(1)
        need = max(state.lengths_host) + k
        most = min(state.width, self.model.positions.num_embeddings)
        if need > size and size < most:
            self.memory["copy_base"] = self.model.position_table(self.memory, min(max(2 * size, need), most))

    def _block_states(self, state, k: int) -> Tensor:
        """The drafter's B x k final states of one pass: one per drafted position."""
        if not self.static:
            self._cover(state, k)
        tokens = state.last_tokens().squeeze(1)
        if self.native is not None and not self.static:
            states = self.native.block_states(self.memory, self.ctx_states, tokens, state.lengths, k)
        else:
            states = self.model.block_states(self.memory, self.ctx_states, tokens, state.lengths, None, k)
        return states

    def propose(self, state, k):
        return self.projection.pick(self._block_states(state, k))

    drafts_trees = True

    def propose_tree(self, state, k, nodes):
        types, lprobs = self.projection.top(self._block_states(state, k), TREE_CANDIDATES)
        return tree_from_candidates(types, lprobs, nodes, self.model.padding_idx)

    #: the default draft length where the row-blocked kernel computes the
    #: passes: with the demo's drafter, drafts of 4-5 tokens added few
    #: accepted tokens over 3 and were no faster, although a pass of up to
    #: 8 rows reads each weight once (docs/verify-kernels.md, "Register blocks
    #: for 5 to 8 rows")
    KERNEL_BLOCK = 3

    def default_block(self, trained: int) -> int:
        """Where the products run through the row-blocked kernel, at most
        :attr:`KERNEL_BLOCK` (a drafting pass of 1 + k rows and a verify pass
        of k + 1 rows each read every weight once; longer drafts are mostly
        rejected); elsewhere the training k."""
        if not self.kernels.products:
            return trained
        return rowgemm.fitting_block(self.model.output_weight, trained, self.KERNEL_BLOCK)

    def describe(self) -> str:
        shortlist = self.model.cfg.shortlist
        return (f"specdec_vsd drafter reading the verifier's states (shortlist {shortlist or 'off'}, "
                f"{'native kernels, ' + self.kernels.precision + ' weights' if self.native is not None else 'torch operations'})")

    def timed_parts(self, k: int):
        yield self, "start_batch", "drafter start of batch (memory from the verifier's encoder output)"
        yield self, "propose", f"drafter pass (1 + up to {k} rows, shortlist projection)", False
        yield self, "propose_tree", f"drafter tree (1 + up to {k} rows, top candidates, best prefixes)", False
        if self.native is not None:
            yield self.native, "block_states", "of which: drafter block layers (native)"
        else:
            yield self.model, "block_states", "of which: drafter block layers"
        yield self, "update", "drafter feedback (the verifier's state)"

    def reorder(self, order, order_host) -> None:
        self.memory = self.model.select_memory(self.memory, order)
        self.ctx_states = self.ctx_states.index_select(0, order)
        if self.static:  # the kept rows, into the buffers of their number
            self._to_static()


def drafter_for_model(model, verifier_model, need_scores: bool, source: str,
                      kernels: DraftKernels = NO_KERNELS) -> Drafter:
    """The loop's drafter for a drafter checkpoint (``source``: where it came
    from, for messages): one drafter class per kind of
    :class:`~fairseq_specdec.models.protocol.DrafterModel`.
    ``need_scores``: the drafts' log-probs are needed (acceptance by drafter
    score, or a confidence cut); ``kernels``: what it may compute with the
    plugin's kernels (the backend's choice)."""
    if isinstance(model, VerifierStateDrafterModel):
        return VerifierStateDrafter(model, verifier_model, model.cfg.shortlist, source, kernels)
    if isinstance(model, SourceReadingDrafterModel):
        return NATBlockDrafter(model, verifier_model, with_scores=need_scores)
    kind = "a drafter of no kind the generator knows" if isinstance(model, DrafterModel) else "not a drafter"
    raise ValueError(f"{source}: a {type(model).__name__} model is {kind} (specdec_nat or specdec_vsd)")
