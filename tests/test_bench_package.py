"""The benchmark harness as a package (fairseq_specdec.bench): rows built from
the registry of decodings and from every labelled drafter, results matched to
their specs by name, the device option, the profiler's loud failure on a
renamed component; end to end: two labelled drafters give two sets of rows, a
decoding registered by a --user-dir plugin runs as a row."""
import json
import random
import shutil
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import specdec_helpers as H
from fairseq_specdec.bench import cli, loading, plots, profiling, specs, workers
from fairseq_specdec.generation.registry import DECODINGS, Decoding


def builder(drafters=("",), decodings=None, blockwise="bw.pt"):
    common = dict(data="bin", src="en", tgt="de", threads=1, limit=None, warmup=0, device="cpu", user_dir=None)
    parsed = [specs.DrafterArg.parse(d if "=" in d or not d else f"{d}={d}.pt") if d else specs.DrafterArg("", "dr.pt")
              for d in drafters]
    return specs.RowSpecs(common, "ver.pt", parsed, blockwise, DECODINGS if decodings is None else decodings)


# ---------------------------------------------------------------- drafters and row names
def test_drafter_option_label_and_path():
    assert specs.DrafterArg.parse("big=runs/d.pt") == specs.DrafterArg("big", "runs/d.pt")
    assert specs.DrafterArg.parse("runs/d.pt") == specs.DrafterArg("", "runs/d.pt")
    # '=' inside a path is no label
    assert specs.DrafterArg.parse("runs/a=b/d.pt") == specs.DrafterArg("", "runs/a=b/d.pt")
    with pytest.raises(ValueError, match="2 drafters labelled 'a'"):
        specs.parse_drafters(["a=x.pt", "a=y.pt"])
    assert [d.label for d in specs.parse_drafters(["x.pt", "a=y.pt"])] == ["", "a"]


def test_two_labelled_drafters_give_two_sets_of_rows():
    build = builder(drafters=("small", "big"))
    rows = build.main_rows(["beam5", "beam1", "strict", "relaxed"], [1, 8], [1], [("3", "1")])
    by_name = {r["name"]: r for r in rows}
    assert len(by_name) == len(rows)
    expected = {"beam5@bs1", "beam1@bs1", "beam5@bs8", "beam1@bs8"}
    for label in ("small", "big"):
        expected |= {f"strict-{label}@bs1", f"strict-{label}@bs8", f"b3t1-{label}@bs1"}
        assert by_name[f"strict-{label}@bs1"]["label"] == f"draft-verify strict ({label})"
        assert by_name[f"b3t1-{label}@bs1"]["label"] == f"draft-verify beta=3 tau=1 ({label})"
        assert by_name[f"strict-{label}@bs8"]["path"] == f"ver.pt:{label}.pt"
        assert by_name[f"b3t1-{label}@bs1"]["drafter"] == label
        assert by_name[f"b3t1-{label}@bs1"]["extra"][:6] == ["--decoding", "draft-verify", "--verify-beta", "3",
                                                            "--verify-tau", "1.0"]
    assert set(by_name) == expected


def test_unlabelled_drafter_keeps_todays_names():
    rows = builder().main_rows(["beam5", "beam1", "strict", "relaxed"], [1], [1], [("3", "1"), ("5", "3")])
    assert [r["name"] for r in rows] == ["beam5@bs1", "beam1@bs1", "strict@bs1", "b3t1@bs1", "b5t3@bs1"]
    assert [r["label"] for r in rows][2:] == ["draft-verify strict", "draft-verify beta=3 tau=1",
                                              "draft-verify beta=5 tau=3"]


def test_rows_of_every_registered_decoding(monkeypatch):
    """Each decoding's bench entry puts its own checkpoint in --path; --decoding
    NAME and the entry's options follow; a decoding that takes a drafter gets a
    row per drafter (by default, with no entry of its own)."""
    monkeypatch.setattr(specs, "BENCH_ENTRIES", dict(specs.BENCH_ENTRIES))
    specs.register_bench_entry("solo", specs.BenchEntry(label="solo decoder", extra=("--x", "1")))
    specs.register_bench_entry("heads", specs.BenchEntry("blockwise"))
    with pytest.raises(ValueError, match="bench model 'nowhere' is none of"):
        specs.register_bench_entry("bad", specs.BenchEntry("nowhere"))
    decodings = {
        "solo": Decoding(name="solo", help="", build=None),
        "paired": Decoding(name="paired", help="", build=None, takes_drafter=True),
        "heads": Decoding(name="heads", help="", build=None),
    }
    build = builder(drafters=("a", "b"), decodings=decodings)
    wanted = specs.resolve_rows("beam5,beam1,solo,paired,heads", decodings, build.drafters, "bw.pt")
    rows = {r["name"]: r for r in build.main_rows(wanted, [2], [2], [])}
    assert rows["solo@bs2"]["path"] == "ver.pt" and rows["solo@bs2"]["label"] == "solo decoder"
    assert rows["solo@bs2"]["extra"] == ["--decoding", "solo", "--x", "1"] and rows["solo@bs2"]["decoding"] == "solo"
    assert rows["paired-a@bs2"]["path"] == "ver.pt:a.pt" and rows["paired-b@bs2"]["label"] == "paired (b)"
    assert rows["heads@bs2"]["path"] == "bw.pt" and rows["heads@bs2"]["beam"] == 1
    assert set(rows) == {"beam5@bs2", "beam1@bs2", "solo@bs2", "paired-a@bs2", "paired-b@bs2", "heads@bs2"}
    with pytest.raises(ValueError, match="--rows heads needs --blockwise"):
        specs.resolve_rows("beam5,beam1,heads", decodings, build.drafters, None)
    with pytest.raises(ValueError, match="--rows paired needs --drafter"):
        specs.resolve_rows("beam5,beam1,paired", decodings, [], "bw.pt")


