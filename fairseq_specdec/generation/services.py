"""What a task keeps for the generators it builds, handed to each build.

Generation never writes to the task object: the drafter checkpoints it has
loaded, the n-gram corpora it has opened, the count of sentences decoded
against those the run's iterators handed out, and the ``--specdec-stats``
files already started live in one :class:`GenerationServices` that the task
owns and passes to :func:`~fairseq_specdec.generation.build.build_speculative_generator`.
"""
import os
from dataclasses import dataclass, field
from typing import Dict, FrozenSet, Optional, Set

from .stats import SentenceCounter


@dataclass
class GenerationServices:
    """``drafters``: loaded drafter models by ``(real path, mtime, size)`` of
    their file (a file changed on disk is loaded again); ``ngram_corpora``:
    opened n-gram corpora by ``(split, order)``; ``sentences``: sentences the
    non-training batch iterators handed out, and those decoded (the
    statistics line is logged when they meet); ``stats_files``: the real
    paths of the ``--specdec-stats`` files this task's generators started;
    ``parts_off``: native parts (:data:`fairseq_specdec.kernels.PARTS`) the
    backend of this task's generators must not use: none, unless the
    benchmark measures what a part gains (its ``FAIRSEQ_SPECDEC_OFF``
    rows)."""

    drafters: Dict[tuple, object] = field(default_factory=dict)
    ngram_corpora: Dict[tuple, object] = field(default_factory=dict)
    sentences: SentenceCounter = field(default_factory=SentenceCounter)
    stats_files: Set[str] = field(default_factory=set)
    parts_off: FrozenSet[str] = frozenset()

    def stats_file_started(self, path: Optional[str]) -> bool:
        """Whether an earlier generator already started the
        ``--specdec-stats`` file ``path`` (a later one appends: every
        ``translate()`` of the Python API builds one); records it as started."""
        if not path:
            return False
        key = os.path.realpath(path)
        started = key in self.stats_files
        self.stats_files.add(key)
        return started
