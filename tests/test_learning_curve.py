"""scripts/learning-curve.py (fairseq_specdec.bench.learning_curve): the
checkpoints of a training run, one per number of updates; training minutes
from fairseq's simple log (the wall field, a resumed run's clock continued,
timestamps without it); end to end on a tiny drafter trained with
--save-interval-updates: one point per checkpoint and label, strict output
identical to beam 1, the plot and the tables written."""
import json
import re

import pytest
import torch

import specdec_helpers as H
from fairseq_specdec.bench import learning_curve as lc

INNER = ("2026-11-22 10:00:{s:02d} | INFO | train_inner | epoch 001:     {u} / 30 loss=3.1, ups=1.2, "
         "num_updates={u}, lr=0.001, gnorm=1.0, train_wall={tw}, wall={w}")
EPOCH = ("2026-11-22 10:00:{s:02d} | INFO | train | epoch 001 | loss 3.1 | num_updates {u} | lr 0.001 "
         "| train_wall {tw} | wall {w}")
VALID = "2026-11-22 10:00:{s:02d} | INFO | valid | epoch 001 | valid on 'valid' subset | loss 3.0 | num_updates {u}"


def test_training_clock_reads_wall_of_inner_and_epoch_lines():
    log = [
        "2026-11-22 10:00:00 | INFO | fairseq_cli.train | task: draft_verify",
        INNER.format(s=5, u=10, tw=4, w=6),
        INNER.format(s=9, u=20, tw=4, w=12),
        VALID.format(s=10, u=30),  # no wall: not a point
        EPOCH.format(s=11, u=30, tw=14, w=18),
    ]
    assert lc.training_clock(log) == [(0, 0.0), (10, 6.0), (20, 12.0), (30, 18.0)]


def test_a_resumed_run_continues_the_clock():
    log = [INNER.format(s=1, u=10, tw=1, w=60), EPOCH.format(s=2, u=20, tw=1, w=120),
           # restarted from checkpoint_last.pt (20 updates): the trainer's wall starts again
           INNER.format(s=3, u=30, tw=1, w=30), EPOCH.format(s=4, u=40, tw=1, w=90)]
    assert lc.training_clock(log) == [(0, 0.0), (10, 60.0), (20, 120.0), (30, 150.0), (40, 210.0)]


def test_a_log_without_wall_uses_its_timestamps():
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
    proc = H.run([
        H.cli("fairseq-train"), toy_bin, "--user-dir", H.USER_DIR, *H.NAT_ARGS, "--block-size", "4", *optim,
        "--max-update", "60", "--save-interval-updates", "20", "--log-format", "simple", "--log-interval", "10",
        "--save-dir", run,
    ])
    log = proc.stdout + proc.stderr
    (tmp_path / "drafter.log").write_text(log)
    out = tmp_path / "curve"
    H.run([H.cli("python"), H.ROOT / "scripts" / "learning-curve.py", "--data", toy_bin, "--src", "src", "--tgt", "tgt",
           "--verifier", ar_checkpoint, "--drafter-dir", f"nat={run}", "--drafter-dir", f"same={run}",
           "--limit", "12", "--warmup", "2", "--jobs", "2", "--out", out])
    result = json.loads((out / "learning-curve.json").read_text())
    assert result["sentences"] == 12 and result["beam1_ms_per_sent"] > 0
    points = result["points"]
    # the toy epoch has 27 updates: update checkpoints 20, 40, 60 and epoch checkpoints 27, 54
    for label in ("nat", "same"):
        mine = [p for p in points if p["label"] == label]
        assert [p["num_updates"] for p in mine] == [20, 27, 40, 54, 60]
        minutes = [p["minutes"] for p in mine]
        assert minutes == sorted(minutes) and minutes[-1] > 0
        for p in mine:
            assert p["identical_to_beam1"], p
            assert p["tok"] >= 1.0 and p["ms_per_sent"] > 0
    # minutes of update 20: the wall of the log's line at 20 updates
    wall20 = float(re.search(r"num_updates=20, .*wall=(\d+)", log).group(1))
    assert next(p for p in points if p["num_updates"] == 20)["minutes"] == pytest.approx(wall20 / 60.0)
    assert (out / "learning-curve.png").stat().st_size > 1000
    table = (out / "learning-curve.md").read_text()
    assert "| nat | checkpoint_1_20.pt | 20 |" in table and "| same | checkpoint2.pt | 54 |" in table
    assert "| fairseq beam 1 |" in table