def test_a_kind_can_be_limited_to_some_drafters():
    """KIND:LABEL+LABEL: the kind's rows for those --drafter labels only (a
    decoding that needs a tree drafter gets no row with a chain-only one)."""
    decodings = {"paired": Decoding(name="paired", help="", build=None, takes_drafter=True)}
    build = builder(drafters=("a", "b", "c"), decodings=decodings)
    wanted = specs.resolve_rows("beam5,beam1,paired:b,strict:a+c", decodings, build.drafters, None)
    assert wanted == ["beam5", "beam1", "paired:b", "strict:a+c"]
    rows = {r["name"]: r for r in build.main_rows(wanted, [1], [1], [])}
    assert set(rows) == {"beam5@bs1", "beam1@bs1", "paired-b@bs1", "strict-a@bs1", "strict-c@bs1"}
    assert rows["paired-b@bs1"]["kind"] == "paired:b"
    assert [d.label for d in build.drafters] == ["a", "b", "c"]  # the builder keeps every drafter
    with pytest.raises(ValueError, match="--rows paired:z: no --drafter LABEL=PATH with the label 'z'"):
        specs.resolve_rows("beam5,beam1,paired:z", decodings, build.drafters, None)
    with pytest.raises(ValueError, match="unknown --rows"):
        specs.resolve_rows("beam5,beam1,nosuch:a", decodings, build.drafters, None)


def test_registry_rows_of_the_plugin():
    """The plugin's own decodings are rows, built from their registry entries
    and the benchmark's own entries of them (label, checkpoint)."""
    assert {"draft-verify", "input-guided", "blockwise"} <= set(specs.row_kinds(DECODINGS))
    # draft-verify is the strict row
    assert specs.resolve_rows("beam5,beam1,draft-verify,strict", DECODINGS, builder().drafters, None) == [
        "beam5", "beam1", "strict"]
    rows = {r["name"]: r for r in builder().main_rows(["input-guided", "blockwise"], [1], [1], [])}
    assert rows["input-guided@bs1"]["label"] == "input-guided"  # no entry: the decoding's name
    assert rows["input-guided@bs1"]["path"] == "ver.pt"
    assert rows["blockwise@bs1"]["path"] == "bw.pt"
    assert rows["blockwise@bs1"]["label"] == "blockwise heads"


# ---------------------------------------------------------------- results matched by name
def test_results_are_matched_to_specs_by_name_not_position(monkeypatch):
    """Workers finish in another order than they started: every result still
    lands under its own spec's name; two specs with one name are refused."""
    polls = {"a": 6, "b": 0, "c": 3}

    class Worker:
        def __init__(self, spec):
            self.spec, self.left = spec, polls[spec["name"]]

        def done(self):
            self.left -= 1
            return self.left < 0

        def result(self):
            return {"from": self.spec["name"]}

        def close(self):
            pass

    monkeypatch.setattr(workers, "WorkerProcess", Worker)
    monkeypatch.setattr(workers.time, "sleep", lambda s: None)
    finished = []
    out = workers.run_specs([{"name": n} for n in "abc"], jobs=3,
                            on_result=lambda spec, r: finished.append((spec["name"], r["from"])))
    assert [name for name, _ in finished] == ["b", "c", "a"]  # the order they ended
    assert all(name == source for name, source in finished)
    assert {name: r["from"] for name, r in out.items()} == {"a": "a", "b": "b", "c": "c"}
    with pytest.raises(ValueError, match="two row specs are named 'a'"):
        workers.run_specs([{"name": "a"}, {"name": "a"}], jobs=1)


def test_sweep_results_read_each_result_by_its_name():
    """Each sweep point comes from the result of the spec of that name, in
    whatever order the results arrive, for every drafter."""
    build = builder(drafters=("p", "q"))
    batch_sizes, ks, beta_tau = [1, 4], [2, 6], [(1, 0.0), (3, 1.0)]
    sweep = build.sweep_rows(batch_sizes, ks, beta_tau)
    names = [s["name"] for s in sweep]
    assert len(set(names)) == len(names)
    assert {"sweep-beam1@bs4", "sweep-strict-p@bs4", "sweep-k6-q", "sweep-b3t1.0-p"} <= set(names)
    # every result is distinguishable: its seconds and Tok. encode its position in the spec list
    results = {s["name"]: {"seconds": (i + 1) / 1000.0, "sentences": 1, "tok": float(i), "idx": i}
               for i, s in enumerate(sweep)}
    shuffled = dict(random.Random(0).sample(sorted(results.items()), len(results)))
    out = build.sweep_results(shuffled, batch_sizes, ks, beta_tau, bleu=lambda r: r["idx"])

    def idx(name):
        return names.index(name)

    assert out["batch_sweep"]["fairseq beam 1"] == {str(bs): idx(f"sweep-beam1@bs{bs}") + 1.0 for bs in batch_sizes}
    for label in ("p", "q"):
        assert out["batch_sweep"][f"draft-verify strict ({label})"]["4"] == idx(f"sweep-strict-{label}@bs4") + 1.0
        assert out["k_sweep"][f"strict ({label})"]["6"]["tok"] == idx(f"sweep-k6-{label}")
        point = out["beta_tau_sweep"][f"beta=3 ({label})"]["1"]
        assert point["tok"] == point["sacrebleu"] == idx(f"sweep-b3t1.0-{label}")
    assert set(out["beta_tau_sweep"]) == {"beta=1 (p)", "beta=3 (p)", "beta=1 (q)", "beta=3 (q)"}


