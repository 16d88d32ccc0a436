"""The options of a speculative generator, as one validated object.

The ``draft_verify`` task builds a :class:`SpeculativeOptions` once per
``build_generator`` call, from its config (``--decoding``, ``--block-size``,
``--verify-*``, ``--ngram-*``, ...) and fairseq's generation options
(``--max-len-a``, ``--temperature``, ...), and hands it to
:func:`~fairseq_specdec.generation.build.build_speculative_generator`.
Generation reads options only from it, never from the task.

Every range check of an option is written here, once, and runs when the
object is made: an option out of range is refused by name before any model,
drafter or corpus is read.  The classes built from the options
(acceptance rules, draft policies, drafters) take their values as given.
Defaults are the task config's (:class:`~fairseq_specdec.tasks.draft_verify.DraftVerifyConfig`);
a decoding's own defaults (its ``--block-size``, ``--draft-min-confidence``,
``--draft-tree``) are its registry entry's.
"""
import os
from dataclasses import dataclass
from typing import Optional

from .acceptance import VERIFY_SCORES
from .registry import get_decoding

#: ``--specdec-backend`` choices (the backend resolves them: :mod:`.backend`)
BACKENDS = ("auto", "reference")

#: the task config's fields that only speculative decodings read, each a
#: field of :class:`SpeculativeOptions` or of its :class:`NgramOptions`
#: (fairseq's own decoding refuses them when they are not at their defaults)
SPECULATIVE_CONFIG = (
    "drafter_path", "verify_beta", "verify_tau", "verify_score", "adaptive_draft", "draft_min_confidence",
    "draft_max_rows", "draft_tree", "block_size", "specdec_backend", "specdec_stats", "ngram_split",
    "ngram_order", "ngram_neighbours", "ngram_min_confidence",
)

# fairseq generation options the loop cannot honour: (option, predicate on
# its value that means "set to something we cannot honour")
UNSUPPORTED_OPTIONS = (
    ("sampling", lambda v: bool(v)),
    ("sampling_topk", lambda v: v is not None and v > 0),
    ("sampling_topp", lambda v: v is not None and v > 0),
    ("diverse_beam_groups", lambda v: v is not None and v > 0),
    ("diversity_rate", lambda v: v is not None and v > -1),
    ("match_source_len", lambda v: bool(v)),
    ("constraints", lambda v: bool(v)),
    ("prefix_size", lambda v: v is not None and v > 0),
    ("no_repeat_ngram_size", lambda v: v is not None and v > 0),
    ("print_alignment", lambda v: bool(v)),
    ("nbest", lambda v: v is not None and v > 1),
    ("lm_path", lambda v: bool(v)),
    # fairseq-generate then reads a "history" entry no greedy loop keeps (stock --beam 1 crashes on it too)
    ("retain_iter_history", lambda v: bool(v)),
)


def option_name(name: str) -> str:
    """A config field's command-line spelling (``block_size``: ``--block-size``)."""
    return "--" + name.replace("_", "-")


def check_generation_options(args) -> None:
    """Refuse fairseq generation options the speculative loop cannot honour
    (``args``: fairseq's generation namespace or config; older ones may lack
    an option, which then counts as not set)."""
    beam = getattr(args, "beam", 1)
    if beam != 1:
        raise ValueError(
            f"speculative decoding is greedy and needs --beam 1 (got --beam {beam}); from "
            "Python, translate(..., beam=1), or load the model with "
            "fairseq_specdec.hub.from_pretrained, whose translate() decodes greedily"
        )
    for name, unsupported in UNSUPPORTED_OPTIONS:
        value = getattr(args, name, None)
        if unsupported(value):
            raise ValueError(f"speculative decoding does not support {option_name(name)} (got {value!r})")


@dataclass(frozen=True)
class NgramOptions:
    """``--ngram-split``, ``--ngram-order``, ``--ngram-neighbours``,
    ``--ngram-min-confidence``, and where the split is read: the task's
    first data directory and its language pair."""

    split: str
    order: int
    neighbours: int
    min_confidence: float
    data_dir: str
    source_lang: Optional[str]
    target_lang: Optional[str]

    def __post_init__(self):
        if self.order < 1:
            raise ValueError(f"--ngram-order must be >= 1, got {self.order}")
        if self.neighbours < 0:
            raise ValueError(f"--ngram-neighbours must be >= 0, got {self.neighbours}")
        if not 0.0 <= self.min_confidence < 1.0:
            raise ValueError(f"--ngram-min-confidence must be in [0, 1), got {self.min_confidence}")

    @classmethod
    def from_config(cls, cfg) -> "NgramOptions":
        """The ``--ngram-*`` options of the task config ``cfg``, checked."""
        return cls(cfg.ngram_split, cfg.ngram_order, cfg.ngram_neighbours, cfg.ngram_min_confidence,
                   data_dir=str(cfg.data or "").split(os.pathsep)[0], source_lang=cfg.source_lang,
                   target_lang=cfg.target_lang)


