"""Int8 copies of linear layers through torch's quantized CPU library
(fbgemm, or oneDNN where torch's quantized engine is ``onednn``).

A weight is quantized once, symmetrically per output channel (scale =
the row's largest magnitude / 127); the activations are quantized at run
time, per call, by the library's dynamic linear (``quantized::linear_dynamic``),
which also adds the float32 bias and returns float32.  ``reduce_range``
(7-bit activations) is always on: without it the AVX2 kernels' 16-bit
intermediate sums can saturate.

The copy computes an approximation of the float32 layer: it serves the
self-drafting decoding (:mod:`fairseq_specdec.generation.self_draft`),
whose drafts the float32 verifier checks, never an output.
"""
import warnings
from typing import Optional

import torch
from torch import Tensor

#: the quantized engines whose dynamic linear runs on an x86 CPU
_ENGINES = ("x86", "fbgemm", "onednn")


def int8_unavailable_reason() -> Optional[str]:
    """Why torch's int8 dynamic linear cannot run here (None: it can)."""
    engines = torch.backends.quantized.supported_engines
    if not any(e in engines for e in _ENGINES):
        return f"this torch build has no x86 quantized engine (it has {', '.join(engines) or 'none'})"
    if not hasattr(torch.ops.quantized, "linear_dynamic"):
        return "this torch build has no quantized::linear_dynamic"
    return None


def quantize_rows(weight: Tensor) -> Tensor:
    """``weight`` (out x in, float) as int8 per output channel (scale: the
    row's largest magnitude / 127): the quantized tensor torch's packing
    takes."""
    w = weight.detach().float().cpu()
    scales = (w.abs().amax(dim=1) / 127.0).clamp_(min=1e-12)
    zeros = torch.zeros(w.size(0), dtype=torch.long)
    with warnings.catch_warnings():  # torch marks its quantized tensor constructors deprecated
        warnings.simplefilter("ignore")
        return torch.quantize_per_channel(w, scales.double(), zeros, 0, torch.qint8)


class Int8Linear:
    """``x -> F.linear(x, weight, bias)`` (then ReLU if ``relu``) with the
    weight in int8 per output channel and the activations quantized per call:
    one call of torch's quantized library, packed once."""

    def __init__(self, weight: Tensor, bias: Optional[Tensor] = None, relu: bool = False):
        q = quantize_rows(weight)
        b = bias.detach().float().cpu().contiguous() if bias is not None else None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.packed = torch.ops.quantized.linear_prepack(q, b)
        self.op = torch.ops.quantized.linear_relu_dynamic if relu else torch.ops.quantized.linear_dynamic
        self.out_features, self.in_features = weight.shape

    def __call__(self, x: Tensor) -> Tensor:
        return self.op(x, self.packed, True)
