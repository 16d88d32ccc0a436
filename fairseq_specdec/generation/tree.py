"""Draft trees: several continuations verified in one pass.

A draft tree of row ``r`` is a set of candidate continuations of the row's
accepted output, merged on their common prefixes.  A verify pass of a tree
has ``m = 1 + n`` input slots per row:

* slot 0 is the row's newest accepted token (the root);
* slot ``i`` (1 .. n) is a drafted token whose **parent** is slot
  ``parents[r, i] < i`` (so slots are in topological order); it continues
  the output ``root, ..., parent, token``;
* a node's **depth** is its number of ancestors: the token at depth ``d``
  sits at output index ``lengths[r] + d`` (its position), whatever its slot;
* a pad token marks a slot the row does not use (rows of a batch share
  ``m``, not their shapes); the verifier never picks pad, so such a node is
  never accepted, and nor is anything under it.

A chain of k drafts is the tree whose slot ``i`` has parent ``i - 1``.

In the pass, slot ``i`` attends to the row's committed prefix and to its
ancestors and itself among the pass's slots (:meth:`DraftTree.ancestors`):
exactly the inputs the verifier would have seen had it decoded that path
alone.  The acceptance rule walks the tree from the root and keeps the
deepest root path all of whose nodes are acceptable (the first such path
in slot order, where relaxed verification accepts more than one);
:attr:`DraftTree.paths` lists every node's root path, so that the loop can
gather the accepted path's tokens and the verify pass keep the accepted
path's cache entries (``VerifyPass.rollback``'s ``path``).

Builders (each drafter's tree ends up here):

* :func:`chain_tree`: k drafts as a chain;
* :func:`tree_from_candidates`: drafters that propose every position in
  parallel (``specdec_vsd``, the blockwise heads) give their ``c`` best
  tokens per position with log-probs; the tree is the ``n`` most probable
  prefixes of their combinations (EAGLE-2's dynamic tree: a node's score is
  its path's summed log-prob), per row, with tensor operations only;
* :func:`tree_from_paths`: host-made candidate paths with scores (the
  ``ngram`` drafter's continuations, several drafters combined), merged in a
  trie and cut to the ``n`` best nodes.
"""
import heapq
import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor


def derived_views(parents: Sequence[Sequence[int]], device) -> Dict[str, Tensor]:
    """A tree's ``depths``, ``ancestors`` and ``paths`` (see :class:`DraftTree`)
    from its parent slots, one list per row (-1 at slot 0, parents first),
    worked out in plain Python on the host (cheaper than any array
    operation at a tree's size) and made into tensors on ``device``."""
    bsz = len(parents)
    m = len(parents[0]) if parents else 1
    depths, ancestors, paths = [], [], []
    for par in parents:
        depth = [0] * m
        path = [[0]] + [None] * (m - 1)
        anc = [[False] * m for _ in range(m)]
        anc[0][0] = True
        for i in range(1, m):
            p = par[i]
            depth[i] = depth[p] + 1
            path[i] = path[p] + [i]
            for j in path[i]:
                anc[i][j] = True
        depths.append(depth)
        ancestors.append(anc)
        paths.append(path)
    most = max((max(d) for d in depths), default=0)
    full = [[p + [p[-1]] * (most + 1 - len(p)) for p in row] for row in paths]
    return dict(
        depths=torch.tensor(depths, dtype=torch.long).view(bsz, m).to(device),
        ancestors=torch.tensor(ancestors, dtype=torch.bool).view(bsz, m, m).to(device),
        paths=torch.tensor(full, dtype=torch.long).view(bsz, m, most + 1).to(device),
    )


def gather_slots(x: Tensor, index: Tensor) -> Tensor:
    """``x`` (B x m, or B x m x C) at the slots ``index`` (B x j) of each row:
    B x j (x C)."""
    if x.dim() == 3:
        index = index.unsqueeze(-1).expand(-1, -1, x.size(-1))
    return x.gather(1, index)


