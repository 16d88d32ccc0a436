"""Build the speculative generator of ``--decoding`` from its options.

The options arrive checked (:class:`~.options.SpeculativeOptions`); what
depends on the models (a drafter that fits, a block size it can draft, a
tree it can shape) fails here, before any decoding, with a message naming
the option.
"""
import logging
import os
from typing import Dict

from fairseq import checkpoint_utils

from ..utils.dictionary import check_same_dictionary, dictionary_fingerprint
from .acceptance import StrictAcceptance, build_acceptance
from .backend import resolve_backend
from ..models.protocol import BlockwiseHeadsModel, DrafterModel
from .combined import CombinedDrafter
from .drafters import BlockwiseHeadsDrafter, NoDrafter, SourceCopyDrafter, TreeDrafter, drafter_for_model
from .ngram import NgramDrafter, load_ngram_corpus
from .options import SpeculativeOptions
from .self_draft import SelfDrafter
from .registry import DECODINGS, DEFAULT_MIN_CONFIDENCE, BuiltDrafter, Decoding, DrafterContext, get_decoding, register_decoding
from .draft_policy import AllRows, DraftLengthPolicy, FixedRows, MeasuredRows, RowsRule
from .services import GenerationServices
from .speculative import DecodeSettings, SpeculativeGenerator
from .stats import SpecDecStats

logger = logging.getLogger(__name__)

#: --decoding ngram's k when --block-size is not given: a cap; its confidence
#: cut (--ngram-min-confidence) decides how much of it a row drafts
NGRAM_BLOCK_SIZE = 7

def load_drafter(task, path: str, like, cache: Dict[tuple, object]):
    """Load a drafter checkpoint (specdec_nat or specdec_vsd) with the task's dictionaries; placed on the
    device and in the dtype of ``like`` (the verifier).  The model is loaded
    once per file into ``cache`` (the task's
    :attr:`~fairseq_specdec.generation.services.GenerationServices.drafters`:
    the hub interface builds a generator at every ``translate()``); a file
    changed on disk is loaded again."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--drafter-path {path}: no such file")
    real, stat = os.path.realpath(path), os.stat(path)
    key = (real, stat.st_mtime_ns, stat.st_size)
    drafter = cache.get(key)
    if drafter is None:
        state = checkpoint_utils.load_checkpoint_to_cpu(path)
        saved = (state.get("model") or {}).get("dictionary_fingerprint")
        if saved is not None:  # before building the model: another dictionary is a size mismatch there
            check_same_dictionary(saved, dictionary_fingerprint(task.target_dictionary), f"the drafter (--drafter-path {path})")
        models, _ = checkpoint_utils.load_model_ensemble([path], task=task, state=state)
        drafter = models[0]
        if not isinstance(drafter, DrafterModel):
            raise ValueError(f"--drafter-path {path} is a {type(drafter).__name__} checkpoint, not a drafter (specdec_nat or specdec_vsd)")
        for old in [k for k in cache if k[0] == real]:
            del cache[old]
        cache[key] = drafter
    param = next(like.parameters())
    return drafter.to(device=param.device, dtype=param.dtype).eval()


def _split_models(options: SpeculativeOptions, models):
    drafters = [m for m in models if isinstance(m, DrafterModel)]
    verifiers = [m for m in models if not isinstance(m, DrafterModel)]
    if not verifiers and drafters:
        raise ValueError(
            f"--path holds only a drafter ({type(drafters[0]).__name__}): the verifier, a fairseq "
            f"Transformer checkpoint, comes first: --path verifier.pt:drafter.pt, or --path "
            f"verifier.pt --drafter-path drafter.pt"
        )
    if len(verifiers) != 1:
        raise ValueError(
            f"--decoding {options.decoding} needs exactly one verifier in --path, got "
            f"{len(verifiers)} (ensembles are not supported)"
        )
    return verifiers[0], drafters


def _nat_drafter(ctx: DrafterContext) -> BuiltDrafter:
    drafter, block_size, source = _model_drafter(ctx)
    return BuiltDrafter(drafter, block_size, f"{drafter.describe()} ({source})")


def _model_drafter(ctx: DrafterContext):
    """The drafter checkpoint's drafter, its default k and where it came from."""
    task, verifier, drafters, acceptance = ctx.task, ctx.verifier, ctx.drafters, ctx.acceptance
    opts = ctx.options
    if opts.drafter_path and drafters:
        raise ValueError("give the drafter either with --drafter-path or in --path, not both")
    if len(drafters) > 1:
        raise ValueError(f"--path holds {len(drafters)} drafters; give one")
    if drafters:
        model, source = drafters[0], "the second model in --path"
    elif opts.drafter_path:
        model, source = load_drafter(task, opts.drafter_path, verifier, ctx.services.drafters), f"--drafter-path {opts.drafter_path}"
    else:
        raise ValueError(
            f"--decoding {opts.decoding} needs a drafter: --drafter-path FILE or --path verifier.pt:drafter.pt"
        )
    # drafters built in-process never pass through load_state_dict's check
    check_same_dictionary(
        model.dictionary_fingerprint, dictionary_fingerprint(task.target_dictionary), f"the drafter ({source})"
    )
    need_scores = acceptance.uses_draft_scores or opts.min_confidence_or(DEFAULT_MIN_CONFIDENCE) > 0
    drafter = drafter_for_model(model, verifier, need_scores, source, ctx.backend.drafting)
    block_size = opts.block_size_or(drafter.default_block(int(model.train_block_size)))
    return drafter, block_size, source


