"""A Python process that has imported torch and fairseq once, and runs each
of the tests' fairseq commands in a fork of itself (tests/specdec_helpers.run).

Every fairseq command of the suite is a new process, and a new process spends
about 5 s importing torch, fairseq and what fairseq imports (scikit-learn,
scipy) before it reads its first option.  A fork of this process starts with
those modules imported, and then runs the command's own file as the
interpreter would, as ``__main__``: the console script of
``fairseq-generate`` (or ``fairseq-train``, ...) from the venv's ``bin/``, a
script of the repository's ``scripts/``, or the code of ``python -c``; with
the command's argv, environment, working directory, stdin (a file, or
empty), stdout and stderr.  Only torch and the ``fairseq`` package are
imported before the fork: not ``fairseq_cli`` (its modules configure logging
when imported), not the plugin (it reads ``FAIRSEQ_SPECDEC_*`` at import), so
each command imports those itself, as a new process does.

What a fork cannot change after the import is what torch and its OpenMP
runtime read when loaded (``OMP_*``, ``MKL_*``, ``TORCH_*``, ...):
specdec_helpers.run only sends a command here when those variables are the
ones this process started with, and runs any other command as a new process.

Protocol (one request at a time, JSON lines): the parent writes
``{"path" or "code", "argv", "env", "cwd", "stdin", "stdout", "stderr"}``
(the script or the ``-c`` code, its argv, environment and folder, the name
of its input file or null, the names of its output files); this process
forks, answers ``{"pid": ...}`` at once (so that the parent can kill the
command on a timeout, as subprocess.run kills its child), then
``{"rc": ...}`` (the exit status as subprocess reports it) when the command
ends.  It exits when its stdin closes.
"""
import json
import os
import sys


def run_child(request, channels) -> None:
    """In the fork: become the command (never returns)."""
    code = 1
    try:
        for fd in channels:
            os.close(fd)
        stdin = os.open(request.get("stdin") or os.devnull, os.O_RDONLY)
        os.dup2(stdin, 0)
        os.close(stdin)
        for fd, name in ((1, request["stdout"]), (2, request["stderr"])):
            out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(out, fd)
            os.close(out)
        if request.get("cwd"):
            os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = list(request["argv"])
        if request.get("code") is not None:
            # as `python -c CODE`: the working directory first on sys.path
            path = "<string>"
            sys.path[0] = ""
            source = compile(request["code"], path, "exec")
        else:
            # as `python PATH`: the script's folder first on sys.path
            path = os.path.abspath(request["path"])
            sys.path[0] = os.path.dirname(path)
            source = None
        import runpy

        try:
            if source is not None:
                # a new __main__ module, as `python -c` has (this file's stays intact)
                import types

                main_module = types.ModuleType("__main__")
                sys.modules["__main__"] = main_module
                exec(source, main_module.__dict__)
            else:
                runpy.run_path(path, run_name="__main__")
            code = 0
        except SystemExit as stop:
            if stop.code is None:
                code = 0
            elif isinstance(stop.code, int):
                code = stop.code
            else:
                print(stop.code, file=sys.stderr)
                code = 1
        except BaseException:  # what the interpreter does with an uncaught exception
            kind, error, tb = sys.exc_info()
            # the traceback from the script's own frame, as `python path` prints it
            first = tb
            while first is not None and first.tb_frame.f_code.co_filename != path:
                first = first.tb_next
            sys.excepthook(kind, error.with_traceback(first or tb), first or tb)
            code = 1
        # the interpreter's exit: wait for non-daemon threads, run atexit, flush
        import threading

        shutdown = getattr(threading, "_shutdown", None)
        if shutdown is not None:
            shutdown()
        import atexit

        atexit._run_exitfuncs()
    except BaseException:
        try:
            import traceback

            traceback.print_exc()
        except BaseException:
            pass
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:
                pass
        os._exit(code & 0xFF)


def main() -> None:
    requests = os.fdopen(os.dup(0), "r")
    replies = os.fdopen(os.dup(1), "w")
    # nothing this process or a fork prints reaches the protocol's pipes
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.close(null)

    import torch  # noqa: F401
    import fairseq  # noqa: F401

    replies.write(json.dumps({"ready": os.getpid()}) + "\n")
    replies.flush()
    for line in requests:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            run_child(request, (requests.fileno(), replies.fileno()))
        replies.write(json.dumps({"pid": pid}) + "\n")
        replies.flush()
        _, status = os.waitpid(pid, 0)
        replies.write(json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\n")
        replies.flush()


if __name__ == "__main__":
    main()
