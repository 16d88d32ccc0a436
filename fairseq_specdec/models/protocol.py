"""What the rest of the package may ask of a model: the capability protocol.

The task, the criteria, the generation layer and the benchmark never probe a
model's attributes; they test ``isinstance`` against one of these classes and
use what it declares.  A model states a capability by subclassing the class
(as the plugin's models do) and providing its members.

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
from typing import ClassVar


class DrafterModel:
    """A block drafter model.

    Members: ``train_block_size`` (0-d long buffer, saved: the block size it
    was trained with; the task fills it in when it builds the model),
    ``dictionary_fingerprint`` (0-d long buffer, saved: its target
    dictionary's, :func:`~fairseq_specdec.utils.dictionary.dictionary_fingerprint`),
    and ``mask_idx`` (the mask symbol's index, one past the dictionary)."""

    #: the model's name in messages
    drafter_name: ClassVar[str] = "drafter"


class SourceReadingDrafterModel(DrafterModel):
    """A drafter with its own encoder (``specdec_nat``).

    Members: ``encoder`` (fairseq encoder; ``forward_torchscript``,
    ``reorder_encoder_out``), ``decoder.max_positions()``,
    ``max_source_length()``, and ``draft(encoder_out, prefix_tokens,
    prefix_lengths, k, with_scores, active) -> (tokens, log_probs or None)``.
    ``--init-from-verifier`` copies a verifier checkpoint's encoder and
    embeddings into it (:mod:`fairseq_specdec.models.init_from_verifier`);
    ``freeze_encoder()`` trains its decoder only."""

    drafter_name = "specdec_nat"


class VerifierStateDrafterModel(DrafterModel):
    """A drafter that reads its verifier's states (``specdec_vsd``).

    Members: ``init_from_verifier(verifier)`` (copies what it shares with
    the verifier), ``check_verifier(verifier, source)`` (refuses another
    verifier, naming ``source``), ``verifier_states(verifier, src_tokens,
    src_lengths, prev_output_tokens) -> (encoder_out, features)`` (the
    teacher-forced states it trains on), ``source_memory``, ``position_table``
    (its table of slot rows for more positions), ``positions`` (the position
    embedding: its ``num_embeddings`` bounds that table),
    ``select_memory``, ``block_states`` (its last argument, ``precision``:
    the element type of the packed weights where the C++ kernel computes the
    pass), ``start_state``, ``output_weight``,
    ``num_types``, ``padding_idx``, ``dictionary``, ``offsets`` and
    ``cfg.shortlist`` / ``cfg.cuts_per_sentence``."""

    drafter_name = "specdec_vsd"


class BlockwiseHeadsModel:
    """A verifier with blockwise heads (``blockwise_transformer``; Stern et
    al. 2018).

    Members: ``blockwise_k`` (tokens per position, the base prediction
    included), ``heads`` (``fc1``, ``b1``, ``fc2``, ``b2``), ``head_logits``,
    ``blockwise_shortlist`` and ``decoder.output_projection``.
    ``--init-from-verifier`` copies a whole verifier into its base model."""
