"""The verifier's encoder at inference with its layers as fused C++ calls.

fairseq's ``TransformerEncoder`` runs each layer as a dozen modules and
``F.multi_head_attention_forward``, whose products go through the BLAS: on a
CPU at batch 1 a sentence of a dozen tokens spends about as long in the
encoder as a sentence's worth of verify passes spend in their layers.
:class:`LeanEncoder` computes the same function: fairseq's own embedding
code (:meth:`forward_embedding`, padded positions zeroed as fairseq does),
then every layer in one call of the extension
(:class:`~fairseq_specdec.kernels.rowgemm.FusedEncoderLayer`), then the final
layer norm, and returns fairseq's encoder output dictionary.  Its products
round as the lean verify pass's do (the row-blocked kernel's summation
order, not the BLAS's), so strict decoding is held to ``--beam 1`` by the
same exactness tests.

Only fairseq's own Transformer encoder is accepted
(:func:`lean_encoder_unsupported_reason` names what is not); anything else
runs through fairseq's modules.
"""
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from fairseq.models.transformer import TransformerEncoderBase
from fairseq.modules.transformer_layer import TransformerEncoderLayerBase

from ..kernels import rowgemm
from ..utils.projection import ModuleParameters, WeightsWatch, cat_linears

#: the encoder methods whose function the lean encoder reproduces: a
#: subclass that overrides one of them computes something else
_FAIRSEQ_METHODS = ("forward", "forward_scriptable", "forward_torchscript", "forward_embedding")


def lean_encoder_unsupported_reason(encoder) -> Optional[str]:
    """Why :class:`LeanEncoder` cannot compute this encoder's function on
    this machine (None: it can)."""
    reason = rowgemm.unavailable_reason()
    if reason is not None:
        return reason
    if not rowgemm.fused_encoder_layer_available():
        return "the C++ extension has no fused encoder layer (rebuild it: pip install --no-build-isolation -e .)"
    if not isinstance(encoder, TransformerEncoderBase):
        return f"{type(encoder).__name__} is not a fairseq Transformer encoder"
    for name in _FAIRSEQ_METHODS:
        if getattr(type(encoder), name) is not getattr(TransformerEncoderBase, name):
            return f"{type(encoder).__name__} overrides {name}"
    weight = encoder.embed_tokens.weight
    if not rowgemm.applies_to(weight):
        return f"its weights are {weight.dtype} on {weight.device} (the fused layers need float32 on the CPU)"
    for i, layer in enumerate(encoder.layers):
        if type(layer) is not TransformerEncoderLayerBase and type(layer).__name__ != "TransformerEncoderLayer":
            return f"layer {i} is a {type(layer).__name__}"
        if layer.activation_fn is not F.relu:
            return f"layer {i}'s feed-forward is not ReLU"
        if not rowgemm.fusable_norms((layer.self_attn_layer_norm, layer.final_layer_norm)):
            return f"layer {i}'s layer norms are not affine torch LayerNorms with one epsilon"
        attn = layer.self_attn
        if attn.bias_k is not None or attn.add_zero_attn or getattr(attn, "use_xformers", False):
            return f"layer {i} has attention bias_k/add_zero_attn or xformers"
        if not getattr(attn, "self_attention", True) or attn.kdim != attn.embed_dim or attn.vdim != attn.embed_dim:
            return f"layer {i}'s attention is not plain self-attention"
    return None


class LeanEncoder:
    """``encoder.forward_torchscript(net_input)`` at inference, its layers as
    fused C++ calls (see the module docstring).

    The layers' weights are packed at the first call and packed again when
    any of them has changed since (a model trained in between)."""

    def __init__(self, encoder):
        reason = lean_encoder_unsupported_reason(encoder)
        if reason is not None:
            raise ValueError(f"the lean encoder cannot run this encoder: {reason}")
        self.encoder = encoder
        self.layers: List[rowgemm.FusedEncoderLayer] = []
        self._weights = WeightsWatch()
        self._parameters = ModuleParameters(encoder.layers)

    def __call__(self, net_input) -> Dict[str, List[Tensor]]:
        encoder = self.encoder
        if self._weights.changed(self._parameters()):
            self.layers = [_fused_layer(layer) for layer in encoder.layers]
        src_tokens = net_input["src_tokens"]
        padding = src_tokens.eq(encoder.padding_idx)
        has_pads = bool(padding.any())
        x, embedding = encoder.forward_embedding(src_tokens)
        if has_pads:  # fairseq zeroes the padded positions before the layers
            x = x * (1 - padding.unsqueeze(-1).type_as(x))
        x = x.contiguous()
        for layer in self.layers:  # B x S x C
            x = layer(x, padding if has_pads else None)
        x = x.transpose(0, 1).contiguous()  # S x B x C, as fairseq's encoder returns it
        if encoder.layer_norm is not None:
            x = encoder.layer_norm(x)
        src_lengths = src_tokens.ne(encoder.padding_idx).sum(dim=1, dtype=torch.int32).reshape(-1, 1).contiguous()
        return {
            "encoder_out": [x],
            "encoder_padding_mask": [padding],
            "encoder_embedding": [embedding],
            "encoder_states": [],
            "fc_results": [],
            "src_tokens": [],
            "src_lengths": [src_lengths],
        }


def _fused_layer(layer) -> rowgemm.FusedEncoderLayer:
    """An encoder layer's weights packed for the extension's fused layer."""
    sa = layer.self_attn
    return rowgemm.FusedEncoderLayer(
        layer,
        rowgemm.PackedLinear(*cat_linears([sa.q_proj, sa.k_proj, sa.v_proj])),
        rowgemm.PackedLinear(sa.out_proj.weight, sa.out_proj.bias),
        rowgemm.PackedLinear(layer.fc1.weight, layer.fc1.bias, "relu"),
        rowgemm.PackedLinear(layer.fc2.weight, layer.fc2.bias),
    )
