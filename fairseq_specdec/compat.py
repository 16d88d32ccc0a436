"""Compatibility layer between fairseq-fixed 0.12.3.1 and torch 2.13.

Installed once by ``import fairseq_specdec`` (which ``--user-dir`` does); every
function here is idempotent.

1. Safe checkpoint loading.  torch >= 2.6 unpickles checkpoints with
   ``weights_only=True``, which refuses the few non-tensor globals that
   fairseq checkpoints contain.  We allowlist exactly those
   (:data:`CHECKPOINT_SAFE_GLOBALS`) with ``torch.serialization.add_safe_globals``;
   the safe unpickler stays on, so loading a checkpoint never executes
   arbitrary pickled code.  ``torch.load`` is wrapped (not fairseq) only to
   (a) turn the unpickler's refusal into an error that names the global and the
   opt-in, and (b) honour that opt-in: files listed in the environment variable
   ``SPECDEC_TRUSTED_CHECKPOINTS`` (``os.pathsep``-separated paths) or passed
   to :func:`trust_checkpoint` are loaded with ``weights_only=False``.

2. Logging.  Importing ``fairseq.models`` runs ``logging.basicConfig(level=DEBUG)``
   (in ``wav2vec2_classification.py``) before the command-line tools configure
   logging, so their own ``basicConfig`` calls become no-ops: log lines go to
   stderr in the wrong format and ``fairseq-generate --results-path`` loses its
   "Translated N sentences" line.  :func:`restore_fairseq_logging` removes that
   stray handler and installs the configuration the running tool asked for
   (:class:`FairseqCLIHandler`).
"""
import argparse
import functools
import logging
import os
import sys
from typing import Iterable, Set

import numpy as np
import torch

logger = logging.getLogger(__name__)

TRUST_ENV_VAR = "SPECDEC_TRUSTED_CHECKPOINTS"

FAIRSEQ_LOG_FORMAT = "%(asctime)s | %(levelname)s | %(name)s | %(message)s"
FAIRSEQ_LOG_DATEFMT = "%Y-%m-%d %H:%M:%S"


def _numpy_globals():
    """numpy objects a checkpoint carries when training stored numpy scalars or
    arrays in its state (e.g. ``best_bleu`` of ``--eval-bleu``)."""
    out = [np.ndarray, np.dtype]
    try:  # numpy 2
        from numpy._core.multiarray import _reconstruct, scalar
    except ImportError:  # numpy 1
        from numpy.core.multiarray import _reconstruct, scalar
    out += [_reconstruct, scalar]
    # numpy >= 1.25 pickles dtypes by their class (numpy.dtypes.Float64DType ...)
    dtypes = getattr(np, "dtypes", None)
    if dtypes is not None:
        out += [
            getattr(dtypes, name)
            for name in dir(dtypes)
            if name.endswith("DType") and isinstance(getattr(dtypes, name), type)
        ]
    return out


#: Every non-tensor global a stock fairseq 0.12 checkpoint may contain.
CHECKPOINT_SAFE_GLOBALS = [argparse.Namespace] + _numpy_globals()

_trusted_files: Set[str] = set()


def trust_checkpoint(path: str) -> None:
    """Allow ``path`` to be loaded with the full (unsafe) unpickler.

    Only for files from a source you trust: unpickling can run arbitrary code.
    """
    _trusted_files.add(os.path.realpath(path))


def _trusted_paths() -> Set[str]:
    env = os.environ.get(TRUST_ENV_VAR, "")
    from_env = {os.path.realpath(p) for p in env.split(os.pathsep) if p}
    return _trusted_files | from_env


def _path_of(f) -> str:
    if isinstance(f, (str, os.PathLike)):
        return os.fspath(f)
    return getattr(f, "name", None) or ""


class UntrustedCheckpointError(RuntimeError):
    """A checkpoint needs a global that the safe loader does not allow."""


