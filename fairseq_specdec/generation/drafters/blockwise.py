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