@dataclass
class DraftTree:
    """B rows of ``n`` drafted nodes each (see the module docstring).

    ``tokens``: B x n (node i is slot i + 1; pad: unused); ``parents``:
    B x (1 + n) int64, the parent slot of every slot (-1 for the root);
    ``lprobs``: B x n drafter log-probs of the tokens, or None."""

    tokens: Tensor
    parents: Tensor
    lprobs: Optional[Tensor] = None
    _cache: Dict[str, Tensor] = field(default_factory=dict, repr=False)

    @property
    def size(self) -> int:
        """Drafted nodes per row (n)."""
        return self.tokens.size(1)

    @property
    def slots(self) -> int:
        """Input slots of the verify pass (1 + n)."""
        return self.tokens.size(1) + 1

    def _derive(self) -> None:
        """Depths, ancestors and paths from the parents (on the host: see
        :func:`derived_views`), then on the parents' device."""
        self._cache.update(derived_views(self.parents.tolist(), self.parents.device))

    def _get(self, name: str) -> Tensor:
        if name not in self._cache:
            self._derive()
        return self._cache[name]

    @property
    def depths(self) -> Tensor:
        """B x (1 + n): every slot's depth (0 for the root)."""
        return self._get("depths")

    @property
    def ancestors(self) -> Tensor:
        """B x (1 + n) x (1 + n) bool: ``[r, i, j]`` when slot j is slot i
        or one of its ancestors (what slot i attends to in the pass)."""
        return self._get("ancestors")

    @property
    def paths(self) -> Tensor:
        """B x (1 + n) x (1 + D) (D: the deepest node's depth): ``[r, s, d]``
        is the slot of slot s's ancestor at depth d (slot s itself for
        ``d >= depth(s)``)."""
        return self._get("paths")

    @property
    def max_depth(self) -> int:
        return self.paths.size(2) - 1

    # -- what the acceptance step reads of a tree ----------------------------
    #: declared by :class:`ChainTree`: every slot i hangs from slot i - 1, and
    #: the methods below take their cheaper chain forms
    chain = False

    def parent_values(self, x: Tensor) -> Tensor:
        """B x n (x ...): ``x``'s entry at each node's parent slot (``x``:
        B x (1 + n) (x ...), one entry per slot)."""
        return gather_slots(x, self.parents[:, 1:])

    def running_scores(self, cum: Tensor, draft_vlp: Tensor, on_host: bool) -> Tensor:
        """B x (1 + n) float32 running scores before each slot: the row's
        ``cum`` at the root, then the parent's plus the parent-slot log-prob
        of the node's token (``draft_vlp``, B x n), one float32 addition per
        node: SequenceGenerator's order along every root path.  ``on_host``
        adds through numpy (a CPU tensor's memory is shared: nothing is
        copied), otherwise node by node on the device, with no read back."""
        bsz, n = draft_vlp.shape
        if on_host:
            running = np.empty((bsz, n + 1), dtype=np.float32)
            running[:, 0] = cum.cpu().numpy()
            vlp = draft_vlp.cpu().numpy()
            par = self.parents.cpu().numpy()
            rows = np.arange(bsz)
            for i in range(1, n + 1):
                running[:, i] = running[rows, par[:, i]] + vlp[:, i - 1]
            return torch.from_numpy(running).to(cum.device)
        running = torch.empty((bsz, n + 1), dtype=torch.float32, device=cum.device)
        running[:, 0] = cum
        for i in range(1, n + 1):
            torch.add(running.gather(1, self.parents[:, i : i + 1]).squeeze(1), draft_vlp[:, i - 1],
                      out=running[:, i])
        return running

    def deepest_acceptable(self, ok: Tensor) -> Tuple[Tensor, Optional[Tensor]]:
        """From ``ok`` (B x n: each node acceptable at its parent) to each
        row's accepted count and path: the deepest root path all of whose
        nodes are acceptable (the first in slot order), as ``(depth,
        B x (1 + D) slots)``; a chain's path is None (slots ``0 .. k``)."""
        bsz = ok.size(0)
        bad = torch.cat([ok.new_zeros(bsz, 1), ~ok], dim=1)
        reach = ~(self.ancestors & bad.unsqueeze(1)).any(dim=2)  # no unacceptable node on the root path
        depths = self.depths
        chosen = torch.where(reach, depths, torch.full_like(depths, -1)).argmax(dim=1)  # the first deepest
        rows = torch.arange(bsz, device=ok.device)
        return depths[rows, chosen], self.paths[rows, chosen]

    @staticmethod
    def along(x: Tensor, path: Optional[Tensor]) -> Tensor:
        """``x`` (B x (1 + n) (x ...), one entry per slot) at the slots of
        ``path`` (B x (1 + D)); ``x`` itself where ``path`` is None (a chain)."""
        return x if path is None else gather_slots(x, path)

    def drafted_counts(self, pad: int) -> Tensor:
        """B: each row's drafted nodes (those not pad)."""
        return self.tokens.ne(pad).sum(dim=1)

    def is_chain(self) -> bool:
        """Whether every row's slot i has parent i - 1."""
        m = self.slots
        chain = torch.arange(-1, m - 1, device=self.parents.device)
        return bool(torch.equal(self.parents, chain.unsqueeze(0).expand_as(self.parents)))

    @classmethod
    def from_lists(cls, rows: Sequence[Sequence[Tuple[int, int]]], pad: int, like: Tensor,
                   lprobs: Optional[Sequence[Sequence[float]]] = None) -> "DraftTree":
        """A tree from host lists, per row its nodes as ``(token, parent
        slot)`` in slot order (parents first); rows with fewer nodes are
        padded (pad nodes under the root).  The depths, ancestors and paths
        are worked out from the same lists (:func:`derived_views`), every
        tensor made once, on ``like``'s device."""
        n = max((len(r) for r in rows), default=0)
        device = like.device
        bsz = len(rows)
        tokens = [[t for t, _ in row] + [pad] * (n - len(row)) for row in rows]
        parents = [[-1] + [p for _, p in row] + [0] * (n - len(row)) for row in rows]
        tree = cls(torch.tensor(tokens, dtype=torch.long).view(bsz, n).to(device),
                   torch.tensor(parents, dtype=torch.long).view(bsz, n + 1).to(device),
                   None if lprobs is None else torch.tensor(
                       [list(r) + [-math.inf] * (n - len(r)) for r in lprobs], dtype=torch.float).view(bsz, n).to(device))
        tree._cache.update(derived_views(parents, device))
        return tree


