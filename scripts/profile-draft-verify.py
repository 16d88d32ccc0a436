#!/usr/bin/env python
"""Where decoding time goes: strict draft-verify against fairseq's greedy
decoder, component by component (fairseq_specdec/bench/profiling.py; --help
for the options)."""
from fairseq_specdec.bench.profiling import main

if __name__ == "__main__":
    main()
