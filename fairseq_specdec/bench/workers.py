"""Worker processes and the scheduler that runs row specs ``jobs`` at a time."""
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional

#: the directory holding the fairseq_specdec package, put first on the workers' PYTHONPATH
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def worker_environment(threads: int) -> Dict[str, str]:
    """A worker process's environment: this one, its torch threads pinned,
    and this checkout's package first on its PYTHONPATH."""
    path = os.pathsep.join(p for p in (PACKAGE_ROOT, os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), PYTHONPATH=path)


def worker_command(spec_path: str) -> List[str]:
    return [sys.executable, "-m", "fairseq_specdec.bench.worker", spec_path]


class WorkerProcess:
    """One configuration decoding in a fresh process (its own peak memory, pinned threads)."""

    def __init__(self, spec: Dict):
        self.tmp = tempfile.TemporaryDirectory()
        self.spec = dict(spec, result_path=os.path.join(self.tmp.name, "result.json"))
        spec_path = os.path.join(self.tmp.name, "spec.json")
        with open(spec_path, "w") as f:
            json.dump(self.spec, f)
        env = worker_environment(spec["threads"])
        self.log = open(os.path.join(self.tmp.name, "worker.log"), "w+")
        self.proc = subprocess.Popen(
            worker_command(spec_path), env=env, stdout=self.log, stderr=subprocess.STDOUT, text=True,
        )

    def done(self) -> bool:
        return self.proc.poll() is not None

    def result(self) -> Dict:
        self.proc.wait()
        try:
            if self.proc.returncode != 0:
                self.log.seek(0)
                raise RuntimeError(f"worker failed for {self.spec['name']}:\n{self.log.read()[-6000:]}")
            with open(self.spec["result_path"]) as f:
                return json.load(f)
        finally:
            self.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        self.tmp.cleanup()


def check_unique_names(specs: List[Dict]) -> None:
    seen = set()
    for spec in specs:
        if spec["name"] in seen:
            raise ValueError(f"two row specs are named {spec['name']!r}: results are matched to specs by name")
        seen.add(spec["name"])


def run_specs(specs: List[Dict], jobs: int = 1, filler: Optional[Dict] = None,
              on_result: Optional[Callable[[Dict, Dict], None]] = None,
              on_error: Optional[Callable[[Dict, str], None]] = None) -> Dict[str, Dict]:
    """Run every spec, ``jobs`` worker processes at a time; returns each
    spec's result under the spec's name (in spec order).  Names must be unique.

    With ``jobs`` > 1 and a ``filler`` spec, no slot stays idle while a row is
    being timed: when fewer rows than slots are left, the free slots run the
    filler (a decoder whose output is discarded) until the last row ends, so
    every row is timed under the same load on the other cores.

    A row whose worker fails stops the run (``RuntimeError`` with the
    worker's log), unless ``on_error(spec, message)`` is given: then the row
    is left out of the results and the others go on.
    """
    check_unique_names(specs)
    by_name = {spec["name"]: spec for spec in specs}
    results: Dict[str, Optional[Dict]] = dict.fromkeys(by_name)
    pending = list(specs)
    running: Dict[str, WorkerProcess] = {}
    fillers: List[WorkerProcess] = []
    try:
        while pending or running:
            while pending and len(running) + len(fillers) < jobs:
                spec = pending.pop(0)
                running[spec["name"]] = WorkerProcess(spec)
            if not pending and running and filler is not None:
                while len(running) + len(fillers) < jobs:
                    fillers.append(WorkerProcess(dict(filler, name="filler", filler=True)))
            finished = [name for name, w in running.items() if w.done()]
            if not finished:
                time.sleep(0.2)
                continue
            for name in finished:
                try:
                    results[name] = running.pop(name).result()
                except RuntimeError as error:
                    if on_error is None:
                        raise
                    on_error(by_name[name], str(error))
                    del results[name]
                    continue
                if on_result is not None:
                    on_result(by_name[name], results[name])
    finally:
        for w in list(running.values()) + fillers:
            w.close()
    return results