class ChainTree(DraftTree):
    """A chain of k drafts: the tree whose slot i hangs from slot i - 1.

    It answers every question of a tree, and declares :attr:`chain` so that
    what reads it can take the chain's cheaper forms: a verify pass its
    causal mask (``forward`` with no ``tree``), the acceptance step slices
    instead of gathers.  A pad stops a chain: nothing after it is drafted.
    Its derived views are made on the device from ``arange`` (no host read:
    a chain is what a captured iteration drafts); so are its parents, made
    only where something asks for them (no chain form does)."""

    chain = True

    def __init__(self, tokens: Tensor, lprobs: Optional[Tensor] = None):
        self.tokens, self.lprobs, self._cache = tokens, lprobs, {}

    @property
    def parents(self) -> Tensor:
        if "parents" not in self._cache:
            bsz, k = self.tokens.shape
            self._cache["parents"] = torch.arange(-1, k, device=self.tokens.device).unsqueeze(0).expand(bsz, -1)
        return self._cache["parents"]

    def _derive(self) -> None:
        bsz, m = self.tokens.size(0), self.slots
        slots = torch.arange(m, device=self.tokens.device)
        self._cache.update(
            depths=slots.unsqueeze(0).expand(bsz, -1),
            ancestors=(slots.unsqueeze(1) >= slots.unsqueeze(0)).unsqueeze(0).expand(bsz, -1, -1),
            paths=torch.minimum(slots.unsqueeze(1), slots.unsqueeze(0)).unsqueeze(0).expand(bsz, -1, -1),
        )

    def parent_values(self, x: Tensor) -> Tensor:
        return x[:, : self.size]

    def running_scores(self, cum: Tensor, draft_vlp: Tensor, on_host: bool) -> Tensor:
        # a chain's root paths are its prefixes: a running sum, in float32,
        # one addition at a time (np.cumsum adds in order)
        n, k = draft_vlp.shape
        if on_host:
            running = np.empty((n, k + 1), dtype=np.float32)
            running[:, 0] = cum.cpu().numpy()
            if k > 0:
                path = np.concatenate([running[:, :1], draft_vlp.cpu().numpy()], axis=1)
                np.cumsum(path, axis=1, dtype=np.float32, out=running)
            return torch.from_numpy(running).to(cum.device)
        running = torch.empty((k + 1, n), dtype=torch.float32, device=cum.device)  # slot x row
        running[0] = cum
        for j in range(k):
            torch.add(running[j], draft_vlp[:, j], out=running[j + 1])
        return running.t()

    def deepest_acceptable(self, ok: Tensor) -> Tuple[Tensor, Optional[Tensor]]:
        return ok.long().cumprod(dim=1).sum(dim=1), None

    def drafted_counts(self, pad: int) -> Tensor:
        return self.tokens.ne(pad).long().cumprod(dim=1).sum(dim=1)


def chain_tree(tokens: Tensor, lprobs: Optional[Tensor] = None) -> ChainTree:
    """B x k drafts as a chain (slot i's parent: slot i - 1)."""
    return ChainTree(tokens, lprobs)


