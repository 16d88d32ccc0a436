"""The scale benchmark of ``--decoding ngram`` (``scripts/ngram-scale.py``).

From a small binarized data directory it makes corpora of the sizes asked
(the split's sentences copied; and copied with a share of their tokens
changed at random, so that the copies' contexts are distinct), and for each:
builds the saved index (``scripts/ngram-index.py``, its wall time and peak
memory), measures retrieval per sentence (neighbours and their table, for
the sources of ``--gen-subset``), then decodes ``--gen-subset`` with
``--decoding ngram`` and with ``--decoding loop-greedy`` (fairseq-generate's
"Translated ... in" time, the n-gram index's start-up, peak memory, Tok.,
and how many hypotheses are identical), and prints a Markdown table.

    python scripts/ngram-scale.py DATA_DIR --path VERIFIER.pt --sizes 29000 290000 4350000 \\
        --work-dir /big/disk/ngram-scale [--gen-subset test] [--dry-run]

Peak memory is each child process's own (``os.wait4``), in MiB.
"""
import argparse
import json
import math
import os
import re
import shlex
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PLUGIN = os.path.join(ROOT, "fairseq_specdec")
KINDS = ("copies", "changed")


def run_measured(cmd, env, log_path):
    """Run ``cmd``; its stdout and stderr go to ``log_path``.  Returns (exit
    status, wall seconds, peak RSS in MiB, the output)."""
    started = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen([str(c) for c in cmd], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - started
    with open(log_path, encoding="utf-8", errors="replace") as f:
        output = f.read()
    return proc.returncode, wall, usage.ru_maxrss / 1024, output


def read_split(data, split, lang, src, tgt):
    from fairseq_specdec.generation.ngram_index import read_side, split_prefixes

    prefixes = split_prefixes(data, split, src, tgt, option="--split")
    return read_side(prefixes[0] if lang == src else prefixes[1], "--split", split)


def make_corpus(data, dest, split, src, tgt, size, changed, seed, gen_subset):
    """A data directory ``dest``: ``data``'s dictionaries and ``gen_subset``
    (linked), and a ``split`` of ``size`` sentences, the original's copied
    over and over; from the second copy on, a share ``changed`` of the tokens
    (not the final EOS) replaced by random ones of the dictionary."""
    from fairseq.data import Dictionary
    from fairseq.data.indexed_dataset import MMapIndexedDataset, data_file_path, index_file_path

    marker = os.path.join(dest, "corpus.json")
    want = {"data": os.path.realpath(data), "split": split, "size": size, "changed": changed, "seed": seed}
    if os.path.isfile(marker) and json.load(open(marker, encoding="utf-8")) == want:
        return dest
    os.makedirs(dest, exist_ok=True)
    for name in os.listdir(data):
        if name.startswith("dict.") or (name.startswith(gen_subset + ".") and name.endswith((".bin", ".idx"))):
            link = os.path.join(dest, name)
            if not os.path.lexists(link):
                os.symlink(os.path.realpath(os.path.join(data, name)), link)
    for lang in (src, tgt):
        tokens, sizes = read_split(data, split, lang, src, tgt)
        tokens = np.asarray(tokens)
        vocab = len(Dictionary.load(os.path.join(data, f"dict.{lang}.txt")))
        n = sizes.size
        copies = math.ceil(size / n)
        out_sizes = np.tile(sizes, copies)[:size]
        last = np.cumsum(sizes) - 1  # each sentence's EOS
        prefix = os.path.join(dest, f"{split}.{src}-{tgt}.{lang}")
        with open(data_file_path(prefix), "wb") as f:
            left = size
            for c in range(copies):
                m = min(n, left)
                part = tokens[: int(sizes[:m].sum())].copy()
                if changed > 0 and c > 0:
                    rng = np.random.default_rng([seed, c, 0 if lang == src else 1])
                    mask = rng.random(part.size) < changed
                    mask[last[last < part.size]] = False
                    part[mask] = rng.integers(4, vocab, int(mask.sum())).astype(part.dtype)
                part.tofile(f)
                left -= m
        with MMapIndexedDataset.Index.writer(index_file_path(prefix), tokens.dtype.type) as w:
            w.write(out_sizes)
    with open(marker, "w", encoding="utf-8") as f:
        json.dump(want, f)
    return dest


def probe(args) -> None:
    """(--probe) Open the saved index of ``args.data`` and time retrieval
    for each source sentence of ``--gen-subset``: one JSON line."""
    from fairseq.data import Dictionary

    from fairseq_specdec.generation.ngram import NgramCorpus
    from fairseq_specdec.generation.ngram_index import SplitSource, open_index

    src, tgt = args.source_lang, args.target_lang
    dicts = [Dictionary.load(os.path.join(args.data, f"dict.{lang}.txt")) for lang in (src, tgt)]
    started = time.perf_counter()
    source = SplitSource(args.data, args.split, src, tgt, dicts[0], dicts[1], option="--split")
    directory, meta, arrays = open_index(source, args.order)
    corpus = NgramCorpus.from_arrays(arrays, args.order)
    load = time.perf_counter() - started
    tokens, sizes = read_split(args.data, args.gen_subset, src, src, tgt)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    sentences = [np.asarray(tokens[starts[i]:starts[i + 1]]).tolist() for i in range(sizes.size)]
    started = time.perf_counter()
    for s in sentences:
        corpus.table(corpus.neighbours(s, args.neighbours))
    per = (time.perf_counter() - started) / max(1, len(sentences))
    print(json.dumps({"load_s": load, "retrieval_ms": per * 1000, "contexts": int(corpus.keys.size),
                      "index": directory}))


_TRANSLATED = re.compile(r"Translated ([\d,]+) sentences \(([\d,]+) tokens\) in ([\d.]+)s")
_TOK = re.compile(r"Tok\. ([\d.]+)")
_READY = re.compile(r"n-gram drafter: .* ready in ([\d.]+) s")
_H = re.compile(r"^H-(\d+)\t\S+\t(.*)$", re.M)


def decode(args, data, decoding, env, log):
    cmd = [os.path.join(os.path.dirname(sys.executable), "fairseq-generate"), data, "--path", args.path,
           "--user-dir", PLUGIN, "--task", "draft_verify", "--decoding", decoding, "--gen-subset", args.gen_subset,
           "--beam", "1", "--batch-size", str(args.batch_size), "--source-lang", args.source_lang,
           "--target-lang", args.target_lang, *shlex.split(args.extra)]
    if not args.gpu:
        cmd.append("--cpu")
    if args.dry_run:
        print(" ".join(shlex.quote(str(c)) for c in cmd))
        return None
    status, wall, peak, out = run_measured(cmd, env, log)
    if status != 0:
        raise SystemExit(f"ngram-scale.py: {decoding} decoding failed ({log}):\n{out[-3000:]}")
    m = _TRANSLATED.search(out)
    ready = _READY.search(out)
    tok = _TOK.search(out)
    return {"seconds": float(m.group(3)) if m else float("nan"), "peak": peak,
            "startup": float(ready.group(1)) if ready else None, "tok": float(tok.group(1)) if tok else None,
            "hyps": dict(_H.findall(out))}


def main(argv=None):
    parser = argparse.ArgumentParser(prog="ngram-scale.py", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    parser.add_argument("data", metavar="DATA_DIR", help="a small binarized data directory (its dictionaries, "
                        "the --split to copy, the --gen-subset to decode)")
    parser.add_argument("--path", help="the verifier checkpoint to decode with (required unless --no-decode)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[29000, 290000, 4350000],
                        help="corpus sizes in sentences (default: 29000 290000 4350000)")
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS),
                        help="copies: the split copied; changed: copies with --changed of their tokens changed "
                        "(default: both)")
    parser.add_argument("--changed", type=float, default=0.1, help="share of tokens changed in 'changed' copies "
                        "(default 0.1)")
    parser.add_argument("--work-dir", default=None, help="where the corpora and their indexes go (default: "
                        "ngram-scale under the current directory; a corpus of 4.35M Multi30k sentences and its index take about 1.2 GB)")
    parser.add_argument("--split", default="train", help="the split copied (default train: best, the "
                        "verifier's distillation)")
    parser.add_argument("--gen-subset", default="test", help="the split decoded (default test)")
    parser.add_argument("--source-lang", "-s", default=None)
    parser.add_argument("--target-lang", "-t", default=None)
    parser.add_argument("--order", type=int, default=4, help="--ngram-order (default 4)")
    parser.add_argument("--neighbours", type=int, default=20, help="--ngram-neighbours for the retrieval probe")
    parser.add_argument("--batch-size", type=int, default=1, help="decoding batch size (default 1)")
    parser.add_argument("--threads", type=int, default=1, help="OMP/MKL threads of every child (default 1)")
    parser.add_argument("--gpu", action="store_true", help="decode without --cpu")
    parser.add_argument("--extra", default="", help="extra fairseq-generate options, one string")
    parser.add_argument("--seed", type=int, default=1, help="seed of the changed tokens")
    parser.add_argument("--no-decode", action="store_true", help="build and probe only (no verifier needed)")
    parser.add_argument("--output", default=None, help="also write the table to this file")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and the commands; make nothing")
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.source_lang is None or args.target_lang is None:
        from fairseq.data import data_utils

        args.source_lang, args.target_lang = data_utils.infer_language_pair(args.data)
        if args.source_lang is None:
            parser.error(f"DATA_DIR {args.data}: cannot infer the language pair; give --source-lang/--target-lang")
    if args.probe:
        return probe(args)
    if not args.no_decode and not args.path:
        parser.error("--path VERIFIER is required to decode (or --no-decode)")
    if not args.no_decode and not args.dry_run and not os.path.isfile(args.path):
        parser.error(f"--path {args.path}: no such file")
    if not 0 <= args.changed < 1:
        parser.error(f"--changed must be in [0, 1), got {args.changed}")
    if any(s < 1 for s in args.sizes):
        parser.error("--sizes must be >= 1")
    work = os.path.abspath(args.work_dir or "ngram-scale")
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    rows = []
    for kind in args.kinds:
        for size in args.sizes:
            changed = args.changed if kind == "changed" else 0.0
            dest = os.path.join(work, f"{kind}-{size}")
            index_cmd = [sys.executable, os.path.join(ROOT, "scripts", "ngram-index.py"), dest, "--split",
                         args.split, "--order", str(args.order), "--source-lang", args.source_lang,
                         "--target-lang", args.target_lang, "--force"]
            probe_cmd = [sys.executable, os.path.join(ROOT, "scripts", "ngram-scale.py"), dest, "--probe", "--split", args.split,
                         "--gen-subset", args.gen_subset, "--order", str(args.order), "--neighbours",
                         str(args.neighbours), "-s", args.source_lang, "-t", args.target_lang]
            if args.dry_run:
                print(f"# {kind}, {size} sentences: {dest} (the {args.split} split of {args.data} copied"
                      + (f", {changed:g} of the tokens of every copy after the first changed)" if changed else ")"))
                for cmd in (index_cmd, probe_cmd):
                    print(" ".join(shlex.quote(str(c)) for c in cmd))
                if not args.no_decode:
                    for decoding in ("ngram", "loop-greedy"):
                        decode(args, dest, decoding, env, None)
                continue
            make_corpus(args.data, dest, args.split, args.source_lang, args.target_lang, size, changed, args.seed,
                        args.gen_subset)
            status, build_s, build_peak, out = run_measured(index_cmd, env, os.path.join(dest, "index.log"))
            if status != 0:
                raise SystemExit(f"ngram-scale.py: building the index failed:\n{out[-3000:]}")
            index_dir = out.strip().splitlines()[-1].split(":")[0]
            index_mb = sum(os.path.getsize(os.path.join(index_dir, f)) for f in os.listdir(index_dir)) / 2**20
            status, _, probe_peak, out = run_measured(probe_cmd, env, os.path.join(dest, "probe.log"))
            if status != 0:
                raise SystemExit(f"ngram-scale.py: the retrieval probe failed:\n{out[-3000:]}")
            found = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
            row = {"kind": kind, "sentences": size, "build_s": build_s, "build_peak": build_peak,
                   "index_mb": index_mb, "contexts": found["contexts"], "retrieval_ms": found["retrieval_ms"]}
            if not args.no_decode:
                ngram = decode(args, dest, "ngram", env, os.path.join(dest, "ngram.log"))
                greedy = decode(args, dest, "loop-greedy", env, os.path.join(dest, "loop-greedy.log"))
                same = sum(ngram["hyps"].get(i) == h for i, h in greedy["hyps"].items())
                row.update(ngram=ngram, greedy=greedy, identical=f"{same}/{len(greedy['hyps'])}")
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k not in ("ngram", "greedy")}), flush=True)
    if args.dry_run:
        return None
    table = markdown(rows, args)
    print(table)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(table + "\n")
    return rows


def markdown(rows, args) -> str:
    head = ["corpus", "sentences", "index build (s)", "build peak (MiB)", "index (MiB)", "corpus contexts",
            "retrieval (ms/sentence)"]
    if not args.no_decode:
        head += ["start-up (s)", "ngram peak (MiB)", "ngram (s)", "loop-greedy (s)", "vs loop-greedy", "Tok.",
                 "identical to loop-greedy"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["kind"], f"{r['sentences']:,}", f"{r['build_s']:.1f}", f"{r['build_peak']:,.0f}",
                 f"{r['index_mb']:,.1f}", f"{r['contexts']:,}", f"{r['retrieval_ms']:.2f}"]
        if "ngram" in r:
            n, g = r["ngram"], r["greedy"]
            cells += [f"{n['startup']:.1f}" if n["startup"] is not None else "?", f"{n['peak']:,.0f}",
                      f"{n['seconds']:.1f}", f"{g['seconds']:.1f}", f"{g['seconds'] / n['seconds']:.2f}x",
                      f"{n['tok']:.2f}" if n["tok"] is not None else "?", r["identical"]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    main()
