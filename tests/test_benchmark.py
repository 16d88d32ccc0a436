"""scripts/benchmark.py end to end on the toy models: every row decodes every
sentence, strict draft-verify and blockwise are identical to beam 1, the
table, hypotheses, results.json and the plots are written.  (Timings are not
checked: speed is what the script measures, not what a test asserts.)"""
import json
import os
from pathlib import Path

import pytest

import specdec_helpers as H

pytestmark = pytest.mark.slow


def test_benchmark_writes_every_row_table_and_plot(toy_bin, ar_checkpoint, nat_checkpoint, blockwise_checkpoint, tmp_path):
    raw_ref = Path(toy_bin).parent / "raw" / "test.tgt"
    out = tmp_path / "bench"
    proc = H.run([
        H.cli("python"), H.ROOT / "scripts" / "benchmark.py", "--data", toy_bin, "--src", "src", "--tgt", "tgt",
        "--verifier", ar_checkpoint, "--drafter", nat_checkpoint, "--blockwise", blockwise_checkpoint,
        "--rows", "beam5,beam1,strict,relaxed,blockwise", "--relaxed", "3:1", "--batch-sizes", "1,4",
        "--relaxed-batch-sizes", "1", "--jobs", "2",
        "--raw-ref", raw_ref, "--detok-lang", "en", "--warmup", "2", "--limit", "24", "--out", out,
        "--sweeps", "--sweep-batch-sizes", "4", "--sweep-ks", "2,4", "--sweep-betas", "3", "--sweep-taus", "1",
    ])
    results = json.loads((out / "results.json").read_text())
    rows = {r["name"]: r for r in results["rows"]}
    for bs in (1, 4):
        assert {f"{kind}@bs{bs}" for kind in ("beam5", "beam1", "strict", "blockwise")} <= set(rows)
    assert "b3t1@bs1" in rows and "b3t1@bs4" not in rows  # --relaxed-batch-sizes 1
    assert results["jobs"] == 2
    assert results["sentences"] == 24  # --limit
    for r in rows.values():
        assert r["sentences"] == 24
        assert r["tok"] >= 1.0 and r["seconds"] > 0
    for bs in (1, 4):
        assert rows[f"strict@bs{bs}"]["identical_to_beam1"], rows[f"strict@bs{bs}"]["differs_from_beam1"]
        assert rows[f"blockwise@bs{bs}"]["identical_to_beam1"]
        assert rows[f"beam1@bs{bs}"]["tok"] == 1.0
    # statistics of the timed pass: Tok. is output tokens over iterations
    strict = rows["strict@bs1"]
    assert strict["tok"] == pytest.approx(strict["out_tokens"] / strict["iterations"])
    assert sum(int(n) * c for n, c in strict["histogram"].items()) == strict["out_tokens"]

    table = (out / "results.md").read_text()
    assert "2 decoders at a time" in table
    assert f"Machine: CPU: {results['machine']['cpu']}" in table
    assert "draft-verify strict" in table and "blockwise" in table
    hyp = (out / "hyp.strict@bs1.txt").read_text().splitlines()
    assert len(hyp) == 24
    assert set(results["k_sweep"]["strict"]) == {"2", "4"}
    assert set(results["batch_sweep"]["draft-verify strict"]) == {"4"}
    assert set(results["beta_tau_sweep"]) == {"beta=3"}
    for name in ("speedup-distribution.png", "latency-vs-batch.png", "tok-vs-k.png", "tok-vs-beta-tau.png"):
        assert os.path.getsize(out / name) > 1000, name
    assert "draft-verify strict" in proc.stdout  # the table is printed too
    # what a run cut short would have kept: every row, with the table's identity with --beam 1
    partial = [json.loads(line) for line in (out / "rows.partial.jsonl").read_text().splitlines()]
    assert sorted(r["name"] for r in partial) == sorted(rows)
    for r in partial:
        assert r["identical_to_beam1"] == rows[r["name"]]["identical_to_beam1"], r["name"]
        assert r["speedup_vs_beam1"] == pytest.approx(rows[r["name"]]["speedup_vs_beam1"]), r["name"]


