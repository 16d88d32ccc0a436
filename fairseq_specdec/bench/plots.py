"""The benchmark's PNG plots."""
import os
from typing import Dict, List

from .specs import DRAFT_VERIFY, fmt_number

#: draft-verify rows per drafter in the speedup distribution (strict and the first relaxed settings)
ROWS_PER_DRAFTER = 3


def _save(fig, out_dir: str, name: str, written: List[str]) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    written.append(path)


def speedup_rows(rows: List[Dict]) -> List[Dict]:
    """The batch-1 draft-verify rows of the speedup distribution: the first
    :data:`ROWS_PER_DRAFTER` of every drafter."""
    chosen, per_drafter = [], {}
    for r in rows:
        if r["batch_size"] == 1 and r["decoding"] == DRAFT_VERIFY:
            drafter = r.get("drafter", "")
            per_drafter[drafter] = per_drafter.get(drafter, 0) + 1
            if per_drafter[drafter] <= ROWS_PER_DRAFTER:
                chosen.append(r)
    return chosen


def make_plots(results: Dict, out_dir: str) -> List[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written: List[str] = []
    rows = {r["name"]: r for r in results["rows"]}
    # 1. per-sentence speedup distribution at batch 1 (papers' Figure 4/6)
    base = rows.get("beam1@bs1")
    dvs = speedup_rows(results["rows"])
    if base and dvs:
        fig, ax = plt.subplots(figsize=(7, 4))
        for r in dvs:
            speed = [base["ms"][k] / r["ms"][k] for k in base["ms"] if k in r["ms"] and r["ms"][k] > 0]
            ax.hist(speed, bins=40, alpha=0.5, label=f"{r['label']} (median {sorted(speed)[len(speed) // 2]:.2f}x)")
        ax.axvline(1.0, color="k", lw=0.8)
        ax.set_xlabel("per-sentence speedup over fairseq --beam 1 (batch 1)")
        ax.set_ylabel("sentences")
        ax.legend()
        _save(fig, out_dir, "speedup-distribution.png", written)
    # 2. latency vs batch size
    sweep = results.get("batch_sweep")
    if sweep:
        fig, ax = plt.subplots(figsize=(6, 4))
        for label, pts in sweep.items():
            xs = sorted(int(b) for b in pts)
            ax.plot(xs, [pts[str(b)] for b in xs], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel("ms / sentence")
        ax.legend()
        ax.set_title("Latency vs batch size (Xia et al. 2023, Figure 5)")
        _save(fig, out_dir, "latency-vs-batch.png", written)
    # 3. Tok. vs k, and vs beta/tau
    for key, xlabel, fname in (("k_sweep", "block size k", "tok-vs-k.png"), ("beta_tau_sweep", "tau", "tok-vs-beta-tau.png")):
        sw = results.get(key)
        if not sw:
            continue
        fig, ax = plt.subplots(figsize=(6, 4))
        for label, pts in sw.items():
            xs = sorted(float(x) for x in pts)
            ax.plot(xs, [pts[fmt_number(x)]["tok"] for x in xs], marker="o", label=label)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("Tok. (tokens per iteration)")
        ax.legend()
        _save(fig, out_dir, fname, written)
    return written
