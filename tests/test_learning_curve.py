"""scripts/learning-curve.py (fairseq_specdec.bench.learning_curve): the
checkpoints of a training run, one per number of updates; training minutes
from fairseq's simple log (timestamps from the run's start, a resumed run
continued without the pause); end to end on a tiny drafter trained with
--save-interval-updates: one point per checkpoint and label, strict output
identical to beam 1, the plot and the tables written."""
import json
import re
import subprocess
from datetime import datetime

import pytest
import torch

import specdec_helpers as H
from fairseq_specdec.bench import learning_curve as lc

TASK = "2026-11-22 10:{m:02d}:{s:02d} | INFO | fairseq_cli.train | task: DraftVerifyTask"
INNER = ("2026-11-22 10:{m:02d}:{s:02d} | INFO | train_inner | epoch 001:     {u} / 30 loss=3.1, ups=1.2, "
         "num_updates={u}, lr=0.001, gnorm=1.0, train_wall=1, wall=0")
EPOCH = ("2026-11-22 10:{m:02d}:{s:02d} | INFO | train | epoch 001 | loss 3.1 | num_updates {u} | lr 0.001 "
         "| train_wall 1 | wall 0")
VALID = "2026-11-22 10:{m:02d}:{s:02d} | INFO | valid | epoch 001 | valid on 'valid' subset | loss 3.0 | num_updates {u}"


def test_training_clock_reads_the_timestamps_of_update_lines():
    log = [
        "2026-11-22 09:59:57 | INFO | fairseq.tasks.text_to_speech | Please install tensorboardX",
        "/venv/hydra/initialize.py:43: UserWarning: no timestamp here",
        TASK.format(m=0, s=0),
        "2026-11-22 10:00:03 | INFO | fairseq_cli.train | Start iterating over samples",
        INNER.format(m=0, s=6, u=10),
        INNER.format(m=0, s=12, u=20),
        VALID.format(m=0, s=17, u=30),
        EPOCH.format(m=0, s=18, u=30),
    ]
    # seconds from the run's start (its task: line)
    assert lc.training_clock(log) == [(0, 0.0), (10, 6.0), (20, 12.0), (30, 17.0), (30, 18.0)]
    assert lc.minutes_at(lc.training_clock(log), 30) == pytest.approx(18 / 60)  # the latest line of 30 updates


def test_a_resumed_run_continues_the_clock_without_the_pause():
    log = [TASK.format(m=0, s=0), INNER.format(m=1, s=0, u=10), EPOCH.format(m=2, s=0, u=20),
           # stopped, then resumed from checkpoint_last.pt (20 updates) 30 minutes later
           TASK.format(m=32, s=0), INNER.format(m=32, s=30, u=30), EPOCH.format(m=33, s=0, u=40)]
    assert lc.training_clock(log) == [(0, 0.0), (10, 60.0), (20, 120.0), (30, 150.0), (40, 180.0)]


def test_a_log_without_a_task_line_counts_from_its_first_timestamp():
    log = ["2026-11-22 10:00:00 | INFO | fairseq_cli.train | start",
           "2026-11-22 10:01:30 | INFO | train | epoch 001 | loss 3.1 | num_updates 25",
           "2026-11-22 10:03:00 | INFO | train | epoch 002 | loss 2.1 | num_updates 50"]
    assert lc.training_clock(log) == [(0, 0.0), (25, 90.0), (50, 180.0)]


def test_minutes_at_exact_between_and_past_the_log():
    clock = [(0, 0.0), (10, 60.0), (30, 300.0)]
    assert lc.minutes_at(clock, 10) == 1.0
    assert lc.minutes_at(clock, 20) == pytest.approx(3.0)  # halfway from 60 s to 300 s
    assert lc.minutes_at(clock, 40) == pytest.approx(7.0)  # past the last line at the last rate (12 s/update)
    assert lc.minutes_at(clock, 0) == 0.0
    with pytest.raises(ValueError, match="no time for 5 updates"):
        lc.minutes_at([(0, 0.0)], 5)


def fake_checkpoint(path, updates):
    torch.save({"optimizer_history": [{"num_updates": updates}], "model": {}}, path)


