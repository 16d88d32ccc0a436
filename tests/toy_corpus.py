"""A small learnable translation corpus the tests create (no downloads).

The source is a random sequence of words ``a0 .. a{V-1}``; the target maps
each word to ``b{i}`` and swaps every adjacent pair, so the task needs
attention but a tiny model learns it in a minute on a CPU.
"""
import os
import random
import subprocess
import sys


def translate(words):
    out = ["b" + w[1:] for w in words]
    for i in range(0, len(out) - 1, 2):
        out[i], out[i + 1] = out[i + 1], out[i]
    return out


def make_lines(n, seed, vocab=24, min_len=3, max_len=12):
    rng = random.Random(seed)
    src, tgt = [], []
    for _ in range(n):
        words = [f"a{rng.randrange(vocab)}" for _ in range(rng.randint(min_len, max_len))]
        src.append(" ".join(words))
        tgt.append(" ".join(translate(words)))
    return src, tgt


def write_corpus(root, splits):
    """``splits``: {prefix_name: (n_lines, seed)}; writes prefix.src / prefix.tgt."""
    os.makedirs(root, exist_ok=True)
    for name, (n, seed) in splits.items():
        src, tgt = make_lines(n, seed)
        for ext, lines in (("src", src), ("tgt", tgt)):
            with open(os.path.join(root, f"{name}.{ext}"), "w") as f:
                f.write("\n".join(lines) + "\n")


def binarize(raw, dest, train="train", valid="valid", tests=("test",)):
    cmd = [
        os.path.join(os.path.dirname(sys.executable), "fairseq-preprocess"),
        "--source-lang", "src", "--target-lang", "tgt",
        "--trainpref", os.path.join(raw, train),
        "--validpref", os.path.join(raw, valid),
        "--testpref", ",".join(os.path.join(raw, t) for t in tests),
        "--destdir", dest, "--joined-dictionary", "--workers", "1",
    ]
    subprocess.run(cmd, check=True, capture_output=True)
    return dest
