"""The tests' commands in forks of a pre-imported process (tests/zygote.py,
specdec_helpers.run): a fork gives what a new process gives."""
import os
import subprocess
import sys

import pytest

import specdec_helpers as H

PYTHON = H.cli("python")


def both(cmd, **kwargs):
    """``cmd`` through H.run in a fork, then as a new process."""
    forked = H.run(cmd, check=False, **kwargs)
    os.environ[H.FORK_ENV] = "0"
    try:
        fresh = H.run(cmd, check=False, **kwargs)
    finally:
        del os.environ[H.FORK_ENV]
    return forked, fresh


@pytest.fixture(autouse=True)
def forks_on(monkeypatch):
    monkeypatch.delenv(H.FORK_ENV, raising=False)
    if not H._ZYGOTE.ready():
        pytest.skip("no fork here")


def test_a_command_runs_in_a_fork_of_the_zygote():
    proc = H.run([PYTHON, "-c", "import os; print(os.getppid())"])
    assert int(proc.stdout) == H._ZYGOTE.proc.pid
    os.environ[H.FORK_ENV] = "0"
    try:
        proc = H.run([PYTHON, "-c", "import os; print(os.getppid())"])
    finally:
        del os.environ[H.FORK_ENV]
    assert int(proc.stdout) == os.getpid()


def test_argv_stdin_cwd_and_environment_as_a_new_process(tmp_path):
    code = ("import os, sys; print(sys.argv); print(os.getcwd()); print(os.environ.get('SPECDEC_X'), "
            "'HOME' in os.environ); print(sys.path[0] == ''); sys.stdout.write(sys.stdin.read())")
    forked, fresh = both([PYTHON, "-c", code, "a b", "--c"], cwd=tmp_path, input="line 1\nline 2\n",
                         env={"SPECDEC_X": "x y", "HOME": None})
    assert forked.returncode == fresh.returncode == 0, forked.stderr
    assert forked.stdout == fresh.stdout
    assert forked.stdout.splitlines() == ["['-c', 'a b', '--c']", str(tmp_path), "x y False", "True", "line 1",
                                          "line 2"]
    # no input: an empty stdin
    empty = H.run([PYTHON, "-c", "import sys; print(repr(sys.stdin.read()))"])
    assert empty.stdout.strip() == "''"


@pytest.mark.parametrize("code, status", [
    ("raise ValueError('no such thing')", 1),
    ("import sys; sys.exit(3)", 3),
    ("import sys; sys.exit('refused: a message')", 1),
    ("import sys; sys.exit()", 0),
    ("import atexit; atexit.register(lambda: print('at exit'))", 0),
])
def test_exit_status_traceback_and_exit_handlers_as_a_new_process(code, status):
    forked, fresh = both([PYTHON, "-c", code])
    assert forked.returncode == fresh.returncode == status
    assert forked.stdout == fresh.stdout
    assert forked.stderr == fresh.stderr


def test_a_script_of_the_repository_as_a_new_process(tmp_path):
    script = H.ROOT / "scripts" / "options-doc.py"
    forked, fresh = both([PYTHON, script, "--no-such-option"])
    assert forked.returncode == fresh.returncode == 2
    assert "--no-such-option" in forked.stderr
    assert forked.stderr.splitlines()[-2:] == fresh.stderr.splitlines()[-2:]


@pytest.mark.slow
def test_a_fairseq_console_script_as_a_new_process():
    forked, fresh = both([H.cli("fairseq-generate"), "--help"])
    assert forked.returncode == fresh.returncode == 0
    assert forked.stdout == fresh.stdout and "usage: fairseq-generate" in forked.stdout


def test_a_load_time_variable_starts_a_new_process():
    """The thread counts are read when torch loads: a fork of the zygote
    (loaded with 1) could not honour 2, so such a command is a new process."""
    code = "import os, torch; print(torch.get_num_threads(), os.getppid())"
    threads, parent = H.run([PYTHON, "-c", code], env={"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2"}).stdout.split()
    assert threads == "2" and int(parent) == os.getpid()
    threads, parent = H.run([PYTHON, "-c", code]).stdout.split()
    assert threads == "1" and int(parent) == H._ZYGOTE.proc.pid


def test_a_timeout_kills_the_command_and_the_next_one_runs():
    with pytest.raises(subprocess.TimeoutExpired):
        H.run([PYTHON, "-c", "import time; time.sleep(60)"], timeout=2)
    assert H.run([PYTHON, "-c", "print('next')"]).stdout == "next\n"


def test_other_commands_are_new_processes(tmp_path):
    assert H._ZYGOTE.script(["bash", "-c", "true"]) is None
    assert H._ZYGOTE.script([PYTHON, "-m", "pip", "--version"]) is None
    assert H._ZYGOTE.script([PYTHON, tmp_path / "elsewhere.py"]) is None
    assert H._ZYGOTE.script([sys.executable, H.ROOT / "scripts" / "roofline.py"]) is not None


def test_a_zygote_that_stops_mid_command_is_named_and_later_commands_are_new_processes():
    try:
        with pytest.raises(RuntimeError, match="tests/zygote.py stopped .*SPECDEC_TESTS_FORK=0"):
            H.run([PYTHON, "-c", "import os; os.kill(os.getppid(), 9)"])
        proc = H.run([PYTHON, "-c", "import os; print(os.getppid())"])
        assert int(proc.stdout) == os.getpid()
    finally:
        H._ZYGOTE.failed = False  # forks again for the other tests of this process
    proc = H.run([PYTHON, "-c", "import os; print(os.getppid())"])
    assert int(proc.stdout) == H._ZYGOTE.proc.pid