def test_checkpoints_one_per_number_of_updates(tmp_path):
    run = tmp_path / "drafter"
    run.mkdir()
    for name in ("checkpoint_1_20.pt", "checkpoint_2_40.pt"):
        (run / name).write_bytes(b"")  # named by their updates: never opened
    fake_checkpoint(run / "checkpoint1.pt", 27)
    fake_checkpoint(run / "checkpoint2.pt", 40)  # the same point as checkpoint_2_40.pt
    fake_checkpoint(run / "checkpoint_last.pt", 45)
    for other in ("checkpoint_best.pt", "checkpoint_avg.pt", "checkpoint_selected.pt", "notes.txt"):
        fake_checkpoint(run / other, 99)
    got = [(c.num_updates, c.path.rsplit("/", 1)[1]) for c in lc.find_checkpoints(str(run))]
    assert got == [(20, "checkpoint_1_20.pt"), (27, "checkpoint1.pt"), (40, "checkpoint_2_40.pt"),
                   (45, "checkpoint_last.pt")]
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no checkpoint_"):
        lc.find_checkpoints(str(empty))


def test_drafter_dir_needs_a_label_and_a_log(tmp_path):
    run = tmp_path / "drafter"
    run.mkdir()
    with pytest.raises(ValueError, match="LABEL=DIR"):
        lc.parse_drafter_dir(str(run))
    assert lc.parse_drafter_dir(f"paper={run}").label == "paper"
    with pytest.raises(ValueError, match=r"no training log .*drafter\.log"):
        lc.training_log(str(run))


@pytest.mark.slow
def test_learning_curve_end_to_end(toy_bin, ar_checkpoint, tmp_path):
    run = tmp_path / "drafter"
    optim = [a for a in H.OPTIM_ARGS if a != "--no-epoch-checkpoints"]
    # the log as scripts/recipe-lib.sh writes it: stdout and stderr interleaved in DIR.log
    with open(tmp_path / "drafter.log", "w") as f:
        subprocess.run([
            H.cli("fairseq-train"), toy_bin, "--user-dir", H.USER_DIR, *H.NAT_ARGS, "--block-size", "4", *optim,
            "--max-update", "40", "--save-interval-updates", "20", "--log-format", "simple", "--log-interval", "10",
            "--save-dir", str(run),
        ], stdout=f, stderr=subprocess.STDOUT, env=H.subprocess_env(), check=True, timeout=600)
    log = (tmp_path / "drafter.log").read_text()
    out = tmp_path / "curve"
    H.run([H.cli("python"), H.ROOT / "scripts" / "learning-curve.py", "--data", toy_bin, "--src", "src", "--tgt", "tgt",
           "--verifier", ar_checkpoint, "--drafter-dir", f"nat={run}", "--drafter-dir", f"same={run}",
           "--limit", "12", "--warmup", "2", "--jobs", "2", "--out", out])
    result = json.loads((out / "learning-curve.json").read_text())
    assert result["sentences"] == 12 and result["beam1_ms_per_sent"] > 0
    points = result["points"]
    # the toy epoch has 27 updates: update checkpoints 20 and 40 (in the second epoch) and epoch checkpoint 27
    for label in ("nat", "same"):
        mine = [p for p in points if p["label"] == label]
        assert [p["num_updates"] for p in mine] == [20, 27, 40]
        minutes = [p["minutes"] for p in mine]
        assert minutes == sorted(minutes) and minutes[-1] > 0
        for p in mine:
            assert p["identical_to_beam1"], p
            assert p["tok"] >= 1.0 and p["ms_per_sent"] > 0
    # minutes of update 20: from the run's task: line to the last log line that
    # reports 20 updates (train_inner, validation or checkpoint lines alike;
    # they may fall in different seconds)
    def stamp(pattern, last=False):
        found = re.findall(r"^(\S+ \S+) \| .*" + pattern, log, re.M)
        return datetime.strptime(found[-1] if last else found[0], "%Y-%m-%d %H:%M:%S")

    seconds = (stamp(r"num_updates[ =]20\b", last=True) - stamp(r"fairseq_cli\.train \| task: ")).total_seconds()
    assert next(p for p in points if p["num_updates"] == 20)["minutes"] == pytest.approx(seconds / 60.0)
    assert (out / "learning-curve.png").stat().st_size > 1000
    table = (out / "learning-curve.md").read_text()
    assert "| nat | checkpoint_1_20.pt | 20 |" in table and "| same | checkpoint1.pt | 27 |" in table
    assert "| fairseq beam 1 |" in table
