"""The ``specdec_vsd`` drafting pass through the plugin's kernels.

:meth:`SpecDecVSDModel.block_states <fairseq_specdec.models.specdec_vsd.SpecDecVSDModel.block_states>`
is the model's function in torch's operations (training, the reference
backend, devices the kernels do not run on).  :class:`NativeBlockPass`
computes the same function at decoding on a CPU with the kernels: the input
rows (context row and slot rows) in one call, each block layer in one call,
the weights packed once in ``precision`` (float32, or bfloat16 panels: half
the bytes streamed per pass).  It rounds differently from torch's
operations, which changes drafts at most, never a strict output.
"""
import math
from typing import Optional

import torch
from torch import Tensor

from ...kernels import rowgemm
from ...kernels.packing import packed_linear
from ...utils.projection import DerivedWeight


def native_block_pass_reason(model) -> Optional[str]:
    """Why :class:`NativeBlockPass` cannot compute ``model``'s pass (None: it can)."""
    reason = rowgemm.unavailable_reason()
    if reason is not None:
        return reason
    if not rowgemm.applies_to(model.fuse.weight):
        return f"the drafter's weights are {model.fuse.weight.dtype} on {model.fuse.weight.device}"
    if not (rowgemm.block_input_available() and rowgemm.fused_layer_available()):
        return "the C++ extension was built without the block layer calls; reinstall the plugin"
    for layer in model.layers:
        if not rowgemm.fusable_norms((layer.ln_self, layer.ln_cross, layer.ln_ffn)):
            return "its layer norms are not affine nn.LayerNorm with one epsilon"
    return None


class NativeBlockPass:
    """:meth:`block_states` computes ``model.block_states(memory, ctx_states, ctx_tokens, cuts, None, k)``
    at decoding (every slot masked, ``memory`` with ``copy_base``) through
    the kernels; its layouts are derived at the first pass of an inference
    scope and rebuilt when a weight changes."""

    def __init__(self, model, precision: str = "float32"):
        self.model = model
        self.precision = precision
        self._layers = DerivedWeight(lambda *weights: [self._layer_args(layer) for layer in model.layers])

    def _layer_args(self, layer) -> tuple:
        modules = (layer.self_qkv, layer.self_out, layer.cross_q, layer.cross_out, layer.fc1, layer.fc2)
        linears = [packed_linear(m, self.precision) for m in modules]
        norms = [(n.weight.detach(), n.bias.detach()) for n in (layer.ln_self, layer.ln_cross, layer.ln_ffn)]
        return rowgemm.packed_pairs(linears), norms, float(layer.ln_self.eps), layer.heads

    def block_states(self, memory, ctx_states: Tensor, ctx_tokens: Tensor, cuts: Tensor, k: int) -> Tensor:
        model = self.model
        x = rowgemm.block_input(ctx_states.float(), ctx_tokens, model.embed_weight, float(model.embed_scale),
                                packed_linear(model.fuse, self.precision), memory["copy_base"], cuts,
                                model.offsets.weight, k)
        layers = self._layers.get_with(model.layers.parameters)
        n, _, c = x.shape
        mask = memory["mask"]
        pad = ~mask.reshape(n, -1) if mask is not None else None
        for (weights, norms, eps, heads), layer_memory in zip(layers, memory["layers"]):
            d = c // heads
            cross = tuple(t.reshape(n * heads, -1, d) for t in layer_memory)
            scale = 1.0 / math.sqrt(d)  # scaled_dot_product_attention's default
            x = rowgemm.fused_layer(x, weights, norms, eps, heads, scale, heads, scale, True, cross, pad)
        return model.final_ln(x[:, 1:])
