"""The one backend choice: ``--specdec-backend {auto,reference}``.

A speculative iteration has three computations that can run more than one
way: the verify pass, the step from its log-probs to the tokens appended
(fairseq's ``--beam 1`` rules, greedy picks, acceptance) and the drafters'
passes.  :func:`resolve_backend` decides all three once per generator, from
the option, the verifier's device and weights and the acceptance rule, logs
what it chose and why, and hands the loop a :class:`Backend`: a ready verify
pass, whether the acceptance step is one native call, what drafters may
compute natively, and whether whole iterations run on fixed buffers.

* ``reference``: fairseq's own layer modules over their incremental state
  (:class:`~fairseq_specdec.generation.verifier.CachedVerifier`), torch's
  products and tensor operations everywhere: fairseq's arithmetic.
* ``auto``: the fastest exact path measured for the device:

  - a verifier whose layers the lean pass does not know: as ``reference``;
  - a CUDA verifier: the lean pass with static shapes replayed as CUDA graphs
    (:class:`~fairseq_specdec.generation.static_verifier.StaticVerifier`),
    whole iterations of a batch of one sentence as one graph for a float32
    verifier, the verify pass's graphs for batches of one sentence in half
    precision (docs/gpu.md);
  - a float32 CPU verifier on a machine that runs the native kernels
    (:mod:`fairseq_specdec.kernels`): the lean pass through them
    (:class:`~fairseq_specdec.generation.lean_verifier.LeanVerifier`:
    row-blocked products, each decoder and encoder layer one call), the
    strict acceptance step as one call, the commit into the decoding state
    as one call, drafters' passes through them;
  - otherwise the lean pass with torch's products.

Both keep the loop's guarantee (strict output = the verifier's greedy
output under the pass's arithmetic, at any batch size); the kernels round
differently from torch's BLAS (docs/verify-kernels.md, Exactness).
:func:`resolve_backend`'s ``off`` leaves single native parts unused
(:data:`fairseq_specdec.kernels.PARTS`): the benchmark measures each part
that way (the task's
:attr:`~fairseq_specdec.generation.services.GenerationServices.parts_off`).
"""
from dataclasses import dataclass, field
from typing import Callable, FrozenSet, Optional, Tuple

import torch

from ..kernels import applies_to, check_parts, rowgemm, unavailable_reason
from .accept_step import AcceptanceStep, FairseqRules, NativeStep, TensorStep, native_step_unavailable
from .acceptance import StrictAcceptance
from .drafters import NO_KERNELS, Drafter, DraftKernels, StaticDrafter
from .iteration import EagerRunner
from .iteration_graphs import IterationGraphs
from .lean_verifier import LeanVerifier, lean_unsupported_reason
from .screened_greedy import ScreenedGreedy
from .static_verifier import StaticVerifier
from .verifier import CachedVerifier
from .verify_pass import VerifyPass

#: on a half-precision CUDA verifier, the verify pass's graphs run for
#: batches of at most this many sentences (whole iterations have not been
#: measured in half precision)
AUTO_GRAPH_ROWS = 1


@dataclass
class Backend:
    """What computes an iteration, resolved once per generator.

    The loop takes strategy objects from it: ``verifier`` (the verify
    pass), :meth:`acceptance_step` and :meth:`runners`.  Drafters read
    ``drafting`` (what they may compute natively).  The rest records the
    choice: ``fused_accept``, the acceptance step is one call of the native
    extension (strict or top-beta acceptance, float32 log-probs on a CPU);
    ``append``, what the decoding state commits with (one native call on a
    CPU, or None);
    ``iteration``, ``static`` or ``iteration`` where whole iterations of a
    batch of one sentence run on fixed buffers (``iteration``: captured as
    CUDA graphs), else None; ``reasons``: why, for the log; ``off``: the
    native parts it was told not to use."""

    name: str
    verifier: VerifyPass
    fused_accept: bool = False
    drafting: DraftKernels = NO_KERNELS
    iteration: Optional[str] = None
    #: the loop's commit as one native call (``rowgemm.append_rows``), or None: tensor operations
    append: Optional[Callable] = None
    #: greedy steps at batch 1 without the float32 vocabulary product
    #: (:mod:`~fairseq_specdec.generation.screened_greedy`; strict rule, native step)
    screen: bool = False
    #: the most screened greedy steps an iteration that drafts nothing by design runs in one call
    #: (``ScreenedGreedy.run_length``; 1: a step an iteration)
    screen_run: int = ScreenedGreedy.MAX_STEPS
    reasons: Tuple[str, ...] = ()
    off: FrozenSet[str] = field(default_factory=frozenset)

    def acceptance_step(self, rule, rules: FairseqRules) -> AcceptanceStep:
        """The step from the pass's log-probs to the tokens appended, for
        acceptance ``rule`` under fairseq's ``rules`` (``NativeStep`` refuses
        what it cannot compute, ``--unkpen`` included)."""
        tensors = TensorStep(rule, rules)
        return NativeStep(tensors) if self.fused_accept else tensors

    def screened_greedy(self, rule, rules: FairseqRules) -> Optional[ScreenedGreedy]:
        """The screened greedy steps for acceptance ``rule`` (strict only),
        or None where the backend has none."""
        if not self.screen or not isinstance(rule, StrictAcceptance) or rules.unk_penalty != 0:
            return None
        return ScreenedGreedy(self.verifier, rules, max_steps=self.screen_run)

    def runners(self, drafter: Drafter, trees: bool) -> tuple:
        """``(eager, whole)``: the runner of every iteration, and the runner
        of a batch of one sentence's iterations on fixed buffers, or None
        (no such choice, draft trees, or a drafter that cannot work on fixed
        buffers: ``StaticDrafter.static_inputs``)."""
        whole = None
        if self.iteration in ("static", "iteration") and not trees and isinstance(drafter, StaticDrafter) \
                and drafter.static_inputs():
            whole = IterationGraphs(self.verifier, drafter, graphs=self.iteration == "iteration")
        return EagerRunner(), whole

    def describe(self) -> str:
        """One line for the log: the choice, its parts and why."""
        parts = [f"verify pass {self.verifier.describe()}",
                 f"acceptance step {'native' if self.fused_accept else 'torch'}",
                 f"commit {'native' if self.append is not None else 'torch'}"]
        if self.screen:
            parts.append(f"screened greedy steps of up to {ScreenedGreedy.MAX_ROWS} rows"
                         + (f", up to {self.screen_run} in one call where nothing is drafted" if self.screen_run > 1
                            else ""))
        if self.drafting.products:
            parts.append(f"drafters native ({self.drafting.precision} weights)")
        if self.iteration is not None:
            parts.append(f"whole iterations at batch 1 ({self.iteration})")
        why = f"; {'; '.join(self.reasons)}" if self.reasons else ""
        off = f"; native parts not used: {', '.join(sorted(self.off))}" if self.off else ""
        return f"--specdec-backend {self.name}: {', '.join(parts)}{why}{off}"


