"""Which verify pass runs: ``--verify-impl``, ``--verify-gemm``, ``--encoder-impl`` and ``--cuda-graphs``."""
from typing import Optional, Tuple

import torch

from .lean_verifier import ENCODER_IMPLS, VERIFY_GEMMS, LeanVerifier, lean_unsupported_reason
from .static_verifier import CUDA_GRAPHS, StaticVerifier
from .verifier import CachedVerifier
from .verify_pass import VerifyPass

VERIFY_IMPLS = ("auto", "lean", "fairseq")


#: ``--cuda-graphs auto`` on a half-precision CUDA verifier replays the verify
#: pass's graphs for batches of at most this many sentences (measured in
#: float32 on an H100; whole iterations have not run in half precision)
AUTO_GRAPH_ROWS = 1


def resolve_cuda_graphs(graphs: str, device_type: str, dtype, gemm: str = "auto",
                        encoder: str = "auto") -> Tuple[str, Optional[int]]:
    """What ``--cuda-graphs graphs`` runs, as ``(choice, max_rows)``:
    ``auto`` becomes ``iteration`` for a float32 verifier on a CUDA device
    that the lean pass runs with torch's products (``gemm`` not
    ``rowgemm``, ``encoder`` not ``lean``): the verify pass's graphs at every
    batch size and whole iterations at batch 1, measured faster than the
    lean pass as it is at batch 1, 8 and 64 on an H200 (docs/gpu.md); the
    verify pass's graphs for batches of :data:`AUTO_GRAPH_ROWS` sentence on
    such a verifier in half precision; ``off`` otherwise.  Any other choice
    is itself, without a row limit."""
    check_graphs(graphs)
    if graphs != "auto":
        return graphs, None
    if device_type != "cuda" or gemm == "rowgemm" or encoder == "lean":
        return "off", None
    if dtype == torch.float32:
        return "iteration", None
    return "on", AUTO_GRAPH_ROWS


def check_graphs(graphs: str) -> None:
    if graphs not in CUDA_GRAPHS:
        raise ValueError(f"--cuda-graphs must be one of {', '.join(CUDA_GRAPHS)}, got {graphs!r}")


def build_verifier(model, temperature: float = 1.0, impl: str = "auto", gemm: str = "auto",
                   graphs: str = "auto", encoder: str = "auto") -> VerifyPass:
    """The verify pass: ``lean`` (:class:`~fairseq_specdec.generation.lean_verifier.LeanVerifier`,
    its products computed as ``gemm`` says: ``--verify-gemm``), ``fairseq``
    (:class:`~fairseq_specdec.generation.verifier.CachedVerifier`, fairseq's own layer modules), or ``auto``: lean
    where it supports the verifier's layers, else fairseq's.  ``graphs``
    (``--cuda-graphs``) ``static`` or ``on``: the lean pass with static
    shapes (:class:`~fairseq_specdec.generation.static_verifier.StaticVerifier`),
    replayed as CUDA graphs with ``on`` and ``iteration`` (which the loop
    extends to whole iterations of batches of one sentence); ``auto``: as
    :func:`resolve_cuda_graphs` says.  ``encoder``
    (``--encoder-impl``): the lean pass's encoder, fused C++ layers
    (:class:`~fairseq_specdec.generation.lean_encoder.LeanEncoder`, ``lean``)
    or fairseq's modules; ``auto``: lean where it runs."""
    if impl not in VERIFY_IMPLS:
        raise ValueError(f"--verify-impl must be one of {', '.join(VERIFY_IMPLS)}, got {impl!r}")
    if gemm not in VERIFY_GEMMS:
        raise ValueError(f"--verify-gemm must be one of {', '.join(VERIFY_GEMMS)}, got {gemm!r}")
    check_graphs(graphs)
    if encoder not in ENCODER_IMPLS:
        raise ValueError(f"--encoder-impl must be one of {', '.join(ENCODER_IMPLS)}, got {encoder!r}")
    static = graphs in ("on", "static", "iteration")
    if encoder == "lean" and (impl == "fairseq" or static):
        raise ValueError("--encoder-impl lean runs in the lean verify pass with rowgemm products; drop "
                         + ("--verify-impl fairseq" if impl == "fairseq" else f"--cuda-graphs {graphs}"))
    if impl == "fairseq":
        if gemm == "rowgemm":
            raise ValueError("--verify-gemm rowgemm needs the lean verify pass; drop --verify-impl fairseq")
        if static:
            raise ValueError(f"--cuda-graphs {graphs} needs the lean verify pass; drop --verify-impl fairseq")
        return CachedVerifier(model, temperature)
    reason = lean_unsupported_reason(getattr(model, "decoder", None)) if impl == "auto" else None
    if reason is not None:
        if encoder == "lean":
            raise ValueError(f"--encoder-impl lean needs the lean verify pass, which cannot run this verifier: {reason}")
        if gemm == "rowgemm":
            raise ValueError(f"--verify-gemm rowgemm needs the lean verify pass, which cannot run this verifier: {reason}")
        if static:
            raise ValueError(f"--cuda-graphs {graphs} needs the lean verify pass, which cannot run this verifier: {reason}")
        return CachedVerifier(model, temperature)
    if static:
        if gemm == "rowgemm":
            raise ValueError(f"--cuda-graphs {graphs} computes with torch's products; drop --verify-gemm rowgemm")
        return StaticVerifier(model, temperature, graphs=graphs in ("on", "iteration"), option=graphs)
    if graphs == "auto":
        weight = next(model.parameters())
        choice, max_rows = resolve_cuda_graphs(graphs, weight.device.type, weight.dtype, gemm, encoder)
        if choice != "off":
            return StaticVerifier(model, temperature, graphs=True, max_rows=max_rows, option=f"auto ({choice})",
                                  choice=choice)
    return LeanVerifier(model, temperature, gemm, encoder)
