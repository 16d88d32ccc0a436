#!/usr/bin/env python
"""Roofline of the verify pass: measured and ideal cost of a verify pass of
m tokens on this machine, per component (fairseq_specdec/bench/roofline.py;
--help for the options).  Example: scripts/roofline.py --shape demo --json"""
import sys

from fairseq_specdec.bench.roofline import main

if __name__ == "__main__":
    sys.exit(main())
