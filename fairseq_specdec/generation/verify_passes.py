"""Which verify pass runs: ``--verify-impl`` and ``--verify-gemm``."""
from .lean_verifier import VERIFY_GEMMS, LeanVerifier, lean_unsupported_reason
from .verifier import CachedVerifier
from .verify_pass import VerifyPass

VERIFY_IMPLS = ("auto", "lean", "fairseq")


def build_verifier(model, temperature: float = 1.0, impl: str = "auto", gemm: str = "auto") -> VerifyPass:
    """The verify pass: ``lean`` (:class:`~fairseq_specdec.generation.lean_verifier.LeanVerifier`,
    its products computed as ``gemm`` says: ``--verify-gemm``), ``fairseq``
    (:class:`~fairseq_specdec.generation.verifier.CachedVerifier`, fairseq's own layer modules), or ``auto``: lean
    where it supports the verifier's layers, else fairseq's."""
    if impl not in VERIFY_IMPLS:
        raise ValueError(f"--verify-impl must be one of {', '.join(VERIFY_IMPLS)}, got {impl!r}")
    if gemm not in VERIFY_GEMMS:
        raise ValueError(f"--verify-gemm must be one of {', '.join(VERIFY_GEMMS)}, got {gemm!r}")
    if impl == "fairseq":
        if gemm == "rowgemm":
            raise ValueError("--verify-gemm rowgemm needs the lean verify pass; drop --verify-impl fairseq")
        return CachedVerifier(model, temperature)
    reason = lean_unsupported_reason(getattr(model, "decoder", None)) if impl == "auto" else None
    if reason is not None:
        if gemm == "rowgemm":
            raise ValueError(f"--verify-gemm rowgemm needs the lean verify pass, which cannot run this verifier: {reason}")
        return CachedVerifier(model, temperature)
    return LeanVerifier(model, temperature, gemm)
