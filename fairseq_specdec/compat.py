"""Compatibility layer between fairseq-fixed 0.12.3.1 and torch 2.13.

Installed once by ``import fairseq_specdec`` (which ``--user-dir`` does); every
function here is idempotent.

1. Safe checkpoint loading.  torch >= 2.6 unpickles checkpoints with
   ``weights_only=True``, which refuses the few non-tensor globals that
   fairseq checkpoints contain.  We allowlist exactly those
   (:data:`CHECKPOINT_SAFE_GLOBALS`) with ``torch.serialization.add_safe_globals``;
   the safe unpickler stays on, so loading a checkpoint never executes
   arbitrary pickled code.  ``torch.load`` is wrapped (not fairseq) only to
   (a) turn the unpickler's refusal into an error that names the file, the
   global and the opt-in (:class:`UntrustedCheckpointError`, whatever torch's
   wording: a global outside the allowlist, or one from a module torch
   blocks such as ``posix.system``), and never repeats torch's advice to load
   with ``weights_only=False``; a file that cannot be read at all (empty,
   truncated, corrupt) gets a :class:`CheckpointLoadError` that names it;
   (b) honour that opt-in: files listed in the environment variable
   ``SPECDEC_TRUSTED_CHECKPOINTS`` (``os.pathsep``-separated paths) or passed
   to :func:`trust_checkpoint` are loaded with ``weights_only=False``; and
   (c) refuse ``from_pretrained(..., task='draft_verify', decoding=...)``
   with flat keywords on a checkpoint trained with another task, which
   fairseq would otherwise ignore silently (:func:`_check_task_override`).

2. Logging.  Importing ``fairseq.models`` runs ``logging.basicConfig(level=DEBUG)``
   (in ``wav2vec2_classification.py``) before the command-line tools configure
   logging, so their own ``basicConfig`` calls become no-ops: log lines go to
   stderr in the wrong format and ``fairseq-generate --results-path`` loses its
   "Translated N sentences" line.  :func:`restore_fairseq_logging` removes that
   stray handler and installs the configuration the running tool asked for
   (:class:`FairseqCLIHandler`).

3. Refusals on the command line.  The plugin refuses what it cannot honour
   by raising (``ValueError``, ``FileNotFoundError``, the checkpoint
   errors above); under fairseq's command-line tools that printed a Python
   traceback.  :func:`install_cli_refusals` makes a refusal raised from this
   package's code print one line in argparse's style,
   ``fairseq-generate: error: <message>``, and exit with status 2 (argparse's
   status for a usage error).  Any other exception keeps its traceback; the
   Python API keeps raising the exceptions.
"""
import argparse
import functools
import logging
import os
import pickle
import re
import sys
import zipfile
from typing import Iterable, Optional, Set

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


class CheckpointLoadError(RuntimeError):
    """A checkpoint file that cannot be read: empty, truncated, corrupt, or
    not written by ``torch.save``."""


#: torch's safe unpickler refusing an object outside the allowlist: a named
#: global ("Unsupported global: GLOBAL m.f ..." or "unsupported GLOBAL m.f
#: whose module m is blocked"), or a call/instance of something not allowed
_REFUSED_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")
_REFUSED_OBJECT = re.compile(r"(unrecognized function .*|Can only (?:create new object|build) .* but got .*)")


#: torch's RuntimeErrors for a file that is not a readable zip checkpoint
_UNREADABLE_ZIP = ("PytorchStreamReader", "zip archive")


def _unpickler_detail(msg: str) -> str:
    """torch's own reason, without its header, its advice to load with
    ``weights_only=False`` and its pointer to the documentation."""
    lines = [ln.strip() for ln in msg.splitlines() if ln.strip()]
    lines = [
        ln.split("WeightsUnpickler error:", 1)[-1].strip()
        for ln in lines
        if "weights_only" not in ln and not ln.startswith("Check the documentation")
    ]
    lines = [ln for ln in lines if ln]
    return lines[-1] if lines else msg.splitlines()[0] if msg else "no detail"


