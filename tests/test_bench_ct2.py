"""The optional CTranslate2 rows of the benchmark (fairseq_specdec.bench.ct2):
never among the default rows, a clear error naming the package when it is
not installed, source and output tokens mapped through fairseq's
dictionaries, fairseq's length rule; end to end (when ctranslate2 is
installed): the toy verifier converted once, its greedy output identical to
fairseq's --beam 1 at batch 1 and 4."""
import json
from pathlib import Path

import pytest
import torch

import specdec_helpers as H
from fairseq_specdec.bench import cli, ct2, specs
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
def test_ct2_rows_end_to_end(toy_bin, ar_checkpoint, tmp_path):
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
    ref = H.parse_generate(H.generate(toy_bin, ar_checkpoint, task="draft_verify").stdout)
    hyp = (out / "hyp.ct2@bs1.txt").read_text().splitlines()
    assert [ref[i][1] for i in sorted(ref)] == hyp
    assert "| CTranslate2 greedy (float32) | 1 |" in (out / "results.md").read_text()
    assert "CTranslate2 greedy (int8)" in proc.stdout