def test_speedup_plot_takes_rows_of_every_drafter():
    rows = [dict(name=f"{n}-{d}@bs1", batch_size=1, decoding="draft-verify", drafter=d)
            for d in ("a", "b") for n in ("strict", "b3t1", "b3t3", "b5t1")]
    rows.append(dict(name="strict-a@bs8", batch_size=8, decoding="draft-verify", drafter="a"))
    assert [r["name"] for r in plots.speedup_rows(rows)] == [
        "strict-a@bs1", "b3t1-a@bs1", "b3t3-a@bs1", "strict-b@bs1", "b3t1-b@bs1", "b3t3-b@bs1"]


# ---------------------------------------------------------------- device
def test_device_option():
    spec = dict(data="bin", path="v.pt", batch_size=1, beam=1, src="en", tgt="de", extra=["--decoding", "x"])
    assert "--cpu" in loading.generate_argv(dict(spec, device="cpu"))
    assert "--cpu" not in loading.generate_argv(dict(spec, device="cuda"))
    assert loading.generate_argv(spec)[-2:] == ["--decoding", "x"]
    assert cli.resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    assert cli.resolve_device("cpu") == "cpu"
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="--device cuda: torch sees no GPU"):
            cli.resolve_device("cuda")


def test_table_has_a_gpu_memory_column_only_on_cuda():
    row = dict(label="x", batch_size=1, sent_per_s=1.0, ms_per_sent=1.0, speedup_vs_beam5=1.0, speedup_vs_beam1=1.0,
               tok=1.0, iterations=3, sacrebleu=1.0, peak_rss_mb=100.0, identical_to_beam1=True)
    cpu = cli.markdown_table([row]).splitlines()
    assert "peak GPU MB" not in cpu[0] and cpu[0].count("|") == cpu[2].count("|") == 13
    gpu = cli.markdown_table([dict(row, peak_gpu_mb=512.0)]).splitlines()
    assert "| peak MB | peak GPU MB | = beam 1 |" in gpu[0]
    assert gpu[0].count("|") == gpu[1].count("|") == gpu[2].count("|") == 14
    assert "| 100 | 512 | True |" in gpu[2]


# ---------------------------------------------------------------- profiler
def test_profiler_fails_loudly_on_a_missing_component():
    """A renamed method is an error naming it, not a row silently dropped."""
    class Verifier:
        def encode(self):
            pass

    timers = profiling.Timers()
    timers.wrap(Verifier(), "encode", "verifier encoder")
    with pytest.raises(profiling.MissingComponent, match="cannot time 'KV-cache rollback': Verifier has no method 'rollback'"):
        timers.wrap(Verifier(), "rollback", "KV-cache rollback")
    with pytest.raises(profiling.MissingComponent, match="None has no method 'output_layer'"):
        timers.wrap(None, "output_layer", "of which: projection")
    # the draft-verify components of a generator whose verifier lost a method
    fn = staticmethod(lambda *a: None)
    from fairseq_specdec.generation.verify_pass import VerifyPass

    verifier = type("CachedVerifier", (), dict(encode=fn, forward=fn, logits=fn, reorder=fn,
                                               timed_parts=VerifyPass.timed_parts))()
    from fairseq_specdec.generation.drafters import TimedParts

    class Parts(TimedParts):  # a drafter that names its parts
        start_batch = propose = fn

        def timed_parts(self, k):
            return iter([(self, "start_batch", "drafter start"), (self, "propose", "pass")])

    drafter = Parts()
    assert [name for _, _, name, *_ in profiling.drafter_parts(drafter, 4)] == ["drafter start", "pass"]
    plain = SimpleNamespace(start_batch=fn, propose=fn)  # one that does not: the contract's calls
    assert [part[1] for part in profiling.drafter_parts(plain, 4)] == ["start_batch", "propose", "update"]
    generator = SimpleNamespace(block_size=4, verifier=verifier, drafter=drafter)
    timers = profiling.Timers()
    with pytest.raises(profiling.MissingComponent, match="CachedVerifier has no method 'rollback'"):
        for component in profiling.draft_verify_components(generator):
            timers.wrap(*component)


def test_profiler_fails_loudly_on_a_component_never_called():
    """A method that still exists but that the decoder no longer calls."""
    class Drafter:
        def propose(self):
            return 1

        def draft(self):
            return 2

    drafter, timers = Drafter(), profiling.Timers()
    timers.wrap(drafter, "propose", "drafter pass")
    timers.wrap(drafter, "draft", "old drafter pass")
    timers.wrap(drafter, "__init__", "optional part", False)
    timers.enabled = True
    assert drafter.propose() == 1
    with pytest.raises(profiling.MissingComponent, match=r"never called while decoding: 'old drafter pass' \(Drafter.draft\)"):
        timers.check_called()
    drafter.draft()
    timers.check_called()  # the optional part may stay uncalled
    assert timers.calls["drafter pass"] == timers.calls["old drafter pass"] == 1


# ---------------------------------------------------------------- end to end
def bench(toy_bin, ar_checkpoint, out, *args):
    raw_ref = Path(toy_bin).parent / "raw" / "test.tgt"
    H.run([H.cli("python"), H.ROOT / "scripts" / "benchmark.py", "--data", toy_bin, "--src", "src", "--tgt", "tgt",
           "--verifier", ar_checkpoint, "--raw-ref", raw_ref, "--detok-lang", "en", "--warmup", "3",
           "--limit", "20", "--out", out, *args])
    return json.loads((out / "results.json").read_text())


