"""scripts/ngram-scale.py (fairseq_specdec/bench/ngram_scale.py): the corpora
it makes, its dry run, and one tiny run end to end on the toy corpus."""
import os
import subprocess
import sys

import numpy as np
import pytest

import specdec_helpers as H
from fairseq_specdec.bench import ngram_scale

SCRIPT = str(H.ROOT / "scripts" / "ngram-scale.py")


def sentences(data, split, lang):
    from fairseq.data.indexed_dataset import MMapIndexedDataset

    dataset = MMapIndexedDataset(os.path.join(data, f"{split}.src-tgt.{lang}"))
    return [dataset[i].tolist() for i in range(len(dataset))]


def test_corpora_are_copies_and_changed_copies(toy_bin, tmp_path):
    original = {lang: sentences(toy_bin, "train", lang) for lang in ("src", "tgt")}
    n = len(original["src"])
    size = 2 * n + 123
    copies = ngram_scale.make_corpus(toy_bin, str(tmp_path / "copies"), "train", "src", "tgt", size, 0.0, 1, "test")
    changed = ngram_scale.make_corpus(toy_bin, str(tmp_path / "changed"), "train", "src", "tgt", size, 0.1, 1, "test")
    assert sentences(copies, "test", "src") == sentences(toy_bin, "test", "src")  # the decoded split, as it was
    for lang in ("src", "tgt"):
        want = (original[lang] * 3)[:size]
        assert sentences(copies, "train", lang) == want
        got = sentences(changed, "train", lang)
        assert [len(s) for s in got] == [len(s) for s in want]
        assert got[:n] == want[:n]  # the first copy is the original
        assert all(s[-1] == 2 for s in got)  # EOS kept
        flat_got = np.concatenate([np.array(s[:-1]) for s in got[n:]])
        flat_want = np.concatenate([np.array(s[:-1]) for s in want[n:]])
        share = float(np.mean(flat_got != flat_want))
        assert 0.07 < share < 0.11, share  # 10% drawn, a few drawn as the same token
    # a second call with the same settings keeps the corpus
    stamp = os.stat(os.path.join(copies, "train.src-tgt.src.bin")).st_mtime_ns
    ngram_scale.make_corpus(toy_bin, copies, "train", "src", "tgt", size, 0.0, 1, "test")
    assert os.stat(os.path.join(copies, "train.src-tgt.src.bin")).st_mtime_ns == stamp


def test_dry_run_prints_the_plan_and_makes_nothing(toy_bin, tmp_path):
    work = tmp_path / "work"
    proc = H.run([sys.executable, SCRIPT, toy_bin, "--path", "verifier.pt", "--sizes", "100", "2000",
                  "--work-dir", work, "--dry-run"])
    lines = proc.stdout.splitlines()
    assert sum(line.startswith("# ") for line in lines) == 4  # 2 kinds x 2 sizes
    assert sum("ngram-index.py" in line for line in lines) == 4
    assert sum("--decoding ngram" in line for line in lines) == 4
    assert sum("--decoding loop-greedy" in line for line in lines) == 4
    assert not work.exists()
    bad = H.run([sys.executable, SCRIPT, toy_bin, "--sizes", "100"], check=False)
    assert bad.returncode != 0 and "--path" in bad.stderr


@pytest.mark.slow
def test_a_tiny_scale_run(toy_bin, ar_checkpoint, tmp_path):
    out = tmp_path / "table.md"
    H.run([sys.executable, SCRIPT, toy_bin, "--path", ar_checkpoint, "--sizes", "4000", "--work-dir",
           tmp_path / "work", "--output", out])
    table = out.read_text().splitlines()
    assert table[0].startswith("| corpus | sentences |") and len(table) == 4
    for row, kind in zip(table[2:], ("copies", "changed")):
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[0] == kind and cells[1] == "4,000"
        assert cells[-1] == "50/50"  # identical to loop-greedy
        assert float(cells[2]) > 0 and float(cells[4]) > 0 and float(cells[-3].rstrip("x")) > 0