def _no_drafter_model(ctx: DrafterContext, what: str) -> None:
    if ctx.drafters or ctx.options.drafter_path:
        raise ValueError(f"--decoding {ctx.options.decoding} {what} and takes no drafter (--drafter-path, or a second model in --path)")


def _source_copy_drafter(ctx: DrafterContext) -> BuiltDrafter:
    _no_drafter_model(ctx, "drafts from the source")
    task, verifier = ctx.task, ctx.verifier
    src, tgt = task.source_dictionary, task.target_dictionary
    if dictionary_fingerprint(src) != dictionary_fingerprint(tgt):
        raise ValueError(
            "--decoding input-guided copies source tokens into the output: source and "
            "target must share one dictionary (fairseq-preprocess --joined-dictionary)"
        )
    # no cap by default: the whole rest of the source is one draft
    block_size = ctx.options.block_size_or(verifier.max_decoder_positions())
    drafter = SourceCopyDrafter(tgt.pad(), tgt.eos())
    return BuiltDrafter(drafter, block_size, drafter.describe())


def _blockwise_drafter(ctx: DrafterContext) -> BuiltDrafter:
    _no_drafter_model(ctx, "drafts with the verifier's own heads")
    verifier = ctx.verifier
    if not isinstance(verifier, BlockwiseHeadsModel):
        raise ValueError(
            f"--decoding blockwise needs a blockwise_transformer checkpoint in --path, got "
            f"{type(verifier).__name__}"
        )
    heads = verifier.blockwise_k - 1
    k = ctx.options.block_size
    block_size = min(k, heads) if k is not None else heads
    drafter = BlockwiseHeadsDrafter(verifier, kernels=ctx.backend.drafting)
    return BuiltDrafter(drafter, block_size, drafter.describe())


def _ngram_drafter(ctx: DrafterContext) -> BuiltDrafter:
    _no_drafter_model(ctx, "drafts from a corpus (--ngram-split)")
    drafter = _corpus_drafter(ctx)
    block_size = ctx.options.block_size_or(NGRAM_BLOCK_SIZE)
    return BuiltDrafter(drafter, block_size, drafter.describe())


def _corpus_drafter(ctx: DrafterContext) -> NgramDrafter:
    ngram, tgt = ctx.options.ngram, ctx.task.target_dictionary
    corpus = load_ngram_corpus(ctx.task, ngram, ctx.services.ngram_corpora)
    return NgramDrafter(corpus, ngram.neighbours, tgt.pad(), tgt.eos(), ngram.min_confidence)


#: --draft-tree of ngram+draft-verify when it is not given (chosen on the valid split: docs/trees.md)
COMBINED_TREE_NODES = 5


def _combined_drafter(ctx: DrafterContext) -> BuiltDrafter:
    model_drafter, model_k, source = _model_drafter(ctx)
    if not isinstance(model_drafter, TreeDrafter):
        raise ValueError(f"--decoding ngram+draft-verify combines draft trees, and the drafter ({source}: "
                         f"{model_drafter.describe()}) drafts chains only: give a specdec_vsd drafter")
    ngram = _corpus_drafter(ctx)
    tgt = ctx.task.target_dictionary
    block_size = ctx.options.block_size_or(NGRAM_BLOCK_SIZE)
    drafter = CombinedDrafter(ngram, model_drafter, tgt.pad(), second_k=model_k)
    return BuiltDrafter(drafter, block_size, f"{drafter.describe()} ({source})", tree_nodes=COMBINED_TREE_NODES)


