"""The optional CTranslate2 rows of the benchmark (fairseq_specdec.bench.ct2):
never among the default rows, a clear error naming the package when it is
not installed, source and output tokens mapped through fairseq's
dictionaries, fairseq's length rule; end to end (when ctranslate2 is
installed): the toy verifier converted once, its greedy output identical to
fairseq's --beam 1 at batch 1 and 4; the same translator as a row of
scripts/interleave.py (--ct2), identical to the plugin's greedy loop there."""
import json
from pathlib import Path

import pytest
import torch

import specdec_helpers as H
from fairseq_specdec.bench import cli, ct2, interleave, specs
from fairseq_specdec.generation.registry import DECODINGS

CT2_MISSING = "ctranslate2 is not installed (pip install ctranslate2): the optional CTranslate2 rows cannot run"


def builder(ct2_dir="ct2-model"):
    common = dict(data="bin", src="en", tgt="de", threads=1, limit=None, warmup=0, device="cpu", user_dir=None)
    return specs.RowSpecs(common, "ver.pt", [], None, DECODINGS, ct2_dir=ct2_dir)


def test_ct2_rows_are_optional_and_never_default():
    default = cli.build_parser(DECODINGS).get_default("rows")
    assert "ct2" not in default
    assert "ct2" not in specs.resolve_rows(default.replace(",strict,relaxed", ""), DECODINGS, [], None)
    assert {"ct2", "ct2-int8"} <= set(specs.row_kinds(DECODINGS))


def test_asking_for_ct2_without_the_package_names_it(monkeypatch):
    monkeypatch.setattr(ct2, "available", lambda: False)
    for kind in ("ct2", "ct2-int8"):
        with pytest.raises(ValueError, match=rf"--rows {kind} needs the ctranslate2 package.*pip install ctranslate2"):
            specs.resolve_rows(f"beam5,beam1,{kind}", DECODINGS, [], None)


def test_asking_for_ct2_without_the_package_stops_the_benchmark(monkeypatch, toy_bin, tmp_path, capsys):
    monkeypatch.setattr(ct2, "available", lambda: False)
    ref = tmp_path / "ref.txt"
    ref.write_text("x\n")
    with pytest.raises(SystemExit):
        cli.main(["--data", toy_bin, "--verifier", str(ref), "--raw-ref", str(ref), "--rows", "beam5,beam1,ct2",
                  "--out", str(tmp_path / "out")])
    assert "pip install ctranslate2" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_ct2_row_specs():
    rows = {r["name"]: r for r in builder().main_rows(["beam5", "beam1", "ct2", "ct2-int8"], [1, 8], [1], [])}
    assert set(rows) == {f"{k}@bs{bs}" for k in ("beam5", "beam1", "ct2", "ct2-int8") for bs in (1, 8)}
    assert rows["ct2@bs8"]["label"] == "CTranslate2 greedy (float32)"
    assert rows["ct2-int8@bs1"]["label"] == "CTranslate2 greedy (int8)"
    assert rows["ct2@bs8"]["engine"] == "ctranslate2" and rows["ct2@bs8"]["compute_type"] == "float32"
    assert rows["ct2-int8@bs1"]["compute_type"] == "int8"
    assert rows["ct2@bs8"]["path"] == "ct2-model" and rows["ct2@bs8"]["batch_size"] == 8
    assert rows["ct2@bs1"]["threads"] == 1
    with pytest.raises(ValueError, match="no converted CTranslate2 model"):
        builder(ct2_dir=None).main_rows(["beam5", "beam1", "ct2"], [1], [1], [])


def dictionary(words):
    from fairseq.data import Dictionary

    d = Dictionary()
    for w in words:
        d.add_symbol(w)
    return d


def test_source_tokens_drop_padding_and_the_final_eos():
    d = dictionary(["a@@", "b", "c"])
    pad, eos = d.pad(), d.eos()
    a, b, c = d.index("a@@"), d.index("b"), d.index("c")
    sample = {"net_input": {"src_tokens": torch.tensor([[pad, pad, a, b, eos], [a, c, d.unk(), b, eos]])}}
    assert ct2.source_tokens(sample, d) == [["a@@", "b"], ["a@@", "c", "<unk>", "b"]]


