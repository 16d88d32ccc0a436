"""Spec-Drafter (``specdec_nat``): a non-autoregressive block drafter.

A Transformer encoder-decoder whose decoder reads ``prefix + k mask slots`` and
predicts the k block tokens in parallel (Xia et al. 2023, section 3.1):

* the encoder is fairseq's own ``TransformerEncoderBase``, so a verifier's
  encoder and embeddings copy into it tensor for tensor
  (``fairseq-train --task draft_verify --init-from-verifier VERIFIER.pt``,
  :mod:`fairseq_specdec.models.init_from_verifier`);
* the decoder has bidirectional self-attention (key padding mask only),
  learned positions, and a GLAT soft copy of the source embeddings into the
  mask slots;
* only the k block rows are projected to the vocabulary.

Dictionary compatibility: the drafter uses the verifier's dictionary files
unchanged.  The mask symbol is one extra embedding row, index
``len(dictionary)`` (:func:`mask_index`), that no dictionary file contains, so
every real token (``<unk>`` included) has the same id in drafter and
verifier, and the mask can never be predicted: the output projection covers
only the ``len(dictionary)`` real types.

Positions: the decoder's learned position table has ``--max-target-positions``
rows, and the soft copy looks up the *source* positions in it too.  A row
whose source is longer than :meth:`SpecDecNATModel.max_source_length`, or
whose prefix plus block is longer than the table, is never drafted (its
draft is pad: the loop takes a greedy step for it) instead of indexing past
the table.
"""
import logging
import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from fairseq.dataclass.utils import gen_parser_from_dataclass
from fairseq.models import FairseqDecoder, register_model, register_model_architecture
from fairseq.models.transformer import TransformerConfig, TransformerModel
from fairseq.models.transformer.transformer_base import TransformerModelBase
from fairseq.models.transformer.transformer_base import Embedding
from fairseq.modules import FairseqDropout, LayerNorm, PositionalEmbedding
from fairseq.modules.transformer_layer import TransformerDecoderLayerBase

from ..utils.dictionary import check_same_dictionary, dictionary_fingerprint, mask_index
from ..utils.encoder_out import encoder_states, source_padding
from ..utils.projection import TransposedProjection
from .protocol import SourceReadingDrafterModel

logger = logging.getLogger(__name__)


@dataclass
class SpecDecNATConfig(TransformerConfig):
    src_embedding_copy: bool = field(
        default=True,
        metadata={
            "help": "fill the mask slots of the drafter decoder with a soft copy "
            "of the source embeddings (GLAT) instead of the mask embedding"
        },
    )


