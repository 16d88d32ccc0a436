#!/usr/bin/env python
"""Interleaved timing of several decoders in one run (rounds over every
row, fastest round per row, ratios and identity against the first row):
fairseq_specdec/bench/interleave.py; --help for the options."""
import sys

from fairseq_specdec.bench.interleave import main

if __name__ == "__main__":
    sys.exit(main())
