"""The benchmark's row scheduler (fairseq_specdec.bench.workers.run_specs), with
fake worker processes: results keep the spec order, never more than ``jobs``
processes run, and once no row is waiting every free slot runs the filler
until the last row ends (so each row is timed under the same load)."""
import pytest

import specdec_helpers as H
from fairseq_specdec.bench import cli, workers


@pytest.fixture
def benchmark(monkeypatch):
    """The scheduler module, its polling sleep made instant."""
    monkeypatch.setattr(workers.time, "sleep", lambda s: None)
    return workers


class FakeWorkers:
    """Each fake worker finishes after a given number of polls."""

    def __init__(self, polls):
        self.polls = polls  # spec name -> polls before done
        self.alive = []
        self.trace = []  # (rows alive, fillers alive) at every poll

    def factory(self):
        fake = self

        class Worker:
            def __init__(self, spec):
                self.spec, self.left, self.closed = spec, fake.polls.get(spec["name"], 0), False
                fake.alive.append(self)

            def done(self):
                rows = [w for w in fake.alive if not w.spec.get("filler")]
                fake.trace.append((len(rows), len(fake.alive) - len(rows)))
                self.left -= 1
                return self.left < 0

            def result(self):
                self.close()
                return {"name": self.spec["name"]}

            def close(self):
                if not self.closed:
                    self.closed = True
                    fake.alive.remove(self)

        return Worker


def test_rows_in_order_jobs_bound_and_filler_until_the_last_row(benchmark, monkeypatch):
    fake = FakeWorkers({"a": 1, "b": 8, "c": 2, "d": 5})
    monkeypatch.setattr(benchmark, "WorkerProcess", fake.factory())
    specs = [{"name": n} for n in "abcd"]
    seen = []
    out = benchmark.run_specs(specs, jobs=2, filler={"name": "x"}, on_result=lambda s, r: seen.append(s["name"]))
    assert list(out) == list("abcd")
    assert [r["name"] for r in out.values()] == list("abcd")
    assert sorted(seen) == list("abcd")
    assert all(rows + fillers <= 2 for rows, fillers in fake.trace)
    # whenever a row is being timed, both slots are busy
    assert all(rows + fillers == 2 for rows, fillers in fake.trace if rows > 0)
    assert any(fillers > 0 for _, fillers in fake.trace)  # the last row had a filler beside it
    assert fake.alive == []  # fillers stopped at the end


def test_one_job_runs_rows_one_at_a_time_without_filler(benchmark, monkeypatch):
    fake = FakeWorkers({"a": 3, "b": 1})
    monkeypatch.setattr(benchmark, "WorkerProcess", fake.factory())
    out = benchmark.run_specs([{"name": "a"}, {"name": "b"}], jobs=1, filler={"name": "x"})
    assert list(out) == ["a", "b"] and [r["name"] for r in out.values()] == ["a", "b"]
    assert all(rows == 1 and fillers == 0 for rows, fillers in fake.trace)


def test_a_failing_row_stops_the_fillers(benchmark, monkeypatch):
    fake = FakeWorkers({"a": 0, "b": 4})
    Worker = fake.factory()

    class Failing(Worker):
        def result(self):
            self.close()
            if self.spec["name"] == "b":
                raise RuntimeError("worker failed for b")
            return {"name": self.spec["name"]}

    monkeypatch.setattr(benchmark, "WorkerProcess", Failing)
    with pytest.raises(RuntimeError, match="failed for b"):
        benchmark.run_specs([{"name": "a"}, {"name": "b"}], jobs=2, filler={"name": "x"})
    assert fake.alive == []
    # --keep-going: the failed row is left out and told about, the others run to the end
    failed = []
    out = benchmark.run_specs([{"name": "b"}, {"name": "a"}, {"name": "c"}], jobs=1,
                              on_error=lambda spec, message: failed.append((spec["name"], message)))
    assert list(out) == ["a", "c"] and failed == [("b", "worker failed for b")]
    assert fake.alive == []


