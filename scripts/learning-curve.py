#!/usr/bin/env python
"""Learning curve of drafters: Tok. and ms/sentence of strict draft-verify
against training minutes, one point per saved checkpoint
(fairseq_specdec/bench/learning_curve.py; --help for the options)."""
from fairseq_specdec.bench.learning_curve import main

if __name__ == "__main__":
    main()
