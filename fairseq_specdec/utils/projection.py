"""Inference-time linear layers through derived weight layouts.

On a CPU, ``F.linear(x, W)`` with a few rows ``x`` costs far more than the
same product through a layout of ``W`` made once: a contiguous transpose for
torch's ``addmm``, or the row-blocked kernel's packed panels
(:mod:`fairseq_specdec.kernels.rowgemm`).  A speculative iteration runs its
linears over a few rows, so the drafters and the verify pass compute through
such layouts (the measurements: docs/verify-kernels.md).  Only the
exactness tests are relied on for their values.

**When a cached transpose is trusted.**  Optimizers update parameters through
``p.data`` in place, which changes neither the tensor's storage nor its
version counter, so neither can tell a stale copy.  A copy is therefore
checked against its weight's storage, version, dtype and 16 sampled values
(:class:`WeightsWatch`) at its first use in every :func:`inference_scope` (one per
``generate()`` call of the speculative loop) and at every use outside one;
inside a scope the weights are taken to be constant.  Weights that several
layouts are made from are looked at once per scope for all of them
(:class:`SharedWatch`).
"""
import weakref
from contextlib import contextmanager
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor


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


def _looked_in_scope(epoch) -> bool:
    """Whether a look taken at ``epoch`` (:func:`_scope_epoch`) still holds:
    inside the inference scope it was taken in."""
    return _SCOPE[0] > 0 and epoch == _SCOPE[1]


def _scope_epoch():
    """The epoch of a look taken now: the current scope's, None outside one
    (a look there holds for that call only)."""
    return _SCOPE[1] if _SCOPE[0] > 0 else None


