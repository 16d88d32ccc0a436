"""The registry of decodings: one entry per ``--decoding`` choice.

A decoding is a drafter plus what it takes to build one.  Everything that
lists decodings reads this registry: the ``draft_verify`` task's
``--decoding`` option (its help and its check), the generator builder
(:mod:`fairseq_specdec.generation.build`) and the benchmark harness
(:mod:`fairseq_specdec.bench`).  A new decoding is a drafter class plus one
:func:`register_decoding` call; no loop, task or benchmark code changes::

    register_decoding(Decoding(
        name="my-drafter",
        help="drafts with ...",
        build=lambda ctx: BuiltDrafter(MyDrafter(...), block_size=4, description="..."),
    ))

``build`` receives a :class:`DrafterContext` and raises ``ValueError`` naming
the option at fault when the models or options do not fit.
"""
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

#: fairseq's own SequenceGenerator: not a speculative decoding, never in the registry
AUTOREGRESSIVE = "autoregressive"


@dataclass
class DrafterContext:
    """What a drafter builder may read.

    ``verifier``: the verifier model; ``drafters``: drafter models given in
    ``--path`` after the verifier (already split off); ``acceptance``: the
    acceptance rule (``acceptance.uses_draft_scores`` says whether drafts
    need log-probs); ``backend``: what computes the iteration
    (:class:`~fairseq_specdec.generation.backend.Backend`;
    ``backend.drafting`` says what a drafter may compute natively)."""

    task: object
    verifier: object
    drafters: List[object]
    acceptance: object
    backend: object = None

    @property
    def cfg(self):
        return self.task.cfg


#: --draft-min-confidence when neither the user nor the decoding gives one:
#: it cuts most rejected drafts of weak drafters and costs little with good
#: ones (docs/results/2026-11-23-c17a224-specdec-vsd-drafter.md)
DEFAULT_MIN_CONFIDENCE = 0.2


@dataclass
class BuiltDrafter:
    """A decoding's drafter, its default ``--block-size`` and its
    description; ``tree_nodes``: its default ``--draft-tree`` (0: chains);
    ``min_confidence``: its default ``--draft-min-confidence``."""

    drafter: object
    block_size: int
    description: str
    tree_nodes: int = 0
    min_confidence: float = DEFAULT_MIN_CONFIDENCE


@dataclass(frozen=True)
class Decoding:
    """One ``--decoding`` choice.

    ``bench_model``: which checkpoint the benchmark passes in ``--path`` for
    this decoding's rows: ``"verifier"`` (the verifier alone),
    ``"verifier+drafter"`` (verifier, then the ``--drafter`` checkpoint) or
    ``"blockwise"`` (the ``--blockwise`` checkpoint, a verifier with heads).
    ``bench_rows``: the benchmark row kinds this decoding runs as (the row
    kind ``relaxed`` adds its beta/tau grid).  ``takes_drafter``: whether
    ``--drafter-path`` / a second model in ``--path`` is meaningful."""

    name: str
    help: str
    build: Callable[[DrafterContext], BuiltDrafter]
    takes_drafter: bool = False
    relaxed: bool = True
    bench_model: str = "verifier"
    bench_label: Optional[str] = None
    bench_extra: List[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        return self.bench_label or self.name


DECODINGS: Dict[str, Decoding] = {}


def register_decoding(decoding: Decoding, replace: bool = False) -> Decoding:
    if decoding.name == AUTOREGRESSIVE:
        raise ValueError(f"'{AUTOREGRESSIVE}' is fairseq's own decoding and cannot be registered")
    if decoding.name in DECODINGS and not replace:
        raise ValueError(f"decoding '{decoding.name}' is registered already")
    if decoding.bench_model not in ("verifier", "verifier+drafter", "blockwise"):
        raise ValueError(f"decoding '{decoding.name}': unknown bench_model {decoding.bench_model!r}")
    DECODINGS[decoding.name] = decoding
    return decoding


def unregister_decoding(name: str) -> None:
    DECODINGS.pop(name, None)


def decoding_names() -> List[str]:
    """Every ``--decoding`` choice, fairseq's own first."""
    return [AUTOREGRESSIVE] + list(DECODINGS)


def get_decoding(name: str) -> Decoding:
    try:
        return DECODINGS[name]
    except KeyError:
        raise ValueError(
            f"--decoding {name!r} is not a decoding; choose from {', '.join(decoding_names())}"
        ) from None


def decoding_help() -> str:
    lines = [f"'{AUTOREGRESSIVE}': fairseq's own SequenceGenerator"]
    lines += [f"'{d.name}': {d.help}" for d in DECODINGS.values()]
    return "decoding algorithm of fairseq-generate/-interactive; " + "; ".join(lines)