def test_profile_script_profiles_loop_greedy_and_blockwise(toy_bin, ar_checkpoint, blockwise_checkpoint, tmp_path):
    """--loop-greedy and --blockwise rows: their components and "other" add
    up to the total; loop-greedy times no drafter, the heads update once per
    verification."""
    out = tmp_path / "profile.json"
    proc = H.run([
        H.cli("python"), H.ROOT / "scripts" / "profile-draft-verify.py", "--data", toy_bin, "--src", "src", "--tgt", "tgt",
        "--verifier", ar_checkpoint, "--blockwise", blockwise_checkpoint, "--loop-greedy",
        "--limit", "20", "--warmup", "3", "--json", out,
    ])
    rows = json.loads(out.read_text())["rows"]
    for decoder in ("loop-greedy", "blockwise heads strict"):
        mine = {r["component"].split(" (")[0]: r for r in rows if r["decoder"] == decoder}
        assert mine["total"]["calls"] == 20
        parts = [r for name, r in mine.items() if name != "total" and not name.startswith("of which")]
        assert sum(r["ms_per_sentence"] for r in parts) == pytest.approx(mine["total"]["ms_per_sentence"])
        # the weight checks: at least one a sentence (a batch), inside the timed components
        assert mine["of which: weight checks"]["calls"] >= 20
        if decoder == "loop-greedy":
            assert not any(name.startswith(("drafter", "blockwise")) for name in mine), sorted(mine)
        else:
            # an iteration is an ordinary pass or a screened one (a step with no drafts: a sentence's first,
            # or any where drafting was measured not to pay); the heads draft in some of them
            passes = H.profiled_passes(mine)
            assert passes == mine["other"]["calls"] and 0 < mine["blockwise heads"]["calls"] <= passes
    assert "| loop-greedy | verifier pass" in proc.stdout
    assert not any("weight checks" in r["component"] for r in rows if r["decoder"] == "fairseq beam 1")


def test_profile_script_needs_a_decoder_to_profile(toy_bin, ar_checkpoint):
    proc = H.run([H.cli("python"), H.ROOT / "scripts" / "profile-draft-verify.py", "--data", toy_bin,
                  "--verifier", ar_checkpoint], check=False)
    assert proc.returncode != 0 and "--drafter, --blockwise, --ngram, --self-draft or --loop-greedy" in proc.stderr


def test_profile_script_accounts_for_every_millisecond(toy_bin, ar_checkpoint, nat_checkpoint, tmp_path):
    """scripts/profile-draft-verify.py: per decoder, the components and
    "other" add up to the total; iterations and decoder steps are counted."""
    out = tmp_path / "profile.json"
    proc = H.run([
        H.cli("python"), H.ROOT / "scripts" / "profile-draft-verify.py", "--data", toy_bin, "--src", "src", "--tgt", "tgt",
        "--verifier", ar_checkpoint, "--drafter", nat_checkpoint, "--limit", "20", "--warmup", "3", "--json", out,
    ])
    rows = json.loads(out.read_text())["rows"]
    for decoder in ("fairseq beam 1", "draft-verify strict"):
        mine = [r for r in rows if r["decoder"] == decoder]
        total = next(r for r in mine if r["component"] == "total")
        assert total["calls"] == 20
        parts = [r for r in mine if r["component"] != "total" and not r["component"].startswith("of which")]
        assert sum(r["ms_per_sentence"] for r in parts) == pytest.approx(total["ms_per_sentence"])
        assert all(r["ms_per_sentence"] >= 0 for r in parts)
    names = {r["component"].split(" (")[0] for r in rows}
    # the verifier's vocabulary projection runs inside its one-call pass (timed with it)
    assert {"encoder", "decoder step", "verifier encoder", "drafter pass", "verifier pass",
            "of which: drafter vocabulary projection"} <= names
    dv = {r["component"].split(" (")[0]: r for r in rows if r["decoder"] == "draft-verify strict"}
    # at most one drafter pass per iteration; an iteration is an ordinary verify pass or a screened one
    # (no drafts) ("other" counts iterations)
    passes = H.profiled_passes(dv)
    assert 0 < dv["drafter pass"]["calls"] <= passes == dv["other"]["calls"]
    greedy = {r["component"].split(" (")[0]: r for r in rows if r["decoder"] == "fairseq beam 1"}
    assert greedy["decoder step"]["calls"] > greedy["encoder"]["calls"] == 20
    assert "| draft-verify strict | verifier pass" in proc.stdout
