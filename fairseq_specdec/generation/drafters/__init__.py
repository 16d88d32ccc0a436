"""Drafters: what proposes the next k tokens in the speculative loop.

The contract is :mod:`.base` (:class:`Drafter`, and the capabilities a
drafter may declare beside it, such as :class:`PathDrafter`); each drafter
of a model checkpoint has its file; :func:`drafter_for_model`
(:mod:`.factory`) makes the loop's drafter of a drafter checkpoint.  The
drafters that are no model's (``ngram``, the verifier's int8 copy, two
drafters combined) live in their own modules of
:mod:`fairseq_specdec.generation`.
"""
from .base import (  # noqa: F401
    NO_KERNELS, DraftKernels, Drafter, NeverDrafts, PathDrafter, StaticDrafter, TimedParts, TreeDrafter,
    padded_drafts, row_tails,
)
from .blockwise import BlockwiseHeadsDrafter  # noqa: F401
from .factory import drafter_for_model  # noqa: F401
from .nat import NATBlockDrafter, same_encoder  # noqa: F401
from .none import NoDrafter  # noqa: F401
from .shortlist import TREE_CANDIDATES, ShortlistProjection  # noqa: F401
from .source_copy import SourceCopyDrafter  # noqa: F401
from .vsd import VerifierStateDrafter  # noqa: F401