@lru_cache(maxsize=64)
def _universe(depth: int, width: int, device: str) -> Tuple[Tensor, Tensor, Tensor]:
    """Every rank combination of at most ``depth`` positions and ``width``
    candidates per position, in order of depth, then rank: ``(choices U x
    (depth * width) float, one-hot of the candidate each position takes),
    ``parent`` (U, the index of the combination without its last position,
    -1 at depth 1), ``rank_at`` (U x depth, the candidate rank of each
    position, -1 past the depth)."""
    combos: List[Tuple[int, ...]] = []
    level: List[Tuple[int, ...]] = [()]
    for _ in range(depth):
        level = [c + (r,) for c in level for r in range(width)]
        combos.extend(level)
    index = {c: i for i, c in enumerate(combos)}
    choices = torch.zeros(len(combos), depth * width)
    parent = torch.full((len(combos),), -1, dtype=torch.long)
    rank_at = torch.full((len(combos), depth), -1, dtype=torch.long)
    for i, c in enumerate(combos):
        for pos, r in enumerate(c):
            choices[i, pos * width + r] = 1.0
            rank_at[i, pos] = r
        if len(c) > 1:
            parent[i] = index[c[:-1]]
    return choices.to(device), parent.to(device), rank_at.to(device)


#: the most combinations tree_from_candidate_tensors scores per row
UNIVERSE_LIMIT = 4096


def best_prefixes(tokens: Sequence[Sequence[int]], lprobs: Sequence[Sequence[float]], nodes: int,
                  pad: int) -> List[Tuple[int, int, float]]:
    """One row of :func:`tree_from_candidates` on the host: the ``nodes``
    most probable prefixes of a k x c candidate table (each position's
    candidates best first), found best first (a prefix's next candidates are
    its first child and its next sibling, so each step pushes two), as
    ``(token, parent slot, log-prob)`` in slot order, parents first."""
    k = len(tokens)
    heap = []
    if k and tokens[0]:
        heap.append((-lprobs[0][0], 0, 0, 0))  # (-score, parent slot, position, rank)
    out: List[Tuple[int, int, float]] = []
    while heap and len(out) < nodes:
        negative, parent, pos, rank = heapq.heappop(heap)
        width = len(tokens[pos])
        if rank + 1 < width:  # the next sibling
            heapq.heappush(heap, (negative - lprobs[pos][rank + 1] + lprobs[pos][rank], parent, pos, rank + 1))
        token, lp = tokens[pos][rank], lprobs[pos][rank]
        if token == pad or lp == -math.inf:
            continue
        out.append((token, parent, lp))
        if pos + 1 < k:  # the first child
            heapq.heappush(heap, (negative - lprobs[pos + 1][0], len(out), pos + 1, 0))
    return out


def tree_from_candidates(tokens: Tensor, lprobs: Tensor, nodes: int, pad: int) -> DraftTree:
    """The tree of the ``nodes`` most probable draft prefixes, per row, of a
    drafter that proposes every position at once (see
    :func:`tree_from_candidate_tensors`): on a CPU from host lists
    (:func:`best_prefixes`, a few microseconds a row), elsewhere with tensor
    operations only (no host read)."""
    if tokens.device.type != "cpu":
        return tree_from_candidate_tensors(tokens, lprobs, nodes, pad)
    rows = [best_prefixes(t, lp, nodes, pad) for t, lp in zip(tokens.tolist(), lprobs.float().tolist())]
    return DraftTree.from_lists([[(t, p) for t, p, _ in row] for row in rows], pad, tokens,
                                [[lp for _, _, lp in row] for row in rows])


