"""Speculative decoding for fairseq: one loop, pluggable drafters and acceptance rules."""
from .acceptance import StrictAcceptance, TopBetaAcceptance, build_acceptance  # noqa: F401
from .drafters import (  # noqa: F401
    BlockwiseHeadsDrafter, Drafter, NATBlockDrafter, NoDrafter, SourceCopyDrafter, VerifierStateDrafter, drafter_for_model,
)
from .registry import DECODINGS, Decoding, register_decoding  # noqa: F401
from .draft_policy import AllRows, DraftLengthPolicy, FixedRows, MeasuredRows, RowsRule  # noqa: F401
from .speculative import DecodeSettings, SpeculativeGenerator  # noqa: F401
from .state import DecodingState, Feedback  # noqa: F401
from .stats import SentenceCounter, SpecDecStats  # noqa: F401
from .verifier import CachedVerifier  # noqa: F401
from .verify_pass import VerifyPass  # noqa: F401
from .backend import Backend, resolve_backend  # noqa: F401
from .options import BACKENDS, SpeculativeOptions  # noqa: F401
