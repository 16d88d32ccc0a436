#!/usr/bin/env python
"""Build the saved index of ``--decoding ngram`` for a binarized split:

    python scripts/ngram-index.py DATA_DIR --split train [--order 4]

(``fairseq_specdec.generation.ngram_index.build_index_main``; docs/ngram.md.)"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fairseq_specdec.generation.ngram_index import build_index_main  # noqa: E402

if __name__ == "__main__":
    build_index_main()