def cuda_graph_choice(dtype: torch.dtype, off: FrozenSet[str] = frozenset()) -> Tuple[Optional[str], Optional[int]]:
    """What ``auto`` runs on a CUDA verifier of ``dtype``, as ``(static
    choice, max_rows)``: whole iterations at batch 1 and the verify pass's
    graphs at every batch size for float32 (measured faster than the lean
    pass as it is at batch 1, 8 and 64 on an H200: docs/gpu.md); the verify
    pass's graphs for batches of :data:`AUTO_GRAPH_ROWS` sentence in half
    precision; ``(None, None)``: no static shapes (the ``graphs`` part off)."""
    if "graphs" in off:
        return None, None
    if dtype == torch.float32:
        return ("on" if "iteration" in off else "iteration"), None
    return "on", AUTO_GRAPH_ROWS


def resolve_backend(name: str, model, acceptance, temperature: float = 1.0, unk_penalty: float = 0.0,
                    off: FrozenSet[str] = frozenset(), static: Optional[str] = None) -> Backend:
    """The :class:`Backend` of ``--specdec-backend name`` (one of
    :data:`~fairseq_specdec.generation.options.BACKENDS`, checked with the
    options) for verifier
    ``model`` (see the module docstring).  ``off``: names of native parts
    (:data:`~fairseq_specdec.kernels.PARTS`) not to use; an unknown name is
    refused.  ``static`` (tests and tools
    only): ``static`` runs the static-shape pass and whole iterations
    eagerly on any device, ``on`` / ``iteration`` with CUDA graphs."""
    off = check_parts(off)
    weight = next(model.parameters())
    device, dtype = weight.device, weight.dtype
    if name == "reference":
        return Backend(name, CachedVerifier(model, temperature), reasons=("fairseq's modules, torch's products",))
    lean_reason = lean_unsupported_reason(getattr(model, "decoder", None))
    if lean_reason is not None:
        if static is not None:
            raise ValueError(f"static shapes need the lean verify pass, which cannot run this verifier: {lean_reason}")
        return Backend(name, CachedVerifier(model, temperature),
                       reasons=(f"fairseq's modules: the lean pass does not run this verifier ({lean_reason})",))
    if static is None and device.type == "cuda" and "graphs" not in off:
        static, rows = cuda_graph_choice(dtype, off)
        verifier = StaticVerifier(model, temperature, graphs=True, max_rows=rows, choice=static)
        why = "a CUDA verifier: CUDA graphs" + (" of whole iterations at batch 1" if static == "iteration" else "")
        return Backend(name, verifier, iteration=static if static == "iteration" else None, reasons=(why,), off=off)
    if static is not None:
        verifier = StaticVerifier(model, temperature, graphs=static != "static", choice=static)
        return Backend(name, verifier, iteration=static if static in ("static", "iteration") else None,
                       reasons=(f"static shapes ({static})",), off=off)
    native = unavailable_reason()
    if native is None and not applies_to(weight):
        native = f"the verifier's weights are {dtype} on {device}"
    if native is None and "products" in off:
        native = "the products part is not to be used"
    if native is not None:
        return Backend(name, LeanVerifier(model, temperature, gemm="torch", encoder="fairseq"),
                       reasons=(f"torch's products: the native kernels do not run ({native})",), off=off)
    fused = "accept" not in off and native_step_unavailable(acceptance, unk_penalty) is None
    screen = fused and isinstance(acceptance, StrictAcceptance) and "screen" not in off and rowgemm.screen_available()
    verifier = LeanVerifier(model, temperature, gemm="rowgemm", encoder="fairseq" if "encoder" in off else "auto",
                            fused_layers="layers" not in off, screening=screen)
    precision = "bfloat16" if "bf16" not in off and rowgemm.bfloat16_available() else "float32"
    drafting = DraftKernels(products=True, precision=precision, pick="pick" not in off, block="block" not in off,
                            steps="steps" not in off and rowgemm.decoder_steps_available())
    append = rowgemm.append_rows if "commit" not in off and rowgemm.append_rows_available() else None
    run = 1 if "runs" in off else ScreenedGreedy.MAX_STEPS
    return Backend(name, verifier, fused_accept=fused, drafting=drafting, append=append, screen=screen,
                   screen_run=run, reasons=("native kernels: the extension is built and this CPU has AVX2/FMA",),
                   off=off)
