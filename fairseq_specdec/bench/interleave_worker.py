"""The process of one ``--process-row`` of ``scripts/interleave.py``.

Run by its path, never imported by the package::

    python .../fairseq_specdec/bench/interleave_worker.py REPLY_FD

so that the ``fairseq_specdec`` it decodes with is whichever one its
environment names (``PYTHONPATH=DIR`` of another checkout: this file then
drives that checkout's package, through the calls every version of the
benchmark has: ``bench.loading.load_decoder`` and
``bench.timing.reset_statistics``).  It reads one JSON request a line on
standard input and writes one JSON reply a line to the file descriptor
REPLY_FD (its standard output and error go to a log: fairseq and torch may
print there):

- ``{"load": SPEC}``: builds the decoder of the row spec (as
  :func:`fairseq_specdec.bench.loading.load_decoder`) and replies with its
  batches' sentence ids, the package's directory and the products'
  instruction set;
- ``{"decode": B}``: decodes batch B, timed around the decoding alone, and
  replies ``{"seconds", "out": [[id, tokens], ...]}``;
- ``{"reset": true}``: the generator's statistics start afresh;
  ``{"tok": true}``: replies the statistics' tokens per iteration (or null);
- end of input: the process ends.

A failure replies ``{"error": traceback}`` and ends the process.
"""
import json
import os
import sys
import time
import traceback


def serve(requests, reply) -> None:
    import logging
    import warnings

    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    import fairseq_specdec
    from fairseq_specdec import kernels
    from fairseq_specdec.bench.loading import load_decoder
    from fairseq_specdec.bench.timing import reset_statistics
    from fairseq_specdec.generation import SpeculativeGenerator

    def send(value) -> None:
        reply.write(json.dumps(value) + "\n")
        reply.flush()

    task = models = generator = None
    data = []
    for line in requests:
        request = json.loads(line)
        if "load" in request:
            task, models, generator, batches = load_decoder(request["load"])
            data = list(batches())
            # a checkout older than the instruction-set (the prefetch) choice has no kernels.isa (describe_prefetch)
            isa = kernels.isa() if "isa" in vars(kernels) else None
            prefetch = kernels.describe_prefetch() if "describe_prefetch" in vars(kernels) else None
            send({"ids": [sample["id"].tolist() for sample in data],
                  "package": os.path.dirname(os.path.abspath(fairseq_specdec.__file__)), "isa": isa,
                  "prefetch": prefetch})
        elif "decode" in request:
            sample = data[request["decode"]]
            t0 = time.perf_counter()
            hypos = task.inference_step(generator, models, sample)
            seconds = time.perf_counter() - t0
            out = [[sid, h[0]["tokens"].tolist()] for sid, h in zip(sample["id"].tolist(), hypos)]
            send({"seconds": seconds, "out": out})
        elif "reset" in request:
            reset_statistics(generator)
            send({})
        elif "tok" in request:
            stats = generator.stats if isinstance(generator, SpeculativeGenerator) else None
            send({"tok": stats.mean_accepted if stats is not None and stats.iterations else None})
        else:
            raise ValueError(f"unknown request {sorted(request)}")


def main() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    # run by path, Python put this folder first on sys.path: its modules are not top-level ones
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    reply = os.fdopen(int(sys.argv[1]), "w")
    try:
        serve(sys.stdin, reply)
    except Exception:
        reply.write(json.dumps({"error": traceback.format_exc()}) + "\n")
        reply.flush()
        sys.exit(1)


if __name__ == "__main__":
    main()