@pytest.mark.slow
def test_two_labelled_drafters_run_and_plot_end_to_end(toy_bin, ar_checkpoint, nat_checkpoint, tmp_path):
    """The same drafter twice under two labels: two sets of rows and sweep
    series, each identical to beam 1 and to the other."""
    out = tmp_path / "bench"
    results = bench(toy_bin, ar_checkpoint, out, "--drafter", f"one={nat_checkpoint}", "--drafter", f"two={nat_checkpoint}",
                    "--rows", "beam5,beam1,strict,relaxed", "--relaxed", "3:1", "--batch-sizes", "1", "--device", "cpu",
                    "--sweeps", "--sweep-batch-sizes", "2", "--sweep-ks", "2", "--sweep-betas", "3", "--sweep-taus", "1")
    assert results["device"] == "cpu"
    rows = {r["name"]: r for r in results["rows"]}
    assert set(rows) == {"beam5@bs1", "beam1@bs1", "strict-one@bs1", "strict-two@bs1", "b3t1-one@bs1", "b3t1-two@bs1"}
    for label in ("one", "two"):
        strict = rows[f"strict-{label}@bs1"]
        assert strict["label"] == f"draft-verify strict ({label})" and strict["drafter"] == label
        assert strict["identical_to_beam1"] and strict["sentences"] == 20
        assert (out / f"hyp.strict-{label}@bs1.txt").read_text().count("\n") == 20
        assert set(results["k_sweep"][f"strict ({label})"]) == {"2"}
        assert set(results["batch_sweep"][f"draft-verify strict ({label})"]) >= {"2"}
        assert f"beta=3 ({label})" in results["beta_tau_sweep"]
    assert rows["strict-one@bs1"]["tok"] == rows["strict-two@bs1"]["tok"]  # one checkpoint, same drafts
    table = (out / "results.md").read_text()
    assert "| draft-verify strict (one) | 1 |" in table and "| draft-verify beta=3 tau=1 (two) | 1 |" in table
    for name in ("speedup-distribution.png", "latency-vs-batch.png", "tok-vs-k.png", "tok-vs-beta-tau.png"):
        assert (out / name).stat().st_size > 1000, name


PLUGIN = '''
"""A throwaway plugin: registers one more decoding, and how the benchmark labels it."""
import fairseq_specdec  # noqa: F401
from fairseq_specdec.bench.specs import BenchEntry, register_bench_entry
from fairseq_specdec.generation.registry import DECODINGS, Decoding, register_decoding

register_decoding(Decoding(name="copy-twice", help="input-guided under another name",
                           build=DECODINGS["input-guided"].build, relaxed=False))
register_bench_entry("copy-twice", BenchEntry(label="copy twice"))
'''


@pytest.mark.slow
def test_a_decoding_registered_by_a_user_dir_plugin_is_a_row(toy_bin, ar_checkpoint, tmp_path):
    plugin = tmp_path / "bench_test_plugin"
    plugin.mkdir()
    (plugin / "__init__.py").write_text(textwrap.dedent(PLUGIN))
    out = tmp_path / "bench"
    results = bench(toy_bin, ar_checkpoint, out, "--user-dir", plugin, "--rows", "beam5,beam1,copy-twice",
                    "--batch-sizes", "4")
    rows = {r["name"]: r for r in results["rows"]}
    assert set(rows) == {f"{k}@bs4" for k in ("beam5", "beam1", "copy-twice")}
    for bs in (4,):
        row = rows[f"copy-twice@bs{bs}"]
        assert row["decoding"] == "copy-twice" and row["label"] == "copy twice"
        assert row["identical_to_beam1"] and row["sentences"] == 20
        # decoded by the speculative loop under the plugin's decoding (the toy translation copies nothing)
        assert row["summary"].startswith("copy-twice:") and "histogram" in row
    assert "| copy twice | 4 |" in (out / "results.md").read_text()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (torch.cuda.is_available() is False)")
@pytest.mark.slow
def test_cuda_rows_report_peak_gpu_memory(toy_bin, ar_checkpoint, nat_checkpoint, tmp_path):
    out = tmp_path / "bench"
    results = bench(toy_bin, ar_checkpoint, out, "--drafter", nat_checkpoint, "--rows", "beam5,beam1,strict",
                    "--batch-sizes", "1,4", "--device", "cuda")
    assert results["device"] == "cuda"
    for r in results["rows"]:
        assert r["peak_gpu_mb"] > 0 and r["peak_rss_mb"] > 0
    assert all(r["identical_to_beam1"] for r in results["rows"] if r["name"].startswith(("beam1", "strict")))
    assert "peak GPU MB" in (out / "results.md").read_text()


def test_drafter_options_reach_only_their_drafters_rows():
    """--drafter-options LABEL=OPTIONS: the same checkpoint under two labels
    compares two settings; options naming no labelled drafter are refused."""
    drafters = specs.parse_drafters(["fixed=d.pt", "adaptive=d.pt"], ["adaptive=--adaptive-draft --draft-min-confidence 0.3"])
    assert drafters[0].options == () and drafters[1].options == ("--adaptive-draft", "--draft-min-confidence", "0.3")
    for bad in (["nosuch=--adaptive-draft"], ["--adaptive-draft"]):
        with pytest.raises(ValueError, match="--drafter-options"):
            specs.parse_drafters(["fixed=d.pt"], bad)
    common = dict(data="bin", src="en", tgt="de", threads=1, limit=None, warmup=0, device="cpu", user_dir=None)
    rows = specs.RowSpecs(common, "ver.pt", drafters, None, DECODINGS).main_rows(["strict"], [1], [1], [])
    by_name = {r["name"]: r for r in rows}
    assert "--adaptive-draft" not in by_name["strict-fixed@bs1"]["extra"]
    assert by_name["strict-adaptive@bs1"]["extra"][-3:] == ["--adaptive-draft", "--draft-min-confidence", "0.3"]


