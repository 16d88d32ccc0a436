"""Learning curve of drafters: Tok. and ms/sentence of strict draft-verify
against the drafter's training minutes.

For every ``--drafter-dir LABEL=DIR`` (a ``fairseq-train --save-dir``), every
checkpoint of the run is decoded: ``checkpoint_E_U.pt`` (written by
``--save-interval-updates N``), ``checkpointE.pt`` and ``checkpoint_last.pt``,
one point per number of updates (``checkpoint_best.pt`` and averaged or
selected copies are not training points).  A checkpoint's number of updates
comes from its name, else from the checkpoint itself; its training minutes
from the training log ``DIR.log`` beside the directory (fairseq's simple log
format, what ``scripts/recipe-lib.sh`` writes): the timestamps of the lines
that report ``num_updates``, counted from the start of the run, interpolated
linearly between logged updates.  A log that holds several runs (training
resumed from ``checkpoint_last.pt``; each run logs ``fairseq_cli.train |
task: ...`` when it starts) counts each run from its own start, after the time
of the runs before it, so the pause between two runs is not training time.
(fairseq's own ``wall`` field cannot serve: after a resume fairseq 0.12 logs
``wall 0`` on every line.)

Each point decodes the first ``--limit`` test sentences at batch 1 with
strict draft-verify in its own worker process, timed like a benchmark row
(:mod:`fairseq_specdec.bench.workers`, ``--jobs`` at a time, a filler keeping
the other slots busy), next to fairseq's ``--beam 1`` on the same sentences.
Outputs in ``--out``: ``learning-curve.png`` (two panels: Tok. and
ms/sentence against training minutes, one line per label, beam 1 as a
horizontal line), ``learning-curve.json`` and ``learning-curve.md``.

Example (the Multi30k recipe, drafters trained with --save-interval-updates 50):
    scripts/learning-curve.py --data runs/multi30k.en-de/distill/bin --verifier runs/multi30k.en-de/verifier/checkpoint_best.pt \\
        --drafter-dir paper=runs/multi30k.en-de/drafter --drafter-dir vsd=runs/multi30k.en-de/vsd \\
        --limit 200 --jobs 2 --out runs/multi30k.en-de/learning-curve
"""
import argparse
import bisect
import json
import logging
import os
import re
import sys
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Dict, List, Optional, Sequence, Tuple

from .commands import recorded_command
from . import workers
from .specs import DrafterArg, RowSpecs

logger = logging.getLogger("learning-curve")

UPDATE_CHECKPOINT = re.compile(r"checkpoint_(\d+)_(\d+)\.pt")
EPOCH_CHECKPOINT = re.compile(r"checkpoint(\d+)\.pt")
LAST_CHECKPOINT = "checkpoint_last.pt"
#: ``num_updates N`` (epoch lines) or ``num_updates=N`` (train_inner lines)
NUM_UPDATES = re.compile(r"\bnum_updates[ =](\d+)")
TIMESTAMP = re.compile(r"^(\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2})")
#: the line each fairseq-train run logs when it starts
RUN_START = re.compile(r"\| fairseq_cli\.train \| task: ")


@dataclass
class Checkpoint:
    path: str
    num_updates: int


@dataclass
class Point:
    label: str
    checkpoint: str
    num_updates: int
    minutes: float
    tok: float
    ms_per_sent: float
    iterations: int
    identical_to_beam1: bool


def checkpoint_updates(path: str) -> int:
    """``num_updates`` stored in a fairseq checkpoint."""
    import torch

    import fairseq_specdec  # noqa: F401  (torch's safe loader accepts fairseq checkpoints)

    state = torch.load(path, map_location="cpu", mmap=True)
    history = state.get("optimizer_history") or []
    if not history or "num_updates" not in history[-1]:
        raise ValueError(f"{path}: no num_updates in its optimizer_history")
    return int(history[-1]["num_updates"])


def find_checkpoints(directory: str) -> List[Checkpoint]:
    """The training checkpoints of ``directory``, one per number of updates,
    by number of updates (update-numbered names first, then epoch ones, then
    checkpoint_last.pt, for the same number)."""
    names = os.listdir(directory)
    ranked: List[Tuple[int, str]] = []
    for name in names:
        m = UPDATE_CHECKPOINT.fullmatch(name)
        if m:
            ranked.append((0, name))
        elif EPOCH_CHECKPOINT.fullmatch(name):
            ranked.append((1, name))
        elif name == LAST_CHECKPOINT:
            ranked.append((2, name))
    by_updates: Dict[int, Checkpoint] = {}
    for _, name in sorted(ranked):
        path = os.path.join(directory, name)
        m = UPDATE_CHECKPOINT.fullmatch(name)
        updates = int(m.group(2)) if m else checkpoint_updates(path)
        by_updates.setdefault(updates, Checkpoint(path, updates))
    if not by_updates:
        raise ValueError(f"{directory}: no checkpoint_*_*.pt, checkpointN.pt or {LAST_CHECKPOINT}")
    return [by_updates[u] for u in sorted(by_updates)]


