"""Decoding statistics of the speculative loop (Tok., iterations, histogram)."""
import json
import logging
import os
from collections import Counter
from typing import List, Optional

logger = logging.getLogger("fairseq_specdec.generation")


class SpecDecStats:
    """Counts what the papers report.

    ``accepted`` of one iteration is the number of tokens it added to the
    output, the verifier's own token and a final EOS included, so that Tok.
    (their sum over all iterations divided by the number of iterations) is
    exactly 1 for greedy decoding, one token per decoder call, and
    ``iterations`` is the number of verifier calls.
    """

    def __init__(self, path: Optional[str] = None, name: str = "draft-verify", append: bool = False):
        """``path``: the JSON-lines file of per-sentence rows (``--specdec-stats``),
        started anew, or appended to with ``append``; its directory is made
        as fairseq makes ``--results-path``'s.  A path that cannot be a file
        is refused here, before anything is decoded, naming the option."""
        self.name = name
        self.sentences = 0
        self.tokens = 0
        self.iterations = 0
        self.histogram: Counter = Counter()
        #: greedy steps screened (picked from the int8 copy of the projection), and those whose pick was not
        #: certified (computed as ordinary steps)
        self.screened = 0
        self.uncertified = 0
        self.path = path
        self._file = None
        if path:
            if os.path.isdir(path):
                raise ValueError(f"--specdec-stats {path}: is a directory; give a file name (JSON lines)")
            parent = os.path.dirname(os.path.abspath(path))
            try:
                os.makedirs(parent, exist_ok=True)
                self._file = open(path, "a" if append else "w", buffering=1, encoding="utf-8")
            except OSError as err:
                raise ValueError(f"--specdec-stats {path}: cannot write the statistics file there ({err.strerror or err})") from err

    def add(self, sample_id: int, length: int, accepted: List[int], seconds: float) -> None:
        """``length``: output tokens excluding the final EOS; ``accepted``:
        tokens added by each iteration (they sum to ``length + 1``)."""
        self.sentences += 1
        self.tokens += sum(accepted)
        self.iterations += len(accepted)
        self.histogram.update(accepted)
        if self.path and self._file is None:  # more sentences after report(): append
            self._file = open(self.path, "a", buffering=1, encoding="utf-8")
        if self._file is not None:
            self._file.write(
                json.dumps(
                    {
                        "id": sample_id,
                        "length": length,
                        "iterations": len(accepted),
                        "accepted": accepted,
                        "time_ms": round(seconds * 1000.0, 3),
                    }
                )
                + "\n"
            )

    def add_screened(self, screened: int, uncertified: int) -> None:
        """Count screened greedy steps (see ``generation/screened_greedy.py``)."""
        self.screened += screened
        self.uncertified += uncertified

    @property
    def mean_accepted(self) -> float:
        return self.tokens / self.iterations if self.iterations else 0.0

    def summary(self) -> str:
        hist = " ".join(f"{n}:{self.histogram[n]}" for n in sorted(self.histogram))
        return (
            f"{self.name}: {self.sentences} sentences, {self.tokens} tokens (EOS included), "
            f"{self.iterations} iterations, Tok. {self.mean_accepted:.4f}, "
            f"{self.iterations / max(self.sentences, 1):.2f} iterations/sentence; "
            f"tokens added per iteration (count:iterations) {hist}"
            + (f"; greedy steps screened {self.screened}, not certified {self.uncertified}"
               if self.screened or self.uncertified else "")
        )

    def report(self) -> None:
        """Log the summary and close the statistics file (a later
        :meth:`add` reopens it to append)."""
        logger.info(self.summary())
        self.close()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass


class SentenceCounter:
    """Sentences the task's non-training batch iterators handed out, and
    those the speculative generators decoded: when the two meet, a run (a
    ``fairseq-generate`` call, one ``translate()``) is over and its
    statistics line is logged.  Both counts belong to the task, so a
    generator built before its batches (the hub interface) or a second run
    in the same process still reports."""

    def __init__(self):
        self.expected = 0
        self.done = 0

    def expect(self, n: int) -> None:
        self.expected += n

    def decoded(self, n: int) -> bool:
        """Count ``n`` decoded sentences; True when every expected one is."""
        self.done += n
        return self.done >= self.expected > 0