def test_output_tokens_become_dictionary_ids_with_eos_last():
    d = dictionary(["x", "y"])
    x, y, eos = d.index("x"), d.index("y"), d.eos()
    assert ct2.target_ids(["x", "y", "</s>"], d) == [x, y, eos]
    # stopped at the length limit: fairseq forces EOS there
    assert ct2.target_ids(["y", "y"], d) == [y, y, eos]
    assert ct2.target_ids([], d) == [eos]
    assert ct2.target_ids(["zz", "</s>"], d) == [d.unk(), eos]


def test_length_limit_is_fairseqs():
    from types import SimpleNamespace

    cfg = SimpleNamespace(generation=SimpleNamespace(max_len_a=0, max_len_b=200))
    assert ct2.max_length(cfg, src_len=30, max_target_positions=1024) == 200
    assert ct2.max_length(cfg, src_len=30, max_target_positions=101) == 100
    cfg.generation.max_len_a, cfg.generation.max_len_b = 1.2, 10
    assert ct2.max_length(cfg, src_len=10, max_target_positions=1024) == 22


@pytest.mark.slow
def test_ct2_rows_end_to_end(toy_bin, ar_checkpoint, stock_beam1, tmp_path):
    pytest.importorskip("ctranslate2", reason=CT2_MISSING)
    raw_ref = Path(toy_bin).parent / "raw" / "test.tgt"
    out = tmp_path / "bench"
    proc = H.run([H.cli("python"), H.ROOT / "scripts" / "benchmark.py", "--data", toy_bin, "--src", "src", "--tgt", "tgt",
                  "--verifier", ar_checkpoint, "--raw-ref", raw_ref, "--detok-lang", "en", "--warmup", "3",
                  "--rows", "beam5,beam1,ct2,ct2-int8", "--batch-sizes", "1,4", "--jobs", "2", "--out", out])
    results = json.loads((out / "results.json").read_text())
    rows = {r["name"]: r for r in results["rows"]}
    assert set(rows) == {f"{k}@bs{bs}" for k in ("beam5", "beam1", "ct2", "ct2-int8") for bs in (1, 4)}
    assert (out / "ct2-verifier" / "model.bin").is_file()
    assert results["ctranslate2"]["model"] == str(out / "ct2-verifier")
    for bs in (1, 4):
        row = rows[f"ct2@bs{bs}"]
        assert row["sentences"] == H.SPLIT_SIZES["test"] and row["seconds"] > 0
        assert row["label"] == "CTranslate2 greedy (float32)"
        # the same greedy decoding of the same model: the same token strings as fairseq --beam 1
        assert row["identical_to_beam1"], row["differs_from_beam1"]
        assert (out / f"hyp.ct2@bs{bs}.txt").read_text() == (out / f"hyp.beam1@bs{bs}.txt").read_text()
        assert row["sacrebleu"] == rows[f"beam1@bs{bs}"]["sacrebleu"]
        assert rows[f"ct2-int8@bs{bs}"]["sentences"] == H.SPLIT_SIZES["test"]
    # fairseq-generate itself (not the harness) gives the same sentences
    ref = stock_beam1(ar_checkpoint)
    hyp = (out / "hyp.ct2@bs1.txt").read_text().splitlines()
    assert [ref[i][1] for i in sorted(ref)] == hyp
    assert "| CTranslate2 greedy (float32) | 1 |" in (out / "results.md").read_text()
    assert "CTranslate2 greedy (int8)" in proc.stdout
    # the machine, with CTranslate2's own choice of instruction set and products, named in the header
    ct2_info = results["machine"]["ctranslate2"]
    assert "error" not in ct2_info and ct2_info["isa"] and ct2_info["sgemm"] and ct2_info["gemm_s8"], ct2_info
    assert f"(ISA {ct2_info['isa']}, " in (out / "results.md").read_text()


def interleave_args(toy_bin, verifier, *extra):
    return ["--data", toy_bin, "--src", "src", "--tgt", "tgt", "--verifier", str(verifier),
            "--row", "loop-greedy=--decoding loop-greedy", *map(str, extra)]