def _wrap_torch_load(original):
    @functools.wraps(original)
    def load(f, *args, **kwargs):
        path = _path_of(f)
        if (
            kwargs.get("weights_only") is None
            and path
            and os.path.realpath(path) in _trusted_paths()
        ):
            kwargs["weights_only"] = False
        try:
            return original(f, *args, **kwargs)
        except Exception as exc:  # torch raises pickle.UnpicklingError
            msg = str(exc)
            # only a refused global is a trust question; a corrupt or foreign
            # file keeps torch's own error
            if "Weights only load failed" not in msg or "Unsupported global" not in msg:
                raise
            detail = next(
                (ln.strip() for ln in msg.splitlines() if "Unsupported global" in ln),
                msg.splitlines()[0],
            )
            raise UntrustedCheckpointError(
                f"refusing to load checkpoint {path or f!r} with torch's safe "
                f"loader: {detail}\nfairseq-specdec allows only the globals "
                "stock fairseq checkpoints contain. If you trust this file "
                "(unpickling may run arbitrary code), opt in for it alone with\n"
                f"    export {TRUST_ENV_VAR}={path or '/path/to/checkpoint.pt'}\n"
                "(several files separated by ':'), or call "
                "fairseq_specdec.compat.trust_checkpoint(path) in Python."
            ) from exc

    load._specdec_wrapped = True
    return load


def install_safe_checkpoint_loading() -> None:
    torch.serialization.add_safe_globals(CHECKPOINT_SAFE_GLOBALS)
    if not getattr(torch.load, "_specdec_wrapped", False):
        torch.load = _wrap_torch_load(torch.load)


def _is_stray_debug_handler(handler: logging.Handler) -> bool:
    """The handler ``logging.basicConfig(level=DEBUG)`` installs: a plain
    StreamHandler on stderr with logging's default format."""
    fmt = getattr(handler.formatter, "_fmt", None)
    return (
        type(handler) is logging.StreamHandler
        and handler.stream in (sys.stderr, sys.__stderr__)
        and fmt == logging.BASIC_FORMAT
    )


def _cli_log_stream():
    """The stream the running fairseq command line wants its log on:
    ``fairseq-generate`` writes it to ``output_file`` (the ``--results-path``
    file) while its ``_main`` runs; everything else goes to stdout."""
    frame = sys._getframe(1)
    while frame is not None:
        if (
            frame.f_code.co_name == "_main"
            and frame.f_globals.get("__name__") == "fairseq_cli.generate"
            and "output_file" in frame.f_locals
        ):
            return frame.f_locals["output_file"]
        frame = frame.f_back
    return sys.stdout


class FairseqCLIHandler(logging.StreamHandler):
    """Root handler in fairseq's format whose stream is looked up at every
    record (see :func:`_cli_log_stream`).  The plugin is imported while
    fairseq parses the command line, before ``fairseq-generate`` opens its
    ``--results-path`` file, so the stream cannot be fixed at import time."""

    def __init__(self):
        super().__init__(sys.stdout)
        self.setFormatter(logging.Formatter(FAIRSEQ_LOG_FORMAT, FAIRSEQ_LOG_DATEFMT))

    def emit(self, record):
        self.stream = _cli_log_stream()
        super().emit(record)


def restore_fairseq_logging() -> bool:
    """Undo fairseq's stray ``basicConfig(level=DEBUG)``. Returns whether it
    was found (and fixed)."""
    root = logging.getLogger()
    stray = [h for h in root.handlers if _is_stray_debug_handler(h)]
    if not stray:
        return False
    for handler in stray:
        root.removeHandler(handler)
    if not root.handlers:
        root.addHandler(FairseqCLIHandler())
    root.setLevel(os.environ.get("LOGLEVEL", "INFO").upper())
    return True


def install() -> None:
    install_safe_checkpoint_loading()
    restore_fairseq_logging()


__all__: Iterable[str] = [
    "CHECKPOINT_SAFE_GLOBALS",
    "TRUST_ENV_VAR",
    "UntrustedCheckpointError",
    "install",
    "restore_fairseq_logging",
    "trust_checkpoint",
]
