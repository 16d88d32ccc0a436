#!/usr/bin/env python
"""Measure draft-then-verify decoding against fairseq's own decoders, in one run.

Every row decodes the whole test set in its own worker process (so peak memory
is per decoder) through the same code path as ``fairseq-generate``:
``task.build_generator`` on the ``draft_verify`` task.  Threads are pinned
(default 1), model loading and a warm-up on the first sentences are excluded
from the timings.  Rows: fairseq ``--beam 5``, ``--beam 1``, strict
draft-verify and a grid of relaxed settings, at batch 1 (latency) and batch 32
(throughput).  Each row reports sentences/s, ms/sentence, speedups against
beam 5 and beam 1 of the same batch size, Tok., iterations, sacreBLEU
(detokenized, with its signature) and tokenized BLEU, peak memory, and whether
the output is token-identical to ``--beam 1`` at that batch size.

Outputs in ``--out``: ``results.json``, ``results.md`` (the table), hypothesis
files, and PNG plots (per-sentence speedup distribution, latency vs batch
size, Tok. vs k and vs beta/tau).

With ``--jobs 2`` two decoders are timed at once (one per core, one thread
each); a discarded beam-1 decoder fills a free slot until the last row ends,
so every row is timed with the other core busy.

Example (the Multi30k demo models):
    scripts/benchmark.py --data runs/multi30k.en-de/distill/bin --verifier runs/multi30k.en-de/verifier/checkpoint_best.pt \\
        --drafter runs/multi30k.en-de/drafter/checkpoint_selected.pt --tok-ref data/multi30k.en-de/tok/test_2016_flickr.de \\
        --raw-ref ../shared/data/multi30k/test_2016_flickr.de.gz --out runs/multi30k.en-de/benchmark --jobs 2
"""
import argparse
import gzip
import json
import logging
import os
import resource
import subprocess
import sys
import time
from typing import Dict, List, Optional

ROW_KINDS = ("beam5", "beam1", "strict", "relaxed", "input-guided", "blockwise")
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PLUGIN = os.path.join(ROOT, "fairseq_specdec")
logger = logging.getLogger("benchmark")


# --------------------------------------------------------------------------- worker
def load_decoder(spec: Dict):
    """Models, task and generator of one configuration, exactly as
    ``fairseq-generate`` builds them, with threads pinned.  Returns
    ``(task, models, generator, batches)``; ``batches()`` yields the test set
    (its first ``spec["limit"]`` sentences) in fairseq's batch order."""
    import torch

    torch.set_num_threads(spec["threads"])
    sys.path.insert(0, ROOT)
    import fairseq_specdec  # noqa: F401
    from fairseq import checkpoint_utils, options, tasks, utils
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    argv = [
        spec["data"], "--user-dir", PLUGIN, "--task", "draft_verify", "--cpu",
        "--gen-subset", spec.get("subset", "test"), "--path", spec["path"],
        "--batch-size", str(spec["batch_size"]), "--beam", str(spec["beam"]),
        "--source-lang", spec["src"], "--target-lang", spec["tgt"],
    ] + spec.get("extra", [])
    parser = options.get_generation_parser()
    args = options.parse_args_and_arch(parser, argv)
    cfg = convert_namespace_to_omegaconf(args)
    task = tasks.setup_task(cfg.task)
    models, saved_cfg = checkpoint_utils.load_model_ensemble(
        utils.split_paths(cfg.common_eval.path), task=task
    )
    for model in models:
        model.eval()
        model.prepare_for_inference_(cfg)
    task.load_dataset(cfg.dataset.gen_subset, task_cfg=saved_cfg.task)
    dataset = task.dataset(cfg.dataset.gen_subset)
    generator = task.build_generator(models, cfg.generation)
    max_positions = utils.resolve_max_positions(task.max_positions(), *[m.max_positions() for m in models])
    limit = spec.get("limit")

    def batches():
        itr = task.get_batch_iterator(
            dataset=dataset, max_sentences=spec["batch_size"], max_positions=max_positions,
            ignore_invalid_inputs=False, num_workers=0,
        ).next_epoch_itr(shuffle=False)
        seen = 0
        for sample in itr:
            if limit is not None and seen >= limit:
                break
            seen += len(sample["id"])
            yield sample

    return task, models, generator, batches


