#!/usr/bin/env python
"""Corrupt tokenized English sentences with realistic grammatical errors, for a
grammatical-error-correction (GEC) style corpus: the noisy sentence is the
source, the original the target.

Noise model (each rule applied independently, per eligible token, with the
probability given; the defaults below are what scripts/run-gec-demo.sh uses):

| rule | eligible tokens | default p |
|---|---|---|
| article drop | a, an, the | 0.25 |
| article swap | a/an/the -> another of them | 0.10 |
| preposition swap | in on at with of to for by from into | 0.10 |
| preposition drop | same | 0.05 |
| agreement | is/are, was/were, has/have, does/do swapped; 3rd-person -s added or removed on a verb after a subject pronoun or noun | 0.15 |
| noun number | a plural noun (ends in "s", length > 3) loses its "s" | 0.05 |
| spelling | words of 4+ letters: swap, drop or double one inner letter | 0.03 |
| word order | swap with the next token | 0.02 |

About a fifth of the sentences come out unchanged, as in real GEC data, where
many sentences need no correction.  Deterministic for a given --seed.

    scripts/make-gec-noise.py --seed 1 < clean.tok > noisy.tok
"""
import argparse
import random
import sys

ARTICLES = ["a", "an", "the"]
PREPOSITIONS = ["in", "on", "at", "with", "of", "to", "for", "by", "from", "into"]
AGREEMENT = {"is": "are", "are": "is", "was": "were", "were": "was", "has": "have", "have": "has", "does": "do", "do": "does"}


def misspell(word, rng):
    i = rng.randrange(1, len(word) - 1)
    kind = rng.randrange(3)
    if kind == 0:
        return word[:i] + word[i + 1] + word[i] + word[i + 2 :] if i + 1 < len(word) else word
    if kind == 1:
        return word[:i] + word[i + 1 :]
    return word[:i] + word[i] + word[i:]


def corrupt(tokens, rng, p):
    out = []
    for tok in tokens:
        low = tok.lower()
        if low in ARTICLES:
            r = rng.random()
            if r < p["article_drop"]:
                continue
            if r < p["article_drop"] + p["article_swap"]:
                tok = rng.choice([a for a in ARTICLES if a != low])
        elif low in PREPOSITIONS:
            r = rng.random()
            if r < p["prep_drop"]:
                continue
            if r < p["prep_drop"] + p["prep_swap"]:
                tok = rng.choice([q for q in PREPOSITIONS if q != low])
        elif low in AGREEMENT and rng.random() < p["agreement"]:
            tok = AGREEMENT[low]
        elif tok.isalpha() and len(tok) > 3 and tok.endswith("s") and not tok.endswith("ss") and rng.random() < p["number"]:
            tok = tok[:-1]
        elif tok.isalpha() and len(tok) >= 4 and rng.random() < p["spelling"]:
            tok = misspell(tok, rng)
        out.append(tok)
    for i in range(len(out) - 1):
        if rng.random() < p["order"]:
            out[i], out[i + 1] = out[i + 1], out[i]
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=1)
    for name, default in (("article_drop", 0.25), ("article_swap", 0.10), ("prep_swap", 0.10), ("prep_drop", 0.05),
                          ("agreement", 0.15), ("number", 0.05), ("spelling", 0.03), ("order", 0.02)):
        parser.add_argument("--" + name.replace("_", "-"), type=float, default=default)
    args = parser.parse_args(argv)
    p = {k: v for k, v in vars(args).items() if k != "seed"}
    rng = random.Random(args.seed)
    changed = total = 0
    for line in sys.stdin:
        tokens = line.split()
        noisy = corrupt(tokens, rng, p)
        changed += noisy != tokens
        total += 1
        sys.stdout.write(" ".join(noisy) + "\n")
    sys.stderr.write(f"make-gec-noise: {changed} of {total} sentences changed ({100.0 * changed / max(total, 1):.1f}%)\n")


if __name__ == "__main__":
    main()