@register_model("specdec_nat")
class SpecDecNATModel(TransformerModel, SourceReadingDrafterModel):
    """Encoder + bidirectional block decoder; see the module docstring."""

    @classmethod
    def add_args(cls, parser):
        gen_parser_from_dataclass(
            parser, SpecDecNATConfig(), delete_default=True, with_prefix=""
        )

    @classmethod
    def build_model(cls, args, task):
        specdec_nat_base(args)
        if args.share_all_embeddings and task.source_dictionary != task.target_dictionary:
            raise ValueError("--share-all-embeddings requires a joined dictionary")
        if args.share_all_embeddings:
            args.share_decoder_input_output_embed = True
        cfg = SpecDecNATConfig.from_namespace(args)
        return TransformerModelBase.build_model.__func__(cls, cfg, task)

    @classmethod
    def build_embedding(cls, cfg, dictionary, embed_dim, path=None):
        # one extra row: the mask symbol (mask_index(dictionary))
        return Embedding(len(dictionary) + 1, embed_dim, dictionary.pad())

    @classmethod
    def build_decoder(cls, cfg, tgt_dict, embed_tokens):
        return SpecDecNATDecoder(cfg, tgt_dict, embed_tokens)

    def __init__(self, args, encoder, decoder):
        super().__init__(args, encoder, decoder)
        self.num_updates = 0
        # Saved with the weights so a decoder can check them: the block size the
        # drafter was trained with, and the fingerprint of its target dictionary.
        self.register_buffer("train_block_size", torch.tensor(0, dtype=torch.long))
        self.register_buffer(
            "dictionary_fingerprint",
            torch.tensor(dictionary_fingerprint(decoder.dictionary), dtype=torch.long),
        )

    def set_num_updates(self, num_updates):
        super().set_num_updates(num_updates)
        self.num_updates = num_updates

    def load_state_dict(self, state_dict, strict=True, model_cfg=None, args=None):
        """Refuse weights trained with another dictionary before any size
        mismatch can hide the reason."""
        saved = state_dict.get("dictionary_fingerprint")
        if saved is not None:
            check_same_dictionary(saved, self.dictionary_fingerprint, "this specdec_nat checkpoint")
        return super().load_state_dict(state_dict, strict=strict, model_cfg=model_cfg, args=args)

    @property
    def mask_idx(self) -> int:
        return self.decoder.mask_idx

    #: see :meth:`freeze_encoder`
    encoder_frozen = False

    def freeze_encoder(self) -> None:
        """Train the decoder only: the encoder (embeddings included) gets no
        gradient and runs in eval mode, exactly as at decoding time.  A drafter
        whose encoder is a frozen copy of its verifier's can reuse the
        verifier's encoder output: one encoder pass per sentence, not two."""
        self.encoder_frozen = True
        for param in self.encoder.parameters():
            param.requires_grad_(False)
        self.encoder.eval()

    def train(self, mode: bool = True):
        super().train(mode)
        if self.encoder_frozen:
            self.encoder.eval()
        return self

    def forward(
        self, src_tokens, src_lengths, prev_output_tokens, block_mask=None, glance=None, **kwargs
    ):
        """Logits of the slots selected by ``block_mask`` (B x T bool), shaped
        ``(block_mask.sum(), vocab)``; of every slot (B x T x vocab) without it.

        ``glance`` (training only) is a callable ``glance(logits) ->
        (prev_output_tokens, block_mask)``: it receives the logits of a first
        decoder pass run without gradient and returns the glanced inputs and the
        slots to predict in the second pass.  The encoder runs once either way.
        Returns ``(logits, extra)``.
        """
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.encoder_frozen):
            encoder_out = self.encoder(src_tokens, src_lengths=src_lengths)
        if glance is not None:
            with torch.no_grad():
                first, _ = self.decoder(prev_output_tokens, encoder_out, block_mask=block_mask)
            prev_output_tokens, block_mask = glance(first)
        return self.decoder(prev_output_tokens, encoder_out, block_mask=block_mask)

    def max_source_length(self) -> int:
        """Longest source (EOS included) this drafter reads: its encoder's
        ``--max-source-positions`` and, with the soft copy, its decoder's
        position table (``--max-target-positions``), which the copy indexes
        with source positions."""
        limit = self.encoder.max_positions()
        if self.decoder.src_embedding_copy:
            limit = min(limit, self.decoder.max_positions())
        return limit

    @torch.no_grad()
    def draft(
        self,
        encoder_out: Dict[str, List[Tensor]],
        prefix_tokens: Tensor,
        prefix_lengths: Tensor,
        k: int,
        with_scores: bool = True,
        active: Optional[Tensor] = None,
    ) -> Tuple[Tensor, Optional[Tensor]]:
        """Propose the next ``k`` tokens after each row's prefix.

        Args:
            encoder_out: ``self.encoder`` output for the batch (computed once
                per sentence; reorder it with ``encoder.reorder_encoder_out``
                when rows leave the batch).
            prefix_tokens: B x P accepted target tokens, right-padded, no BOS.
            prefix_lengths: B true prefix lengths (may differ per row, may be 0).
            k: block size.
            with_scores: also return the drafter's log-probabilities (only
                ``--verify-score drafter`` needs them).
            active: B bool, the rows to draft (None: every row).  Rows that
                are not active, and rows whose source (read from
                ``encoder_out``) or prefix plus ``k`` does not fit the
                drafter's positions, get pad (log-prob -inf): no draft.

        Returns:
            ``(tokens, log_probs)``, both B x k: the argmax token of each block
            slot (never pad, BOS or the mask; pad for the rows not drafted)
            and the drafter's log-probability of it (None without ``with_scores``).
        """
        fits = self._fits(encoder_out, prefix_lengths, k)
        if active is not None:
            fits = fits & active
        if not bool(fits.all()):
            return self._draft_rows(fits, encoder_out, prefix_tokens, prefix_lengths, k, with_scores)
        bsz = prefix_tokens.size(0)
        pad = self.decoder.padding_idx
        max_prefix = int(prefix_lengths.max()) if bsz > 0 else 0
        inp = prefix_tokens.new_full((bsz, max_prefix + k), pad)
        width = min(max_prefix, prefix_tokens.size(1))
        inp[:, :width] = prefix_tokens[:, :width]
        slots = prefix_lengths.unsqueeze(1) + torch.arange(k, device=inp.device)
        # a row's prefix ends at its own length: clear anything beyond it
        inp.masked_fill_(torch.arange(inp.size(1), device=inp.device) >= prefix_lengths.unsqueeze(1), pad)
        inp.scatter_(1, slots, self.decoder.mask_idx)
        features = self.decoder.extract_features(inp, encoder_out)
        block = features.gather(1, slots.unsqueeze(-1).expand(-1, -1, features.size(-1)))
        logits = self.decoder.output_layer(block)
        logits[:, :, pad] = -math.inf
        logits[:, :, self.decoder.dictionary.bos()] = -math.inf
        if not with_scores:
            return logits.argmax(dim=-1), None
        lprobs = F.log_softmax(logits.float(), dim=-1)
        log_probs, tokens = lprobs.max(dim=-1)
        return tokens, log_probs

    def _fits(self, encoder_out, prefix_lengths: Tensor, k: int) -> Tensor:
        """B bool: rows whose source and prefix + k fit the drafter's positions."""
        fits = prefix_lengths + k <= self.decoder.max_positions()
        src_lengths = (~source_padding(encoder_out)).long().sum(dim=1)
        return fits & (src_lengths <= self.max_source_length())

    def _draft_rows(self, rows: Tensor, encoder_out, prefix_tokens, prefix_lengths, k: int, with_scores: bool):
        """:meth:`draft` of the ``rows`` (B bool) only; pad elsewhere."""
        tokens = prefix_tokens.new_full((prefix_tokens.size(0), k), self.decoder.padding_idx)
        log_probs = torch.full(tokens.shape, -math.inf, device=tokens.device) if with_scores else None
        index = rows.nonzero().squeeze(1)
        if index.numel() > 0:
            sub_out = self.encoder.reorder_encoder_out(encoder_out, index)
            sub_tokens, sub_log_probs = self.draft(
                sub_out, prefix_tokens.index_select(0, index), prefix_lengths.index_select(0, index), k, with_scores
            )
            tokens[index] = sub_tokens
            if with_scores:
                log_probs[index] = sub_log_probs
        return tokens, log_probs


