"""Inference-time linear layers through derived weight layouts.

On a CPU, ``F.linear(x, W)`` with a few rows ``x`` costs far more than the
same product through a layout of ``W`` made once: a contiguous transpose for
torch's ``addmm``, or the row-blocked kernel's packed panels
(:mod:`fairseq_specdec.utils.rowgemm`).  A speculative iteration runs its
linears over a few rows, so the drafters and the verify pass compute through
such layouts (the measurements are in docs/verify-kernels.md and
docs/results/).  Only the exactness tests are relied on for their values.

**When a cached transpose is trusted.**  Optimizers update parameters through
``p.data`` in place, which changes neither the tensor's storage nor its
version counter, so neither can tell a stale copy.  A copy is therefore
checked against a fingerprint of its weight (storage, version, dtype and 16
sampled values) at its first use in every :func:`inference_scope` (one per
``generate()`` call of the speculative loop) and at every use outside one;
inside a scope the weights are taken to be constant.
"""
from contextlib import contextmanager
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from . import rowgemm

# [depth, epoch]: inside a scope when depth > 0; every entry starts a new epoch
_SCOPE = [0, 0]


@contextmanager
def inference_scope():
    """Weights do not change inside: cached transposes are checked once."""
    _SCOPE[0] += 1
    _SCOPE[1] += 1
    try:
        yield
    finally:
        _SCOPE[0] -= 1


def _sampled_values(weight: Tensor) -> Tensor:
    flat = weight.detach().reshape(-1)
    return flat[:: max(1, flat.numel() // 16)][:16]


def _version(weight: Tensor) -> int:
    """``weight._version``, or -1 for a tensor made under
    ``torch.inference_mode()`` (a model loaded there), which keeps no version
    counter; such a tensor cannot be changed in place outside inference mode,
    and inside it the sampled values still tell most changes."""
    return -1 if weight.is_inference() else weight._version


def weight_fingerprint(weight: Tensor) -> tuple:
    """Storage, version, dtype, device and 16 sampled values of ``weight``."""
    return (weight.data_ptr(), _version(weight), weight.dtype, weight.device, tuple(_sampled_values(weight).tolist()))


def weights_fingerprint(weights) -> tuple:
    """:func:`weight_fingerprint` of several tensors (on one device) with one
    device -> host read of all their sampled values."""
    weights = list(weights)
    if not weights:
        return ()
    values = torch.cat([_sampled_values(w).to(weights[0].dtype) for w in weights]).tolist()
    return tuple((w.data_ptr(), _version(w), w.dtype, w.device) for w in weights), tuple(values)


class DerivedWeight:
    """``build(weight, bias)`` (a derived layout: a transpose, a packed
    weight), rebuilt when the fingerprint of the weight or the bias changes."""

    def __init__(self, build):
        self._build = build
        self._fingerprint = None
        self._epoch = None
        self._derived = None

    def get(self, weight: Tensor, bias: Optional[Tensor] = None):
        if _SCOPE[0] > 0 and self._epoch == _SCOPE[1]:
            return self._derived
        fingerprint = (weight_fingerprint(weight), None if bias is None else weight_fingerprint(bias))
        if fingerprint != self._fingerprint:
            self._derived = self._build(weight.detach(), None if bias is None else bias.detach())
            self._fingerprint = fingerprint
        self._epoch = _SCOPE[1] if _SCOPE[0] > 0 else None
        return self._derived


class TransposedWeight(DerivedWeight):
    """A contiguous ``weight.t()``, rebuilt when the weight's fingerprint changes."""

    def __init__(self):
        super().__init__(lambda weight, bias: weight.t().contiguous())


class TransposedProjection:
    """``x @ weight.t() (+ bias)`` through a cached contiguous transpose
    (:class:`TransposedWeight`).  With gradients enabled it is plain
    ``F.linear`` (the cached copy is detached, so no gradient would reach
    ``weight``)."""

    def __init__(self):
        self._cache = TransposedWeight()

    def __call__(self, x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
        if torch.is_grad_enabled():
            return F.linear(x, weight, bias)
        out = torch.matmul(x, self._cache.get(weight))
        return out + bias if bias is not None else out


def cached_linear(module: torch.nn.Linear, x: Tensor) -> Tensor:
    """``module(x)``, at inference (no gradients, eval mode) through a cached
    layout of its weight, kept in the module's ``__dict__`` (never saved) and
    rebuilt when the weight changes: packed for the row-blocked kernel
    (:mod:`fairseq_specdec.utils.rowgemm`) where it runs, else a contiguous
    transpose (:class:`TransposedWeight`).  For drafters, whose rounding
    changes drafts, never the strict output."""
    if torch.is_grad_enabled() or module.training:
        return module(x)
    if x.dtype == torch.float32:
        packed = packed_linear(module)
        if packed is not None:
            return packed(x)
    cache = module.__dict__.get("_specdec_weight_t")
    if cache is None:
        cache = module.__dict__["_specdec_weight_t"] = TransposedWeight()
    return transposed_linear(x, cache.get(module.weight), module.bias)


def packed_linear(module: torch.nn.Linear):
    """The :class:`~fairseq_specdec.utils.rowgemm.PackedLinear` of ``module``
    that :func:`cached_linear` computes with (the same cached layout, rebuilt
    when the weight changes); None where the kernel does not apply."""
    if not rowgemm.applies_to(module.weight):
        return None
    cache = module.__dict__.get("_specdec_packed")
    if cache is None:
        cache = module.__dict__["_specdec_packed"] = DerivedWeight(rowgemm.PackedLinear)
    return cache.get(module.weight, module.bias)


def transposed_linear(x: Tensor, weight_t: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """``F.linear(x, weight, bias)`` through ``weight_t = weight.t().contiguous()``
    (``C_in x C_out``), for inputs of any leading shape."""
    flat = x.reshape(-1, x.size(-1))
    out = torch.mm(flat, weight_t) if bias is None else torch.addmm(bias, flat, weight_t)
    return out.view(x.shape[:-1] + (out.size(-1),))