#: --decoding self-draft's k and --draft-min-confidence when they are not
#: given (chosen on the valid split: docs/self-draft.md)
SELF_DRAFT_BLOCK_SIZE = 16
SELF_DRAFT_MIN_CONFIDENCE = 0.0


def _self_drafter(ctx: DrafterContext) -> BuiltDrafter:
    _no_drafter_model(ctx, "drafts with the verifier's own int8 copy")
    tgt = ctx.task.target_dictionary
    cut = ctx.options.min_confidence_or(SELF_DRAFT_MIN_CONFIDENCE)
    kernels = ctx.backend.drafting
    drafter = SelfDrafter(ctx.verifier, tgt.pad(), tgt.eos(), cut, native=kernels.products, steps=kernels.steps)
    block_size = ctx.options.block_size_or(SELF_DRAFT_BLOCK_SIZE)
    return BuiltDrafter(drafter, block_size, drafter.describe(), min_confidence=SELF_DRAFT_MIN_CONFIDENCE)


def _no_draft(ctx: DrafterContext) -> BuiltDrafter:
    _no_drafter_model(ctx, "never drafts")
    k = ctx.options.block_size
    if k is not None and k != 1:
        raise ValueError(
            f"--decoding {ctx.options.decoding} never drafts (one verifier token a verify pass): "
            f"--block-size does not apply (got {k}); drop it"
        )
    drafter = NoDrafter()
    return BuiltDrafter(drafter, 1, drafter.describe())


#: the built-in decodings (other plugins register theirs the same way); the
#: package's ``__init__`` registers them (:func:`register_builtin_decodings`)
BUILTIN_DECODINGS = (
    Decoding(
        "draft-verify",
        "drafts with a drafter checkpoint (--drafter-path, or --path verifier.pt:drafter.pt): the "
        "paper's specdec_nat Spec-Drafter, or a specdec_vsd drafter that reads the verifier's states",
        _nat_drafter, takes_drafter=True,
    ),
    Decoding(
        "input-guided",
        "drafts by copying the source (input-guided aggressive decoding; same dictionary required)",
        _source_copy_drafter, relaxed=False,
    ),
    Decoding(
        "blockwise",
        "drafts with the extra heads of a blockwise_transformer verifier (blockwise parallel decoding)",
        _blockwise_drafter, relaxed=False,
    ),
    Decoding(
        "ngram",
        "drafts the continuation of the output's last tokens most frequent in a corpus's targets "
        "(--ngram-split, e.g. the verifier's own distillation), preferring the sentences whose "
        "source is most like this one (retrieval: no drafter model)",
        _ngram_drafter, relaxed=False,
    ),
    Decoding(
        "ngram+draft-verify",
        "draft trees from a corpus (as ngram) and, for the rows where the corpus is unsure, from a "
        "specdec_vsd drafter checkpoint (--drafter-path), merged in one tree (--draft-tree, default "
        f"{COMBINED_TREE_NODES} nodes)",
        _combined_drafter, takes_drafter=True, relaxed=False,
    ),
    Decoding(
        "self-draft",
        "drafts with an int8 copy of the verifier itself, made when the model is loaded (CPU; "
        "nothing to train, no extra file); the float32 verifier checks every draft",
        _self_drafter,
    ),
    Decoding(
        "loop-greedy",
        "no drafter: greedy decoding through the speculative loop, one verifier token a verify "
        "pass (separates the loop's own speed from speculation's)",
        _no_draft, relaxed=False,
    ),
)


def register_builtin_decodings() -> None:
    """Register :data:`BUILTIN_DECODINGS` (the package's ``__init__`` does, once)."""
    for decoding in BUILTIN_DECODINGS:
        register_decoding(decoding)


#: --draft-max-rows when it is not given, for a verifier on a CPU and a
#: relaxed acceptance (whose output depends on what is drafted, so the rule
#: must not depend on timings); strict decodings there measure instead
#: (:class:`~fairseq_specdec.generation.draft_policy.MeasuredRows`)
DRAFT_MAX_ROWS_CPU = 4