def run_worker(spec: Dict) -> Dict:
    """Decode the test set with one configuration; returns timings and hypotheses."""
    task, models, generator, batches = load_decoder(spec)
    if spec.get("filler"):  # load for an idle core: decode until killed, report nothing
        while True:
            for sample in batches():
                task.inference_step(generator, models, sample)

    # warm-up (excluded): the first sentences, once
    warm = spec.get("warmup", 20)
    done = 0
    for sample in batches():
        if done >= warm:
            break
        task.inference_step(generator, models, sample)
        done += len(sample["id"])
    if hasattr(generator, "stats"):
        from fairseq_specdec.generation import SpecDecStats

        generator.stats = SpecDecStats(name=generator.stats.name)

    hyps, per_sentence_ms = {}, {}
    start = time.perf_counter()
    for sample in batches():
        t0 = time.perf_counter()
        out = task.inference_step(generator, models, sample)
        dt = (time.perf_counter() - t0) * 1000.0
        for i, sid in enumerate(sample["id"].tolist()):
            hyps[sid] = out[i][0]["tokens"].tolist()
            per_sentence_ms[sid] = dt / len(sample["id"])
    total = time.perf_counter() - start
    tgt_dict = task.target_dictionary
    result = {
        "seconds": total,
        "sentences": len(hyps),
        "tokens": {str(k): v for k, v in hyps.items()},
        "text": {str(k): tgt_dict.string(v[:-1] if v and v[-1] == tgt_dict.eos() else v) for k, v in hyps.items()},
        "ms": {str(k): v for k, v in per_sentence_ms.items()},
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
    }
    stats = getattr(generator, "stats", None)
    if stats is not None:
        # the timed pass only (the warm-up had its own statistics object)
        result.update(tok=stats.mean_accepted, iterations=stats.iterations, out_tokens=stats.tokens,
                      histogram={str(n): c for n, c in sorted(stats.histogram.items())}, summary=stats.summary())
    else:  # autoregressive: one token per step
        out_tokens = sum(len(v) for v in hyps.values())  # EOS included: one per decoder step
        result.update(tok=1.0, iterations=out_tokens, out_tokens=out_tokens)
    return result


class WorkerProcess:
    """One configuration decoding in a fresh process (its own peak memory, pinned threads)."""

    def __init__(self, spec: Dict):
        import tempfile

        self.tmp = tempfile.TemporaryDirectory()
        self.spec = dict(spec, result_path=os.path.join(self.tmp.name, "result.json"))
        env = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]), MKL_NUM_THREADS=str(spec["threads"]))
        self.log = open(os.path.join(self.tmp.name, "worker.log"), "w+")
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(self.spec)],
            env=env, stdout=self.log, stderr=subprocess.STDOUT, text=True,
        )

    def done(self) -> bool:
        return self.proc.poll() is not None

    def result(self) -> Dict:
        self.proc.wait()
        try:
            if self.proc.returncode != 0:
                self.log.seek(0)
                raise RuntimeError(f"worker failed for {self.spec['name']}:\n{self.log.read()[-6000:]}")
            with open(self.spec["result_path"]) as f:
                return json.load(f)
        finally:
            self.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        self.tmp.cleanup()


def run_specs(specs: List[Dict], jobs: int = 1, filler: Optional[Dict] = None, on_result=None) -> List[Dict]:
    """Run every spec, ``jobs`` worker processes at a time; results in spec order.

    With ``jobs`` > 1 and a ``filler`` spec, no slot stays idle while a row is
    being timed: when fewer rows than slots are left, the free slots run the
    filler (a decoder whose output is discarded) until the last row ends, so
    every row is timed under the same load on the other cores.
    """
    results: List[Optional[Dict]] = [None] * len(specs)
    pending = list(enumerate(specs))
    running: Dict[int, WorkerProcess] = {}
    fillers: List[WorkerProcess] = []
    try:
        while pending or running:
            while pending and len(running) + len(fillers) < jobs:
                i, spec = pending.pop(0)
                running[i] = WorkerProcess(spec)
            if not pending and running and filler is not None:
                while len(running) + len(fillers) < jobs:
                    fillers.append(WorkerProcess(dict(filler, name="filler", filler=True)))
            finished = [i for i, w in running.items() if w.done()]
            if not finished:
                time.sleep(0.2)
                continue
            for i in finished:
                results[i] = running.pop(i).result()
                if on_result is not None:
                    on_result(specs[i], results[i])
    finally:
        for w in list(running.values()) + fillers:
            w.close()
    return results


