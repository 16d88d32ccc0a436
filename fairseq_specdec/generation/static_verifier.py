"""The lean verify pass with static shapes, replayable as CUDA graphs.

At batch 1 on a GPU a verify pass is bound by kernel launches, not by
arithmetic: a few hundred small kernels, each launched from Python.  A CUDA
graph launches them all at once, but only if every tensor the pass touches
keeps its shape and its address from one pass to the next.
:class:`StaticVerifier` is :class:`~fairseq_specdec.generation.lean_verifier.LeanVerifier`'s
pass laid out that way (eagerly on any device with ``graphs=False``, which
the CPU tests run; captured once per shape and replayed with ``graphs=True``,
what ``--specdec-backend auto`` runs on a CUDA device):

* **the self-attention cache** has a fixed capacity (the batch's output
  width rounded up to :data:`CAPACITY_STEP`), one per batch bucket; every
  pass attends over the whole capacity, the positions past each row's
  input masked (-inf) on the device from the row's length, so no shape
  depends on how far decoding has got;
* **the encoder attention's keys and values** are computed once per batch
  (outside the graph) into a buffer of :data:`SOURCE_STEP`-rounded source
  length, the padding masked;
* **the batch** runs in a bucket of rows, the next power of two: a batch
  whose rows finish moves its rows to the front of its (or a smaller)
  bucket, and the bucket's spare rows compute values nobody reads (their
  length is 0 and their tokens are stale, so they never index outside the
  cache);
* **inputs** (the new tokens and the rows' lengths) are copied into fixed
  buffers, and **outputs** (log-probs and the final decoder states) are the
  graph's own, read through views of the first rows.

A graph is captured for each (bucket, m, source bucket) the first time it
is met: one eager pass on a side stream (it allocates and initialises the
libraries' workspaces), then the capture; every later pass of that shape
replays it.  The capacity only grows: a batch that needs more frees every
graph and buffer first.

**Cache invariant**: :class:`~fairseq_specdec.generation.verify_pass.VerifyPass`'s,
in the bucket's first ``state.size`` rows; as in the lean pass,
:meth:`rollback` has nothing to undo.  The values are those of the lean
pass: the same operations on the same weights, attention over more
(masked) positions.  Masked positions add exact zeros, but a kernel may sum
a longer row in another order, so in rare near-ties the output can differ
from the lean pass's by a last bit; the exactness tests compare it with
``--beam 1``.
"""
import math
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ..utils.encoder_out import encoder_states
from .graph_cache import GraphCache
from .lean_verifier import LeanVerifier, hidden_columns

#: the self-attention cache's capacity is a multiple of this
CAPACITY_STEP = 64
#: the encoder memory's length is a multiple of this
SOURCE_STEP = 16
#: what a static pass stands for: ``on`` (its own graphs), ``static`` (whole
#: iterations on fixed buffers, eagerly), ``iteration`` (whole iterations as graphs)
STATIC_CHOICES = ("on", "static", "iteration")


def bucket_rows(n: int) -> int:
    """The batch bucket of ``n`` rows: the next power of two."""
    return 1 << max(0, n - 1).bit_length()


