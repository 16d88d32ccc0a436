"""Row-blocked float32 products for few-row passes (the C++ extension
``fairseq_specdec._rowgemm``) and the packed weight layout they read.

A BLAS picks its kernel by shape, and on the CPUs measured here a product of
4 rows against a large weight costs 2-5x one of 1 row although reading the
weight dominates both (docs/verify-kernels.md).  The extension streams each
weight once for all rows: :class:`PackedLinear` packs an ``nn.Linear``'s
weight once into panels of 8 columns, and a call sweeps them with 4 rows x 24
columns of accumulators in AVX2 registers.

**Arithmetic.** Each output element is the in-order float32 sum over the
input features of ``x[i, k] * W[n, k]`` (fused multiply-adds from 0), plus
the bias, then the optional ReLU.  A row's result depends on neither the
number of rows in the call nor the other rows; it is not bitwise a BLAS
result, so a greedy choice whose top two log-probs tie within rounding can
differ from ``fairseq-generate --beam 1`` (measured in docs/verify-kernels.md).

The extension is built at install (``setup.py``) and is optional:
:func:`unavailable_reason` says why it cannot be used, and callers fall back
to torch's products.
"""
from typing import Optional

import torch
from torch import Tensor

try:
    from .. import _rowgemm as _ext
except ImportError as error:  # not built: see setup.py
    _ext = None
    _IMPORT_ERROR: Optional[str] = str(error)
else:
    _IMPORT_ERROR = None

#: fused activations of :meth:`PackedLinear.__call__`
ACTIVATIONS = {None: 0, "relu": 1}


def unavailable_reason() -> Optional[str]:
    """Why the kernel cannot run on this machine (None: it can)."""
    if _ext is None:
        return f"the C++ extension fairseq_specdec._rowgemm is not built ({_IMPORT_ERROR}); reinstall the plugin with a C++ compiler"
    if not _ext.supported():
        return "this CPU has no AVX2/FMA instructions"
    return None


def applies_to(weight: Tensor) -> bool:
    """Whether :class:`PackedLinear` can compute with ``weight``: a float32
    CPU tensor, and a machine that runs the kernel."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and unavailable_reason() is None


class PackedLinear:
    """``F.linear(x, weight, bias)`` (then ``activation``) through the
    row-blocked kernel, with ``weight`` packed once at construction.

    A snapshot: it does not see later changes to ``weight`` (its owner
    rebuilds it when the weights change).  Inputs of any leading shape;
    float32 on the CPU only.
    """

    def __init__(self, weight: Tensor, bias: Optional[Tensor] = None, activation: Optional[str] = None):
        reason = unavailable_reason()
        if reason is not None:
            raise RuntimeError(reason)
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(a for a in ACTIVATIONS if a)} or None, got {activation!r}")
        weight = weight.detach()
        self.out_features, self.in_features = weight.shape
        self.packed = _ext.pack(weight.float().contiguous())
        self.bias = _ext.pack_bias(bias.detach().float().contiguous()) if bias is not None else None
        self.activation = ACTIVATIONS[activation]

    def __call__(self, x: Tensor) -> Tensor:
        return _ext.linear(x, self.packed, self.out_features, self.bias, self.activation)