@pytest.mark.parametrize("args, message", [
    (["--jobs", "0"], "--jobs must be at least 1"),
    (["--threads", "0"], "--threads must be at least 1"),
    (["--batch-sizes", "1,x"], "--batch-sizes takes comma-separated positive integers"),
    (["--batch-sizes", "1", "--relaxed-batch-sizes", "32"], "must be among --batch-sizes"),
    (["--sweeps", "--sweep-ks", "0"], "--sweep-ks takes comma-separated positive integers"),
    (["--sweeps", "--sweep-taus", "1,x"], "--sweep-taus takes comma-separated numbers"),
    (["--relaxed", "3-1"], "--relaxed takes comma-separated beta:tau pairs"),
    (["--limit", "0"], "--limit must be at least 1"),
    (["--warmup", "-1"], "--warmup must be at least 0"),
    (["--rows", "beam5,beam1,nope"], "unknown --rows ['nope']; choose from beam5, beam1, strict, relaxed, ct2, ct2-int8, draft-verify, input-guided, blockwise, ngram, ngram+draft-verify, self-draft, loop-greedy"),
    (["--rows", "beam1,strict"], "--rows must include beam5 and beam1"),
    (["--rows", "beam5,beam1,blockwise"], "--rows blockwise needs --blockwise"),
    (["--drafter", "DRAFTER"], "2 drafters without a label; give each drafter its own label"),
    (["--drafter", "x=DRAFTER", "--drafter", "x=DRAFTER"], "2 drafters labelled 'x'"),
    (["--drafter", "y=missing.pt"], "no such file: missing.pt"),
    (["--user-dir", "no-such-plugin"], "--user-dir no-such-plugin: no such directory"),
    (["--variant", "graphs"], "--variant 'graphs': expected LABEL=OPTIONS"),
    (["--variant", "graphs:loop-greedy,nope=FAIRSEQ_SPECDEC_OFF=graphs"], "--variant graphs: no row kind 'nope' (kinds: beam5,"),
])
def test_bad_benchmark_options_fail_before_any_decoding(benchmark, monkeypatch, tmp_path, capsys, args, message):
    """A clear error, not a traceback or (for --jobs 0) a loop that never starts a row."""
    for name in ("verifier.pt", "drafter.pt", "ref.txt"):
        (tmp_path / name).write_text("x")
    started = []
    monkeypatch.setattr(benchmark, "run_specs", lambda *a, **k: started.append(a) or {})
    argv = ["--data", str(tmp_path), "--verifier", str(tmp_path / "verifier.pt"), "--drafter", str(tmp_path / "drafter.pt"),
            "--raw-ref", str(tmp_path / "ref.txt"), "--out", str(tmp_path / "out")]
    argv += [a.replace("DRAFTER", str(tmp_path / "drafter.pt")) for a in args]
    with pytest.raises(SystemExit):
        cli.main(argv)
    assert message in capsys.readouterr().err
    assert not started


@pytest.mark.parametrize("args, message", [
    (["--limit", "0"], "--limit must be at least 1"),
    (["--warmup", "-1"], "--warmup must be at least 0"),
    (["--batch-size", "0"], "--batch-size must be at least 1"),
    (["--drafter", "missing.pt"], "no such file: missing.pt"),
])
def test_bad_profile_options_fail_before_loading(tmp_path, args, message):
    (tmp_path / "verifier.pt").write_text("x")
    (tmp_path / "drafter.pt").write_text("x")
    proc = H.run([
        H.cli("python"), H.ROOT / "scripts" / "profile-draft-verify.py", "--data", tmp_path,
        "--verifier", tmp_path / "verifier.pt", "--drafter", tmp_path / "drafter.pt",
    ] + args, check=False)
    assert proc.returncode == 2 and message in proc.stderr
