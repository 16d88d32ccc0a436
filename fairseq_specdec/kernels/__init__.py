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

**Instruction set and prefetch.**  The products' register blocks are AVX2
ones, or on a CPU with AVX-512F, AVX-512 ones (``csrc/rowgemm_avx512.cpp``),
bitwise the same products; the float32 and bfloat16 products prefetch the
next block of weights into L2 while a block computes, or not (bitwise the
same products again).  Both are chosen once per process, here, for each
class of row counts a product can have (:func:`isa_classes`: 1 row, 2-4,
5-8, 9 or more):

* :data:`ISA_ENV` (``FAIRSEQ_SPECDEC_ISA``) picks one of :data:`ISAS` for
  every class (docs/benchmarking.md); unset (``auto``), the AVX-512 blocks
  on a CPU with AVX-512F, the AVX2 ones elsewhere: one check of the CPU,
  nothing timed (until commit 0a35eca each class was timed on both in each
  process, and a probe that did not predict a decoding's speed chose
  differently from process to process: docs/benchmarking.md);
* :data:`PREFETCH_ENV` (``FAIRSEQ_SPECDEC_PREFETCH``) is ``on`` or ``off``
  for every class; unset (``auto``), each class of up to 8 rows drops the
  prefetch only where its products measured faster without it on this CPU,
  over weights that a large last-level cache holds and weights that stream
  from memory (:func:`choose_prefetch_by_rows`); 9 rows and more keep it.

The variables are checked at import; what they leave to measurement is
measured at the first use of the products (the first packed weight, or a
question to :func:`prefetch_by_rows`:
:func:`ensure_chosen`), so that a process that never runs them (torch's
products, a GPU) pays nothing.  :func:`isa` and :func:`prefetch_by_rows`
say what runs.

