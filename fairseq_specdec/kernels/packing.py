"""Packed-weight layouts of ``nn.Linear`` modules for the row-blocked kernel.

A layout is derived from its module's weight once and kept in the module's
``__dict__`` (never saved with the checkpoint), rebuilt when the weight
changes (:class:`~fairseq_specdec.utils.projection.DerivedWeight`).  The
generation layer's native passes (the ``specdec_vsd`` drafter's) compute
through these; the models themselves never do.
"""
from functools import partial

import torch

from ..utils.projection import DerivedWeight
from . import applies_to
from .rowgemm import PackedLinear


def packed_linear(module: torch.nn.Linear, precision: str = "float32"):
    """The :class:`~fairseq_specdec.kernels.rowgemm.PackedLinear` of ``module``
    in ``precision``, cached in the module's ``__dict__`` and rebuilt when
    the weight changes; None where the kernel does not apply."""
    if not applies_to(module.weight):
        return None
    name = "_specdec_packed" if precision == "float32" else f"_specdec_packed_{precision}"
    cache = module.__dict__.get(name)
    if cache is None:
        cache = module.__dict__[name] = DerivedWeight(partial(PackedLinear, precision=precision))
    return cache.get(module.weight, module.bias)

