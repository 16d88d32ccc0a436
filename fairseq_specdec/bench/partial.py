"""``rows.partial.jsonl``: what a benchmark cut short keeps.

A benchmark writes its tables only when every row has ended.  On a machine
held for minutes (the GPU kit, scripts/gpu-run.sh) a run can be stopped
before that, so each row's figures are written as soon as the row ends, one
JSON object a line, in the order the rows ended.

Invariant: after every ``add``, the file holds every row ended so far (its
figures, without the hypotheses), and each row whose batch size's ``--beam 1``
row has ended also holds ``speedup_vs_beam1``, ``identical_to_beam1`` and
``differs_from_beam1``, computed by :func:`against_beam1`, as for the whole
table.  A row that ended before its ``--beam 1`` row gets them when
that row ends (the file is rewritten whole, through a temporary file, so a
run killed while writing leaves the previous version).
"""
import json
import os
from typing import Dict, List, Tuple

#: the fields of a result that stay out of the file (per-sentence data)
BULKY = ("tokens", "text", "ms")


def beam1_name(batch_size: int) -> str:
    return f"beam1@bs{batch_size}"


def against_beam1(seconds: float, tokens: Dict, beam1: Dict) -> Dict:
    """A row's ``speedup_vs_beam1``, ``identical_to_beam1`` and
    ``differs_from_beam1`` against ``beam1`` (a full result of the same batch
    size); a sentence the row lacks counts as differing.  The one definition
    of these fields, for the whole table and for the partial file alike."""
    ref = beam1["tokens"]
    differ = sum(tokens.get(k) != ref[k] for k in ref)
    return {"speedup_vs_beam1": beam1["seconds"] / seconds, "identical_to_beam1": differ == 0,
            "differs_from_beam1": differ}


class PartialRows:
    """The rows ended so far, kept in ``path`` (see the module's docstring)."""

    def __init__(self, path: str):
        self.path = path
        self.ended: List[Tuple[Dict, Dict]] = []  # (figures, tokens) in the order the rows ended
        self.beam1: Dict[int, Dict] = {}  # batch size -> the --beam 1 result
        self._write()

    def add(self, result: Dict) -> None:
        """One ended row: a worker's result with its spec's ``name`` and ``batch_size``."""
        record = {k: v for k, v in result.items() if k not in BULKY}
        self.ended.append((record, result.get("tokens", {})))
        if result["name"] == beam1_name(result["batch_size"]):
            self.beam1[result["batch_size"]] = result
        self._write()

    def records(self) -> List[Dict]:
        out = []
        for record, tokens in self.ended:
            beam1 = self.beam1.get(record["batch_size"])
            out.append(record if beam1 is None else dict(record, **against_beam1(record["seconds"], tokens, beam1)))
        return out

    def _write(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            for record in self.records():
                f.write(json.dumps(record) + "\n")
        os.replace(tmp, self.path)
