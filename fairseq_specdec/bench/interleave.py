"""Interleaved timing of several decoders in one process: the firm way to
compare speeds on a machine whose speed drifts.

Every row is a decoder built as ``fairseq-generate`` builds it
(:func:`fairseq_specdec.bench.loading.load_decoder`) from the verifier and
the row's own fairseq-generate options; all of them are loaded first, then
each round decodes the same sentences with every row in turn, so a slow
minute of the machine hits every row alike.  A row's time is its fastest
round (ms per sentence); ratios are against the first row, and every row's
output is compared with the first row's, sentence by sentence.  A row
decoded by the plugin's loop also reports its Tok. (output tokens, EOS
included, per iteration, from the generator's statistics over one round);
fairseq's own decoders leave the column empty.

Example (the `make demo` models)::

    scripts/interleave.py --data runs/multi30k.en-de/distill/bin \\
        --verifier runs/multi30k.en-de/verifier/checkpoint_best.pt --limit 400 --rounds 3 \\
        --row 'loop-greedy=--decoding loop-greedy' \\
        --row 'blockwise=--path runs/multi30k.en-de/blockwise/checkpoint_best.pt --decoding blockwise'
"""
import argparse
import json
import logging
import shlex
import sys
import time
import warnings
from typing import Dict, List, Optional


def parse_row(text: str) -> Dict:
    """``NAME=OPTIONS`` -> {"name", "path" (or None), "extra"}: OPTIONS are
    fairseq-generate options; a ``--path`` among them replaces the verifier."""
    if "=" not in text:
        raise ValueError(f"--row {text!r}: expected NAME=OPTIONS, e.g. 'loop-greedy=--decoding loop-greedy'")
    name, options = text.split("=", 1)
    name = name.strip()
    if not name:
        raise ValueError(f"--row {text!r}: the name before '=' is empty")
    extra = shlex.split(options)
    path = None
    if "--path" in extra:
        i = extra.index("--path")
        if i + 1 >= len(extra):
            raise ValueError(f"--row {name}: --path needs a checkpoint")
        path = extra[i + 1]
        del extra[i : i + 2]
    return {"name": name, "path": path, "extra": extra}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="scripts/interleave.py",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--data", required=True, help="binarized data directory (fairseq-preprocess output)")
    p.add_argument("--verifier", required=True, help="the verifier checkpoint (every row's --path unless it names one)")
    p.add_argument("--row", action="append", required=True, metavar="NAME=OPTIONS",
                   help="a decoder: its name and fairseq-generate options (repeat; the first is the reference)")
    p.add_argument("--src", default="en")
    p.add_argument("--tgt", default="de")
    p.add_argument("--subset", default="test", help="the split to decode (default test)")
    p.add_argument("--limit", type=int, default=None, help="the first N sentences in fairseq's batch order")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3, help="rounds over every row (default 3); a row's time is its fastest")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--json", default=None, help="also write the results to this file")
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        rows = [parse_row(r) for r in args.row]
    except ValueError as error:
        parser.error(str(error))
    names = [r["name"] for r in rows]
    if len(set(names)) != len(names):
        parser.error(f"--row names must differ, got {', '.join(names)}")
    for name, least in (("limit", 1), ("batch_size", 1), ("rounds", 1), ("threads", 1)):
        value = getattr(args, name)
        if value is not None and value < least:
            parser.error(f"--{name.replace('_', '-')} must be at least {least}, got {value}")
    import os

    for path in [args.verifier] + [r["path"] for r in rows if r["path"]]:
        if not os.path.isfile(path):
            parser.error(f"no such checkpoint: {path}")
    if not os.path.isdir(args.data):
        parser.error(f"--data {args.data}: no such directory")

    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")  # hydra and torch deprecation notes, not results
    from .loading import load_decoder
    from .timing import reset_statistics

    loaded = []
    for row in rows:
        spec = dict(data=args.data, path=row["path"] or args.verifier, batch_size=args.batch_size, beam=1,
                    src=args.src, tgt=args.tgt, threads=args.threads, limit=args.limit, subset=args.subset,
                    extra=row["extra"])
        task, models, generator, batches = load_decoder(spec)
        loaded.append((row, task, models, generator, list(batches())))
        print(f"loaded {row['name']}", file=sys.stderr, flush=True)

    times: Dict[str, List[float]] = {r["name"]: [] for r in rows}
    tok: Dict[str, Optional[float]] = {}
    outputs: Dict[str, Dict[int, List[int]]] = {}
    for round_ in range(args.rounds):
        for row, task, models, generator, data in loaded:
            hyps, sentences = {}, 0
            reset_statistics(generator)  # the plugin's loop: Tok. of this round only
            t0 = time.perf_counter()
            for sample in data:
                out = task.inference_step(generator, models, sample)
                for sid, h in zip(sample["id"].tolist(), out):
                    hyps[sid] = h[0]["tokens"].tolist()
                sentences += len(out)
            times[row["name"]].append((time.perf_counter() - t0) / max(1, sentences) * 1e3)
            stats = getattr(generator, "stats", None)
            tok[row["name"]] = stats.mean_accepted if stats is not None and stats.iterations else None
            outputs[row["name"]] = hyps
        print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr, flush=True)

    first = rows[0]["name"]
    base = min(times[first])
    result = {"sentences": len(outputs[first]), "batch_size": args.batch_size, "rounds": args.rounds,
              "threads": args.threads, "rows": []}
    lines = [f"| decoder | ms/sentence | vs {first} | Tok. | identical to {first} | rounds (ms/sentence) |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        name = row["name"]
        best = min(times[name])
        same = sum(outputs[name][i] == outputs[first][i] for i in outputs[first])
        result["rows"].append({"name": name, "options": " ".join(([f"--path {row['path']}"] if row["path"] else []) + row["extra"]),
                               "ms_per_sentence": round(best, 3), "speedup": round(base / best, 3),
                               "tok": None if tok.get(name) is None else round(tok[name], 3),
                               "identical": same, "rounds_ms": [round(t, 3) for t in times[name]]})
        tok_cell = "" if tok.get(name) is None else f"{tok[name]:.2f}"
        lines.append(f"| {name} | {best:.2f} | {base / best:.2f}x | {tok_cell} | {same}/{len(outputs[first])} | "
                     f"{' '.join(f'{t:.2f}' for t in times[name])} |")
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