def test_variants_repeat_only_the_plugins_rows():
    """--variant LABEL=OPTIONS: each row of the plugin's decodings again with
    the options appended, named ROW+LABEL; fairseq's rows run once."""
    variants = specs.parse_variants(["graphs=FAIRSEQ_SPECDEC_OFF=graphs --block-size 3"])
    assert variants == [specs.Variant("graphs", ("FAIRSEQ_SPECDEC_OFF=graphs", "--block-size", "3"))]
    for bad in (["graphs"], ["=--x"], ["g=  "], ["a=--x", "a=--y"]):
        with pytest.raises(ValueError, match="--variant"):
            specs.parse_variants(bad)
    build = builder(drafters=("vsd",))
    base = build.main_rows(["beam5", "beam1", "loop-greedy", "strict", "relaxed"], [1], [1], [("5", "3")])
    rows = {r["name"]: r for r in specs.with_variants(base, variants)}
    assert set(rows) == {r["name"] for r in base} | {"loop-greedy+graphs@bs1", "strict-vsd+graphs@bs1",
                                                      "b5t3-vsd+graphs@bs1"}
    plain, graphed = rows["strict-vsd@bs1"], rows["strict-vsd+graphs@bs1"]
    assert graphed["extra"] == plain["extra"] + ["FAIRSEQ_SPECDEC_OFF=graphs", "--block-size", "3"]
    assert graphed["label"] == plain["label"] + " [graphs]" and graphed["path"] == plain["path"]
    assert "--block-size" not in rows["beam1@bs1"]["extra"]
    # the environment assignment is set while the row's generator is built, never passed to fairseq
    from fairseq_specdec.bench.loading import generate_argv, split_environment

    assert split_environment(graphed["extra"]) == ({"FAIRSEQ_SPECDEC_OFF": "graphs"}, plain["extra"] + ["--block-size", "3"])
    assert "FAIRSEQ_SPECDEC_OFF=graphs" not in generate_argv(dict(graphed, batch_size=1, beam=1, threads=1))
    # the products' instruction set is chosen at import: a row that sets it is refused, not ignored
    with pytest.raises(ValueError, match="FAIRSEQ_SPECDEC_ISA=avx2: FAIRSEQ_SPECDEC_ISA is read once"):
        split_environment(["--beam", "1", "FAIRSEQ_SPECDEC_ISA=avx2"])
    with pytest.raises(ValueError, match="FAIRSEQ_SPECDEC_PREFETCH=off: FAIRSEQ_SPECDEC_PREFETCH is read once"):
        split_environment(["--beam", "1", "FAIRSEQ_SPECDEC_PREFETCH=off"])


def test_a_variant_for_some_row_kinds_repeats_only_their_rows():
    """--variant LABEL:KINDS=OPTIONS: only the rows of those --rows kinds run
    again (the GPU kit's whole-iteration graphs, which at batch 1 differ from
    the default only for loop-greedy and specdec_vsd)."""
    kinds = ["beam5", "beam1", "strict", "relaxed", "loop-greedy", "ngram", "blockwise"]
    variants = specs.parse_variants(["it:loop-greedy,draft-verify,relaxed=FAIRSEQ_SPECDEC_OFF=iteration"], kinds)
    assert variants == [specs.Variant("it", ("FAIRSEQ_SPECDEC_OFF=iteration",), ("loop-greedy", "strict", "relaxed"))]
    with pytest.raises(ValueError, match="no row kind 'stric'"):
        specs.parse_variants(["it:stric=FAIRSEQ_SPECDEC_OFF=iteration"], kinds)
    for bad in (["it:=--x"], ["it:,=--x"]):
        with pytest.raises(ValueError, match="LABEL:ROW,ROW=OPTIONS"):
            specs.parse_variants(bad, kinds)
    build = builder(drafters=("vsd",))
    base = build.main_rows(["beam5", "beam1", "loop-greedy", "ngram", "strict", "relaxed"], [1, 8], [1], [("5", "3")])
    names = [r["name"] for r in specs.with_variants(base, variants)]
    added = [n for n in names if n not in {r["name"] for r in base}]
    assert added == ["loop-greedy+it@bs1", "strict-vsd+it@bs1", "b5t3-vsd+it@bs1",
                     "loop-greedy+it@bs8", "strict-vsd+it@bs8"]
    assert names.index("strict-vsd+it@bs1") == names.index("strict-vsd@bs1") + 1  # right after itself


def test_roofline_command_reports_the_verify_pass_by_width():
    """scripts/roofline.py --shape demo --json: the measured cost of a verify
    pass of each width, for every product implementation this machine runs,
    and the machine's peak and bandwidth it is judged against."""
    proc = H.run([H.cli("python"), H.ROOT / "scripts" / "roofline.py", "--shape", "demo", "--json", "--max-m", "3", "--seconds", "0.2"])
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(result["verify_ms"]) == {"1", "2", "3"}
    assert all(v > 0 for v in result["verify_ms"].values())
    assert set(result["by_gemm"]) == {g for g in H.GEMMS if H.gemm_available(g)}
    for rows in result["by_gemm"].values():
        assert rows["ratio_to_m1"]["1"] == 1.0
        assert all(rows["ops"][m] > 10 for m in rows["ops"])  # every pass dispatches its operations
        assert set(rows["break_even_tok"]) == {"1", "2"}
    assert result["verify_ms"] == result["by_gemm"][result["default_gemm"]]["verify_ms"]
    # the cost of a draft tree's pass, by its nodes (the root included)
    assert {"1", "4", "8"} <= set(result["tree_ms"])
    assert all(v > 0 for v in result["tree_ms"].values())
    assert result["tree_ms"] == result["by_gemm"][result["default_gemm"]]["tree_ms"]
    assert result["machine"]["peak_gflops"] > 0 and result["machine"]["read_gbs"] > 0
    # the peak: the faster of torch's large product and register-only FMAs at
    # the widest vectors the kernels have here (a library may not use them)
    mach = result["machine"]
    assert result["threads"] == 1  # the register probe's one core bounds a pass of one thread
    assert mach["peak_gflops"] == max(mach["peak_library_gflops"], mach["peak_registers_gflops"] or 0.0)
    if H.gemm_available("rowgemm"):
        from fairseq_specdec import kernels
        assert mach["peak_registers_isa"] == ("avx512" if kernels.has_avx512() else "avx2")
        assert mach["peak_registers_gflops"] > 0
    else:
        assert mach["peak_registers_gflops"] is None
    # the machine named: the CPU, and the instruction set of the plugin's products
    assert result["isa"] == result["machine"]["plugin_isa"] and H.is_fresh_process_isa(result["isa"])
    assert result["machine"]["cpu"] and result["machine"]["torch"]["cpu_capability"]
    # the ideal products cost never falls as the width grows
    ideal = [result["ideal_products_ms"][m] for m in ("1", "2", "3")]
    assert ideal == sorted(ideal)