def training_clock(log_lines: Sequence[str]) -> List[Tuple[int, float]]:
    """``(num_updates, seconds of training)`` of every timestamped log line
    that reports ``num_updates``, in order, starting at ``(0, 0)``.  Seconds
    count from the start of the line's run (its ``task:`` line, or the log's
    first timestamp), plus the time of the runs before it (each up to its last
    such line)."""
    points: List[Tuple[int, float]] = [(0, 0.0)]
    before = 0.0  # training seconds of the earlier runs
    run_start: Optional[datetime] = None
    last = 0.0  # seconds into the current run of its latest point
    for line in log_lines:
        stamp = TIMESTAMP.match(line)
        if not stamp:
            continue
        when = datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S")
        if RUN_START.search(line):  # a run starts (the first one, or a resumed one)
            if run_start is not None:
                before, last = before + last, 0.0
            run_start = when
            continue
        if run_start is None:
            run_start = when
        updates = NUM_UPDATES.search(line)
        if updates:
            last = (when - run_start).total_seconds()
            points.append((int(updates.group(1)), before + last))
    return points


def minutes_at(clock: Sequence[Tuple[int, float]], num_updates: int) -> float:
    """Training minutes at ``num_updates``: the latest logged time at exactly
    that many updates, else linear between the logged updates around it
    (past the last one, the last one's rate)."""
    exact = [s for u, s in clock if u == num_updates]
    if exact:
        return exact[-1] / 60.0
    points = sorted({u: s for u, s in clock}.items())  # the latest time of each number of updates
    xs = [u for u, _ in points]
    i = bisect.bisect_left(xs, num_updates)
    if i == len(points):
        if len(points) < 2:
            raise ValueError(f"the training log has no time for {num_updates} updates")
        (u0, s0), (u1, s1) = points[-2], points[-1]
    else:
        (u0, s0), (u1, s1) = points[i - 1], points[i]
    return (s0 + (s1 - s0) * (num_updates - u0) / (u1 - u0)) / 60.0


def training_log(directory: str) -> str:
    """``DIR.log`` beside the save directory (what scripts/recipe-lib.sh writes)."""
    log = os.path.normpath(directory) + ".log"
    if not os.path.isfile(log):
        raise ValueError(f"--drafter-dir {directory}: no training log {log} (fairseq-train's output, --log-format simple)")
    return log


def parse_drafter_dir(value: str) -> DrafterArg:
    """``LABEL=DIR`` (the label is required: it names the line of the plot)."""
    arg = DrafterArg.parse(value)
    if not arg.label:
        raise ValueError(f"--drafter-dir takes LABEL=DIR, got {value!r}")
    if not os.path.isdir(arg.path):
        raise ValueError(f"--drafter-dir {value}: no such directory")
    return arg


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--data", required=True, help="binarized data directory (fairseq-preprocess output)")
    parser.add_argument("--verifier", required=True, help="verifier checkpoint (a fairseq transformer)")
    parser.add_argument("--drafter-dir", action="append", required=True, metavar="LABEL=DIR",
                        help="a drafter's fairseq-train --save-dir, its log DIR.log beside it; repeat for more drafters")
    parser.add_argument("--src", default="en")
    parser.add_argument("--tgt", default="de")
    parser.add_argument("--limit", type=int, default=200, help="decode the first N test sentences in fairseq's batch order")
    parser.add_argument("--warmup", type=int, default=10, help="sentences decoded before timing")
    parser.add_argument("--block-size", type=int, default=None, help="k (default: each drafter's)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per decoder (default 1)")
    parser.add_argument("--jobs", type=int, default=1, help="decoders timed at once, as in scripts/benchmark.py")
    parser.add_argument("--user-dir", help="a fairseq plugin directory given to every decoder as --user-dir")
    parser.add_argument("--out", default="learning-curve")
    return parser


def markdown(points: List[Point], beam1_ms: float) -> str:
    lines = ["| drafter | checkpoint | updates | training min | Tok. | ms/sent | iterations | = beam 1 |",
             "|---|---|---|---|---|---|---|---|"]
    for p in points:
        lines.append(f"| {p.label} | {os.path.basename(p.checkpoint)} | {p.num_updates} | {p.minutes:.2f} | {p.tok:.2f} "
                     f"| {p.ms_per_sent:.2f} | {p.iterations} | {p.identical_to_beam1} |")
    lines.append(f"| fairseq beam 1 | | | | 1.00 | {beam1_ms:.2f} | | |")
    return "\n".join(lines)


