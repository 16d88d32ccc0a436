#!/usr/bin/env python
"""The GPU kit's one-page report from a run folder and its log
(fairseq_specdec/bench/kit_summary.py; --help for the options)."""
import sys

from fairseq_specdec.bench.kit_summary import main

if __name__ == "__main__":
    sys.exit(main())