class SpecDecNATDecoder(FairseqDecoder):
    """Bidirectional decoder over ``prefix + k mask slots``.

    Inputs are right-padded; a slot holding :func:`mask_index` is a block slot
    to predict (glanced slots hold the gold token instead).  Self-attention
    sees every non-pad slot of its row, so no state can be cached between
    drafting rounds.
    """

    def __init__(self, cfg, dictionary, embed_tokens):
        super().__init__(dictionary)
        self.padding_idx = dictionary.pad()
        self.mask_idx = mask_index(dictionary)
        self.num_types = len(dictionary)
        embed_dim = cfg.decoder.embed_dim
        self.embed_tokens = embed_tokens
        self.embed_scale = 1.0 if cfg.no_scale_embedding else math.sqrt(embed_dim)
        self.embed_positions = PositionalEmbedding(
            cfg.max_target_positions, embed_dim, self.padding_idx, learned=True
        )
        self.layernorm_embedding = LayerNorm(embed_dim) if cfg.layernorm_embedding else None
        self.dropout_module = FairseqDropout(cfg.dropout, module_name=self.__class__.__name__)
        self.src_embedding_copy = cfg.src_embedding_copy
        if self.src_embedding_copy:
            self.copy_query = nn.Linear(embed_dim, embed_dim, bias=False)
        self.layers = nn.ModuleList(
            [TransformerDecoderLayerBase(cfg) for _ in range(cfg.decoder.layers)]
        )
        self.layer_norm = LayerNorm(embed_dim) if cfg.decoder.normalize_before else None
        if cfg.share_decoder_input_output_embed:
            self.output_projection = None
        else:
            self.output_projection = nn.Linear(embed_dim, self.num_types, bias=False)
            nn.init.normal_(self.output_projection.weight, mean=0, std=embed_dim ** -0.5)
        self.max_target_positions = cfg.max_target_positions
        self._inference_projection = TransposedProjection()

    def max_positions(self):
        return self.max_target_positions

    def _positions_from_padding(self, padding_mask: Tensor) -> Tensor:
        """Learned position embeddings for a B x S padding mask (left or right pad)."""
        fake = torch.where(padding_mask, self.padding_idx, self.padding_idx + 1)
        return self.embed_positions(fake)

    def soft_copy(self, positions: Tensor, encoder_out) -> Tensor:
        """B x T x C: attention of each decoder position over the source embeddings."""
        src_embed = encoder_out["encoder_embedding"][0]  # B x S x C, scaled tokens
        src_pad = source_padding(encoder_out)
        keys = src_embed + self._positions_from_padding(src_pad)
        query = self.copy_query(positions)
        scores = torch.bmm(query, keys.transpose(1, 2)) / math.sqrt(query.size(-1))
        scores = scores.masked_fill(src_pad.unsqueeze(1), -math.inf)
        return torch.bmm(F.softmax(scores.float(), dim=-1).type_as(src_embed), src_embed)

    def extract_features(self, prev_output_tokens: Tensor, encoder_out) -> Tensor:
        """B x T x C decoder states of every slot."""
        tokens = prev_output_tokens
        padding_mask = tokens.eq(self.padding_idx)
        positions = self.embed_positions(tokens)
        x = self.embed_scale * self.embed_tokens(tokens)
        if self.src_embedding_copy:
            is_mask = tokens.eq(self.mask_idx).unsqueeze(-1)
            x = torch.where(is_mask, self.soft_copy(positions, encoder_out), x)
        x = x + positions
        if self.layernorm_embedding is not None:
            x = self.layernorm_embedding(x)
        x = self.dropout_module(x)
        x = x.transpose(0, 1)
        enc, enc_pad = encoder_states(encoder_out)
        self_pad = padding_mask if padding_mask.any() else None
        for layer in self.layers:
            x, _, _ = layer(x, enc, enc_pad, self_attn_padding_mask=self_pad)
        if self.layer_norm is not None:
            x = self.layer_norm(x)
        return x.transpose(0, 1)

    def output_layer(self, features: Tensor) -> Tensor:
        """Logits over the real types (the mask is excluded)."""
        weight = (
            self.embed_tokens.weight[: self.num_types]
            if self.output_projection is None
            else self.output_projection.weight
        )
        if not self.training:  # inference: the faster CPU layout
            return self._inference_projection(features, weight)
        return F.linear(features, weight)

    def forward(self, prev_output_tokens, encoder_out=None, block_mask=None, **kwargs):
        features = self.extract_features(prev_output_tokens, encoder_out)
        if block_mask is not None:
            features = features[block_mask]
        return self.output_layer(features), {}