def round_up(n: int, step: int) -> int:
    return -(-n // step) * step


class StaticVerifier(LeanVerifier):
    """The lean pass with static shapes; ``graphs=True`` replays each shape's
    pass as a CUDA graph (the verifier must be on a CUDA device).

    ``max_rows`` (None: no limit): a batch of more sentences than this runs
    the lean pass as it is (dynamic shapes, no graphs) from its start to its
    end; the backend sets 1 for a half-precision verifier
    (:func:`~fairseq_specdec.generation.backend.resolve_backend`).
    ``choice``: what it stands for, one of :data:`STATIC_CHOICES` (the loop
    captures or runs whole iterations where it is ``iteration`` or
    ``static``)."""

    def __init__(self, model, temperature: float = 1.0, graphs: bool = False, max_rows: Optional[int] = None,
                 choice: str = "on"):
        super().__init__(model, temperature, gemm="torch")
        device = next(model.parameters()).device
        if graphs and device.type != "cuda":
            raise ValueError(
                f"CUDA graphs need the verifier on a CUDA device (it is on {device}); "
                "graphs=False runs the same static-shape pass without graphs anywhere"
            )
        self.graphs = graphs
        if choice not in STATIC_CHOICES:
            raise ValueError(f"a static pass stands for one of {', '.join(STATIC_CHOICES)}, got {choice!r}")
        self.choice = choice
        self.max_rows = max_rows
        #: this batch runs the lean pass as it is (more rows than max_rows)
        self.dynamic = False
        self.device = device
        self.capacity = 0
        self.rows = 0  # the batch bucket of the current batch
        self.source = 0  # the source bucket of the current batch
        self._caches: Dict[int, Tuple[List[Tensor], List[Tensor]]] = {}
        self._memory: Dict[Tuple[int, int], Tuple[List[tuple], Tensor]] = {}
        self._inputs: Dict[Tuple[int, int], Tuple[Tensor, Tensor]] = {}
        #: (bucket, m, source bucket) -> the pass's graph; its counts are read by the tests
        self.graph_cache = GraphCache()
        self._laid_out = None  # the weights' generation (WeightsWatch) the buffers and graphs were made for
        self._dtype = None
        #: counts the times every buffer was dropped: graphs that read them are stale then
        self.generation = 0
        self._replay = True  # this batch replays the pass's own graphs (not inside a whole-iteration capture)

    def describe(self) -> str:
        graphs = ", CUDA graphs" if self.graphs else ""
        limit = f" for batches of at most {self.max_rows} sentence(s)" if self.max_rows is not None else ""
        return f"{self.impl} (static shapes{graphs}{limit}, torch products)"

    def _free(self) -> None:
        """Forget every buffer and graph (the weights or the capacity changed)."""
        self.generation += 1
        self._caches.clear()
        self._memory.clear()
        self._inputs.clear()
        self.graph_cache.clear()

    def start(self) -> None:
        super().start()
        if self._laid_out != self._weights.generation:  # the weights were laid out anew: graphs read the old ones
            self._free()
            self._laid_out = self._weights.generation
        self.rows = 0
        self.dynamic = False
        self._replay = True

    # -- buffers -----------------------------------------------------------
    def _cache(self, rows: int) -> Tuple[List[Tensor], List[Tensor]]:
        if rows not in self._caches:
            self._caches[rows] = tuple(
                [torch.zeros(rows, lw.heads, self.capacity, lw.head_dim, dtype=self._dtype, device=self.device)
                 for lw in self.layers]
                for _ in range(2)
            )
        return self._caches[rows]

    def _memory_buffers(self, rows: int, source: int, like: Tensor) -> Tuple[List[tuple], Tensor]:
        key = (rows, source)
        if key not in self._memory:
            cross = [
                tuple(like.new_zeros(rows * lw.c_heads, source, lw.c_head_dim) for _ in range(2))
                for lw in self.layers
            ]
            mask = torch.zeros(rows, 1, 1, source, dtype=torch.bool, device=self.device)
            self._memory[key] = (cross, mask)
        return self._memory[key]

    def _input_buffers(self, rows: int, m: int, tree: bool = False) -> tuple:
        """The pass's fixed inputs: tokens and lengths, and for a draft tree
        its depths and ancestors."""
        key = (rows, m, tree)
        if key not in self._inputs:
            buffers = (
                torch.zeros(rows, m, dtype=torch.long, device=self.device),
                torch.zeros(rows, dtype=torch.long, device=self.device),
            )
            if tree:
                buffers += (
                    torch.zeros(rows, m, dtype=torch.long, device=self.device),
                    torch.zeros(rows, m, m, dtype=torch.bool, device=self.device),
                )
            self._inputs[key] = buffers
        return self._inputs[key]

    def _point_at(self, rows: int, source: int) -> None:
        """The lean pass's fields (caches, encoder memory, its mask) are the buckets' buffers."""
        self.rows, self.source = rows, source
        self.keys, self.values = self._cache(rows)
        self.cross, self.enc_mask = self._memory[(rows, source)]

    def _start_batch(self, state) -> None:
        """The first pass of a batch: capacity, buckets, the encoder memory."""
        enc, pad = encoder_states(state.encoder_out)  # S x B x C, B x S
        capacity = round_up(state.tokens.size(1), CAPACITY_STEP)
        if capacity > self.capacity or enc.dtype != self._dtype:
            self._free()
            self.capacity = max(capacity, self.capacity)
            self._dtype = enc.dtype
        s, b = enc.size(0), enc.size(1)
        rows, source = bucket_rows(b), round_up(s, SOURCE_STEP)
        cross, mask = self._memory_buffers(rows, source, enc)
        for lw, (keys, values) in zip(self.layers, cross):
            kv = lw.ca_kv(enc).view(s, b, 2, lw.c_heads, lw.c_head_dim)
            for j, buffer in enumerate((keys, values)):
                view = buffer.view(rows, lw.c_heads, source, lw.c_head_dim)
                view[:b, :, :s] = kv[:, :, j].permute(1, 2, 0, 3)
        mask.fill_(False)
        mask[:b, :, :, s:] = True
        if pad is not None:
            mask[:b, 0, 0, :s] = pad
        self._point_at(rows, source)

    # -- the pass ----------------------------------------------------------
    def _pass(self, tokens: Tensor, lengths: Tensor, depths: Optional[Tensor] = None,
              ancestors: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
        """Log-probs and final states of the bucket's rows; only static
        buffers in, so that it can be captured.  With ``depths`` and
        ``ancestors`` the new tokens are a draft tree's slots (see
        :meth:`~fairseq_specdec.generation.verify_pass.VerifyPass.forward`)."""
        rows, m = tokens.shape
        x = self._embed(tokens, lengths, depths)
        positions = lengths.unsqueeze(1) + torch.arange(m, device=tokens.device)  # rows x m
        hidden = hidden_columns(lengths, positions, self.capacity, ancestors)
        mask = x.new_zeros(rows, 1, m, self.capacity).masked_fill_(hidden.unsqueeze(1), -math.inf)
        index = torch.arange(rows, device=tokens.device).unsqueeze(1)
        for i, lw in enumerate(self.layers):
            x = self._layer(lw, i, x, mask, 0, self.capacity, index, positions)
        lprobs = self._finish(x, None)
        return lprobs, self.last_features

    def begin(self, state, replay: bool = True) -> None:
        """Start the batch now rather than at its first pass (capacity,
        buckets, the encoder memory: what a captured iteration must not do);
        ``replay=False``: its passes run eagerly, for a capture of the whole
        iteration (:mod:`~fairseq_specdec.generation.iteration_graphs`)."""
        self._start_batch(state)
        self._replay = replay

    def _run(self, tokens: Tensor, lengths: Tensor, tree: tuple = ()) -> Tuple[Tensor, Tensor]:
        if not (self.graphs and self._replay):
            return self._pass(tokens, lengths, *tree)
        key = (self.rows, tokens.size(1), self.source, bool(tree))
        return self.graph_cache.run(key, lambda: self._pass(tokens, lengths, *tree))

    def forward(self, tokens: Tensor, state, needed: Optional[Tensor] = None, tree=None) -> Tensor:
        bsz, m = tokens.shape
        if self.rows == 0 and not self.dynamic:
            if self.max_rows is not None and bsz > self.max_rows:
                self.dynamic = True
            else:
                self._start_batch(state)
        if self.dynamic:
            return super().forward(tokens, state, needed, tree)
        inputs, lengths, *tree_inputs = self._input_buffers(self.rows, m, tree is not None)
        inputs[:bsz].copy_(tokens)
        lengths.zero_()  # spare rows: length 0, inside the cache
        lengths[:bsz].copy_(state.lengths)
        if tree is not None:  # spare rows: a chain (depth = slot, causal)
            depths, ancestors = tree_inputs
            depths.copy_(torch.arange(m, device=depths.device).expand_as(depths))
            ancestors.copy_(torch.ones(m, m, dtype=torch.bool, device=ancestors.device).tril().expand_as(ancestors))
            depths[:bsz].copy_(tree.depths)
            ancestors[:bsz].copy_(tree.ancestors)
        lprobs, features = self._run(inputs, lengths, tuple(tree_inputs))
        self.last_features = features[:bsz]
        lprobs = lprobs[:bsz]
        if needed is not None:  # as the lean pass: slots nobody reads are -inf
            lprobs = lprobs.masked_fill(~needed.unsqueeze(-1), -math.inf)
        return lprobs

    def reorder(self, state, new_order: Tensor, new_order_host: List[int]) -> None:
        """Move the kept rows to the front of their bucket's buffers."""
        if self.dynamic:
            return super().reorder(state, new_order, new_order_host)
        n = len(new_order_host)
        rows = bucket_rows(n)
        width = max(state.lengths_host) if state.lengths_host else 0
        old_keys, old_values = self.keys, self.values
        old_cross, old_mask = self.cross, self.enc_mask
        like = old_cross[0][0]
        self._memory_buffers(rows, self.source, like)
        new_keys, new_values = self._cache(rows)
        for old, new in ((old_keys, new_keys), (old_values, new_values)):
            for i in range(len(old)):
                new[i][:n, :, :width] = old[i][:, :, :width].index_select(0, new_order)
        new_cross, new_mask = self._memory[(rows, self.source)]
        for lw, old_pair, new_pair in zip(self.layers, old_cross, new_cross):
            for old, new in zip(old_pair, new_pair):
                shape = (-1, lw.c_heads) + tuple(old.shape[1:])
                new.view(shape)[:n] = old.view(shape).index_select(0, new_order)
        kept_mask = old_mask.index_select(0, new_order)
        new_mask.fill_(False)
        new_mask[:n] = kept_mask
        if self.last_features is not None:
            self.last_features = self.last_features.index_select(0, new_order)
        self._point_at(rows, self.source)