@dataclass(frozen=True)
class SpeculativeOptions:
    """What a speculative generator is built from, checked when made.

    The task's options under their config names, less the ``specdec_`` and
    ``ngram_`` prefixes (``backend``, ``stats``, ``ngram``); fairseq's
    generation options under the loop's names (``normalize_scores`` is
    ``not --unnormalized``, ``len_penalty`` ``--lenpen``, ``unk_penalty``
    ``--unkpen``).  ``None`` in ``block_size``, ``draft_min_confidence``,
    ``draft_max_rows``, ``draft_tree``: not given (the decoding's default).
    """

    decoding: str
    ngram: NgramOptions
    drafter_path: Optional[str]
    verify_beta: int
    verify_tau: float
    verify_score: str
    block_size: Optional[int]
    adaptive_draft: bool
    draft_min_confidence: Optional[float]
    draft_max_rows: Optional[int]
    draft_tree: Optional[int]
    backend: str
    stats: Optional[str]
    max_len_a: float
    max_len_b: int
    min_len: int
    normalize_scores: bool
    len_penalty: float
    unk_penalty: float
    temperature: float

    def __post_init__(self):
        get_decoding(self.decoding)  # names the registered ones
        if self.verify_beta < 1:
            raise ValueError(f"--verify-beta must be >= 1, got {self.verify_beta}")
        if not self.verify_tau >= 0:  # NaN too: it would accept nothing, silently
            raise ValueError(f"--verify-tau must be a number >= 0 (inf: no limit), got {self.verify_tau}")
        if self.verify_score not in VERIFY_SCORES:
            raise ValueError(f"--verify-score must be one of {VERIFY_SCORES}, got {self.verify_score!r}")
        if self.block_size is not None and self.block_size < 1:
            raise ValueError(f"--block-size must be >= 1, got {self.block_size}")
        if self.draft_min_confidence is not None and not 0.0 <= self.draft_min_confidence < 1.0:
            raise ValueError(f"--draft-min-confidence must be in [0, 1), got {self.draft_min_confidence}")
        if self.draft_max_rows is not None and self.draft_max_rows < 0:
            raise ValueError(f"--draft-max-rows must be >= 1 (or 0 for no limit), got {self.draft_max_rows}")
        if self.draft_tree is not None and self.draft_tree < 0:
            raise ValueError(f"--draft-tree must be >= 0 (0 = chains), got {self.draft_tree}")
        if self.backend not in BACKENDS:
            raise ValueError(f"--specdec-backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if not self.temperature > 0:
            raise ValueError("--temperature must be greater than 0")

    @classmethod
    def from_config(cls, cfg, args) -> "SpeculativeOptions":
        """The options of the task config ``cfg`` (a ``DraftVerifyConfig``)
        and fairseq's generation options ``args``, checked (fairseq options
        the loop cannot honour are refused here too)."""
        check_generation_options(args)
        return cls(
            decoding=cfg.decoding, ngram=NgramOptions.from_config(cfg), drafter_path=cfg.drafter_path, verify_beta=cfg.verify_beta,
            verify_tau=cfg.verify_tau, verify_score=str(cfg.verify_score), block_size=cfg.block_size,
            adaptive_draft=cfg.adaptive_draft, draft_min_confidence=cfg.draft_min_confidence,
            draft_max_rows=cfg.draft_max_rows, draft_tree=cfg.draft_tree, backend=str(cfg.specdec_backend),
            stats=cfg.specdec_stats, max_len_a=args.max_len_a, max_len_b=args.max_len_b, min_len=args.min_len,
            normalize_scores=not args.unnormalized, len_penalty=args.lenpen, unk_penalty=args.unkpen,
            temperature=args.temperature,
        )

    def block_size_or(self, default: int) -> int:
        """``--block-size`` as given, else the decoding's ``default``."""
        return self.block_size if self.block_size is not None else default

    def min_confidence_or(self, default: float) -> float:
        """``--draft-min-confidence`` as given, else the decoding's ``default``."""
        return self.draft_min_confidence if self.draft_min_confidence is not None else default