def tree_from_candidate_tensors(tokens: Tensor, lprobs: Tensor, nodes: int, pad: int) -> DraftTree:
    """The tree of the ``nodes`` most probable draft prefixes, per row, of a
    drafter that proposes every position at once: ``tokens`` / ``lprobs``
    (B x k x c) are its ``c`` best tokens per position (best first) and their
    log-probs; a prefix's score is the sum of its tokens' log-probs (the
    drafter's probability of the whole prefix; a position's candidates do not
    depend on the choices before it).  A prefix never scores above its
    parent, so the best ``nodes`` form a tree (where equal scores leave a
    node without its parent, the node is left as pad).  A pad candidate is
    scored -inf and, if chosen, left as pad.  Tensor operations only (one
    small product): no host read."""
    bsz, k, width = tokens.shape
    while k > 1 and sum(width ** d for d in range(1, k + 1)) > UNIVERSE_LIMIT:
        k -= 1
    tokens, lprobs = tokens[:, :k], lprobs[:, :k].float()
    choices, parent, rank_at = _universe(k, width, str(tokens.device))
    nodes = min(nodes, choices.size(0))
    flat = lprobs.masked_fill(tokens.eq(pad), -float("inf")).reshape(bsz, k * width)
    # sum of the chosen log-probs: a product with one-hot rows (-inf stays -inf where chosen)
    finite = torch.nan_to_num(flat, neginf=-1e30)
    score = finite @ choices.t()  # B x U
    depth = (rank_at >= 0).sum(1)
    chosen = score.topk(nodes, dim=1).indices.sort(dim=1).values  # B x n, in the universe's order
    # each chosen combination's last position and rank: its token
    last_pos = depth[chosen] - 1
    last_rank = rank_at[chosen, last_pos]
    node_tokens = tokens.reshape(bsz, k * width).gather(1, last_pos * width + last_rank)
    node_lprobs = lprobs.reshape(bsz, k * width).gather(1, last_pos * width + last_rank)
    # parents: the slot of the chosen parent combination (root slot 0 at depth 1)
    slot_of = torch.zeros(bsz, choices.size(0) + 1, dtype=torch.long, device=tokens.device)  # last column: root
    slot_of.scatter_(1, chosen, torch.arange(1, nodes + 1, device=tokens.device).expand(bsz, -1))
    par = parent[chosen]
    par = torch.where(par < 0, torch.full_like(par, choices.size(0)), par)
    parent_slots = slot_of.gather(1, par)
    # a chosen node whose parent was not chosen (only at -inf scores) hangs from the root, as pad
    orphan = parent_slots.eq(0) & depth[chosen].gt(1)
    bad = orphan | ~torch.isfinite(node_lprobs) | node_tokens.eq(pad)
    node_tokens = node_tokens.masked_fill(bad, pad)
    parent_slots = parent_slots.masked_fill(orphan, 0)
    parents = torch.cat([torch.full((bsz, 1), -1, dtype=torch.long, device=tokens.device), parent_slots], 1)
    return DraftTree(node_tokens, parents, node_lprobs)


def tree_from_paths(rows: Sequence[Sequence[Tuple[Sequence[int], float]]], nodes: int, pad: int,
                    like: Tensor) -> DraftTree:
    """Host-made candidates, per row a list of ``(tokens, score)`` paths
    (score: the estimated probability that the verifier accepts the whole
    path, higher first), merged in a trie: a node's score is the largest
    score of the paths through it (so never above its parent's); each row
    keeps its ``nodes`` best nodes (ties: earlier paths first, then shallower).
    Rows with fewer nodes are padded.  One tensor made from host lists."""
    per_row: List[List[Tuple[int, int]]] = []  # (token, parent slot)
    for paths in rows:
        trie: Dict[Tuple[int, ...], float] = {}
        first: Dict[Tuple[int, ...], int] = {}
        for rank, (tokens, score) in enumerate(paths):
            for d in range(1, len(tokens) + 1):
                prefix = tuple(tokens[:d])
                if trie.get(prefix, -1.0) < score:
                    trie[prefix] = score
                first.setdefault(prefix, rank)
        best = sorted(trie, key=lambda p: (-trie[p], first[p], len(p)))[:nodes]
        best.sort(key=lambda p: (len(p), first[p]))  # parents before children
        slot = {(): 0}
        row = []
        for p in best:
            if p[:-1] not in slot:  # its parent was cut (equal scores): drop it
                continue
            slot[p] = len(row) + 1
            row.append((p[-1], slot[p[:-1]]))
        per_row.append(row)
    return DraftTree.from_lists(per_row, pad, like)


def tree_paths(tree: DraftTree, pad: int) -> List[List[Tuple[List[int], float]]]:
    """Per row, every node of ``tree`` as ``(tokens of its root path, the
    probability of that path under the drafter's log-probs)``, in slot order
    (parents first), pad nodes left out: what :func:`tree_from_paths` merges
    with other drafters' paths.  One host read of the tree."""
    tokens = tree.tokens.tolist()
    parents = tree.parents.tolist()
    lprobs = tree.lprobs.tolist() if tree.lprobs is not None else None
    rows = []
    for r, row in enumerate(tokens):
        seqs: Dict[int, Tuple[List[int], float]] = {0: ([], 0.0)}
        out = []
        for i, token in enumerate(row, start=1):
            parent = seqs.get(parents[r][i])
            if token == pad or parent is None:
                continue
            score = parent[1] + (lprobs[r][i - 1] if lprobs is not None else 0.0)
            seqs[i] = (parent[0] + [token], score)
            out.append((seqs[i][0], math.exp(score)))
        rows.append(out)
    return rows