# --------------------------------------------------------------------------- scoring
def detokenize(lines: List[str], lang: str) -> List[str]:
    from sacremoses import MosesDetokenizer

    md = MosesDetokenizer(lang=lang)
    return [md.detokenize(line.replace("@@ ", "").replace("@@", "").split()) for line in lines]


def read_lines(path: str) -> List[str]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def score(text: Dict[str, str], raw_ref: List[str], tok_ref: List[str], lang: str) -> Dict:
    """BLEU of the decoded sentences (ids are line numbers of the references)."""
    import sacrebleu

    ids = sorted(int(k) for k in text)
    hyp_bpe = [text[str(i)] for i in ids]
    detok = detokenize(hyp_bpe, lang)
    bleu = sacrebleu.metrics.BLEU()
    res = bleu.corpus_score(detok, [[raw_ref[i] for i in ids]])
    out = {"sacrebleu": round(res.score, 2), "signature": str(bleu.get_signature())}
    if tok_ref:
        tok_hyp = [h.replace("@@ ", "") for h in hyp_bpe]
        tb = sacrebleu.metrics.BLEU(tokenize="none", force=True)  # tokenized on purpose: no warning
        out["tok_bleu"] = round(tb.corpus_score(tok_hyp, [[tok_ref[i] for i in ids]]).score, 2)
    return out