def plot(points: List[Point], beam1_ms: float, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (tok_ax, ms_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for label in dict.fromkeys(p.label for p in points):
        mine = sorted((p for p in points if p.label == label), key=lambda p: (p.minutes, p.num_updates))
        xs = [p.minutes for p in mine]
        tok_ax.plot(xs, [p.tok for p in mine], marker="o", label=label)
        ms_ax.plot(xs, [p.ms_per_sent for p in mine], marker="o", label=label)
    ms_ax.axhline(beam1_ms, color="k", ls="--", lw=1, label="fairseq --beam 1")
    tok_ax.set_ylabel("Tok. (tokens per iteration)")
    ms_ax.set_ylabel("ms / sentence (batch 1)")
    for ax in (tok_ax, ms_ax):
        ax.set_xlabel("drafter training minutes")
        ax.legend()
    tok_ax.set_title("Tokens per iteration, strict draft-verify")
    ms_ax.set_title("Latency, strict draft-verify")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None) -> Dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name, least in (("limit", 1), ("warmup", 0), ("threads", 1), ("jobs", 1)):
        if getattr(args, name) < least:
            parser.error(f"--{name} must be at least {least}, got {getattr(args, name)}")
    if args.block_size is not None and args.block_size < 1:
        parser.error(f"--block-size must be at least 1, got {args.block_size}")
    for path in (args.verifier, args.data):
        if not os.path.exists(path):
            parser.error(f"no such file or directory: {path}")
    if args.user_dir and not os.path.isdir(args.user_dir):
        parser.error(f"--user-dir {args.user_dir}: no such directory")
    try:
        dirs = [parse_drafter_dir(v) for v in args.drafter_dir]
        labels = [d.label for d in dirs]
        if len(set(labels)) != len(labels):
            raise ValueError(f"--drafter-dir: labels must differ, got {labels}")
        runs = []
        for d in dirs:
            clock = training_clock(open(training_log(d.path), encoding="utf-8", errors="replace").read().splitlines())
            runs += [(d, c, minutes_at(clock, c.num_updates)) for c in find_checkpoints(d.path)]
    except ValueError as e:
        parser.error(str(e))

    logging.basicConfig(format="%(asctime)s | %(levelname)s | %(name)s | %(message)s", datefmt="%Y-%m-%d %H:%M:%S",
                        level=logging.INFO, stream=sys.stdout)
    os.makedirs(args.out, exist_ok=True)
    user_dir = os.path.abspath(args.user_dir) if args.user_dir else None
    common = dict(data=args.data, src=args.src, tgt=args.tgt, threads=args.threads, limit=args.limit,
                  warmup=args.warmup, device="cpu", user_dir=user_dir)
    build = RowSpecs(common, args.verifier, [], None, {}, block_size=args.block_size)
    beam1 = build.autoregressive("beam1@bs1", "fairseq beam 1", 1, beam=1)
    specs, where = [beam1], {}
    for d, ckpt, minutes in runs:
        spec = build.draft_verify(DrafterArg(d.label, ckpt.path), f"u{ckpt.num_updates}@bs1", "draft-verify strict", 1)
        specs.append(spec)
        where[spec["name"]] = (d.label, ckpt, minutes)
    logger.info(f"{len(specs) - 1} checkpoints of {len(dirs)} drafter(s), {args.limit} sentences each, {args.jobs} at a time")
    results = workers.run_specs(specs, args.jobs, build.filler(), on_result=lambda spec, r: logger.info(
        f"{spec['name']}: {1000.0 * r['seconds'] / r['sentences']:.2f} ms/sentence, Tok. {r['tok']:.2f}"))

    ref = results["beam1@bs1"]
    beam1_ms = 1000.0 * ref["seconds"] / ref["sentences"]
    points = []
    for name, (label, ckpt, minutes) in where.items():
        r = results[name]
        points.append(Point(label, ckpt.path, ckpt.num_updates, minutes, r["tok"], 1000.0 * r["seconds"] / r["sentences"],
                            r["iterations"], all(r["tokens"][k] == ref["tokens"][k] for k in ref["tokens"])))
    table = markdown(points, beam1_ms)
    out = {
        "command": recorded_command(argv),
        "sentences": ref["sentences"], "threads": args.threads, "jobs": args.jobs,
        "beam1_ms_per_sent": beam1_ms, "points": [asdict(p) for p in points],
        "plot": plot(points, beam1_ms, os.path.join(args.out, "learning-curve.png")),
    }
    with open(os.path.join(args.out, "learning-curve.json"), "w") as f:
        json.dump(out, f, indent=1)
    with open(os.path.join(args.out, "learning-curve.md"), "w") as f:
        f.write(f"Command: `{out['command']}`\n\n{out['sentences']} sentences at batch 1, strict draft-verify, "
                f"{args.threads} thread(s) per decoder, {args.jobs} decoder(s) at a time, warm-up of {args.warmup} "
                f"sentences excluded; training minutes from each drafter's training log.\n\n{table}\n")
    print(table)
    print(f"\nplot: {out['plot']}; points: {os.path.join(args.out, 'learning-curve.json')}")
    return out
