"""The compatibility layer: safe checkpoint loading and fairseq's logging."""
import argparse
import io
import logging
import os
import re
import sys

import numpy as np
import pytest
import torch

import specdec_helpers as H
import fairseq_specdec  # noqa: F401  (installs the layer)
from fairseq_specdec import compat
from fairseq_specdec.compat import UntrustedCheckpointError


class Marker:
    """A class no allowlist knows."""

    def __init__(self, value):
        self.value = value


class Payload:
    """Unpickling this creates a file: proof that code ran."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.fixture(autouse=True)
def clean_trust(monkeypatch):
    monkeypatch.delenv(H.TRUST_ENV, raising=False)
    monkeypatch.setattr(compat, "_trusted_files", set())


@pytest.fixture
def custom_ckpt(tmp_path):
    path = tmp_path / "custom.pt"
    torch.save({"model": {"w": torch.ones(2)}, "extra": Marker(42)}, path)
    return str(path)


def test_unknown_global_is_refused_with_a_helpful_error(custom_ckpt):
    with pytest.raises(UntrustedCheckpointError) as err:
        torch.load(custom_ckpt)
    msg = str(err.value)
    assert "Marker" in msg  # names the global
    assert H.TRUST_ENV in msg  # names the opt-in
    assert custom_ckpt in msg


def test_untrusted_payload_does_not_run(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    torch.save({"model": {}, "x": Payload(str(marker))}, path)
    with pytest.raises(UntrustedCheckpointError):
        torch.load(str(path))
    assert not marker.exists()


def test_env_var_opt_in_loads_that_file_only(custom_ckpt, tmp_path, monkeypatch):
    other = tmp_path / "other.pt"
    torch.save({"extra": Marker(1)}, other)
    monkeypatch.setenv(H.TRUST_ENV, os.pathsep.join([str(tmp_path / "unrelated.pt"), custom_ckpt]))
    state = torch.load(custom_ckpt)
    assert isinstance(state["extra"], Marker) and state["extra"].value == 42
    assert torch.equal(state["model"]["w"], torch.ones(2))
    with pytest.raises(UntrustedCheckpointError):
        torch.load(str(other))


def test_env_var_opt_in_through_fairseq_loader(custom_ckpt, monkeypatch):
    """fairseq opens the file itself and passes a file object to torch.load."""
    from fairseq import checkpoint_utils

    with pytest.raises(UntrustedCheckpointError):
        checkpoint_utils.load_checkpoint_to_cpu(custom_ckpt)
    monkeypatch.setenv(H.TRUST_ENV, custom_ckpt)
    with open(custom_ckpt, "rb") as f:
        assert torch.load(f)["extra"].value == 42


def test_trust_checkpoint_call(custom_ckpt):
    compat.trust_checkpoint(custom_ckpt)
    assert torch.load(custom_ckpt)["extra"].value == 42


def test_stock_like_state_loads_without_opt_in(tmp_path):
    path = tmp_path / "stock.pt"
    state = {
        "args": argparse.Namespace(arch="transformer", lr=[0.001], data="/x"),
        "model": {"w": torch.arange(3.0)},
        "extra_state": {
            "best": np.float64(3.5),
            "arr": np.array([1, 2]),
            "i": np.int64(7),
            "f32": np.float32(0.25),
        },
    }
    torch.save(state, path)
    loaded = torch.load(str(path))
    assert loaded["args"].arch == "transformer"
    assert loaded["extra_state"]["best"] == 3.5
    assert loaded["extra_state"]["arr"].tolist() == [1, 2]
    assert loaded["extra_state"]["i"] == 7
    assert loaded["extra_state"]["f32"] == np.float32(0.25)


def test_missing_file_passes_through(tmp_path):
    with pytest.raises(FileNotFoundError):
        torch.load(str(tmp_path / "missing.pt"))


def test_corrupt_file_is_not_reported_as_untrusted(tmp_path):
    """A file that is not a checkpoint at all must not be blamed on a missing
    opt-in: telling the user to trust it would not help (and trusting files
    blindly is what the safe loader is there to avoid)."""
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(Exception) as err:
        torch.load(str(bad))
    assert not isinstance(err.value, UntrustedCheckpointError), str(err.value)[:300]


def test_install_is_idempotent():
    wrapped = torch.load
    compat.install_safe_checkpoint_loading()
    compat.install()
    assert torch.load is wrapped
    # torch.load wraps the original exactly once
    assert not getattr(torch.load.__wrapped__, "_specdec_wrapped", False)


def test_restore_fairseq_logging(monkeypatch):
    """The CLI situation: fairseq's basicConfig(level=DEBUG) left the only root
    handler (stderr, logging's default format) before the tool configured logging."""
    root = logging.getLogger()
    saved_handlers, saved_level = list(root.handlers), root.level
    out = io.StringIO()
    try:
        for h in saved_handlers:  # pytest's capture handlers included
            root.removeHandler(h)
        logging.basicConfig(level=logging.DEBUG)
        (stray,) = root.handlers
        monkeypatch.setattr(sys, "stdout", out)
        monkeypatch.delenv("LOGLEVEL", raising=False)

        assert compat.restore_fairseq_logging() is True
        assert stray not in root.handlers
        (new,) = root.handlers
        assert new.stream is out
        assert root.level == logging.INFO
        logging.getLogger("fairseq.test").info("hello")
        logging.getLogger("fairseq.test").debug("not shown")
        # nothing left to fix the second time
        assert compat.restore_fairseq_logging() is False
        assert root.handlers == [new]
    finally:
        for h in list(root.handlers):
            root.removeHandler(h)
        for h in saved_handlers:
            root.addHandler(h)
        root.setLevel(saved_level)
    lines = out.getvalue().splitlines()
    assert len(lines) == 1, lines
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \| INFO \| fairseq.test \| hello", lines[0]), lines[0]


def test_restore_keeps_foreign_handlers():
    """Handlers that are not the stray basicConfig one are left alone."""
    root = logging.getLogger()
    saved_handlers = list(root.handlers)
    try:
        for h in saved_handlers:
            root.removeHandler(h)
        mine = logging.StreamHandler(sys.stderr)
        mine.setFormatter(logging.Formatter("%(message)s"))
        root.addHandler(mine)
        assert compat.restore_fairseq_logging() is False
        assert root.handlers == [mine]
    finally:
        for h in list(root.handlers):
            root.removeHandler(h)
        for h in saved_handlers:
            root.addHandler(h)


def test_global_of_a_blocked_module_gets_the_plugins_message(tmp_path):
    """torch words a global from a module it blocks (posix.system) differently
    from an unknown one; both must get the plugin's message, never torch's
    advice to load with weights_only=False, and nothing may run."""
    marker = tmp_path / "pwned"

    class SystemPayload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    path = tmp_path / "system.pt"
    torch.save({"model": {}, "x": SystemPayload()}, path)
    with pytest.raises(UntrustedCheckpointError) as err:
        torch.load(str(path))
    msg = str(err.value)
    assert f"{os.system.__module__}.system" in msg  # names the global (posix.system)
    assert H.TRUST_ENV in msg and str(path) in msg
    assert "weights_only=False" not in msg and "weights_only` set to `False" not in msg
    assert not marker.exists()


def _truncated_checkpoint(path):
    torch.save({"model": {"w": torch.ones(64)}}, path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize(
    "make",
    [
        lambda p: p.write_bytes(b""),
        lambda p: p.write_bytes(b"not a checkpoint"),
        _truncated_checkpoint,
    ],
    ids=["empty", "junk", "truncated"],
)
def test_unreadable_checkpoint_error_names_the_file(tmp_path, make):
    """Through torch.load and through fairseq's own loader (which passes a
    file object): the error names the file, blames no missing opt-in and
    never advises disabling the safe loader."""
    from fairseq import checkpoint_utils

    path = tmp_path / "corrupt_checkpoint.pt"
    make(path)
    for load in (lambda: torch.load(str(path)), lambda: checkpoint_utils.load_checkpoint_to_cpu(str(path))):
        with pytest.raises(Exception) as err:
            load()
        msg = str(err.value)
        assert str(path) in msg, f"{type(err.value).__name__}: {msg}"
        assert not isinstance(err.value, (UntrustedCheckpointError, OSError)), msg
        assert "weights_only" not in msg and H.TRUST_ENV not in msg, msg
