"""The GPU kit's report (``scripts/gpu-summary.py``, run by ``scripts/gpu-run.sh``):
one Markdown page from a run folder and its log.

It reads what the recipe left behind and nothing else: the machine
(``env.txt``), the time of each stage (the ``[gpu-run ...]`` and
``[multi30k ...]`` lines of the log), what each training reached (the last
``num_updates`` and validation line of ``RUN/NAME.log``, and whether the
stage's wall-clock cap cut it short), the benchmark table
(``results.md`` of the benchmark's folder, or the rows a benchmark cut
short finished, ``rows.partial.jsonl``), and the ratios the GPU targets are stated in
(strict draft-verify against ``--beam 1``, relaxed against beam 5 with the
sacreBLEU difference, loop-greedy against ``--beam 1``) read from
``results.json``.  A stage or file that is missing is said to be missing.
"""
import argparse
import json
import os
import re
from datetime import datetime, timedelta
from typing import Dict, List, Optional, Tuple

TRAININGS = ("verifier", "vsd", "blockwise", "drafter")
STAGE_LINE = re.compile(r"^\[multi30k (\d\d:\d\d:\d\d) \+\d+m\] (stages? .*)$")
DONE_LINE = re.compile(r"^\[(?:multi30k|gpu-run) (\d\d:\d\d:\d\d) \+\d+m\] (all done|phase .* done)")
CAP_LINE = re.compile(r"WARNING: (\w+) stopped by the ([\d.]+)-minute safety cap at (\d+) of (\d+) updates")


def stage_times(log_lines: List[str]) -> List[Tuple[str, float]]:
    """``[(stage, minutes)]`` from the stage-start lines of the recipe's log,
    each stage ending where the next (or the run) does."""
    marks = []
    for line in log_lines:
        m = STAGE_LINE.match(line)
        if m:
            marks.append((m.group(2).replace("stages ", "").replace("stage ", "").replace(", side by side", ""),
                          m.group(1)))
            continue
        m = DONE_LINE.match(line)
        if m:
            marks.append((None, m.group(1)))
    out = []
    for (name, start), (_, end) in zip(marks, marks[1:]):
        if name is None:
            continue
        t0, t1 = (datetime.strptime(t, "%H:%M:%S") for t in (start, end))
        if t1 < t0:
            t1 += timedelta(days=1)
        out.append((name, (t1 - t0).total_seconds() / 60.0))
    return out


