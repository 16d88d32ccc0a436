"""Measure draft-then-verify decoding against fairseq's own decoders, in one run.

Every row decodes the whole test set in its own worker process (so peak memory
is per decoder) through the same code path as ``fairseq-generate``:
``task.build_generator`` on the ``draft_verify`` task.  Threads are pinned
(default 1), model loading and a warm-up on the first sentences are excluded
from the timings.  Rows: fairseq ``--beam 5``, ``--beam 1``, strict
draft-verify and a grid of relaxed settings (for every ``--drafter``), and any
registered decoding (``input-guided``, ``blockwise``, or one a ``--user-dir``
plugin registers), at batch 1 (latency) and batch 32 (throughput).  Each row
reports sentences/s, ms/sentence, speedups against beam 5 and beam 1 of the
same batch size, Tok., iterations, sacreBLEU (detokenized, with its signature)
and tokenized BLEU, peak memory (and peak GPU memory on cuda), and whether the
output is token-identical to ``--beam 1`` at that batch size.

Outputs in ``--out``: ``results.json``, ``results.md`` (the table), hypothesis
files, ``rows.partial.jsonl`` (each row's figures as soon as it ends: what a
run cut short keeps; with the ratio to and identity with ``--beam 1`` once
that row has ended), and PNG plots (per-sentence speedup distribution, latency vs batch
size, Tok. vs k and vs beta/tau).

With ``--jobs 2`` two decoders are timed at once (one per core, one thread
each); a discarded beam-1 decoder fills a free slot until the last row ends,
so every row is timed with the other core busy.

``--drafter`` may be given more than once as ``LABEL=PATH``: every drafter gets
its own strict and relaxed rows (``strict-LABEL@bs1``, ``b3t1-LABEL@bs1``,
labelled ``draft-verify strict (LABEL)``) and its own sweep series.

``--rows ...,ct2`` (and ``ct2-int8``) adds CTranslate2 greedy decoding of the
same verifier, converted once into ``--out``/ct2-verifier, when the optional
``ctranslate2`` package is installed (``pip install ctranslate2``).

Example (the Multi30k demo models):
    scripts/benchmark.py --data runs/multi30k.en-de/distill/bin --verifier runs/multi30k.en-de/verifier/checkpoint_best.pt \\
        --drafter runs/multi30k.en-de/drafter/checkpoint_selected.pt --tok-ref data/multi30k.en-de/tok/test_2016_flickr.de \\
        --raw-ref ../shared/data/multi30k/test_2016_flickr.de.gz --out runs/multi30k.en-de/benchmark --jobs 2
"""
import argparse
import json
import logging
import os
import sys
from typing import Dict, List, Optional

from .commands import recorded_command
from .machine import describe, header
from . import ct2, workers
from .partial import PartialRows, against_beam1, beam1_name
from .plots import make_plots
from .scoring import read_lines, score
from .specs import (BUILTIN_ROWS, OPTIONAL_ROWS, RowSpecs, parse_drafters, parse_variants, resolve_rows, row_kinds,
                    with_variants)

logger = logging.getLogger("benchmark")
DEVICES = ("auto", "cpu", "cuda")


