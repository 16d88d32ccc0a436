"""Decoding statistics of the speculative loop (Tok., iterations, histogram)."""
import json
import logging
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

    def __init__(self, path: Optional[str] = None, name: str = "draft-verify"):
        self.name = name
        self.sentences = 0
        self.tokens = 0
        self.iterations = 0
        self.histogram: Counter = Counter()
        self.path = path
        self._file = open(path, "w", buffering=1, encoding="utf-8") if path else None
        self._reported_at = -1

    def add(self, sample_id: int, length: int, accepted: List[int], seconds: float) -> None:
        """``length``: output tokens excluding the final EOS; ``accepted``:
        tokens added by each iteration (they sum to ``length + 1``)."""
        self.sentences += 1
        self.tokens += sum(accepted)
        self.iterations += len(accepted)
        self.histogram.update(accepted)
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

    @property
    def mean_accepted(self) -> float:
        return self.tokens / self.iterations if self.iterations else 0.0

    def summary(self) -> str:
        hist = " ".join(f"{n}:{self.histogram[n]}" for n in sorted(self.histogram))
        return (
            f"{self.name}: {self.sentences} sentences, {self.tokens} tokens (EOS included), "
            f"{self.iterations} iterations, Tok. {self.mean_accepted:.2f}, "
            f"{self.iterations / max(self.sentences, 1):.2f} iterations/sentence; "
            f"tokens added per iteration (count:iterations) {hist}"
        )

    def report(self, expected: Optional[int]) -> None:
        """Log the summary once all ``expected`` sentences are decoded."""
        if expected is not None and self.sentences == expected and self._reported_at != self.sentences:
            self._reported_at = self.sentences
            logger.info(self.summary())
            if self._file is not None:
                self._file.flush()