def draft_rows_rule(value, verifier, acceptance) -> RowsRule:
    """Whether a batch of so many unfinished rows drafts, for
    ``--draft-max-rows`` ``value``: N > 0, at most N rows
    (:class:`FixedRows`); 0, always (:class:`AllRows`); None (not given),
    for a verifier on a CPU, measured where the acceptance is strict
    (:class:`MeasuredRows`) and at most :data:`DRAFT_MAX_ROWS_CPU` rows
    where it is relaxed; always elsewhere."""
    if value is None:
        if next(verifier.parameters()).device.type != "cpu":
            return AllRows()
        return MeasuredRows() if isinstance(acceptance, StrictAcceptance) else FixedRows(DRAFT_MAX_ROWS_CPU)
    return FixedRows(value) if value else AllRows()  # (a negative N: refused with the options)


def check_strictness(decoding: Decoding, acceptance) -> None:
    """Refuse relaxed verification (``--verify-beta`` > 1) for a decoding
    registered as always strict (``Decoding.relaxed`` False: its output is
    ``--beam 1``'s, as docs/options.md says), before anything is built."""
    if decoding.relaxed or isinstance(acceptance, StrictAcceptance):
        return
    takes = ", ".join(d.name for d in DECODINGS.values() if d.relaxed)
    raise ValueError(
        f"--decoding {decoding.name} is always strict (its output is --beam 1's): relaxed verification "
        f"(--verify-beta {acceptance.beta}, --verify-tau {acceptance.tau}) does not apply to it; drop "
        f"--verify-beta/--verify-tau, or choose a decoding that takes them ({takes})"
    )


def build_speculative_generator(task, models, options: SpeculativeOptions,
                                services: GenerationServices) -> SpeculativeGenerator:
    """The generator of ``options.decoding`` (a registered decoding) for the
    models of ``--path``; ``options``: checked once, by the task
    (:meth:`SpeculativeOptions.from_config`); ``services``: what the task
    keeps for its generators (generation writes nothing to the task, and
    reads only its dictionaries and loaded datasets)."""
    decoding = get_decoding(options.decoding)
    verifier, drafters = _split_models(options, models)
    acceptance = build_acceptance(options.verify_beta, options.verify_tau, options.verify_score)
    check_strictness(decoding, acceptance)
    backend = resolve_backend(options.backend, verifier, acceptance, options.temperature, options.unk_penalty,
                              off=services.parts_off)
    built = decoding.build(DrafterContext(task, options, verifier, drafters, acceptance, backend, services))
    most = built.drafter.max_block  # (DraftLengthPolicy, below, refuses a k below 1)
    if most is not None and built.block_size > most:
        raise ValueError(
            f"--block-size {built.block_size}: the drafter ({built.description}) drafts at most "
            f"{most} tokens per pass (its --max-block); give --block-size {most} or less"
        )
    settings = DecodeSettings(
        block_size=built.block_size,
        max_len_a=options.max_len_a,
        max_len_b=options.max_len_b,
        min_len=options.min_len,
        normalize_scores=options.normalize_scores,
        len_penalty=options.len_penalty,
        unk_penalty=options.unk_penalty,
        temperature=options.temperature,
        draft_policy=DraftLengthPolicy(
            built.block_size,
            adaptive=options.adaptive_draft,
            min_confidence=options.min_confidence_or(built.min_confidence),
            rows=draft_rows_rule(options.draft_max_rows, verifier, acceptance),
        ),
        tree_nodes=built.tree_nodes if options.draft_tree is None else options.draft_tree,
    )
    generator = SpeculativeGenerator(backend, built.drafter, acceptance, task.target_dictionary, settings, None,
                                     services.sentences)
    # the statistics file is opened (and an old one truncated) only now that
    # every option has been checked: a refused run leaves it as it was
    generator.stats = SpecDecStats(options.stats, name=options.decoding, append=services.stats_file_started(options.stats))
    tree = f", draft trees of {settings.tree_nodes} nodes" if settings.tree_nodes else ""
    logger.info(
        f"{options.decoding} decoding: block size {built.block_size}{tree}, acceptance {acceptance!r}, "
        f"drafter {built.description}; {backend.describe()}"
    )
    return generator