def _refusal(path: str, f, msg: str) -> Exception:
    """The plugin's error for a failed :func:`torch.load` of ``path``: the file
    is named, and torch's advice to disable the safe loader is never repeated."""
    shown = path or repr(f)
    if "Weights only load failed" in msg:
        detail = _unpickler_detail(msg)
        refused = _REFUSED_GLOBAL.search(msg) or _REFUSED_OBJECT.search(msg)
        if refused:
            what = refused.group(1) if refused.re is _REFUSED_GLOBAL else refused.group(0)
            return UntrustedCheckpointError(
                f"refusing to load checkpoint {shown} with torch's safe loader: it needs "
                f"{what}, which is not allowed ({detail})\nfairseq-specdec allows only the "
                "globals stock fairseq checkpoints contain. If you trust this file "
                "(unpickling may run arbitrary code), opt in for it alone with\n"
                f"    export {TRUST_ENV_VAR}={path or '/path/to/checkpoint.pt'}\n"
                "(several files separated by ':'), or call "
                "fairseq_specdec.compat.trust_checkpoint(path) in Python."
            )
        reason = detail
    else:
        reason = msg.splitlines()[0] if msg else "unexpected end of file"
    return CheckpointLoadError(
        f"cannot load checkpoint {shown}: {reason.rstrip('.')}. The file is empty, truncated or "
        "corrupt, or was not written by torch.save (fairseq-train writes checkpoint_*.pt)."
    )


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
            state = original(f, *args, **kwargs)
        except OSError:  # a missing or unreadable file: the error names it already
            raise
        except (pickle.UnpicklingError, EOFError, RuntimeError) as exc:
            msg = str(exc)
            unreadable = not isinstance(exc, RuntimeError) or any(s in msg for s in _UNREADABLE_ZIP)
            if "Weights only load failed" not in msg and not unreadable:
                raise  # e.g. a CUDA tensor without CUDA: torch's error is the right one
            raise _refusal(path, f, msg) from exc
        except (KeyError, IndexError, ValueError, UnicodeDecodeError) as exc:
            # bytes that are no zip archive read as the legacy pickle format:
            # the unpickler fails on the first opcode that makes no sense
            if not path or zipfile.is_zipfile(path):
                raise
            raise _refusal(path, f, f"not a torch.save file ({type(exc).__name__}: {exc})") from exc
        _check_task_override(path, state, sys._getframe(1))
        return state

    load._specdec_wrapped = True
    return load


#: the tasks this plugin registers (a flat ``task=`` override naming one of
#: them is checked by :func:`_check_task_override`)
PLUGIN_TASKS = ("draft_verify",)


def _checkpoint_task(state) -> Optional[str]:
    if not isinstance(state, dict):
        return None
    if state.get("cfg") is not None:
        task = state["cfg"].get("task") if hasattr(state["cfg"], "get") else None
        return task.get("_name") if task is not None and hasattr(task, "get") else None
    if state.get("args") is not None:
        return getattr(state["args"], "task", None)
    return None