def int_list(parser, option: str, value: str) -> List[int]:
    """``"1,32"`` -> ``[1, 32]``; a clear error for anything but positive integers."""
    try:
        values = [int(v) for v in value.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        parser.error(f"{option} takes comma-separated positive integers, got {value!r}")
    return values


def float_list(parser, option: str, value: str) -> List[float]:
    try:
        return [float(v) for v in value.split(",")]
    except ValueError:
        parser.error(f"{option} takes comma-separated numbers, got {value!r}")


def relaxed_grid(parser, value: str) -> List[tuple]:
    """``"3:1,5:3"`` -> ``[("3", "1"), ("5", "3")]`` (beta an integer, tau a number)."""
    grid = [tuple(pair.split(":")) for pair in value.split(",")]
    try:
        for beta, tau in grid:
            int(beta), float(tau)
    except ValueError:
        parser.error(f"--relaxed takes comma-separated beta:tau pairs such as 3:1, got {value!r}")
    return grid


def load_note(jobs: int) -> str:
    if jobs <= 1:
        return "one decoder at a time"
    return f"{jobs} decoders at a time (each row timed while {jobs - 1} other decoder(s) ran beside it)"


def resolve_device(device: str) -> str:
    """``auto``: cuda when torch sees a GPU, else cpu."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch sees no GPU (torch.cuda.is_available() is False)")
    return device


def load_decodings(user_dir: Optional[str]) -> Dict:
    """The registry of decodings once the plugin (and ``user_dir``, when given) is imported."""
    import fairseq_specdec  # noqa: F401  (registers the plugin's decodings)
    from fairseq_specdec.generation.registry import DECODINGS

    if user_dir:
        from fairseq.utils import import_user_module

        import_user_module(argparse.Namespace(user_dir=user_dir))
    return DECODINGS


def markdown_table(rows: List[Dict]) -> str:
    """The results table; a peak GPU memory column when the rows ran on cuda,
    a "vs loop-greedy" column when a loop-greedy row ran (the plugin's own
    greedy loop: what speculation must beat)."""
    gpu = any(r.get("peak_gpu_mb") is not None for r in rows)
    greedy = any(r.get("speedup_vs_loop_greedy") is not None for r in rows)
    head = ("| decoder | batch | sent/s | ms/sent | vs beam 5 | vs beam 1 |" + (" vs loop-greedy |" if greedy else "")
            + " Tok. | iterations | sacreBLEU | tok. BLEU | peak MB |" + (" peak GPU MB |" if gpu else "") + " = beam 1 |")
    lines = [head, "|" + "---|" * (12 + gpu + greedy)]
    for r in rows:
        vs_greedy = ""
        if greedy:
            ratio = r.get("speedup_vs_loop_greedy")
            vs_greedy = f"| {ratio:.2f}x " if ratio is not None else "| "
        lines.append(
            f"| {r['label']} | {r['batch_size']} | {r['sent_per_s']:.1f} | {r['ms_per_sent']:.2f} "
            f"| {r['speedup_vs_beam5']:.2f}x | {r['speedup_vs_beam1']:.2f}x {vs_greedy}| {r['tok']:.2f} | {r['iterations']} "
            f"| {r['sacrebleu']:.2f} | {r.get('tok_bleu', float('nan')):.2f} | {r['peak_rss_mb']:.0f} "
            + (f"| {r.get('peak_gpu_mb', float('nan')):.0f} " if gpu else "")
            + f"| {r['identical_to_beam1']} |"
        )
    return "\n".join(lines)


def build_parser(decodings) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--data", help="binarized data directory (fairseq-preprocess output)")
    parser.add_argument("--verifier", help="verifier checkpoint (a fairseq transformer)")
    parser.add_argument("--drafter", action="append", metavar="[LABEL=]PATH",
                        help="drafter checkpoint, specdec_nat or specdec_vsd (rows strict, relaxed, and decodings that take a "
                             "drafter); repeat as LABEL=PATH for several drafters: rows strict-LABEL@bs1, ...")
    parser.add_argument("--drafter-options", action="append", metavar="LABEL=OPTIONS",
                        help="more fairseq-generate options for the rows of drafter LABEL, one string, e.g. "
                             "--drafter-options 'vsd=--adaptive-draft --draft-min-confidence 0.3' (the same "
                             "checkpoint under two labels compares two settings)")
    parser.add_argument("--variant", action="append", metavar="LABEL[:ROWS]=OPTIONS",
                        help="run every row of the plugin's decodings (not fairseq's, not CTranslate2's) again with "
                             "more fairseq-generate options, named ROW+LABEL, e.g. --variant 'no-graphs=FAIRSEQ_SPECDEC_OFF=graphs' "
                             "(repeatable; every row is still compared with the same beam 5 and beam 1 rows); "
                             "LABEL:ROWS=OPTIONS runs only the rows of those --rows kinds again, e.g. "
                             "'no-accept:loop-greedy,strict=FAIRSEQ_SPECDEC_OFF=accept'")
    parser.add_argument("--blockwise", help="blockwise_transformer checkpoint (row blockwise); its base should be the verifier")
    parser.add_argument("--rows", default="beam5,beam1,strict,relaxed",
                        help=f"decoders to run: {', '.join(BUILTIN_ROWS)} (strict and relaxed: draft-verify with every "
                             f"--drafter), {' and '.join(OPTIONAL_ROWS)} (CTranslate2 greedy, float32 and int8, of the "
                             f"same verifier; needs the ctranslate2 package), or a registered decoding "
                             f"({', '.join(decodings) or 'none registered'}, and any "
                             "a --user-dir plugin registers); KIND:LABEL+LABEL: that kind's rows for those --drafter "
                             "labels only; beam5 and beam1 are always needed for the ratios")
    parser.add_argument("--user-dir", help="a fairseq plugin directory imported before the rows are built and given "
                                           "to fairseq as --user-dir (it should import fairseq_specdec), e.g. one "
                                           "that registers more decodings")
    parser.add_argument("--device", default="auto", choices=DEVICES,
                        help="where the decoders run (default auto: cuda when torch sees a GPU, else cpu)")
    parser.add_argument("--fp16", action="store_true",
                        help="decode every fairseq row in float16 (fairseq-generate --fp16: the models cast with "
                             "model.half(), the drafter to the verifier's dtype); = beam 1 then compares with --beam 1 "
                             "in float16. The CTranslate2 rows keep their own compute type")
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
    parser.add_argument("--keep-going", action="store_true",
                        help="a row whose decoder fails is left out of the table (its error is logged and listed "
                             "in results.md and results.json) instead of stopping the benchmark; beam5 and beam1 "
                             "rows must still succeed")
    parser.add_argument("--limit", type=int, default=None, help="decode only the first N sentences in fairseq's batch order (shortest sources first), the same N at every batch size")
    parser.add_argument("--warmup", type=int, default=20, help="sentences decoded before timing")
    parser.add_argument("--sweeps", action="store_true", help="also run the batch-size, k and beta/tau sweeps for the plots")
    parser.add_argument("--sweep-batch-sizes", default="1,2,4,8,16,32,64")
    parser.add_argument("--sweep-ks", default="2,4,6,8,10,15,20,25")
    parser.add_argument("--sweep-betas", default="1,3,5")
    parser.add_argument("--sweep-taus", default="0,1,2,3,5")
    return parser


def check_args(parser, args) -> None:
    """Every check that needs no registry: refuse bad values before loading anything."""
    for name in ("data", "verifier", "raw_ref"):
        if not getattr(args, name):
            parser.error(f"--{name.replace('_', '-')} is required")
    try:
        args.drafters = parse_drafters(args.drafter, args.drafter_options)
        args.variants = parse_variants(args.variant)
    except ValueError as e:
        parser.error(str(e))
    for path in [args.verifier, args.blockwise, args.raw_ref] + [d.path for d in args.drafters]:
        if path and not os.path.exists(path):
            parser.error(f"no such file: {path}")
    if args.user_dir and not os.path.isdir(args.user_dir):
        parser.error(f"--user-dir {args.user_dir}: no such directory")
    for name, least in (("threads", 1), ("jobs", 1), ("limit", 1), ("warmup", 0)):
        value = getattr(args, name)
        if value is not None and value < least:
            parser.error(f"--{name} must be at least {least}, got {value}")


def write_outputs(args, results: Dict, rows: List[Dict]) -> None:
    n_expected = results["sentences"]
    table = markdown_table(rows)
    where = f", on {results['device']}" if results["device"] != "cpu" else ""
    where += ", fairseq rows in float16 (--fp16)" if results["precision"] == "float16" else ""
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(f"Command: `{results['command']}`\n\n{n_expected} sentences, {args.threads} thread(s) per decoder{where}, "
                f"warm-up of {args.warmup} sentences excluded, {load_note(args.jobs)}.\n\n")
        f.write(f"Machine: {header(results['machine'])}\n\n")
        f.write(table + "\n\n")
        if rows:
            f.write(f"sacreBLEU signature: `{rows[0]['signature']}`\n")
        for name, message in results.get("failed", {}).items():
            last = message.strip().splitlines()[-1] if message.strip() else "no output"
            f.write(f"\nRow {name} failed and is not in the table (--keep-going): `{last}`\n")
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


def compare_with_beams(rows: List[Dict]) -> None:
    """Speedups against beam 5 and beam 1 (and the plugin's greedy loop, when
    a loop-greedy row ran), and identity to beam 1, each at the row's batch size."""
    by_name = {r["name"]: r for r in rows}
    for r in rows:
        bs = r["batch_size"]
        b5, b1 = by_name[f"beam5@bs{bs}"], by_name[beam1_name(bs)]
        greedy = by_name.get(f"loop-greedy@bs{bs}")
        r["speedup_vs_beam5"] = b5["seconds"] / r["seconds"]
        r["speedup_vs_loop_greedy"] = greedy["seconds"] / r["seconds"] if greedy is not None else None
        r.update(against_beam1(r["seconds"], r["tokens"], b1))


def main(argv=None):
    parser = build_parser(load_decodings(None))
    args = parser.parse_args(argv)
    check_args(parser, args)
    args.user_dir = os.path.abspath(args.user_dir) if args.user_dir else None
    decodings = load_decodings(args.user_dir)
    try:
        device = resolve_device(args.device)
        wanted = resolve_rows(args.rows, decodings, args.drafters, args.blockwise)
        # again with the registry: the row kinds a LABEL:ROWS variant names must exist
        args.variants = parse_variants(args.variant, row_kinds(decodings))
        if any(kind in ct2.COMPUTE_TYPES for kind in wanted):
            ct2.check_device(device)
    except ValueError as e:
        parser.error(str(e))
    batch_sizes = int_list(parser, "--batch-sizes", args.batch_sizes)
    relaxed_bs = int_list(parser, "--relaxed-batch-sizes", args.relaxed_batch_sizes) if args.relaxed_batch_sizes else batch_sizes
    if "relaxed" in wanted and not set(relaxed_bs) <= set(batch_sizes):
        parser.error(f"--relaxed-batch-sizes {args.relaxed_batch_sizes} must be among --batch-sizes {args.batch_sizes}")
    grid = relaxed_grid(parser, args.relaxed)
    sweep_bs = int_list(parser, "--sweep-batch-sizes", args.sweep_batch_sizes)
    ks = int_list(parser, "--sweep-ks", args.sweep_ks)
    beta_tau = [(b, t) for b in int_list(parser, "--sweep-betas", args.sweep_betas)
                for t in float_list(parser, "--sweep-taus", args.sweep_taus)]
    if args.sweeps and not args.drafters:
        parser.error("--sweeps needs --drafter")

    logging.basicConfig(format="%(asctime)s | %(levelname)s | %(name)s | %(message)s", datefmt="%Y-%m-%d %H:%M:%S",
                        level=logging.INFO, stream=sys.stdout)
    os.makedirs(args.out, exist_ok=True)
    raw_ref = read_lines(args.raw_ref)
    tok_ref = read_lines(args.tok_ref) if args.tok_ref else []
    lang = args.detok_lang or args.tgt

    common = dict(data=args.data, src=args.src, tgt=args.tgt, threads=args.threads, limit=args.limit,
                  warmup=args.warmup, device=device, user_dir=args.user_dir, fp16=args.fp16)
    ct2_dir = None
    if any(kind in ct2.COMPUTE_TYPES for kind in wanted):
        ct2_dir = ct2.convert(args.verifier, args.data, args.src, args.tgt, ct2.model_dir(args.out))
        logger.info(f"CTranslate2: the verifier converted into {ct2_dir}")
    build = RowSpecs(common, args.verifier, args.drafters, args.blockwise, decodings,
                     verify_score=args.verify_score, block_size=args.block_size, ct2_dir=ct2_dir)
    specs = with_variants(build.main_rows(wanted, batch_sizes, relaxed_bs, grid), args.variants)
    filler = build.filler()

    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        tqdm = None
    progress = tqdm(total=len(specs), desc="benchmark", unit="decoder") if tqdm else None

    partial = PartialRows(os.path.join(args.out, "rows.partial.jsonl"))

    def finished(spec, res):
        res.update({k: spec[k] for k in ("name", "label", "decoding", "drafter", "batch_size")})
        res.update(score(res["text"], raw_ref, tok_ref, lang))
        res["sent_per_s"] = res["sentences"] / res["seconds"]
        res["ms_per_sent"] = 1000.0 * res["seconds"] / res["sentences"]
        # each row as it ends, so that a run cut short keeps what it measured
        # (with its identity with --beam 1 once that row has ended)
        partial.add(res)
        logger.info(f"{spec['name']}: {res['ms_per_sent']:.2f} ms/sentence, Tok. {res['tok']:.2f}, BLEU {res['sacrebleu']}")
        if "summary" in res:
            logger.info(f"  {res['summary']}")
        if progress is not None:
            progress.update()

    failed = {}

    def failure(spec, message):
        failed[spec["name"]] = message[-3000:]
        logger.error(f"{spec['name']} failed and is left out (--keep-going):\n{message[-3000:]}")

    rows = list(workers.run_specs(specs, args.jobs, filler, on_result=finished,
                                  on_error=failure if args.keep_going else None).values())
    missing = [name for name in failed if name.split("@")[0] in ("beam5", "beam1")]
    if missing:
        raise RuntimeError(f"{', '.join(missing)} failed: every ratio needs them")
    if progress is not None:
        progress.close()
    n_expected = rows[0]["sentences"] if rows else None
    for r in rows:
        if r["sentences"] != n_expected:
            raise RuntimeError(f"{r['name']} decoded {r['sentences']} sentences, {rows[0]['name']} {n_expected}")
    compare_with_beams(rows)

    results = {
        "command": recorded_command(argv),
        "device": device,
        "precision": "float16" if args.fp16 else "float32",
        "threads": args.threads,
        "jobs": args.jobs,
        "sentences": n_expected,
        "rows": rows,
        "failed": failed,
    }
    results["machine"] = describe(ct2_dir if ct2_dir and device == "cpu" else None)
    if ct2_dir:
        import ctranslate2

        results["ctranslate2"] = {"version": ctranslate2.__version__, "model": ct2_dir}
    if args.sweeps:
        sweep_specs = build.sweep_rows(sweep_bs, ks, beta_tau)
        logger.info(f"sweeps: {len(sweep_specs)} decoders")
        done = workers.run_specs(sweep_specs, args.jobs, filler, on_result=lambda spec, r: logger.info(
            f"{spec['name']}: {1000.0 * r['seconds'] / r['sentences']:.2f} ms/sentence, Tok. {r['tok']:.2f}"))
        results.update(build.sweep_results(done, sweep_bs, ks, beta_tau,
                                           bleu=lambda r: score(r["text"], raw_ref, tok_ref, lang)["sacrebleu"]))
    write_outputs(args, results, rows)