# --------------------------------------------------------------------------- plots
def make_plots(results: Dict, out_dir: str) -> List[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    rows = {r["name"]: r for r in results["rows"]}
    # 1. per-sentence speedup distribution at batch 1 (papers' Figure 4/6)
    base = rows.get("beam1@bs1")
    dvs = [r for r in results["rows"] if r["batch_size"] == 1 and r["decoding"] == "draft-verify"]
    if base and dvs:
        fig, ax = plt.subplots(figsize=(7, 4))
        for r in dvs[:3]:
            speed = [base["ms"][k] / r["ms"][k] for k in base["ms"] if k in r["ms"] and r["ms"][k] > 0]
            ax.hist(speed, bins=40, alpha=0.5, label=f"{r['label']} (median {sorted(speed)[len(speed) // 2]:.2f}x)")
        ax.axvline(1.0, color="k", lw=0.8)
        ax.set_xlabel("per-sentence speedup over fairseq --beam 1 (batch 1)")
        ax.set_ylabel("sentences")
        ax.legend()
        fig.tight_layout()
        path = os.path.join(out_dir, "speedup-distribution.png")
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
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
        ax.set_title("Latency vs batch size (paper 002 Figure 5)")
        fig.tight_layout()
        path = os.path.join(out_dir, "latency-vs-batch.png")
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    # 3. Tok. vs k, and vs beta/tau
    for key, xlabel, fname in (("k_sweep", "block size k", "tok-vs-k.png"), ("beta_tau_sweep", "tau", "tok-vs-beta-tau.png")):
        sw = results.get(key)
        if not sw:
            continue
        fig, ax = plt.subplots(figsize=(6, 4))
        for label, pts in sw.items():
            xs = sorted(float(x) for x in pts)
            ax.plot(xs, [pts[_fmt(x)]["tok"] for x in xs], marker="o", label=label)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("Tok. (tokens per iteration)")
        ax.legend()
        fig.tight_layout()
        path = os.path.join(out_dir, fname)
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written


def int_list(parser, option: str, value: str) -> List[int]:
    """``"1,32"`` -> ``[1, 32]``; a clear error for anything but positive integers."""
    try:
        values = [int(v) for v in value.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        parser.error(f"{option} takes comma-separated positive integers, got {value!r}")
    return values


def load_note(jobs: int) -> str:
    if jobs <= 1:
        return "one decoder at a time"
    return f"{jobs} decoders at a time (each row timed while {jobs - 1} other decoder(s) ran beside it)"


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


# --------------------------------------------------------------------------- main
def markdown_table(rows: List[Dict]) -> str:
    head = ("| decoder | batch | sent/s | ms/sent | vs beam 5 | vs beam 1 | Tok. | iterations "
            "| sacreBLEU | tok. BLEU | peak MB | = beam 1 |")
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        lines.append(
            f"| {r['label']} | {r['batch_size']} | {r['sent_per_s']:.1f} | {r['ms_per_sent']:.2f} "
            f"| {r['speedup_vs_beam5']:.2f}x | {r['speedup_vs_beam1']:.2f}x | {r['tok']:.2f} | {r['iterations']} "
            f"| {r['sacrebleu']:.2f} | {r.get('tok_bleu', float('nan')):.2f} | {r['peak_rss_mb']:.0f} "
            f"| {r['identical_to_beam1']} |"
        )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--data", help="binarized data directory (fairseq-preprocess output)")
    parser.add_argument("--verifier", help="verifier checkpoint (a fairseq transformer)")
    parser.add_argument("--drafter", help="specdec_nat drafter checkpoint (rows strict, relaxed)")
    parser.add_argument("--blockwise", help="blockwise_transformer checkpoint (row blockwise); its base should be the verifier")
    parser.add_argument("--rows", default="beam5,beam1,strict,relaxed",
                        help=f"decoders to run, from {', '.join(ROW_KINDS)} (beam5 and beam1 are always needed for the ratios)")
    parser.add_argument("--raw-ref", help="raw (untokenized) reference file, .gz allowed, for sacreBLEU")
    parser.add_argument("--tok-ref", help="tokenized reference file for tokenized BLEU (optional)")
    parser.add_argument("--src", default="en")
    parser.add_argument("--tgt", default="de")
    parser.add_argument("--detok-lang", default=None, help="Moses detokenizer language (default: --tgt)")
    parser.add_argument("--out", required=False, default="benchmark-results")
    parser.add_argument("--threads", type=int, default=1, help="torch/OpenMP threads per decoder (default 1)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="decoders timed at the same time, each in its own process with --threads threads "
                             "(default 1: one at a time). With more, no core idles while a row is timed "
                             "(a discarded beam-1 decoder fills free slots), so every row sees the same load")
    parser.add_argument("--batch-sizes", default="1,32", help="batch sizes of the main table")
    parser.add_argument("--block-size", type=int, default=None, help="k for draft-verify (default: the drafter's)")
    parser.add_argument("--relaxed", default="3:1,3:3,5:1,5:3", help="beta:tau grid of relaxed settings")
    parser.add_argument("--relaxed-batch-sizes", default=None,
                        help="batch sizes of the relaxed rows (default: every --batch-sizes)")
    parser.add_argument("--verify-score", default="verifier", choices=["verifier", "drafter"])
    parser.add_argument("--limit", type=int, default=None, help="decode only the first N sentences in fairseq's batch order (shortest sources first)")
    parser.add_argument("--warmup", type=int, default=20, help="sentences decoded before timing")
    parser.add_argument("--sweeps", action="store_true", help="also run the batch-size, k and beta/tau sweeps for the plots")
    parser.add_argument("--sweep-batch-sizes", default="1,2,4,8,16,32,64")
    parser.add_argument("--sweep-ks", default="2,4,6,8,10,15,20,25")
    parser.add_argument("--sweep-betas", default="1,3,5")
    parser.add_argument("--sweep-taus", default="0,1,2,3,5")
    args = parser.parse_args(argv)

    if args.worker:
        spec = json.loads(args.worker)
        result = run_worker(spec)
        with open(spec["result_path"], "w") as f:
            json.dump(result, f)
        return
    for name in ("data", "verifier", "raw_ref"):
        if not getattr(args, name):
            parser.error(f"--{name.replace('_', '-')} is required")
    for path in (args.verifier, args.drafter, args.blockwise, args.raw_ref):
        if path and not os.path.exists(path):
            parser.error(f"no such file: {path}")
    for name in ("threads", "jobs"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if "beam5" not in args.rows or "beam1" not in args.rows:
        parser.error("--rows must include beam5 and beam1 (every speedup is a ratio to them)")
    logging.basicConfig(format="%(asctime)s | %(levelname)s | %(name)s | %(message)s", datefmt="%Y-%m-%d %H:%M:%S", level=logging.INFO, stream=sys.stdout)
    os.makedirs(args.out, exist_ok=True)
    raw_ref = read_lines(args.raw_ref)
    tok_ref = read_lines(args.tok_ref) if args.tok_ref else []

    common = dict(data=args.data, src=args.src, tgt=args.tgt, threads=args.threads, limit=args.limit, warmup=args.warmup)
    k_args = ["--block-size", str(args.block_size)] if args.block_size else []

    def ar_spec(name, label, bs, beam):
        """fairseq's own SequenceGenerator on the verifier."""
        return dict(common, name=name, label=label, decoding="autoregressive", path=args.verifier,
                    beam=beam, batch_size=bs, extra=[])

    def dv_spec(name, label, bs, beta=1, tau=0.0, k=None):
        extra = ["--decoding", "draft-verify", "--verify-beta", str(beta), "--verify-tau", str(tau),
                 "--verify-score", args.verify_score]
        extra += ["--block-size", str(k)] if k else k_args
        return dict(common, name=name, label=label, decoding="draft-verify", path=f"{args.verifier}:{args.drafter}",
                    beam=1, batch_size=bs, extra=extra)

    wanted = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in wanted if r not in ROW_KINDS]
    if unknown:
        parser.error(f"unknown --rows {unknown}; choose from {', '.join(ROW_KINDS)}")
    for kind, needs in (("strict", "drafter"), ("relaxed", "drafter"), ("blockwise", "blockwise")):
        if kind in wanted and not getattr(args, needs):
            parser.error(f"--rows {kind} needs --{needs}")

    batch_sizes = int_list(parser, "--batch-sizes", args.batch_sizes)
    relaxed_bs = int_list(parser, "--relaxed-batch-sizes", args.relaxed_batch_sizes) if args.relaxed_batch_sizes else batch_sizes
    if "relaxed" in wanted and not set(relaxed_bs) <= set(batch_sizes):
        parser.error(f"--relaxed-batch-sizes {args.relaxed_batch_sizes} must be among --batch-sizes {args.batch_sizes}")
    sweep_bs = int_list(parser, "--sweep-batch-sizes", args.sweep_batch_sizes)
    ks = int_list(parser, "--sweep-ks", args.sweep_ks)
    specs = []
    for bs in batch_sizes:
        for kind in wanted:
            if kind == "beam5":
                specs.append(ar_spec(f"beam5@bs{bs}", "fairseq beam 5", bs, beam=5))
            elif kind == "beam1":
                specs.append(ar_spec(f"beam1@bs{bs}", "fairseq beam 1", bs, beam=1))
            elif kind == "strict":
                specs.append(dv_spec(f"strict@bs{bs}", "draft-verify strict", bs))
            elif kind == "relaxed" and bs in relaxed_bs:
                for pair in args.relaxed.split(","):
                    beta, tau = pair.split(":")
                    specs.append(dv_spec(f"b{beta}t{tau}@bs{bs}", f"draft-verify beta={beta} tau={tau}", bs, int(beta), float(tau)))
            elif kind == "input-guided":
                specs.append(dict(ar_spec(f"input-guided@bs{bs}", "input-guided", bs, beam=1),
                                  decoding="input-guided", extra=["--decoding", "input-guided"]))
            elif kind == "blockwise":
                specs.append(dict(common, name=f"blockwise@bs{bs}", label="blockwise heads", decoding="blockwise",
                                  path=args.blockwise, beam=1, batch_size=bs, extra=["--decoding", "blockwise"]))

    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        tqdm = None
    progress = tqdm(total=len(specs), desc="benchmark", unit="decoder") if tqdm else None
    # the filler that keeps a core busy once fewer rows than --jobs are left
    filler = ar_spec("filler", "filler", 1, beam=1)

    def finished(spec, res):
        res.update({k: spec[k] for k in ("name", "label", "decoding", "batch_size")})
        res.update(score(res["text"], raw_ref, tok_ref, args.detok_lang or args.tgt))
        res["sent_per_s"] = res["sentences"] / res["seconds"]
        res["ms_per_sent"] = 1000.0 * res["seconds"] / res["sentences"]
        logger.info(f"{spec['name']}: {res['ms_per_sent']:.2f} ms/sentence, Tok. {res['tok']:.2f}, BLEU {res['sacrebleu']}")
        if "summary" in res:
            logger.info(f"  {res['summary']}")
        if progress is not None:
            progress.update()

    rows = run_specs(specs, args.jobs, filler, on_result=finished)
    if progress is not None:
        progress.close()
    n_expected = rows[0]["sentences"] if rows else None
    for r in rows:
        if r["sentences"] != n_expected:
            raise RuntimeError(f"{r['name']} decoded {r['sentences']} sentences, {rows[0]['name']} {n_expected}")

    by_name = {r["name"]: r for r in rows}
    # identical-to-beam-1 compares with the beam-1 row of the same batch size;
    # blockwise compares with its own base model's beam 1 when that differs
    for r in rows:
        bs = r["batch_size"]
        b5, b1 = by_name[f"beam5@bs{bs}"], by_name[f"beam1@bs{bs}"]
        r["speedup_vs_beam5"] = b5["seconds"] / r["seconds"]
        r["speedup_vs_beam1"] = b1["seconds"] / r["seconds"]
        r["identical_to_beam1"] = all(r["tokens"][k] == b1["tokens"][k] for k in b1["tokens"])
        r["differs_from_beam1"] = sum(r["tokens"][k] != b1["tokens"][k] for k in b1["tokens"])

    results = {
        "command": " ".join([os.path.basename(sys.argv[0])] + (argv if argv is not None else sys.argv[1:])),
        "threads": args.threads,
        "jobs": args.jobs,
        "sentences": n_expected,
        "rows": rows,
    }

    if args.sweeps:
        def ms(res):
            return 1000.0 * res["seconds"] / res["sentences"]

        beta_tau = [(int(b), float(t)) for b in args.sweep_betas.split(",") for t in args.sweep_taus.split(",")]
        sweep_specs = []
        for bs in sweep_bs:
            sweep_specs.append(ar_spec(f"sweep-beam1@bs{bs}", "fairseq beam 1", bs, beam=1))
            sweep_specs.append(dv_spec(f"sweep-strict@bs{bs}", "strict", bs))
        sweep_specs += [dv_spec(f"sweep-k{k}", "strict", 1, k=k) for k in ks]
        sweep_specs += [dv_spec(f"sweep-b{beta}t{tau}", "relaxed", 1, beta, tau) for beta, tau in beta_tau]
        logger.info(f"sweeps: {len(sweep_specs)} decoders")
        res = iter(run_specs(sweep_specs, args.jobs, filler,
                             on_result=lambda spec, r: logger.info(f"{spec['name']}: {ms(r):.2f} ms/sentence, Tok. {r['tok']:.2f}")))
        sweep = {"fairseq beam 1": {}, "draft-verify strict": {}}
        for bs in sweep_bs:
            sweep["fairseq beam 1"][str(bs)] = ms(next(res))
            sweep["draft-verify strict"][str(bs)] = ms(next(res))
        results["batch_sweep"] = sweep
        results["k_sweep"] = {"strict": {}}
        for k in ks:
            r = next(res)
            results["k_sweep"]["strict"][str(k)] = {"tok": r["tok"], "ms": ms(r)}
        bt = {}
        for beta, tau in beta_tau:
            r = next(res)
            sc = score(r["text"], raw_ref, tok_ref, args.detok_lang or args.tgt)
            bt.setdefault(f"beta={beta}", {})[_fmt(tau)] = {"tok": r["tok"], "ms": ms(r), "sacrebleu": sc["sacrebleu"]}
        results["beta_tau_sweep"] = bt

    table = markdown_table(rows)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(f"Command: `{results['command']}`\n\n{n_expected} sentences, {args.threads} thread(s) per decoder, warm-up of {args.warmup} sentences excluded, {load_note(args.jobs)}.\n\n")
        f.write(table + "\n\n")
        if rows:
            f.write(f"sacreBLEU signature: `{rows[0]['signature']}`\n")
    for r in rows:
        with open(os.path.join(args.out, f"hyp.{r['name']}.txt"), "w") as f:
            for i in sorted(int(k) for k in r["text"]):
                f.write(r["text"][str(i)] + "\n")
    slim = dict(results, rows=[{k: v for k, v in r.items() if k not in ("tokens", "text")} for r in rows])
    plots = make_plots(results, args.out)
    slim["plots"] = plots
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(slim, f, indent=1)
    print(table)
    print(f"\nresults: {os.path.join(args.out, 'results.json')}; plots: {', '.join(plots) or 'none'}")


if __name__ == "__main__":
    main()
