"""One iteration of the speculative loop before its host read: draft, verify, accept.

:class:`Iteration` computes, for the active rows of a
:class:`~fairseq_specdec.generation.state.DecodingState`, everything the loop
commits: the drafts (always a :class:`~fairseq_specdec.generation.tree.DraftTree`;
a drafter's chain of k tokens is the :class:`~fairseq_specdec.generation.tree.ChainTree`),
one verify pass over them, the acceptance step the backend chose
(:mod:`~fairseq_specdec.generation.accept_step`), and the verifier's final
states along each row's appended tokens (what drafters that read the
verifier's states hear).

A runner calls it: :class:`EagerRunner` on the state itself, or the
backend's :class:`~fairseq_specdec.generation.iteration_graphs.IterationGraphs`
on fixed buffers (captured as CUDA graphs) for batches of one sentence.
Both give the loop ``(StepResult, features)``.
"""
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from .accept_step import AcceptanceStep, StepResult
from .draft_policy import DraftLengthPolicy
from .drafters import Drafter, NeverDrafts
from .screened_greedy import ScreenedGreedy
from .tree import DraftTree, chain_tree
from .verify_pass import VerifyPass


class Iteration:
    """Draft, verify and accept, for one generator.

    ``tree_nodes``: drafts are trees of at most this many nodes
    (``--draft-tree``; 0: the drafter's chains).  ``block_size``: k, the
    deepest draft (``--block-size``)."""

    def __init__(self, verifier: VerifyPass, drafter: Drafter, step: AcceptanceStep, policy: DraftLengthPolicy,
                 block_size: int, tree_nodes: int, pad: int, eos: int, screened: Optional[ScreenedGreedy] = None):
        """``screened``: the screened greedy steps of the backend, or None
        (:mod:`~fairseq_specdec.generation.screened_greedy`: an iteration with
        no drafts where they apply; every other iteration settles their
        deferred scores first)."""
        self.verifier, self.drafter, self.step, self.policy = verifier, drafter, step, policy
        self.screened = screened
        self.block_size, self.tree_nodes = block_size, tree_nodes
        self.pad, self.eos = pad, eos
        #: the drafter declares that it never drafts (:class:`~fairseq_specdec.generation.drafters.NeverDrafts`)
        self.never_drafts = isinstance(drafter, NeverDrafts)
        #: the empty draft of each batch size and device (read only: nothing changes a chain's tokens)
        self._no_drafts = {}

    def draft_width(self, state, max_len: int) -> int:
        """How many tokens deep the drafter may propose this iteration:
        ``--block-size``, within the length limit, the drafter's positions
        and the draft policy (0: no drafts; always for a drafter that never
        drafts)."""
        if self.never_drafts:
            return 0
        k = max(0, min(self.block_size, max_len - min(state.lengths_host)))
        limit = self.drafter.max_positions
        if limit is not None:
            k = max(0, min(k, limit - max(state.lengths_host)))
        if self.policy.adaptive:
            k = min(k, max(state.draft_k))
        if not self.policy.drafts_at(state.size, state.batch_size):
            k = 0
        return k

    def __call__(self, state, k: int, max_len: int, host_checks: bool,
                 always_mask: bool = False) -> Tuple[StepResult, Optional[Tensor]]:
        """The iteration's result and the verifier's final states along each
        row's appended tokens (B x (1 + D) x C, or None).  On the device only
        when ``host_checks`` is off: what a captured iteration runs, ``state``
        then being the fixed buffers of
        :class:`~fairseq_specdec.generation.iteration_graphs.StaticState`."""
        drafts, drafted = self._drafts(state, k, host_checks)
        tokens = state.last_tokens()
        screened = self.screened
        out = None
        if screened is not None and drafts.size == 0 and screened.applies(state, max_len, host_checks):
            steps = screened.run_length(state, max_len) if k == 0 else 1  # k > 0: the drafter was asked
            out, lprobs = screened(state, tokens, steps)  # lprobs: None where a step is certified
        else:
            if screened is not None:
                screened.settle(state)  # the step below reads the running scores
            if drafts.size > 0:
                tokens = torch.cat([tokens, drafts.tokens], dim=1)
            if not drafts.chain:
                lprobs = self.verifier.forward(tokens, state, tree=drafts)
            else:
                # in a ragged batch the slots after a row's last draft are not projected (nothing reads them)
                needed = None
                if drafted and state.size > 1 and min(drafted) < drafts.size:
                    counts = torch.tensor(drafted, device=state.device)
                    needed = torch.arange(drafts.size + 1, device=state.device).unsqueeze(0) <= counts.unsqueeze(1)
                lprobs = self.verifier.forward(tokens, state, needed)
        if out is None:
            out = self.step(state, lprobs, drafts, drafted, max_len, host_checks, always_mask)
        features = self.verifier.last_features
        if features is not None:  # along each row's appended tokens (a chain's are its slots)
            features = drafts.along(features, out.path)
        return out, features

    def _empty(self, state) -> DraftTree:
        """The chain of no drafts for the state's rows (one per batch size and device)."""
        key = (state.size, state.tokens.device)
        empty = self._no_drafts.get(key)
        if empty is None:
            empty = self._no_drafts[key] = chain_tree(state.tokens.new_zeros((state.size, 0)))
        return empty

    def _drafts(self, state, k: int, host_checks: bool) -> Tuple[DraftTree, Optional[List[int]]]:
        """The drafts of depth at most ``k`` (a tree of no node where ``k`` is
        0 or nothing was drafted: a chain) and, for a chain with
        ``host_checks``, each row's count of drafted tokens before its first
        pad (host ints; else None).  With ``host_checks`` a chain ends at the
        last slot any row can still keep: a slot after a drafted EOS or a pad
        is never accepted (a drafted EOS itself is verified)."""
        if k > 0 and self.tree_nodes:
            tree = self.drafter.propose_tree(state, k, self.tree_nodes)
            if tree.lprobs is not None and self.policy.needs_scores:  # the confidence cut, node by node
                tree.tokens = tree.tokens.masked_fill(tree.lprobs < self.policy.log_min_confidence, self.pad)
            if tree.size > 0:
                return tree, None
            k = 0
        if k == 0:
            return self._empty(state), [] if host_checks else None
        # a drafter may propose fewer than k tokens (pad = no draft)
        tokens, lprobs = self.drafter.propose(state, k)
        tokens = self.policy.limit(tokens, lprobs, state.draft_k, self.pad)
        if not host_checks or tokens.size(1) == 0:
            return chain_tree(tokens, lprobs), [] if host_checks else None
        # one read of a few host ints, then plain Python: cheaper than the
        # tensor operations that would find the same cut
        rows = tokens.tolist()
        cut = 0
        for row in rows:
            width = len(row)
            for j, token in enumerate(row):
                if token == self.pad or token == self.eos:
                    width = j + (token == self.eos)
                    break
            cut = max(cut, width)
        if cut < tokens.size(1):
            tokens = tokens[:, :cut]
            lprobs = lprobs[:, :cut] if lprobs is not None else None
        drafted = []
        for row in rows:
            count = 0
            while count < cut and row[count] != self.pad:
                count += 1
            drafted.append(count)
        return chain_tree(tokens, lprobs), drafted


class EagerRunner:
    """Runs the iteration on the decoding state itself (every batch the
    backend's whole-iteration runner does not take)."""

    def start_batch(self, state) -> None:
        """A new batch (nothing to prepare)."""

    def run(self, state, iteration: Iteration, k: int, max_len: int, host_checks: bool):
        return iteration(state, k, max_len, host_checks)
