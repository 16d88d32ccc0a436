"""Speculative decoding for fairseq: one loop, pluggable drafters and acceptance rules."""
from .acceptance import StrictAcceptance, TopBetaAcceptance, build_acceptance  # noqa: F401
from .drafters import BlockwiseHeadsDrafter, Drafter, NATBlockDrafter, SourceCopyDrafter  # noqa: F401
from .speculative import SpeculativeGenerator  # noqa: F401
from .stats import SpecDecStats  # noqa: F401
from .verifier import CachedVerifier  # noqa: F401