def training_outcome(log_path: str) -> Optional[Dict]:
    """The last update count and validation metrics of a fairseq-train log
    (None when there is no log)."""
    if not os.path.exists(log_path):
        return None
    updates, valid, ups = 0, None, []
    with open(log_path, errors="replace") as f:
        for line in f:
            m = re.search(r"num_updates[= ](\d+)", line)
            if m:
                updates = max(updates, int(m.group(1)))
            if "valid on 'valid' subset" in line:
                # its fields, without the table-breaking bars
                valid = line.split("valid on 'valid' subset |", 1)[1].strip().replace(" | ", ", ")
            m = re.search(r"\bups=([\d.]+)", line)
            if m and "train_inner" in line:
                ups.append(float(m.group(1)))
    # the median of the logged intervals (the first one includes the start-up)
    median = sorted(ups)[len(ups) // 2] if ups else None
    return {"updates": updates, "valid": valid, "updates_per_s": median}


def key_ratios(results: Dict) -> List[str]:
    """The figures the GPU targets are stated in, one line each."""
    rows = {r["name"]: r for r in results.get("rows", [])}
    lines = []
    for bs in sorted({r["batch_size"] for r in rows.values()}):
        b1, b5 = rows.get(f"beam1@bs{bs}"), rows.get(f"beam5@bs{bs}")
        if not b1 or not b5:
            continue
        here = [r for r in rows.values() if r["batch_size"] == bs]
        for greedy in (r for r in here if r["name"].startswith("loop-greedy")):
            lines.append(f"batch {bs}: {greedy['label']} {greedy['speedup_vs_beam1']:.2f}x of fairseq --beam 1 "
                         f"(identical: {greedy['identical_to_beam1']})")
        strict = [r for r in here if r["name"].startswith("strict")]
        if strict:
            best = max(strict, key=lambda r: r["speedup_vs_beam1"])
            lines.append(f"batch {bs}: best strict draft-verify ({best['label']}) {best['speedup_vs_beam1']:.2f}x of "
                         f"--beam 1, Tok. {best['tok']:.2f} (identical: {best['identical_to_beam1']})")
        relaxed = [r for r in here if re.match(r"b\d+t", r["name"])]
        if relaxed:
            best = max(relaxed, key=lambda r: r["speedup_vs_beam5"])
            lines.append(f"batch {bs}: best relaxed ({best['label']}) {best['speedup_vs_beam5']:.2f}x of beam 5, "
                         f"sacreBLEU {best['sacrebleu']:.2f} against beam 5's {b5['sacrebleu']:.2f} "
                         f"({best['sacrebleu'] - b5['sacrebleu']:+.2f})")
    return lines


def partial_table(path: str) -> List[str]:
    """The rows a benchmark cut short finished (``rows.partial.jsonl``), with
    their ratio to and identity with ``--beam 1`` where that row finished."""
    lines = ["| decoder | batch | ms/sent | vs beam 1 | Tok. | sacreBLEU | peak GPU MB | = beam 1 |",
             "|---|---|---|---|---|---|---|---|"]
    with open(path) as f:
        for row in map(json.loads, f):
            gpu = row.get("peak_gpu_mb")
            ratio = row.get("speedup_vs_beam1")
            if "identical_to_beam1" not in row:
                same = ""
            elif row["identical_to_beam1"]:
                same = "yes"
            else:
                same = f"no ({row['differs_from_beam1']} differ)"
            lines.append(f"| {row['label']} | {row['batch_size']} | {row['ms_per_sent']:.2f} "
                         f"| {'' if ratio is None else f'{ratio:.2f}x'} | {row['tok']:.2f} "
                         f"| {row['sacrebleu']:.2f} | {'' if gpu is None else f'{gpu:.0f}'} | {same} |")
    return lines


def benchmark_section(bench: str) -> List[str]:
    """The table of one benchmark folder with its key figures, or the rows a
    benchmark cut short finished."""
    table, results = os.path.join(bench, "results.md"), os.path.join(bench, "results.json")
    partial = os.path.join(bench, "rows.partial.jsonl")
    title = f"## Benchmark: {os.path.basename(os.path.normpath(bench))}"
    if os.path.exists(table):
        out = [title, "", open(table).read().strip(), ""]
        if os.path.exists(results):
            with open(results) as f:
                out += ["Key figures:", ""] + [f"- {line}" for line in key_ratios(json.load(f))] + [""]
        return out
    if os.path.exists(partial):
        return ([f"{title} (cut short: the rows it finished; ratios to and identity with --beam 1 where its row "
                 "finished)", ""] + partial_table(partial) + [""])
    return [f"{title}: not run", ""]


def summary(run: str, log: Optional[str], env: Optional[str], benches: Optional[List[str]] = None) -> str:
    out = ["# GPU kit run", ""]
    if env and os.path.exists(env):
        out += ["Machine:", "", "```", open(env).read().strip(), "```", ""]
    log_lines = open(log, errors="replace").read().splitlines() if log and os.path.exists(log) else []
    times = stage_times(log_lines)
    if times:
        out += ["| stage | minutes |", "|---|---|"] + [f"| {name} | {minutes:.1f} |" for name, minutes in times] + [""]
    caps = {m.group(1): m.groups() for m in map(CAP_LINE.search, log_lines) if m}
    origin = os.path.join(run, "ORIGIN.txt")  # a kit made with --models: trained elsewhere
    if os.path.exists(origin):
        out += ["Models: " + open(origin).read().strip() + " (trained before this run, not here).", ""]
    out += ["| model | updates | updates/s | cut by its cap | last validation |", "|---|---|---|---|---|"]
    for name in TRAININGS:
        got = training_outcome(os.path.join(run, f"{name}.log"))
        if got is None:
            out.append(f"| {name} | not trained | | | |")
            continue
        cap = f"yes, at {caps[name][2]} of {caps[name][3]}" if name in caps else "no"
        ups = f"{got['updates_per_s']:.1f}" if got["updates_per_s"] is not None else ""
        out.append(f"| {name} | {got['updates']} | {ups} | {cap} | {got['valid'] or 'none'} |")
    out.append("")
    for bench in benches or [os.path.join(run, "benchmark")]:
        out += benchmark_section(bench)
    return "\n".join(out)


def main(argv=None):
    parser = argparse.ArgumentParser(description="The GPU kit's one-page report (Markdown on standard output).")
    parser.add_argument("--run", required=True, help="the run folder (models, training logs, benchmark/)")
    parser.add_argument("--bench", action="append",
                        help="a benchmark's folder, repeatable (default RUN/benchmark); one not run is said so")
    parser.add_argument("--log", help="the log of scripts/gpu-run.sh (stage times, cap warnings)")
    parser.add_argument("--env", help="env.txt of scripts/gpu-run.sh (the machine)")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.run):
        parser.error(f"--run {args.run}: no such folder")
    print(summary(args.run, args.log, args.env, args.bench))
    return 0
