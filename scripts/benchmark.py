#!/usr/bin/env python
"""Measure draft-then-verify decoding against fairseq's own decoders, in one run.

The harness is the package fairseq_specdec.bench (fairseq_specdec/bench/cli.py
documents the rows and outputs; --help lists every option).
"""
from fairseq_specdec.bench.cli import main

if __name__ == "__main__":
    main()
