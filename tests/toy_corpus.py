"""Small learnable corpora the tests create (no downloads).

Translation: the source is a random sequence of words ``a0 .. a{V-1}``; the
target maps each word to ``b{i}`` and swaps every adjacent pair, so the task
needs attention but a tiny model learns it in a minute on a CPU.

Correction (for input-guided decoding): the target is a random sentence of
``a`` words with no word repeated twice in a row; the source is the same
sentence with noise: some words doubled (the corrector deletes one) and some
``a{i}`` misspelled ``c{i}`` (the corrector writes ``a{i}``, a token the
source does not have there).  Most of the output is a copy of the source.
"""
import os
import random


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


def make_correction_lines(n, seed, vocab=24, min_len=3, max_len=12, p_double=0.1, p_misspell=0.1):
    rng = random.Random(seed)
    src, tgt = [], []
    for _ in range(n):
        clean = []
        for _ in range(rng.randint(min_len, max_len)):
            word = f"a{rng.randrange(vocab)}"
            while clean and word == clean[-1]:
                word = f"a{rng.randrange(vocab)}"
            clean.append(word)
        noisy = []
        for word in clean:
            r = rng.random()
            if r < p_double:
                noisy += [word, word]
            elif r < p_double + p_misspell:
                noisy.append("c" + word[1:])
            else:
                noisy.append(word)
        src.append(" ".join(noisy))
        tgt.append(" ".join(clean))
    return src, tgt


def write_corpus(root, splits, make=make_lines):
    """``splits``: {prefix_name: (n_lines, seed)}; writes prefix.src / prefix.tgt."""
    os.makedirs(root, exist_ok=True)
    for name, (n, seed) in splits.items():
        src, tgt = make(n, seed)
        for ext, lines in (("src", src), ("tgt", tgt)):
            with open(os.path.join(root, f"{name}.{ext}"), "w") as f:
                f.write("\n".join(lines) + "\n")


def binarize(raw, dest, train="train", valid="valid", tests=("test",)):
    from specdec_helpers import cli, run

    cmd = [
        cli("fairseq-preprocess"),
        "--source-lang", "src", "--target-lang", "tgt",
        "--trainpref", os.path.join(raw, train),
        "--validpref", os.path.join(raw, valid),
        "--testpref", ",".join(os.path.join(raw, t) for t in tests),
        "--destdir", dest, "--joined-dictionary", "--workers", "1",
    ]
    run(cmd)
    return dest
