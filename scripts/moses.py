"""Moses tokenization/detokenization through the sacremoses Python API.

The ``sacremoses`` command line always escapes XML characters (``&amp;`` ...);
this module calls the API with ``escape=False`` so the text stays readable and
the detokenized output can be scored against the raw references.

Usage::

    python scripts/moses.py tokenize -l en < raw > tok
    python scripts/moses.py detokenize -l de < tok > detok
"""
import argparse
import sys


def tokenize_lines(lines, lang):
    from sacremoses import MosesTokenizer

    tok = MosesTokenizer(lang=lang)
    for line in lines:
        yield tok.tokenize(line.rstrip("\n"), escape=False, return_str=True)


def detokenize_lines(lines, lang):
    from sacremoses import MosesDetokenizer

    detok = MosesDetokenizer(lang=lang)
    for line in lines:
        yield detok.detokenize(line.rstrip("\n").split(), unescape=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["tokenize", "detokenize"])
    parser.add_argument("-l", "--lang", required=True, help="language code, e.g. en")
    args = parser.parse_args(argv)
    fn = tokenize_lines if args.mode == "tokenize" else detokenize_lines
    out = sys.stdout
    for line in fn(sys.stdin, args.lang):
        out.write(line + "\n")


if __name__ == "__main__":
    main()
