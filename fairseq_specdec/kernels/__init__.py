"""The plugin's native code, in one place: the C++ sources (``csrc/``), the
compiled extension ``fairseq_specdec.kernels._native`` and its bindings
(:mod:`.rowgemm`), the packed-weight layouts it reads
(:mod:`.packing`), and the one check whether it is built and usable here
(:func:`unavailable_reason`, :func:`applies_to`).

Only the generation layer calls into this package, and only where the
backend (``--specdec-backend``, :mod:`fairseq_specdec.generation.backend`)
chose the native path; models never import it.  The extension is optional:
without it (no compiler at install, a CPU without AVX2/FMA) every decoding
runs on torch's operations.

**Instruction set.**  The products' register blocks are AVX2 ones, or on a
CPU with AVX-512F, AVX-512 ones (``csrc/rowgemm_avx512.cpp``), bitwise the
same products.  The choice is made once, at import, here: :data:`ISA_ENV`
(``FAIRSEQ_SPECDEC_ISA``) picks one of :data:`ISAS` (docs/benchmarking.md),
and :func:`isa` says which runs.  The default is AVX2 until the AVX-512
blocks are measured against it on an AVX-512 machine
(docs/verify-kernels.md).

**Parts.**  :data:`PARTS` names the native parts the backend can be told
not to use (``resolve_backend(..., off=...)``), so that the benchmark can
measure what each one gains (its ``FAIRSEQ_SPECDEC_OFF`` rows:
docs/benchmarking.md); decoding never needs it.
"""
import os
from typing import FrozenSet, Iterable, Optional

import torch
from torch import Tensor

#: the native parts a backend can be told not to use, and what each computes
PARTS = {
    "products": "the verify pass's products through the row-blocked kernel (off: torch's products, and no "
                "other part of the verify pass below)",
    "layers": "each decoder layer of the verify pass as one call, and the whole pass as one call where it fits",
    "encoder": "each encoder layer as one call",
    "accept": "fairseq's rules, the greedy picks and strict acceptance as one call",
    "commit": "the loop's commit of the appended tokens into the decoding state as one call",
    "bf16": "specdec_vsd drafter weights packed in bfloat16",
    "pick": "a drafter's shortlist projection, log-softmax and best type as one call",
    "block": "the specdec_vsd drafter's input rows and block layers as calls of the kernel",
    "screen": "at batch 1, a step without drafts picks its greedy token from the int8 copy of the vocabulary "
              "projection and exact float32 candidates, its scores deferred (strict verification)",
    "runs": "where an iteration drafts nothing by design (loop-greedy, or the draft policy's greedy iterations), "
            "up to 32 screened greedy steps as one call (off: one screened step an iteration)",
    "steps": "the self-drafter's draft steps (each row's pick, the confidence test, the next pass) as one call",
    "graphs": "on a CUDA device: the verify pass with static shapes replayed as CUDA graphs",
    "iteration": "on a CUDA device: whole iterations of a batch of one sentence as one CUDA graph",
}


def check_parts(names: Iterable[str], where: str = "") -> FrozenSet[str]:
    """``names`` as a set of :data:`PARTS`; an unknown name is refused
    (``where``: what named them, first in the message)."""
    names = frozenset(names)
    unknown = sorted(names - set(PARTS))
    if unknown:
        raise ValueError(f"{where}no native part {', '.join(unknown)}; the parts are {', '.join(PARTS)}")
    return names


try:
    from . import _native as _ext
except ImportError as error:  # not built: see setup.py
    _ext = None
    _IMPORT_ERROR: Optional[str] = str(error)
else:
    _IMPORT_ERROR = None

#: whether this CPU runs the kernel (asked once: the answer cannot change)
_SUPPORTED = _ext is not None and bool(_ext.supported())

#: the environment variable that forces the products' instruction set
ISA_ENV = "FAIRSEQ_SPECDEC_ISA"
#: what it takes: ``auto`` (or unset: the default, AVX2), ``avx2``,
#: ``avx512`` (refused on a CPU without AVX-512F), and ``avx512-emulated``
#: (the AVX-512 blocks computed with AVX2 instructions, slower: for testing
#: them on a CPU without AVX-512)
ISAS = ("auto", "avx2", "avx512", "avx512-emulated")


def _select_isa() -> None:
    """Apply :data:`ISA_ENV`, once, at import; a value not in :data:`ISAS`,
    or one this CPU cannot run, is refused by the variable's name."""
    wanted = os.environ.get(ISA_ENV, "").strip()
    if wanted and wanted not in ISAS:
        raise ValueError(f"{ISA_ENV}={wanted}: not an instruction set of the plugin's products; "
                         f"the choices are {', '.join(ISAS)}")
    if not _SUPPORTED:
        return  # torch's products: there is nothing to choose
    try:
        _ext.select_isa(wanted)
    except RuntimeError as error:
        raise ValueError(f"{ISA_ENV}={wanted}: {str(error).splitlines()[0]}") from None


_select_isa()


def unavailable_reason() -> Optional[str]:
    """Why the native kernels cannot run on this machine (None: they can)."""
    if _ext is None:
        return (f"the C++ extension fairseq_specdec.kernels._native is not built ({_IMPORT_ERROR}); "
                "reinstall the plugin with a C++ compiler")
    if not _SUPPORTED:
        return "this CPU has no AVX2/FMA instructions"
    return None


def has_avx512() -> bool:
    """Whether this CPU (and its OS) runs the AVX-512 blocks
    (``FAIRSEQ_SPECDEC_ISA=avx512``)."""
    return unavailable_reason() is None and bool(_ext.has_avx512())


def isa() -> Optional[str]:
    """The instruction set the native products run on here (``"avx512"``,
    ``"avx2"``, or ``"avx512-emulated"`` where :data:`ISA_ENV` asked for
    it), as the extension reports it; None where they cannot run
    (:func:`unavailable_reason`): torch's products then."""
    if unavailable_reason() is not None:
        return None
    return _ext.isa()


def applies_to(weight: Tensor) -> bool:
    """Whether the kernels compute with ``weight``: a float32 CPU tensor, on
    a machine that runs them."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and unavailable_reason() is None
