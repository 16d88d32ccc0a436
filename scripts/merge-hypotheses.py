#!/usr/bin/env python
"""Merge fairseq-generate outputs (one or several shards) into one text file
of hypotheses ordered by sentence id; fails if an id is missing or repeated.

    scripts/merge-hypotheses.py --expected 29000 gen.shard*.txt > train.hyp
"""
import argparse
import sys


def read_hypotheses(paths):
    hyps = {}
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if not line.startswith("H-"):
                    continue
                head, _score, *text = line.rstrip("\n").split("\t")
                sid = int(head[2:])
                if sid in hyps:
                    raise SystemExit(f"sentence {sid} appears twice ({path})")
                hyps[sid] = text[0] if text else ""
    return hyps


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("outputs", nargs="+", help="fairseq-generate output files")
    parser.add_argument("--expected", type=int, required=True, help="number of sentences")
    args = parser.parse_args(argv)
    hyps = read_hypotheses(args.outputs)
    missing = [i for i in range(args.expected) if i not in hyps]
    if missing or len(hyps) != args.expected:
        raise SystemExit(f"{len(hyps)} hypotheses for {args.expected} sentences; missing ids {missing[:10]}")
    for i in range(args.expected):
        sys.stdout.write(hyps[i] + "\n")


if __name__ == "__main__":
    main()