def test_roofline_command_refuses_bad_options(capsys):
    """In-process (scripts/roofline.py calls this main; its exit status 2 is
    argparse's)."""
    from fairseq_specdec.bench import roofline

    for argv, message in ((["--max-m", "0"], "--max-m must be >= 1"), (["--gemm", "mkl"], "--gemm: unknown mkl"),
                          (["--path", "missing.pt"], "--path missing.pt: no such checkpoint")):
        with pytest.raises(SystemExit) as exit:
            roofline.main(argv)
        assert exit.value.code == 2 and message in capsys.readouterr().err, argv


def test_interleave_command_times_rows_in_turn_and_checks_identity(toy_bin, ar_checkpoint, tmp_path):
    """scripts/interleave.py: every row decodes the same sentences each round;
    strict plugin decodings are identical to fairseq's --beam 1 row; a row
    that decodes differently (beam 2) is counted as such.  A --process-row
    decodes in a process started with its assignments: here another copy of
    the plugin (PYTHONPATH) with the emulated AVX-512 products and no
    prefetch, which the lines under the table name."""
    other = tmp_path / "other-checkout"
    shutil.copytree(H.ROOT / "fairseq_specdec", other / "fairseq_specdec",
                    ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "interleave.json"
    proc = H.run([
        H.cli("python"), H.ROOT / "scripts" / "interleave.py", "--data", toy_bin, "--src", "src", "--tgt", "tgt",
        "--verifier", ar_checkpoint, "--limit", "8", "--rounds", "2",
        "--row", "beam1=--decoding autoregressive",
        "--row", f"loop-greedy=--path {ar_checkpoint} --decoding loop-greedy FAIRSEQ_SPECDEC_OFF=products",
        "--row", "beam2=--decoding autoregressive --beam 2",
        "--process-row", f"other=--decoding loop-greedy FAIRSEQ_SPECDEC_ISA=avx512-emulated PYTHONPATH={other} "
                         "FAIRSEQ_SPECDEC_PREFETCH=off",
        "--row", "copy=--decoding input-guided --specdec-backend reference", "--json", out, "--by-batch",
    ])
    result = json.loads(out.read_text())
    rows = {r["name"]: r for r in result["rows"]}
    assert result["sentences"] == 8 and list(rows) == ["beam1", "loop-greedy", "beam2", "other", "copy"]
    process = rows["other"]["process"]
    assert process["package"] == str(other / "fairseq_specdec") and process["isa"] == "avx512-emulated"
    assert process["prefetch"] == "off"
    assert process["env"] == {"FAIRSEQ_SPECDEC_ISA": "avx512-emulated", "PYTHONPATH": str(other),
                              "FAIRSEQ_SPECDEC_PREFETCH": "off"}
    assert rows["other"]["identical"] == 8 and rows["other"]["tok"] == 1.0
    assert "process" not in rows["loop-greedy"] and H.is_fresh_process_isa(result["machine"]["plugin_isa"])
    assert (f"other: in its own process (FAIRSEQ_SPECDEC_ISA=avx512-emulated PYTHONPATH={other} "
            f"FAIRSEQ_SPECDEC_PREFETCH=off): the plugin of {other / 'fairseq_specdec'}, products avx512-emulated, "
            "prefetch off") in proc.stdout
    assert result["by_batch"] and "2 rounds taken batch by batch" in proc.stdout
    # Tok.: one token per iteration for greedy, at least one with drafts, none for fairseq's decoders
    assert rows["loop-greedy"]["tok"] == 1.0 and rows["copy"]["tok"] >= 1.0
    assert rows["beam1"]["tok"] is None and rows["beam2"]["tok"] is None
    assert rows["copy"]["identical"] == 8
    assert rows["beam1"]["speedup"] == 1.0
    assert rows["loop-greedy"]["identical"] == 8 and rows["loop-greedy"]["options"].startswith("--path ")
    assert all(len(r["rounds_ms"]) == 2 and min(r["rounds_ms"]) == r["ms_per_sentence"] for r in rows.values())
    assert "| loop-greedy | " in proc.stdout
    assert result["machine"]["cpu"] and f"Machine: CPU: {result['machine']['cpu']}" in proc.stdout


def test_interleave_command_refuses_bad_rows(toy_bin, ar_checkpoint, capsys):
    """In-process: scripts/interleave.py is this main (the test above runs the script)."""
    from fairseq_specdec.bench import interleave

    for row, message in (("nameless", "expected NAME=OPTIONS"), ("x=--path", "--path needs a checkpoint"),
                         ("x=--path missing.pt", "no such checkpoint: missing.pt")):
        with pytest.raises(SystemExit) as exit:
            interleave.main(["--data", str(toy_bin), "--verifier", str(ar_checkpoint), "--row", row])
        assert exit.value.code == 2 and message in capsys.readouterr().err, row
    for argv, message in (([], "give at least one --row or --process-row"),
                          (["--process-row", f"x=--decoding loop-greedy PYTHONPATH={toy_bin}"],
                           f"--process-row x: PYTHONPATH={toy_bin}: no fairseq_specdec/ in")):
        with pytest.raises(SystemExit) as exit:
            interleave.main(["--data", str(toy_bin), "--verifier", str(ar_checkpoint), *argv])
        assert exit.value.code == 2 and message in capsys.readouterr().err, argv


def test_interleave_process_row_that_fails_is_named(toy_bin, ar_checkpoint):
    """A --process-row whose process fails (here: an instruction set the
    plugin refuses at import) stops the run with the row's name and the
    process's error; the logging it silenced while it ran is as it was."""
    import logging

    from fairseq_specdec.bench import interleave

    before = logging.root.manager.disable
    with pytest.raises(RuntimeError, match=r"(?s)--process-row bad failed: .*FAIRSEQ_SPECDEC_ISA"):
        interleave.main(["--data", str(toy_bin), "--src", "src", "--tgt", "tgt", "--verifier", str(ar_checkpoint),
                         "--limit", "2", "--row", "here=--decoding loop-greedy",
                         "--process-row", "bad=--decoding loop-greedy FAIRSEQ_SPECDEC_ISA=no-such-set"])
    assert logging.root.manager.disable == before


def test_table_reports_rows_against_loop_greedy_when_it_ran():
    """Speculation must beat the plugin's own greedy loop: with a loop-greedy
    row at a batch size, every row of that size gets its ratio to it."""
    def row(name, seconds, bs=1):
        return dict(name=f"{name}@bs{bs}", label=name, batch_size=bs, seconds=seconds, tokens={0: [1]},
                    sent_per_s=1.0, ms_per_sent=seconds, tok=1.0, iterations=3, sacrebleu=1.0, peak_rss_mb=100.0)

    rows = [row("beam5", 8.0), row("beam1", 6.0), row("loop-greedy", 4.0), row("strict", 2.0),
            row("beam5", 4.0, 32), row("beam1", 3.0, 32)]
    cli.compare_with_beams(rows)
    assert [r["speedup_vs_loop_greedy"] for r in rows] == [0.5, 4.0 / 6.0, 1.0, 2.0, None, None]
    lines = cli.markdown_table(rows).splitlines()
    assert "| vs beam 1 | vs loop-greedy | Tok. |" in lines[0]
    assert all(line.count("|") == lines[0].count("|") for line in lines)
    assert "| 2.00x | " in lines[5] and "| 3.00x | 2.00x | 1.00 |" in lines[5]
    assert "| 1.33x | 1.00x | | 1.00 |" in lines[7]  # batch 32 ran no loop-greedy row
    without = [dict(r, speedup_vs_loop_greedy=None) for r in rows]
    assert "vs loop-greedy" not in cli.markdown_table(without).splitlines()[0]


def test_recorded_command_names_the_checkouts_paths_not_the_machines(tmp_path):
    """Result files record the command with paths under the working directory
    relative to it (a LABEL=PATH argument too); other paths stay as given."""
    from fairseq_specdec.bench.commands import recorded_command

    cmd = recorded_command(["--data", f"{tmp_path}/runs/bin", "--drafter", f"vsd={tmp_path}/runs/vsd.pt",
                            "--raw-ref", "/elsewhere/ref.gz"], cwd=str(tmp_path))
    assert cmd.split(" ", 1)[1] == "--data runs/bin --drafter vsd=runs/vsd.pt --raw-ref /elsewhere/ref.gz"


def _result(name, bs, seconds, tokens):
    return dict(name=name, label=name, batch_size=bs, seconds=seconds, sentences=len(tokens),
                tokens={str(i): t for i, t in enumerate(tokens)}, text={"0": "x"}, ms=[1.0])


def _read_partial(path):
    return {r["name"]: r for r in map(json.loads, Path(path).read_text().splitlines())}


def test_partial_rows_carry_identity_once_beam1_has_ended(tmp_path):
    from fairseq_specdec.bench.partial import PartialRows

    path = tmp_path / "rows.partial.jsonl"
    rows = PartialRows(str(path))
    assert path.read_text() == ""
    ref = [[4, 5, 2], [6, 2], [7, 8, 9, 2]]
    rows.add(_result("beam5@bs1", 1, 8.0, [[4, 5, 2], [6, 6, 2], [7, 8, 9, 2]]))
    got = _read_partial(path)
    assert "identical_to_beam1" not in got["beam5@bs1"] and "tokens" not in got["beam5@bs1"]
    rows.add(_result("beam1@bs1", 1, 4.0, ref))
    rows.add(_result("strict@bs1", 1, 2.0, ref))
    rows.add(_result("beam5@bs8", 8, 1.0, ref))  # another batch size: its own beam 1 has not ended
    got = _read_partial(path)
    assert list(got) == ["beam5@bs1", "beam1@bs1", "strict@bs1", "beam5@bs8"]  # the order they ended
    # beam 5 ended first and was given its comparison when beam 1 ended: one sentence differs
    assert got["beam5@bs1"]["identical_to_beam1"] is False and got["beam5@bs1"]["differs_from_beam1"] == 1
    assert got["beam5@bs1"]["speedup_vs_beam1"] == pytest.approx(0.5)
    assert got["strict@bs1"]["identical_to_beam1"] is True and got["strict@bs1"]["differs_from_beam1"] == 0
    assert got["strict@bs1"]["speedup_vs_beam1"] == pytest.approx(2.0)
    assert got["beam1@bs1"]["identical_to_beam1"] is True
    assert "identical_to_beam1" not in got["beam5@bs8"]
    assert not (tmp_path / "rows.partial.jsonl.tmp").exists()


def test_partial_rows_count_a_missing_sentence_as_different(tmp_path):
    from fairseq_specdec.bench.partial import PartialRows

    rows = PartialRows(str(tmp_path / "p.jsonl"))
    rows.add(_result("beam1@bs1", 1, 4.0, [[4, 2], [5, 2]]))
    short = _result("loop-greedy@bs1", 1, 1.0, [[4, 2]])
    rows.add(short)
    got = _read_partial(tmp_path / "p.jsonl")["loop-greedy@bs1"]
    assert got["identical_to_beam1"] is False and got["differs_from_beam1"] == 1


def test_limit_picks_the_same_sentences_at_every_batch_size(toy_bin, ar_checkpoint):
    # --limit 10 at batch 4 and 8: the batch holding the 10th sentence is cut,
    # so every batch size decodes the first 10 sentences of fairseq's batch order
    ids = {}
    for bsz in (1, 4, 8):
        spec = dict(data=toy_bin, src="src", tgt="tgt", threads=1, device="cpu", path=ar_checkpoint, beam=1,
                    batch_size=bsz, limit=10, extra=["--decoding", "autoregressive"])
        task, _, _, batches = loading.load_decoder(spec)
        got = [sample["id"].tolist() for sample in batches()]
        assert all(len(b) <= bsz for b in got)
        ids[bsz] = [i for b in got for i in b]
    assert ids[1] == task.dataset("test").ordered_indices()[:10].tolist()  # batch 1 keeps the order
    assert sorted(ids[4]) == sorted(ids[1]) and sorted(ids[8]) == sorted(ids[1])
    assert len(task.dataset("test")) == H.SPLIT_SIZES["test"] > 10


@pytest.mark.parametrize("decoding", ["draft-verify", "ngram", "ngram-tree", "self-draft", "blockwise"])
def test_profile_of_a_decoding_that_drafts_in_no_iteration(decoding, toy_bin, ar_checkpoint, nat_checkpoint,
                                                          blockwise_checkpoint, monkeypatch):
    """The draft policy may give no row a draft in a whole run (at batch 32
    on a CPU, where drafting was measured not to pay): the profile of such a
    run lists the drafter's start of batch and no drafter pass, instead of
    failing as if the profiler's components were out of date."""
    from fairseq_specdec.generation.draft_policy import DraftLengthPolicy

    if decoding == "self-draft" and not H.gemm_available("rowgemm"):
        pytest.skip("the int8 copy needs the native kernels")
    path, extra = {
        "draft-verify": (f"{ar_checkpoint}:{nat_checkpoint}", ["--decoding", "draft-verify"]),
        "ngram": (ar_checkpoint, ["--decoding", "ngram"]),
        "ngram-tree": (ar_checkpoint, ["--decoding", "ngram", "--draft-tree", "5"]),
        "self-draft": (ar_checkpoint, ["--decoding", "self-draft"]),
        "blockwise": (blockwise_checkpoint, ["--decoding", "blockwise"]),
    }[decoding]
    spec = dict(data=toy_bin, src="src", tgt="tgt", subset="test", threads=1, device="cpu", beam=1, batch_size=4,
                limit=12, path=path, extra=extra)
    asked = []
    monkeypatch.setattr(DraftLengthPolicy, "drafts_at", lambda self, rows, batch=1: asked.append(rows) or False)
    total, sentences, tokens, timers = profiling.profile(spec, profiling.draft_verify_components, warmup=0)
    assert asked and sentences == 12 and tokens > 0 and total > 0
    called = {name for name in timers.names if timers.calls[name]}
    assert any("start of batch" in name for name in called), sorted(called)
    drafting = [name for name in timers.names if name.startswith(("drafter pass", "drafter tree", "int8 copy's draft",
                                                                    "blockwise heads", "first drafter's candidate"))]
    assert drafting and not any(timers.calls[name] for name in drafting), {n: timers.calls[n] for n in drafting}


def test_profile_wraps_the_weight_checks_and_undoes_its_wrapper_even_on_failure(monkeypatch):
    from fairseq_specdec.utils.projection import WeightsWatch

    original = WeightsWatch.changed
    seen = {}

    def decode_that_fails(task, models, generator):
        seen["wrapped"] = WeightsWatch.changed is not original
        raise RuntimeError("decoding failed")

    monkeypatch.setattr(profiling, "load_decoder", lambda spec: (None, None, None, None))
    monkeypatch.setattr(profiling, "fairseq_decode", decode_that_fails)
    with pytest.raises(RuntimeError, match="decoding failed"):
        profiling.profile({}, lambda generator: [], warmup=0)
    assert seen["wrapped"]
    assert WeightsWatch.changed is original


def test_parts_are_switched_off_by_the_benchmark_only(toy_bin, ar_checkpoint, monkeypatch):
    """FAIRSEQ_SPECDEC_OFF is the benchmark's: a row's assignment switches
    the parts off for that row's generator (an unknown part refused, naming
    the variable); in the environment of a plain run it changes nothing."""
    from fairseq_specdec.generation import resolve_backend

    if not H.gemm_available("rowgemm"):
        pytest.skip("the native kernels do not run here")
    with pytest.raises(ValueError, match="FAIRSEQ_SPECDEC_OFF=accept,nope: no native part nope"):
        loading.parts_off("accept,nope")
    with pytest.raises(ValueError, match="no native part nope"):
        resolve_backend("auto", torch.nn.Linear(2, 2), None, off={"nope"})
    spec = dict(data=toy_bin, src="src", tgt="tgt", threads=1, path=ar_checkpoint, beam=1, batch_size=1,
                extra=["--decoding", "loop-greedy", "FAIRSEQ_SPECDEC_OFF=products"])
    _, _, generator, _ = loading.load_decoder(spec)
    assert generator.verifier.describe() == "lean (torch products)"
    monkeypatch.setenv("FAIRSEQ_SPECDEC_OFF", "products")
    _, _, generator, _ = loading.load_decoder(dict(spec, extra=["--decoding", "loop-greedy"]))
    assert "rowgemm products" in generator.verifier.describe()