def _sampled_values(weight: Tensor) -> Tensor:
    """16 values of ``weight``, evenly spaced over its elements: a view of its
    own storage when it is contiguous (it then follows in-place changes)."""
    flat = weight.detach().reshape(-1)
    return flat[:: max(1, flat.numel() // 16)][:16]


def _version(weight: Tensor) -> int:
    """``weight._version``, or -1 for a tensor made under
    ``torch.inference_mode()`` (a model loaded there), which keeps no version
    counter; such a tensor cannot be changed in place outside inference mode,
    and inside it the sampled values still tell most changes."""
    return -1 if weight.is_inference() else weight._version


class WeightsWatch:
    """Tells whether any of a list of weights (on one device) changed since the
    last look: its storage, version, dtype, device, shape or 16 sampled values.

    The sampled values of a contiguous weight are read through a view of its
    storage kept from the last look (the view keeps that storage alive too);
    all weights' values are then gathered by one ``torch.cat`` and compared
    with one ``torch.equal``: two tensor operations and one host read for
    the whole list, however many weights it holds."""

    def __init__(self):
        self._meta = None
        self._views = None
        self._values = None
        #: how many times the weights were seen changed (0: never looked)
        self.generation = 0

    @staticmethod
    def _meta_of(weights) -> tuple:
        return tuple((w.data_ptr(), _version(w), w.dtype, w.device, w.shape) for w in weights)

    def _read(self, weights) -> Tensor:
        dtype = weights[0].dtype
        values = [view if view is not None else _sampled_values(w) for view, w in zip(self._views, weights)]
        return torch.cat([v if v.dtype == dtype else v.to(dtype) for v in values])

    def changed(self, weights) -> bool:
        """Whether ``weights`` differ from those of the last call (True at the
        first call); remembers them either way."""
        weights = list(weights)
        meta = self._meta_of(weights)
        if meta == self._meta and (not weights or torch.equal(self._read(weights), self._values)):
            return False
        self._meta = meta
        self._views = [_sampled_values(w) if w.is_contiguous() else None for w in weights]
        self._values = self._read(weights).clone() if weights else None
        self.generation += 1
        return True


class SharedWatch:
    """One :class:`WeightsWatch` for every layout made from the same list of
    weights (:func:`shared_watch`: the verify pass and the int8 copy of
    ``--decoding self-draft`` lay out the same decoder's layers), so that
    the list is looked at once per :func:`inference_scope` (at every call
    outside one) however many layouts are made from it.  Each user keeps
    the :attr:`generation` it last built from and builds again when it
    differs; the weights are then taken to be constant inside a scope, as
    :class:`DerivedWeight` takes them."""

    def __init__(self):
        self.watch = WeightsWatch()
        self._epoch = None

    @property
    def generation(self) -> int:
        """How many times the weights were seen changed (0: never looked)."""
        return self.watch.generation

    def look(self, weights: Callable[[], Sequence[Tensor]]) -> int:
        """The weights' :attr:`generation`, after a look at ``weights()``
        unless one was taken in this scope already."""
        if not _looked_in_scope(self._epoch):
            self.watch.changed(weights())
            self._epoch = _scope_epoch()
        return self.watch.generation


#: owner module -> {what: SharedWatch}
_SHARED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def shared_watch(owner: torch.nn.Module, what: str) -> SharedWatch:
    """The :class:`SharedWatch` of the weights ``what`` names of ``owner``
    (made at the first call): every caller naming the same ``what`` must
    list the same weights of it."""
    return _SHARED.setdefault(owner, {}).setdefault(what, SharedWatch())


class ModuleParameters:
    """``list(module.parameters())``, read again cheaply at every call: the
    submodules that hold parameters are found once (walking the module tree
    costs about a microsecond a module, at every batch), and their
    parameters are read at each call, so a replaced ``Parameter`` is seen.
    A submodule added after construction is not: for the verify pass and
    encoder, which lay out the layers they were built with."""

    def __init__(self, module: torch.nn.Module):
        self._holders = [m for m in module.modules() if m._parameters]

    def __call__(self) -> list:
        return [p for m in self._holders for p in m._parameters.values() if p is not None]


class DerivedWeight:
    """``build(*tensors)`` (a derived layout: a transpose, a packed weight, a
    table computed from several weights), rebuilt when any of the tensors it
    is made from changes (:class:`WeightsWatch`; a None, such as a missing
    bias, is passed through).  Checked at the first use in every
    :func:`inference_scope` and at every use outside one."""

    def __init__(self, build):
        self._build = build
        self._watch = WeightsWatch()
        self._epoch = None
        self._derived = None

    def get_with(self, tensors: Callable[[], Sequence[Optional[Tensor]]]):
        """:meth:`get` of the tensors ``tensors()`` lists, called only where
        a check is due (not again within an inference scope)."""
        if _looked_in_scope(self._epoch):
            return self._derived
        return self.get(*tensors())

    def get(self, *tensors: Optional[Tensor]):
        if _looked_in_scope(self._epoch):
            return self._derived
        if self._watch.changed([t for t in tensors if t is not None]):
            self._derived = self._build(*(None if t is None else t.detach() for t in tensors))
        self._epoch = _scope_epoch()
        return self._derived


class TransposedWeight(DerivedWeight):
    """A contiguous ``weight.t()``, rebuilt when the weight changes."""

    def __init__(self):
        super().__init__(lambda weight: weight.t().contiguous())


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
    contiguous transpose of its weight (:class:`TransposedWeight`), kept in the
    module's ``__dict__`` (never saved) and rebuilt when the weight changes."""
    if torch.is_grad_enabled() or module.training:
        return module(x)
    cache = module.__dict__.get("_specdec_weight_t")
    if cache is None:
        cache = module.__dict__["_specdec_weight_t"] = TransposedWeight()
    return transposed_linear(x, cache.get(module.weight), module.bias)


def transposed_linear(x: Tensor, weight_t: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """``F.linear(x, weight, bias)`` through ``weight_t = weight.t().contiguous()``
    (``C_in x C_out``), for inputs of any leading shape."""
    flat = x.reshape(-1, x.size(-1))
    out = torch.mm(flat, weight_t) if bias is None else torch.addmm(bias, flat, weight_t)
    return out.view(x.shape[:-1] + (out.size(-1),))


def cat_linears(linears):
    """One weight (and bias, None if any is missing) for several
    ``nn.Linear`` with the same input, their outputs side by side."""
    weight = torch.cat([lin.weight.detach() for lin in linears], dim=0)
    biases = [lin.bias for lin in linears]
    bias = None if any(b is None for b in biases) else torch.cat([b.detach() for b in biases])
    return weight, bias