**Parts.**  :data:`PARTS` names the native parts the backend can be told
not to use (``resolve_backend(..., off=...)``), so that the benchmark can
measure what each one gains (its ``FAIRSEQ_SPECDEC_OFF`` rows:
docs/benchmarking.md); decoding never needs it.
"""
import math
import os
from typing import Callable, Dict, FrozenSet, Iterable, List, Optional

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
#: what it takes: ``auto`` (or unset: the default, AVX-512 where the CPU
#: has AVX-512F, else AVX2), ``avx2``,
#: ``avx512`` (refused on a CPU without AVX-512F), and ``avx512-emulated``
#: (the AVX-512 blocks computed with AVX2 instructions, slower: for testing
#: them on a CPU without AVX-512)
ISAS = ("auto", "avx2", "avx512", "avx512-emulated")


#: the rows of the pass timed for the last class of row counts (9 or more)
#: where a class's products are measured; every other class is timed at its
#: largest row count (:func:`isa_probe_rows`)
ISA_PROBE_OPEN_ROWS = 32
#: a class drops the prefetch only where its products measured at least this
#: much faster without it (:func:`pick_prefetch_by_rows`)
PREFETCH_MARGIN = 0.03

#: the environment variable that sets whether the float32 and bfloat16
#: products prefetch the next block of weights
PREFETCH_ENV = "FAIRSEQ_SPECDEC_PREFETCH"
#: what it takes: ``auto`` (or unset: measured per class), ``on``, ``off``
PREFETCHES = ("auto", "on", "off")
#: the classes whose prefetch is measured: those of at most this many rows
#: (more rows compute long enough per weight that the prefetch does not
#: show, and keep it)
PREFETCH_MOST_ROWS = 8
#: the weight sets the prefetch is timed on: {name: (weights, rows,
#: columns)}: 16 MiB, which a large last-level cache holds from one pass to
#: the next (the demo verifier's decoder reads 18 MB), and 64 MiB, which
#: streams from memory at each pass (a transformer-base decoder reads 150 MB)
PREFETCH_PROBES = {"16 MiB": (8, 1024, 512), "64 MiB": (8, 2048, 1024)}
#: the measurement behind the prefetch's choice: {first rows: {probe: {"on"
#: or "off": [ms of each round]}}} (empty where nothing was measured)
PREFETCH_MEASURED: Dict[int, Dict[str, Dict[str, List[float]]]] = {}

# what the variables left to measure, done by ensure_chosen: None once done
_PENDING: Optional[Dict[str, bool]] = None


def _select() -> None:
    """Apply :data:`ISA_ENV` and :data:`PREFETCH_ENV`, once, at import; a
    value not in :data:`ISAS` or :data:`PREFETCHES`, or an instruction set
    this CPU cannot run, is refused by the variable's name.  What they leave
    to measurement waits for :func:`ensure_chosen`."""
    global _PENDING
    wanted = os.environ.get(ISA_ENV, "").strip()
    if wanted and wanted not in ISAS:
        raise ValueError(f"{ISA_ENV}={wanted}: not an instruction set of the plugin's products; "
                         f"the choices are {', '.join(ISAS)}")
    prefetch = os.environ.get(PREFETCH_ENV, "").strip()
    if prefetch and prefetch not in PREFETCHES:
        raise ValueError(f"{PREFETCH_ENV}={prefetch}: the choices are {', '.join(PREFETCHES)}")
    if not _SUPPORTED:
        return  # torch's products: there is nothing to choose
    try:
        _ext.select_isa(_resolve_isa(wanted))
    except RuntimeError as error:
        raise ValueError(f"{ISA_ENV}={wanted}: {str(error).splitlines()[0]}") from None
    for first in isa_classes():
        _ext.set_prefetch_for_rows(first, prefetch != "off")
    _PENDING = {"prefetch": prefetch in ("", "auto")}


def ensure_chosen() -> None:
    """Measure, once per process, what :data:`PREFETCH_ENV` left to
    measurement (:func:`choose_prefetch_by_rows`, on the instruction set
    :data:`ISA_ENV` chose at import); called at the first packed weight and
    by the functions that report the choice.  Cheap after the first call."""
    global _PENDING
    pending, _PENDING = _PENDING, None  # cleared first: the measurement packs weights itself
    if not pending:
        return
    if pending["prefetch"]:
        PREFETCH_MEASURED.update(choose_prefetch_by_rows())


def isa_classes() -> List[int]:
    """The first row count of each class of products that has an
    instruction set of its own (``[1, 2, 5, 9]``: 1 row, 2-4, 5-8, 9 or
    more); empty where the native kernels cannot run."""
    return list(_ext.isa_classes()) if _SUPPORTED else []


def isa_probe_rows() -> Dict[int, int]:
    """{first row count of a class: the rows its measured pass has}: the
    class's largest row count, :data:`ISA_PROBE_OPEN_ROWS` for the last
    (``{1: 1, 2: 4, 5: 8, 9: 32}``)."""
    firsts = isa_classes()
    return {first: (firsts[i + 1] - 1 if i + 1 < len(firsts) else ISA_PROBE_OPEN_ROWS)
            for i, first in enumerate(firsts)}


def isa_by_rows() -> Dict[int, str]:
    """{first row count of a class: its instruction set} (empty where the
    native kernels cannot run)."""
    ensure_chosen()
    return {first: _ext.isa_for_rows(first) for first in isa_classes()}


def prefetch_by_rows() -> Dict[int, bool]:
    """{first row count of a class: whether its float32 and bfloat16
    products prefetch} (empty where the native kernels cannot run)."""
    ensure_chosen()
    return {first: bool(_ext.prefetch_for_rows(first)) for first in isa_classes()}


def _check_classes(table: Dict[int, object]) -> None:
    """Refuse a table of settings by class ({first row count: setting})
    where the kernels cannot run or a class does not exist."""
    if unavailable_reason() is not None:
        raise RuntimeError(unavailable_reason())
    unknown = sorted(set(table) - set(isa_classes()))
    if unknown:
        raise ValueError(f"no class of products starts at {unknown} rows; the classes start at {isa_classes()}")


def set_prefetch_by_rows(table: Dict[int, bool]) -> None:
    """Set whether each class in ``table`` ({first row count: bool})
    prefetches; a class that does not exist is refused before any changes."""
    _check_classes(table)
    for first, on in table.items():
        _ext.set_prefetch_for_rows(first, bool(on))


def describe_prefetch() -> Optional[str]:
    """Whether the float32 products prefetch, in words: ``"on"``,
    ``"off"``, or by class, e.g. ``"off (1-4 rows), on (5+ rows)"``; None
    where the native kernels cannot run."""
    if unavailable_reason() is not None:
        return None
    table = prefetch_by_rows()
    return _by_classes({first: "on" if on else "off" for first, on in table.items()})


def _by_classes(table: Dict[int, str]) -> str:
    """{first rows of each class: a name} in words: the name alone where
    every class has it, else each run of classes with its rows."""
    firsts = isa_classes()
    if len(set(table.values())) == 1:
        return table[firsts[0]]
    spans = []  # [name, first, last or None], runs of classes with the same name joined
    for i, first in enumerate(firsts):
        last = firsts[i + 1] - 1 if i + 1 < len(firsts) else None
        if spans and spans[-1][0] == table[first]:
            spans[-1][2] = last
        else:
            spans.append([table[first], first, last])
    rows = lambda a, b: f"{a}+" if b is None else (f"{a}" if a == b else f"{a}-{b}")
    return ", ".join(f"{name} ({rows(a, b)} row{'' if a == b else 's'})" for name, a, b in spans)


def set_isa_by_rows(table: Dict[int, str]) -> None:
    """Set the instruction set of each class in ``table`` ({first row
    count: name}, as :func:`isa_by_rows` gives); a name this CPU cannot run
    is refused before any class changes."""
    _check_classes(table)
    names = sorted(set(table.values()) - set(ISAS))
    if names:
        raise ValueError(f"no instruction set {', '.join(names)} for a class; the choices are {', '.join(ISAS)}")
    if "avx512" in table.values() and not _ext.has_avx512():
        raise ValueError("this CPU has no AVX-512F instructions")
    for first, name in table.items():
        _ext.set_isa_for_rows(first, _resolve_isa(name))


def _resolve_isa(name: str) -> str:
    """The instruction set ``name`` (one of :data:`ISAS`, or empty) runs:
    ``auto`` (or empty) is AVX-512 on a CPU with AVX-512F, AVX2 elsewhere;
    the one place that decides it (the extension takes only the others)."""
    if name in ("", "auto"):
        return "avx512" if _ext.has_avx512() else "avx2"
    return name


def _paired_rounds(weights, inputs: Dict[int, Tensor], settings: Dict[str, Callable[[int], None]],
                   rounds: int) -> Dict[int, Dict[str, List[float]]]:
    """{first rows: {setting: [ms of each round]}}: for each class in
    ``inputs`` ({first rows: its probe's input}), a pass of its input
    through ``weights`` under each of ``settings`` ({name: apply it for the
    class of that first row count}) back to back, their order alternating
    from round to round, after a round that only warms (the code paged in,
    the weights touched).  On one thread, torch's count restored after: what
    the benchmarks time, and no thread pool is started by it, so a process
    may fork after packing its first weights."""
    import time

    names = list(settings)
    times = {first: {name: [] for name in names} for first in inputs}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for r in range(rounds + 1):
            for first, x in inputs.items():
                for name in (names if r % 2 == 0 else list(reversed(names))):
                    settings[name](first)
                    t0 = time.perf_counter()
                    for linear in weights:
                        linear(x)
                    if r > 0:
                        times[first][name].append((time.perf_counter() - t0) * 1000.0)
    finally:
        torch.set_num_threads(threads)
    return times


def pick_prefetch_by_rows(times: Dict[int, Dict[str, Dict[str, List[float]]]],
                          margin: float = PREFETCH_MARGIN) -> Dict[int, bool]:
    """{first rows: prefetch} from measured times ({first rows: {probe:
    {"on": [ms], "off": [ms]}}}, the rounds paired): a class drops the
    prefetch only where the geometric mean over the probes of the median
    over the rounds of its time without it over its time with it is at
    most ``1 - margin``: the weights that stay in the cache and the weights
    that stream from memory count alike, so a large gain on one is not
    given up for a near-tie on the other, nor taken at a large loss."""
    import statistics

    table = {}
    for first, by_probe in times.items():
        ratios = [statistics.median(off / on for off, on in zip(t["off"], t["on"])) for t in by_probe.values()]
        table[first] = math.prod(ratios) ** (1.0 / len(ratios)) > 1.0 - margin
    return table


def measure_prefetch(rounds: int = 7) -> Dict[int, Dict[str, Dict[str, List[float]]]]:
    """{first rows of each class of at most :data:`PREFETCH_MOST_ROWS`
    rows: {probe: {"on": [ms of each round], "off": [...]}}}: a pass of
    :func:`isa_probe_rows` rows through each of :data:`PREFETCH_PROBES`'
    weight sets, with and without the prefetch back to back in each round,
    their order alternating, on the classes' instruction sets as they are,
    on one thread (:func:`_paired_rounds`).  Leaves every class
    prefetching."""
    from . import rowgemm

    probe_rows = isa_probe_rows()
    firsts = [first for first in isa_classes() if first <= PREFETCH_MOST_ROWS]
    settings = {"on": lambda first: _ext.set_prefetch_for_rows(first, True),
                "off": lambda first: _ext.set_prefetch_for_rows(first, False)}
    times = {first: {} for first in firsts}
    try:
        for name, (count, n, k) in PREFETCH_PROBES.items():
            # the values do not matter to the time, only the bytes read: no random numbers to draw
            weights = [rowgemm.PackedLinear(torch.full((n, k), 0.01 * (i + 1)), None) for i in range(count)]
            inputs = {first: torch.full((probe_rows[first], k), 0.5) for first in firsts}
            for first, by_setting in _paired_rounds(weights, inputs, settings, rounds).items():
                times[first][name] = by_setting
            del weights
    finally:
        for first in firsts:
            _ext.set_prefetch_for_rows(first, True)
    return times


def choose_prefetch_by_rows() -> Dict[int, Dict[str, Dict[str, List[float]]]]:
    """Measure the prefetch (:func:`measure_prefetch`), set each class as
    :func:`pick_prefetch_by_rows` makes of it, and return the measurement."""
    times = measure_prefetch()
    set_prefetch_by_rows(pick_prefetch_by_rows(times))
    return times


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
    it), or where it differs by the products' rows, each class's, e.g.
    ``"avx2 (1-4 rows), avx512 (5+ rows)"``; None where they cannot run
    (:func:`unavailable_reason`): torch's products then."""
    if unavailable_reason() is not None:
        return None
    return _by_classes(isa_by_rows())


def applies_to(weight: Tensor) -> bool:
    """Whether the kernels compute with ``weight``: a float32 CPU tensor, on
    a machine that runs them."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and unavailable_reason() is None


# last: every name the check uses is defined above
_select()
