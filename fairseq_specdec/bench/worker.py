"""One benchmark row in its own process::

    python -m fairseq_specdec.bench.worker SPEC.json

decodes with the row spec in SPEC.json (see :mod:`fairseq_specdec.bench.specs`)
and writes the result to the spec's ``result_path``.
"""
import json
import sys


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        raise SystemExit("usage: python -m fairseq_specdec.bench.worker SPEC.json")
    with open(argv[0]) as f:
        spec = json.load(f)
    if spec.get("engine") == "ctranslate2":  # a CTranslate2 row (fairseq_specdec.bench.ct2)
        from .ct2 import run_ct2_worker as run
    else:
        from .timing import run_worker as run
    result = run(spec)
    with open(spec["result_path"], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