def _defaults(args, **values):
    for name, value in values.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)


@register_model_architecture("specdec_nat", "specdec_nat_base")
def specdec_nat_base(args):
    """The Spec-Drafter of Xia et al. 2023: 12-layer encoder, 2-layer decoder, d 512."""
    _defaults(
        args,
        encoder_embed_dim=512,
        encoder_ffn_embed_dim=2048,
        encoder_layers=12,
        encoder_attention_heads=8,
        decoder_layers=2,
        activation_fn="gelu",
        dropout=0.1,
    )
    _defaults(
        args,
        decoder_embed_dim=args.encoder_embed_dim,
        decoder_ffn_embed_dim=args.encoder_ffn_embed_dim,
        decoder_attention_heads=args.encoder_attention_heads,
    )
    if getattr(args, "src_embedding_copy", None) is None:
        args.src_embedding_copy = True
    from fairseq.models.transformer.transformer_legacy import base_architecture

    base_architecture(args)


@register_model_architecture("specdec_nat", "specdec_nat_tiny")
def specdec_nat_tiny(args):
    """For tests: 2-layer encoder, 1-layer decoder, d 64."""
    _defaults(
        args,
        encoder_embed_dim=64,
        encoder_ffn_embed_dim=128,
        encoder_layers=2,
        encoder_attention_heads=2,
        decoder_layers=1,
    )
    specdec_nat_base(args)


@register_model_architecture("specdec_nat", "specdec_nat_multi30k")
def specdec_nat_multi30k(args):
    """CPU-sized drafter for Multi30k: the Multi30k verifier's encoder shape
    (3 layers, d 256, FFN 1024, 4 heads, ReLU) so it copies in exactly, and a
    1-layer decoder."""
    _defaults(
        args,
        encoder_embed_dim=256,
        encoder_ffn_embed_dim=1024,
        encoder_layers=3,
        encoder_attention_heads=4,
        decoder_layers=1,
        activation_fn="relu",
    )
    specdec_nat_base(args)
