"""Two drafters in one draft tree: a cheap one always, a model where the
cheap one is unsure.

:class:`CombinedDrafter` asks its ``first`` drafter (host-made candidate
paths with confidences: the ``ngram`` drafter's corpus continuations) for
every row's tree.  Where a row's tree is confident enough (the sum of its
nodes' confidences, the drafter's estimate of how many of them the verifier
accepts, reaches ``enough``) that tree is the draft; elsewhere the ``second``
drafter (a model that drafts every row in one pass: ``specdec_vsd``) adds
its candidates, and the two sets of paths are merged in one trie, the most
confident ``nodes`` kept.

The second drafter costs nothing until a row first needs it: its start of
batch runs then, not for every sentence (a fallback that ran a second
drafter's start on every sentence lost more than it gained), and it is
handed the verifier's newest states of the rows so far, so that it drafts
as if it had followed the batch from its start.
"""
from typing import List, Optional

import torch
from torch import Tensor

from .drafters import Drafter, PathDrafter, TimedParts, TreeDrafter
from .state import Feedback
from .tree import tree_from_paths, tree_paths

#: ``enough`` when none is given: the sum of confidences from which the first
#: drafter's tree is used alone (set, not tuned: docs/trees.md)
COMBINED_ENOUGH = 1.0


class CombinedDrafter(Drafter, TreeDrafter, TimedParts):
    """``first``: a :class:`~fairseq_specdec.generation.drafters.PathDrafter`
    (per row, ``(tokens, confidence)`` paths); ``second``: a
    :class:`~fairseq_specdec.generation.drafters.TreeDrafter` whose tree's
    log-probs rank its paths, drafting at most ``second_k`` deep; ``pad``:
    the dictionary's pad.  Drafts trees only."""

    trees_only = True

    def __init__(self, first: Drafter, second: Drafter, pad: int, enough: float = COMBINED_ENOUGH,
                 second_k: Optional[int] = None):
        if not isinstance(first, PathDrafter):
            raise ValueError(f"{first.describe()} gives no candidate paths to combine")
        if not isinstance(second, TreeDrafter):
            raise ValueError(f"{second.describe()} drafts chains only: it cannot add candidates to a tree")
        self.first, self.second = first, second
        #: the deepest the second drafter drafts (its own default k; None: as deep as the tree)
        self.second_k = second_k
        self.pad = pad
        self.enough = enough
        self.started = False  # whether the second drafter's start of batch has run
        self.newest: Optional[Tensor] = None  # B x C: the verifier's newest states, until it has
        self.max_positions = second.max_positions

    def describe(self) -> str:
        return (f"{self.first.describe()}, then {self.second.describe()} where the first's tree is unsure "
                f"(its confidences sum below {self.enough:g})")

    def timed_parts(self, k: int):
        yield self.first, "start_batch", "first drafter's start of batch"
        yield self.first, "tree_paths", f"first drafter's candidate paths (up to {k} deep)", False
        yield self.second, "start_batch", "second drafter's start of batch (where a row needs it)", False
        yield self.second, "propose_tree", "second drafter's tree (where a row needs it)", False
        yield self, "propose_tree", "combined tree", False

    def start_batch(self, state) -> None:
        self.first.start_batch(state)
        self.started = False
        self.newest = None

    def _start_second(self, state) -> None:
        self.second.start_batch(state)
        if self.newest is not None:  # the verifier's state behind every row's newest token
            n_new = torch.ones(state.size, dtype=torch.long, device=self.newest.device)
            self.second.update(state, Feedback([], [], n_new, self.newest.unsqueeze(1)))
        self.started = True
        self.newest = None

    def propose(self, state, k):
        raise NotImplementedError("a combined drafter drafts trees only")

    def propose_tree(self, state, k, nodes):
        paths = self.first.tree_paths(state, k, nodes)
        unsure = [i for i, row in enumerate(paths) if sum(score for _, score in row) < self.enough]
        if unsure:
            if not self.started:
                self._start_second(state)
            depth = min(k, self.second_k or k, self.second.max_block or k)
            more = tree_paths(self.second.propose_tree(state, depth, nodes), self.pad)
            for i in unsure:
                paths[i] = paths[i] + more[i]
        return tree_from_paths(paths, nodes, self.pad, state.tokens)

    def update(self, state, feedback) -> None:
        self.first.update(state, feedback)
        if self.started:
            self.second.update(state, feedback)
        elif feedback.features is not None:
            self.newest = feedback.newest_states()

    def reorder(self, order: Tensor, order_host: List[int]) -> None:
        self.first.reorder(order, order_host)
        if self.started:
            self.second.reorder(order, order_host)
        elif self.newest is not None:
            self.newest = self.newest.index_select(0, order)
