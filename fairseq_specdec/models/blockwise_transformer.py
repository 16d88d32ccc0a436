"""Blockwise parallel decoding (Stern et al. 2018): a Transformer
whose decoder output feeds k-1 extra heads that predict the tokens 2..k
positions ahead.

The base model is an ordinary fairseq ``transformer`` (same parameter names),
so the model decodes with fairseq's own ``--beam 1`` unchanged and verifies
its own drafts in ``--decoding blockwise``.  Head i (1 <= i < k) maps the
decoder state h to ``h + W2_i relu(W1_i h)`` (hidden size d per head, k x d
over all heads counting the base) and then through the shared output
projection.
"""
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from fairseq.dataclass.utils import gen_parser_from_dataclass
from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer import TransformerConfig, TransformerModel
from fairseq.models.transformer.transformer_base import TransformerModelBase
from fairseq.models.transformer.transformer_legacy import base_architecture

from ..utils.projection import TransposedProjection
from .protocol import BlockwiseHeadsModel


@dataclass
class BlockwiseTransformerConfig(TransformerConfig):
    blockwise_k: int = field(
        default=4,
        metadata={"help": "tokens predicted per position: the base prediction plus k-1 heads"},
    )
    blockwise_shortlist: int = field(
        default=2000,
        metadata={
            "help": "decoding: the heads draft over the N most frequent types (dictionary order) plus "
            "the batch's source tokens (joined dictionaries) instead of the whole vocabulary (0: all types)"
        },
    )


class BlockwiseHeads(nn.Module):
    """k-1 residual feed-forward heads over the decoder state."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.fc1 = nn.Parameter(torch.empty(num_heads, dim, dim))
        self.b1 = nn.Parameter(torch.zeros(num_heads, dim))
        self.fc2 = nn.Parameter(torch.empty(num_heads, dim, dim))
        self.b2 = nn.Parameter(torch.zeros(num_heads, dim))
        nn.init.xavier_uniform_(self.fc1)
        nn.init.zeros_(self.fc2)  # every head starts as the base prediction

    def forward(self, features: Tensor) -> Tensor:
        """(..., C) -> (..., num_heads, C)."""
        hidden = F.relu(torch.einsum("...c,hcd->...hd", features, self.fc1) + self.b1)
        return features.unsqueeze(-2) + torch.einsum("...hd,hdc->...hc", hidden, self.fc2) + self.b2


@register_model("blockwise_transformer")
class BlockwiseTransformerModel(TransformerModel, BlockwiseHeadsModel):
    """A fairseq ``transformer`` plus the heads; see the module docstring."""

    @classmethod
    def add_args(cls, parser):
        gen_parser_from_dataclass(parser, BlockwiseTransformerConfig(), delete_default=True, with_prefix="")

    @classmethod
    def build_model(cls, args, task):
        blockwise_base(args)
        if args.blockwise_k < 2:
            raise ValueError(f"--blockwise-k must be >= 2, got {args.blockwise_k}")
        model = super().build_model(args, task)
        if args.blockwise_shortlist < 0:
            raise ValueError(f"--blockwise-shortlist must be >= 0 (0: all types), got {args.blockwise_shortlist}")
        model.heads = BlockwiseHeads(args.decoder_output_dim or args.decoder_embed_dim, args.blockwise_k - 1)
        model.blockwise_shortlist = args.blockwise_shortlist
        model._inference_projection = TransposedProjection()
        return model

    @property
    def blockwise_k(self) -> int:
        return self.heads.num_heads + 1

    def head_logits(self, features: Tensor, frozen_projection: bool = False) -> Tensor:
        """(..., C) decoder states -> (..., k-1, V) logits of the tokens 2..k ahead.

        With ``frozen_projection`` no gradient reaches the shared output
        projection (it is also the base model's, and its embedding when shared)."""
        return self.project_heads(self.heads(features), frozen_projection)

    def project_heads(self, hidden: Tensor, frozen_projection: bool = False, vocab: Optional[Tensor] = None) -> Tensor:
        """Head states (..., C) -> logits through the shared output projection:
        over every type, or over the types ``vocab`` (ids, in that order)."""
        projection = self.decoder.output_projection
        if vocab is not None:
            if not isinstance(projection, torch.nn.Linear):
                raise ValueError("a head shortlist needs a plain linear output projection")
            weight, bias = projection.weight.index_select(0, vocab), projection.bias
            bias = bias.index_select(0, vocab) if bias is not None else None
            if frozen_projection:
                weight, bias = weight.detach(), None if bias is None else bias.detach()
            return F.linear(hidden, weight, bias)
        if not self.training and not torch.is_grad_enabled() and isinstance(projection, torch.nn.Linear):
            return self._inference_projection(hidden, projection.weight, projection.bias)
        if frozen_projection and isinstance(projection, torch.nn.Linear):
            return F.linear(hidden, projection.weight.detach(), None if projection.bias is None else projection.bias.detach())
        return self.decoder.output_layer(hidden)


@register_model_architecture("blockwise_transformer", "blockwise_transformer")
def blockwise_base(args):
    if getattr(args, "blockwise_k", None) is None:
        args.blockwise_k = 4
    if getattr(args, "blockwise_shortlist", None) is None:  # checkpoints saved before the option
        args.blockwise_shortlist = 2000
    base_architecture(args)
