"""What the rest of the package may ask of a model: the capability protocol.

The task, the criteria, the generation layer and the benchmark never probe a
model's attributes; they test ``isinstance`` against one of these classes and
use what it declares.  A model states a capability by subclassing the class
(as the plugin's models do) and providing its members: every method declared
here (each raises ``NotImplementedError`` until a model gives it) and every
attribute annotated here (set by the model's constructor).
:func:`declared_members` lists them; a test checks each of the plugin's
models against it.

* :class:`DrafterModel`: a model that drafts blocks of tokens for a verifier;
  the ``draft_verify`` task trains it on block inputs (``glat_block``), and a
  drafter checkpoint in ``--path`` or ``--drafter-path`` is one of these.
  Two kinds, and the generation layer has one drafter for each:

  * :class:`SourceReadingDrafterModel` (``specdec_nat``): an encoder of its
    own and a block decoder over ``prefix + k`` mask slots;
  * :class:`VerifierStateDrafterModel` (``specdec_vsd``): reads the
    verifier's encoder output and final decoder states, so its training
    needs the frozen verifier.

* :class:`BlockwiseHeadsModel` (``blockwise_transformer``): a verifier with
  extra heads that draft for its own verification.

This module imports nothing of the package: models subclass it, the layers
above read it.
"""
from typing import Any, ClassVar, Dict, List, Optional, Tuple

from torch import Tensor


def declared_members(protocol: type) -> Tuple[List[str], List[str]]:
    """``(attributes, methods)`` a model of ``protocol`` must provide: the
    annotated attributes (``ClassVar`` ones excepted) and the methods
    declared by ``protocol`` and the protocol classes it extends."""
    attributes, methods = [], []
    for cls in reversed(protocol.__mro__):
        if cls is object or cls.__module__ != __name__:
            continue
        for name, hint in vars(cls).get("__annotations__", {}).items():
            if "ClassVar" not in str(hint) and name not in attributes:
                attributes.append(name)
        for name, value in vars(cls).items():
            if callable(value) and not name.startswith("__") and name not in methods:
                methods.append(name)
            elif isinstance(value, (staticmethod, property)) and name not in methods:
                methods.append(name)
    return attributes, methods


class DrafterModel:
    """A block drafter model."""

    #: the model's name in messages
    drafter_name: ClassVar[str] = "drafter"
    #: 0-d long buffer, saved: the block size it was trained with (the task
    #: fills it in when it builds the model)
    train_block_size: Tensor
    #: 0-d long buffer, saved: its target dictionary's
    #: :func:`~fairseq_specdec.utils.dictionary.dictionary_fingerprint`
    dictionary_fingerprint: Tensor
    #: the mask symbol's index, one past the dictionary
    mask_idx: int


class SourceReadingDrafterModel(DrafterModel):
    """A drafter with its own encoder (``specdec_nat``).
    ``--init-from-verifier`` copies a verifier checkpoint's encoder and
    embeddings into it (:mod:`fairseq_specdec.models.init_from_verifier`)."""

    drafter_name = "specdec_nat"
    #: fairseq encoder (``forward_torchscript``, ``reorder_encoder_out``)
    encoder: Any
    #: its block decoder (``max_positions()``)
    decoder: Any

    def max_source_length(self) -> int:
        """The longest source (tokens) its encoder reads."""
        raise NotImplementedError

    def freeze_encoder(self) -> None:
        """Train its decoder only."""
        raise NotImplementedError

    def draft(self, encoder_out, prefix_tokens: Tensor, prefix_lengths: Tensor, k: int, with_scores: bool,
              active: Optional[Tensor] = None) -> Tuple[Tensor, Optional[Tensor]]:
        """B x k drafts after each row's prefix and their log-probs (or None)."""
        raise NotImplementedError


class VerifierStateDrafterModel(DrafterModel):
    """A drafter that reads its verifier's states (``specdec_vsd``); the
    generation layer's drafter computes its pass natively where the backend
    allows (``fairseq_specdec.generation.drafters.vsd_native``)."""

    drafter_name = "specdec_vsd"
    #: its dataclass config (``shortlist``, ``cuts_per_sentence``)
    cfg: Any
    dictionary: Any
    num_types: int
    padding_idx: int
    #: the learned start state (C), the context of a batch's first pass
    start_state: Tensor
    #: its frozen copy of the verifier's output projection (V x C)
    output_weight: Tensor
    #: the position embedding (its ``num_embeddings`` bounds the slot-row table)
    positions: Any
    #: the slot-offset embedding (its ``num_embeddings``: the largest block)
    offsets: Any

    def init_from_verifier(self, verifier) -> None:
        """Copy what it shares with the verifier."""
        raise NotImplementedError

    def check_verifier(self, verifier, source: str) -> None:
        """Refuse another verifier, naming ``source``."""
        raise NotImplementedError

    @staticmethod
    def verifier_states(verifier, src_tokens: Tensor, src_lengths: Tensor, prev_output_tokens: Tensor):
        """``(encoder_out, features)``: the teacher-forced states it trains on."""
        raise NotImplementedError

    def source_memory(self, encoder_out, positions: int = 0) -> Dict[str, object]:
        """Per-sentence tensors every drafting pass reads."""
        raise NotImplementedError

    def position_table(self, memory, positions: int) -> Tensor:
        """The slot-row table for ``positions`` target positions."""
        raise NotImplementedError

    @staticmethod
    def select_memory(memory, index: Tensor) -> Dict[str, object]:
        """:meth:`source_memory` of the rows ``index``."""
        raise NotImplementedError

    def block_states(self, memory, ctx_states: Tensor, ctx_tokens: Tensor, cuts: Tensor,
                     slot_tokens: Optional[Tensor], k: int) -> Tensor:
        """N x k x C states of the block slots."""
        raise NotImplementedError


class BlockwiseHeadsModel:
    """A verifier with blockwise heads (``blockwise_transformer``; Stern et
    al. 2018).  ``--init-from-verifier`` copies a whole verifier into its
    base model."""

    #: the heads (``fc1``, ``b1``, ``fc2``, ``b2``)
    heads: Any
    #: the heads' shortlist size at decoding (0: every type)
    blockwise_shortlist: int
    #: the decoder (its ``output_projection`` and ``dictionary``)
    decoder: Any

    @property
    def blockwise_k(self) -> int:
        """Tokens per position, the base prediction included."""
        raise NotImplementedError

    def head_logits(self, features: Tensor, frozen_projection: bool = False) -> Tensor:
        """The heads' logits from the decoder's features."""
        raise NotImplementedError

