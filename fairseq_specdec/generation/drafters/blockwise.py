"""Blockwise parallel decoding: the verifier's own heads draft (Stern et al. 2018)."""
from typing import Optional

import torch

from ...models.protocol import BlockwiseHeadsModel
from ...utils.dictionary import joined_dictionaries
from ..tree import chain_tree, tree_from_candidates
from .base import NO_KERNELS, DraftKernels, Drafter, TimedParts, TreeDrafter
from .shortlist import TREE_CANDIDATES, ShortlistProjection


class BlockwiseHeadsDrafter(Drafter, TreeDrafter, TimedParts):
    """Blockwise parallel decoding (Stern et al. 2018): the k-1 heads of a
    ``blockwise_transformer`` read the verifier's state at the last accepted
    draft slot of the previous pass, whose base prediction is the token the
    loop just appended, and propose the k-1 tokens after it (the merged
    verify-and-predict step of section 4).  The first iteration has no draft.

    Per batch it lays the heads' weights out for one product each (the first
    layers of all heads side by side, the second layers as a batched product)
    and picks the shortlist (:class:`ShortlistProjection` of the model's
    ``blockwise_shortlist``), so a draft costs three small products and one
    projection of k-1 rows onto the shortlist.  Padding and BOS are never
    drafted.

    The heads run when a draft is asked for, not when the state arrives:
    :meth:`update` keeps the rows' newest verifier states, and the first
    :meth:`propose` or :meth:`propose_tree` after it computes the heads once
    from them.  An iteration that does not draft (a batch whose rows the
    loop's rule keeps from drafting) costs the drafter nothing; the drafts
    are the same either way, since they depend on those states alone.

    Invariant between two iterations: ``states`` is None before the first
    update of a batch, else B x C, row ``i`` the verifier's state that
    predicted row ``i``'s newest token; ``pending`` and ``pending_top`` are
    None or the heads' drafts from exactly those states (rows reordered
    with them)."""

    def __init__(self, model, shortlist: Optional[int] = None, kernels: DraftKernels = NO_KERNELS):
        if not isinstance(model, BlockwiseHeadsModel):
            raise ValueError(f"--decoding blockwise needs a blockwise_transformer, got {type(model).__name__}")
        self.model = model
        dictionary = model.decoder.dictionary
        size = model.blockwise_shortlist if shortlist is None else shortlist
        self.projection = ShortlistProjection(
            size, len(dictionary), joined_dictionaries(model), (dictionary.pad(), dictionary.bos()), kernels
        )
        self.states = None  # B x C: the states the next drafts are read from (None: no draft yet)
        self.pending = None  # B x (k-1): the drafts from them, once asked for
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
        yield self, "propose", f"blockwise heads (up to {k} drafts from the verifier's state, shortlist projection)", False
        yield self, "propose_tree", f"blockwise heads (up to {k} drafts' top candidates for a tree)", False
        yield self, "update", "drafter feedback (the verifier's state)"

    def start_batch(self, state):
        self.states = self.pending = self.pending_top = None
        heads = self.model.heads
        num_heads, dim, hidden = heads.fc1.shape
        self.w1 = heads.fc1.detach().permute(1, 0, 2).reshape(dim, num_heads * hidden)
        self.b1 = heads.b1.detach().reshape(-1)
        self.w2, self.b2 = heads.fc2.detach(), heads.b2.detach().unsqueeze(1)
        output = self.model.decoder.output_projection
        self.projection.start_batch(output.weight, output.bias, state.net_input["src_tokens"])

    def update(self, state, feedback):
        self.states = feedback.newest_states()  # B x C; the heads wait for a propose
        self.pending = self.pending_top = None

    def _heads(self):
        """The heads' output states from ``states``: (B * (k-1)) x C, row-major by row then head."""
        x = self.states
        bsz, num_heads = x.size(0), self.w2.size(0)
        hidden = torch.relu(torch.addmm(self.b1, x, self.w1)).view(bsz, num_heads, -1).transpose(0, 1)
        out = torch.baddbmm(self.b2, hidden, self.w2).transpose(0, 1) + x.unsqueeze(1)  # B x (k-1) x C
        return out.reshape(bsz * num_heads, -1)

    def propose(self, state, k):
        if self.states is None:
            return state.tokens.new_zeros((state.size, 0)), None
        if self.pending is None:
            p = self.projection
            self.pending = p.types(p(self._heads()).argmax(-1).view(self.states.size(0), -1))
        return self.pending[:, :k], None

    def propose_tree(self, state, k, nodes):
        if self.states is None:  # the first iteration of a batch
            return chain_tree(state.tokens.new_zeros((state.size, 0)))
        if self.pending_top is None:
            types, lprobs = self.projection.top(self._heads(), TREE_CANDIDATES)
            rows = self.states.size(0)
            self.pending_top = (types.view(rows, -1, types.size(-1)), lprobs.view(rows, -1, lprobs.size(-1)))
        types, lprobs = self.pending_top
        return tree_from_candidates(types[:, :k], lprobs[:, :k], nodes, self.model.decoder.dictionary.pad())

    def reorder(self, order, order_host):
        if self.states is not None:
            self.states = self.states.index_select(0, order)
        if self.pending is not None:
            self.pending = self.pending.index_select(0, order)
        if self.pending_top is not None:
            self.pending_top = tuple(t.index_select(0, order) for t in self.pending_top)
