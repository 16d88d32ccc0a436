#!/usr/bin/env python
"""The scale benchmark of ``--decoding ngram``: corpora of the sizes asked made
from a small one (copies, and copies with 10% of their tokens changed), their
index built, retrieval timed, and ngram decoded against loop-greedy:

    python scripts/ngram-scale.py DATA_DIR --path VERIFIER.pt --sizes 29000 290000 4350000 --work-dir DIR

(``fairseq_specdec.bench.ngram_scale``; docs/ngram.md.)"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fairseq_specdec.bench.ngram_scale import main  # noqa: E402

if __name__ == "__main__":
    main()
