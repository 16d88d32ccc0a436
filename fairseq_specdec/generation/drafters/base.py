"""The drafter contract: what proposes the next k tokens in the speculative loop.

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

Drafters read the state; they never write it.  What a drafter can do
beyond the contract it declares by deriving from a capability's abstract
base as well, never by an attribute the loop probes:

* :class:`TreeDrafter`: ``propose_tree(state, k, nodes) -> DraftTree``, at
  most ``nodes`` nodes at most ``k`` deep
  (:mod:`~fairseq_specdec.generation.tree`); the loop calls it instead of
  ``propose`` where ``--draft-tree`` asks for trees (``trees_only``: it has
  no chains);
* :class:`PathDrafter`: per row, candidate paths with confidences (what
  :class:`~fairseq_specdec.generation.combined.CombinedDrafter` merges);
* :class:`StaticDrafter`: it can run inside a captured CUDA graph of a
  whole iteration: ``static_inputs() -> bool`` switches it, for good, to
  buffers whose shapes and addresses stay fixed between the iterations of a
  batch of one sentence (and between batches whose source falls in the same
  bucket), and ``static_key()`` names what the current batch's buffers are,
  so that the loop captures one graph per key
  (:mod:`~fairseq_specdec.generation.iteration_graphs`).  Its ``propose``
  then reads only those buffers and the state's ``last_tokens()`` and
  ``lengths``, and reads nothing back to the host;
* :class:`NeverDrafts`: it proposes nothing, ever (greedy decoding
  through the loop): the loop does not ask it, and an iteration may run
  several greedy steps (:mod:`~fairseq_specdec.generation.screened_greedy`);
* :class:`TimedParts`: ``timed_parts(k)``, the calls the profiler
  (``scripts/profile-draft-verify.py``) times for it, its inner passes
  included; for a drafter without it the profiler times the contract's
  calls.

A drafter checkpoint (a
:class:`~fairseq_specdec.models.protocol.DrafterModel`) becomes a drafter
through :func:`drafter_for_model`.
"""
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Iterator, List, Optional, Tuple

import torch
from torch import Tensor


@dataclass(frozen=True)
class DraftKernels:
    """What drafters may compute with the plugin's kernels: the backend
    (:mod:`~fairseq_specdec.generation.backend`) decides, once per generator.
    ``products``: packed row-blocked products where a weight allows them;
    ``precision``: the element type of those packings (float32, bfloat16);
    ``pick``: a shortlist projection's best type in one call; ``block``: the
    ``specdec_vsd`` pass through :class:`NativeBlockPass`; ``steps``: the
    self-drafter's steps in one call (``LeanVerifier.draft_steps``)."""

    products: bool = False
    precision: str = "float32"
    pick: bool = False
    block: bool = False
    steps: bool = False


#: torch's operations only (the reference backend, devices the kernels do not run on)
NO_KERNELS = DraftKernels()


class Drafter(ABC):
    """The drafter contract (see the module docstring): what the loop, the
    generator's builder and the benchmark call on every drafter.  The four
    calls of the loop and ``describe`` are declared here; a drafter must
    give ``start_batch``, ``propose``, ``reorder`` and ``describe``, and may
    override the rest."""

    #: largest prefix + block length the drafter accepts (None: unlimited)
    max_positions: Optional[int] = None
    #: most tokens one pass can draft (None: any); a larger --block-size is
    #: refused when the generator is built
    max_block: Optional[int] = None

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

    def update(self, state, feedback) -> None:
        """Called after every verification pass (see the module docstring)."""

    @abstractmethod
    def reorder(self, order: Tensor, order_host: List[int]) -> None:
        """Keep only the rows ``order`` (a device tensor, and as host ints)."""


class TreeDrafter(ABC):
    """A capability a drafter declares beside :class:`Drafter`: draft trees
    (``--draft-tree``)."""

    #: whether it drafts trees only (its ``propose`` is not available)
    trees_only: bool = False

    @abstractmethod
    def propose_tree(self, state, k: int, nodes: int):
        """A :class:`~fairseq_specdec.generation.tree.DraftTree` of at most
        ``nodes`` nodes, at most ``k`` deep, per row."""


class StaticDrafter(ABC):
    """A capability a drafter declares beside :class:`Drafter`: its
    ``propose`` can run on fixed buffers inside a captured whole iteration
    (see the module docstring)."""

    @abstractmethod
    def static_inputs(self) -> bool:
        """Switch to fixed buffers so that ``propose`` can be captured in a
        CUDA graph; False: this drafter cannot now (for example, native
        kernels that read host values)."""

    @abstractmethod
    def static_key(self) -> tuple:
        """What the current batch's fixed buffers are (their buckets)."""


class PathDrafter(ABC):
    """A capability a drafter declares beside :class:`Drafter`: candidate
    paths with confidences, per row, rather than a tree (what
    :class:`~fairseq_specdec.generation.combined.CombinedDrafter` merges
    with another drafter's candidates)."""

    @abstractmethod
    def tree_paths(self, state, k: int, nodes: int) -> List[List[Tuple[List[int], float]]]:
        """Per row, ``(tokens, confidence)`` paths at most ``k`` deep, at
        most ``nodes`` of them, the most confident first: the confidence is
        the drafter's estimate that the verifier accepts the whole path."""


class NeverDrafts(ABC):
    """A capability a drafter declares beside :class:`Drafter`: it never
    proposes a token, so the loop never calls its ``propose``, and an
    iteration may append several greedy tokens a row (a run of screened
    steps, :mod:`~fairseq_specdec.generation.screened_greedy`); its
    ``update`` then hears all of them at once (``Feedback.n_new``)."""


class TimedParts(ABC):
    """A capability a drafter declares beside :class:`Drafter`: it names
    the calls the profiler (``scripts/profile-draft-verify.py``) times for
    it, its inner passes included.  A drafter without it is profiled by the
    contract's calls (its start of batch, its pass, its feedback)."""

    @abstractmethod
    def timed_parts(self, k: int) -> Iterator[tuple]:
        """``(object, method name, label[, required])`` of the calls to
        time, for drafts of up to ``k`` tokens; a label starting "of which: "
        is a part of the rows above it; ``required`` False: a call the
        decoding may never make.  Every call a draft makes is one: the draft
        policy may give no row a draft in a whole run (at batch 32 on a CPU,
        where drafting was measured not to pay), so only the start of a
        batch and the feedback may be required."""


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
