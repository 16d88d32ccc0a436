"""scripts/distill.sh's shards (fairseq-generate's --distributed-world-size /
--distributed-rank, what a Slurm job array or one process per GPU runs):
their union is every sentence exactly once, and the merged distillation has
every sentence in order. A tiny model and a 57-sentence split, 3 shards."""
import os
import shutil
import subprocess
import sys

import pytest

import specdec_helpers as H

SHARDS = 3


def mini_data(toy_bin, tmp_path):
    """A data directory whose train split is the toy test1 split (57 sentences)
    and whose valid split is test (50), with their text as distill.sh's BPE_DIR."""
    raw = os.path.join(os.path.dirname(toy_bin), "raw")
    bin_dir, bpe = tmp_path / "bin", tmp_path / "bpe"
    bin_dir.mkdir()
    bpe.mkdir()
    for name in os.listdir(toy_bin):
        if not os.path.isfile(os.path.join(toy_bin, name)):
            continue  # an index other tests built beside the toy data
        for old, new in (("test1.", "train."), ("test.", "valid.")):
            if name.startswith(old):
                shutil.copy(os.path.join(toy_bin, name), bin_dir / (new + name[len(old):]))
        if name.startswith(("dict.", "test.")):  # distill.sh keeps the test split as it is
            shutil.copy(os.path.join(toy_bin, name), bin_dir / name)
    for old, new in (("test1", "train"), ("test", "val")):
        for lang in ("src", "tgt"):
            shutil.copy(os.path.join(raw, f"{old}.{lang}"), bpe / f"{new}.{lang}")
    return str(bin_dir), str(bpe)


@pytest.mark.slow
def test_distill_shards_cover_every_sentence_once(toy_bin, ar_checkpoint, tmp_path):
    bin_dir, bpe = mini_data(toy_bin, tmp_path)
    out = tmp_path / "distill"
    env = H.subprocess_env()
    env.update(SHARDS=str(SHARDS), BEAM="1", MAX_TOKENS="200", PYTHON=sys.executable,
               PATH=os.path.dirname(H.cli("fairseq-generate")) + os.pathsep + env.get("PATH", ""))
    proc = subprocess.run(["bash", str(H.ROOT / "scripts" / "distill.sh"), ar_checkpoint, bin_dir, bpe, str(out),
                           "src", "tgt"], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for split, prefix, n in (("train", "train", 57), ("valid", "val", 50)):
        shards = [H.parse_generate(open(out / "gen" / f"{split}.shard{i}.txt", encoding="utf-8").read())
                  for i in range(SHARDS)]
        ids = [i for shard in shards for i in shard]
        assert sorted(ids) == list(range(n)), split  # every sentence, once
        assert all(len(shard) > 0 for shard in shards)  # each shard did a part
        # the merged distillation: one line per sentence, in sentence order, the shards' hypotheses
        lines = open(out / "text" / f"{prefix}.tgt", encoding="utf-8").read().splitlines()
        assert len(lines) == n
        merged = {i: hyp for shard in shards for i, hyp in shard.items()}
        assert lines == [merged[i][1] for i in range(n)]
    assert os.path.isfile(out / "bin" / "train.src-tgt.tgt.bin")


@pytest.mark.slow
def test_readme_step_1_as_written(toy_bin, ar_checkpoint, tmp_path):
    """The README's step 1 (``BEAM=1 scripts/distill.sh CKPT data-bin
    data-bpe distill SRC TGT`` with ``data-bpe/{train,valid}.*``, fairseq's
    split names) distills both splits and binarizes them."""
    bin_dir, bpe = mini_data(toy_bin, tmp_path)
    for lang in ("src", "tgt"):
        os.rename(os.path.join(bpe, f"val.{lang}"), os.path.join(bpe, f"valid.{lang}"))
    out = tmp_path / "distill"
    env = H.subprocess_env()
    env.update(BEAM="1", PYTHON=sys.executable,
               PATH=os.path.dirname(H.cli("fairseq-generate")) + os.pathsep + env.get("PATH", ""))
    proc = subprocess.run(["bash", str(H.ROOT / "scripts" / "distill.sh"), ar_checkpoint, bin_dir, bpe, str(out),
                           "src", "tgt"], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len(open(out / "text" / "valid.tgt", encoding="utf-8").read().splitlines()) == 50
    assert os.path.isfile(out / "bin" / "valid.src-tgt.tgt.bin") and os.path.isfile(out / "bin" / "train.src-tgt.tgt.bin")


@pytest.mark.parametrize("missing", ["valid", "train"])
def test_a_missing_input_is_refused_before_any_decoding(toy_bin, ar_checkpoint, tmp_path, missing):
    """No valid text or no train text: refused at once, naming the file,
    with nothing decoded."""
    bin_dir, bpe = mini_data(toy_bin, tmp_path)
    if missing == "valid":
        os.remove(os.path.join(bpe, "val.src"))
    else:
        os.remove(os.path.join(bpe, "train.src"))
    out = tmp_path / "distill"
    proc = subprocess.run(["bash", str(H.ROOT / "scripts" / "distill.sh"), ar_checkpoint, bin_dir, bpe, str(out),
                           "src", "tgt"], capture_output=True, text=True, env=H.subprocess_env(), timeout=60)
    assert proc.returncode == 2
    want = {"valid": "valid.src (nor val.src)", "train": "train.src"}[missing]
    assert want in proc.stderr, proc.stderr
    assert not (out / "gen").exists()
