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
from dataclasses import dataclass
from typing import Callable, Dict, List

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
    ``backend.drafting`` says what a drafter may compute natively);
    ``services``: the task's
    :class:`~fairseq_specdec.generation.services.GenerationServices` (where
    loaded drafters and corpora are kept); ``options``: every option, checked
    (:class:`~fairseq_specdec.generation.options.SpeculativeOptions`);
    ``task``: for its dictionaries (and loading checkpoints with it)."""

    task: object
    options: object
    verifier: object
    drafters: List[object]
    acceptance: object
    backend: object
    services: object


#: --draft-min-confidence when neither the user nor the decoding gives one:
#: it cuts most rejected drafts of weak drafters and costs little with good
#: ones (chosen by measurement: docs/architecture.md, Draft length)
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

    ``takes_drafter``: whether ``--drafter-path`` / a second model in
    ``--path`` is meaningful; ``relaxed``: whether relaxed verification
    (``--verify-beta`` > 1) applies.  How the benchmark runs it is the
    benchmark's own table (:mod:`fairseq_specdec.bench.specs`)."""

    name: str
    help: str
    build: Callable[[DrafterContext], BuiltDrafter]
    takes_drafter: bool = False
    relaxed: bool = True


DECODINGS: Dict[str, Decoding] = {}


def register_decoding(decoding: Decoding, replace: bool = False) -> Decoding:
    if decoding.name == AUTOREGRESSIVE:
        raise ValueError(f"'{AUTOREGRESSIVE}' is fairseq's own decoding and cannot be registered")
    if decoding.name in DECODINGS and not replace:
        raise ValueError(f"decoding '{decoding.name}' is registered already")
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