def test_interleave_refuses_ct2_without_the_package_by_name(monkeypatch, toy_bin, tmp_path, capsys):
    """--ct2 (--ct2-int8) without ctranslate2: a usage error naming the
    package, before anything is loaded or converted."""
    monkeypatch.setattr(ct2, "available", lambda: False)
    verifier = tmp_path / "not-a-checkpoint.pt"  # never loaded: the refusal comes first
    verifier.write_text("x")
    for option in ("--ct2", "--ct2-int8"):
        with pytest.raises(SystemExit) as stop:
            interleave.main(interleave_args(toy_bin, verifier, option, "--ct2-dir", tmp_path / "ct2"))
        err = capsys.readouterr().err
        assert stop.value.code == 2
        assert f"{option} needs the ctranslate2 package" in err and "pip install ctranslate2" in err, err
    assert not (tmp_path / "ct2").exists()


def test_interleave_refuses_a_ct2_dir_it_would_wipe(monkeypatch, toy_bin, tmp_path, capsys):
    """The conversion replaces --ct2-dir: a directory with other files is
    refused; --ct2-dir without a CTranslate2 row too; a --row may not take a
    CTranslate2 row's name."""
    monkeypatch.setattr(ct2, "available", lambda: True)
    verifier = tmp_path / "ver.pt"
    verifier.write_text("x")
    kept = tmp_path / "precious"
    kept.mkdir()
    (kept / "notes.txt").write_text("keep me")
    for extra, message in (
        (["--ct2", "--ct2-dir", kept], "not a new or empty directory"),
        (["--ct2-dir", tmp_path / "ct2"], "--ct2-dir needs --ct2 or --ct2-int8"),
        (["--ct2", "--row", "ctranslate2=--decoding loop-greedy"], "--ct2 adds the row ctranslate2"),
    ):
        with pytest.raises(SystemExit):
            interleave.main(interleave_args(toy_bin, verifier, *extra))
        assert message in capsys.readouterr().err, extra
    assert (kept / "notes.txt").read_text() == "keep me"


@pytest.mark.slow
def test_interleave_ct2_row_is_identical_to_the_plugins_greedy_loop(toy_bin, ar_checkpoint, tmp_path, monkeypatch):
    """scripts/interleave.py --ct2 --ct2-int8: the verifier converted once
    into a temporary directory (removed at the end), the CTranslate2 rows
    decode the same sentences as the loop-greedy row each round, float32
    greedy identical to it on every sentence, no Tok."""
    pytest.importorskip("ctranslate2", reason=CT2_MISSING)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    out = tmp_path / "interleave.json"
    proc = H.run([H.cli("python"), H.ROOT / "scripts" / "interleave.py",
                  *interleave_args(toy_bin, ar_checkpoint, "--limit", 8, "--rounds", 1, "--ct2", "--ct2-int8",
                                   "--json", out)])
    result = json.loads(out.read_text())
    rows = {r["name"]: r for r in result["rows"]}
    assert result["sentences"] == 8 and list(rows) == ["loop-greedy", "ctranslate2", "ctranslate2-int8"]
    assert result["ctranslate2"]["model"] is None  # a temporary directory
    row = rows["ctranslate2"]
    assert row["identical"] == 8, row
    assert row["tok"] is None and row["engine"] == "ctranslate2" and row["compute_type"] == "float32"
    assert row["options"] == "--ct2" and len(row["rounds_ms"]) == 1 and row["ms_per_sentence"] > 0
    assert rows["ctranslate2-int8"]["compute_type"] == "int8" and rows["ctranslate2-int8"]["ms_per_sentence"] > 0
    assert "| ctranslate2 | " in proc.stdout and "| 8/8 | " in proc.stdout.split("| ctranslate2 | ")[1]
    assert list(tmp.iterdir()) == []  # the converted model removed with its temporary directory
    # CTranslate2's instruction set and products, read from its log when it loaded the converted model
    ct2_info = result["machine"]["ctranslate2"]
    assert "error" not in ct2_info and ct2_info["isa"] and ct2_info["sgemm"], ct2_info
    assert f"CTranslate2 {ct2_info['version']} (ISA {ct2_info['isa']}, " in proc.stdout