def _check_task_override(path: str, state, caller) -> None:
    """Refuse ``from_pretrained(..., task='draft_verify', decoding=...)`` with
    flat keywords on a checkpoint trained with another task.

    fairseq's ``from_pretrained`` passes its keywords to
    ``checkpoint_utils.load_checkpoint_to_cpu`` as ``arg_overrides``, and
    ``overwrite_args_by_name`` sets only options that the checkpoint's
    configuration already has: a string ``task`` does not change a stored
    task, so ``decoding``, ``drafter_path`` and the other options of
    ``draft_verify`` would be dropped without a word, and the model would
    decode with its training task.  (Checkpoints that store ``args``, not
    ``cfg``, take every override, and are not refused.)"""
    if caller.f_code.co_name != "load_checkpoint_to_cpu" or caller.f_globals.get("__name__") != "fairseq.checkpoint_utils":
        return
    overrides = caller.f_locals.get("arg_overrides") or {}
    task = overrides.get("task") if isinstance(overrides, dict) else None
    if not isinstance(task, str) or task not in PLUGIN_TASKS:
        return
    if not isinstance(state, dict) or state.get("cfg") is None:
        return
    trained = _checkpoint_task(state)
    if trained == task:
        return
    raise ValueError(
        f"from_pretrained(..., task={task!r}) cannot switch checkpoint {path}, trained with "
        f"--task {trained}, to the {task} task: fairseq applies flat keywords only to options "
        f"the checkpoint already has, so the {task} options (decoding=, drafter_path=, ...) "
        "would be dropped silently. Use\n"
        "    fairseq_specdec.hub.from_pretrained(model_dir, checkpoint_file=..., "
        "data_name_or_path=..., decoding='draft-verify', drafter_path=...)\n"
        f"or give the task as a dict: task={{'_name': {task!r}, 'data': DATA_DIR, "
        "'decoding': 'draft-verify', 'drafter_path': ...}"
    )


def save_checkpoint(state: dict, path: str) -> None:
    """Write ``state`` (as :func:`fairseq.checkpoint_utils.load_checkpoint_to_cpu`
    returns it, changed) to ``path`` the way fairseq's trainer saves: the
    config as plain containers (the loader made it an OmegaConf object, which
    the safe loader refuses), so that it loads back safely.  Written to a
    temporary file first, then renamed: ``path`` is whole or absent.  Its
    folder is made if missing."""
    from omegaconf import OmegaConf

    if os.path.isdir(path):
        raise IsADirectoryError(f"{path} is a directory: give the checkpoint's file name (e.g. {os.path.join(path, 'checkpoint.pt')})")
    if OmegaConf.is_config(state.get("cfg")):
        state = {**state, "cfg": OmegaConf.to_container(state["cfg"], resolve=True, enum_to_str=True)}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    try:
        torch.save(state, tmp)
        os.replace(tmp, path)
    except BaseException:  # nothing half-written stays behind
        if os.path.lexists(tmp):
            os.remove(tmp)
        raise


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


#: the exception types the plugin refuses with (the CLI prints them in one line)
REFUSALS = (ValueError, FileNotFoundError)
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def _raised_by_plugin(tb) -> bool:
    """Whether the innermost frame of a traceback is this package's code."""
    last = None
    while tb is not None:
        last, tb = tb, tb.tb_next
    return last is not None and os.path.abspath(last.tb_frame.f_code.co_filename).startswith(_PACKAGE_DIR + os.sep)


def install_cli_refusals(argv0: Optional[str] = None) -> bool:
    """Under a fairseq command-line tool (``fairseq-generate``,
    ``fairseq-interactive``, ...: the program name starts with
    ``fairseq-``), print the plugin's own refusals as ``PROG: error:
    MESSAGE`` and exit with status 2 (see the module docstring).  Returns
    whether the hook was installed."""
    prog = os.path.basename(argv0 if argv0 is not None else (sys.argv[0] if sys.argv else ""))
    if not prog.startswith("fairseq-") or getattr(sys.excepthook, "_specdec", False):
        return False
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        if issubclass(exc_type, REFUSALS + (CheckpointLoadError, UntrustedCheckpointError)) and _raised_by_plugin(tb):
            sys.stdout.flush()
            sys.stderr.write(f"{prog}: error: {exc}\n")
            sys.stderr.flush()
            os._exit(2)  # argparse's status; nothing was decoded or written
        previous(exc_type, exc, tb)

    hook._specdec = True
    sys.excepthook = hook
    return True


def install() -> None:
    install_safe_checkpoint_loading()
    restore_fairseq_logging()


__all__: Iterable[str] = [
    "CHECKPOINT_SAFE_GLOBALS",
    "CheckpointLoadError",
    "TRUST_ENV_VAR",
    "UntrustedCheckpointError",
    "install",
    "install_cli_refusals",
    "restore_fairseq_logging",
    "save_checkpoint",
    "trust_checkpoint",
]
