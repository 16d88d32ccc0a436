"""Build the speculative generator from fairseq's generation options.

Every option the loop cannot honour fails here, before any decoding, with a
message naming it.
"""
import logging
import os

from fairseq import checkpoint_utils

from ..models.specdec_nat import check_same_dictionary, dictionary_fingerprint
from .acceptance import build_acceptance
from .drafters import BlockwiseHeadsDrafter, NATBlockDrafter, SourceCopyDrafter
from .speculative import SpeculativeGenerator
from .stats import SpecDecStats

logger = logging.getLogger(__name__)

# (option, predicate on its value that means "set to something we cannot honour")
UNSUPPORTED_OPTIONS = [
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
]


def _option_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_generation_options(args) -> None:
    beam = getattr(args, "beam", 1)
    if beam != 1:
        raise ValueError(
            f"speculative decoding is greedy and needs --beam 1 (got --beam {beam})"
        )
    for name, unsupported in UNSUPPORTED_OPTIONS:
        value = getattr(args, name, None)
        if unsupported(value):
            raise ValueError(f"speculative decoding does not support {_option_name(name)} (got {value!r})")


def load_drafter(task, path: str, like):
    """Load a specdec_nat checkpoint with the task's dictionaries; placed on the
    device and in the dtype of ``like`` (the verifier)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--drafter-path {path}: no such file")
    models, _ = checkpoint_utils.load_model_ensemble([path], task=task)
    drafter = models[0]
    if not getattr(drafter, "is_block_drafter", False):
        raise ValueError(f"--drafter-path {path} is a {type(drafter).__name__} checkpoint, not a specdec_nat drafter")
    param = next(like.parameters())
    return drafter.to(device=param.device, dtype=param.dtype).eval()


def _split_models(task, models):
    drafters = [m for m in models if getattr(m, "is_block_drafter", False)]
    verifiers = [m for m in models if not getattr(m, "is_block_drafter", False)]
    if len(verifiers) != 1:
        raise ValueError(
            f"--decoding {task.cfg.decoding} needs exactly one verifier in --path, got "
            f"{len(verifiers)} (ensembles are not supported)"
        )
    return verifiers[0], drafters


def _nat_drafter(task, verifier, drafters, acceptance):
    cfg = task.cfg
    if cfg.drafter_path and drafters:
        raise ValueError("give the drafter either with --drafter-path or in --path, not both")
    if len(drafters) > 1:
        raise ValueError(f"--path holds {len(drafters)} drafters; give one")
    if drafters:
        model, source = drafters[0], "second model in --path"
    elif cfg.drafter_path:
        model, source = load_drafter(task, cfg.drafter_path, verifier), cfg.drafter_path
    else:
        raise ValueError(
            "--decoding draft-verify needs a drafter: --drafter-path FILE or --path verifier.pt:drafter.pt"
        )
    # drafters built in-process never pass through load_state_dict's check
    check_same_dictionary(
        model.dictionary_fingerprint, dictionary_fingerprint(task.target_dictionary), f"the drafter ({source})"
    )
    block_size = cfg.block_size if cfg.block_size is not None else int(model.train_block_size)
    drafter = NATBlockDrafter(model, verifier, with_scores=acceptance.uses_draft_scores)
    shared = ", sharing the verifier's encoder" if drafter.shares_encoder else ""
    return drafter, block_size, f"specdec_nat drafter {source}{shared}"


def _source_copy_drafter(task, verifier, drafters, acceptance):
    if drafters or task.cfg.drafter_path:
        raise ValueError("--decoding input-guided drafts from the source and takes no drafter")
    src, tgt = task.source_dictionary, task.target_dictionary
    if dictionary_fingerprint(src) != dictionary_fingerprint(tgt):
        raise ValueError(
            "--decoding input-guided copies source tokens into the output: source and "
            "target must share one dictionary (fairseq-preprocess --joined-dictionary)"
        )
    # no cap by default: the whole rest of the source is one draft
    block_size = task.cfg.block_size if task.cfg.block_size is not None else verifier.max_decoder_positions()
    return SourceCopyDrafter(tgt.pad(), tgt.eos()), block_size, "the source (input-guided)"


def _blockwise_drafter(task, verifier, drafters, acceptance):
    if drafters or task.cfg.drafter_path:
        raise ValueError("--decoding blockwise drafts with the verifier's own heads and takes no drafter")
    if not getattr(verifier, "has_blockwise_heads", False):
        raise ValueError(
            f"--decoding blockwise needs a blockwise_transformer checkpoint in --path, got "
            f"{type(verifier).__name__}"
        )
    heads = verifier.blockwise_k - 1
    block_size = min(task.cfg.block_size, heads) if task.cfg.block_size is not None else heads
    return BlockwiseHeadsDrafter(verifier), block_size, f"{heads} blockwise heads of the verifier"


DRAFTER_BUILDERS = {
    "blockwise": _blockwise_drafter,
    "draft-verify": _nat_drafter,
    "input-guided": _source_copy_drafter,
}


def build_speculative_generator(task, models, args) -> SpeculativeGenerator:
    check_generation_options(args)
    cfg = task.cfg
    verifier, drafters = _split_models(task, models)
    acceptance = build_acceptance(cfg.verify_beta, cfg.verify_tau, cfg.verify_score)
    drafter, block_size, description = DRAFTER_BUILDERS[cfg.decoding](task, verifier, drafters, acceptance)
    if block_size < 1:
        raise ValueError(f"--block-size must be >= 1, got {block_size}")
    stats = SpecDecStats(cfg.specdec_stats, name=cfg.decoding)
    logger.info(
        f"{cfg.decoding} decoding: block size {block_size}, acceptance {acceptance!r}, drafter {description}"
    )
    return SpeculativeGenerator(
        verifier,
        drafter,
        acceptance,
        task.target_dictionary,
        block_size=block_size,
        max_len_a=getattr(args, "max_len_a", 0),
        max_len_b=getattr(args, "max_len_b", 200),
        min_len=getattr(args, "min_len", 1),
        normalize_scores=not getattr(args, "unnormalized", False),
        len_penalty=getattr(args, "lenpen", 1),
        unk_penalty=getattr(args, "unkpen", 0),
        temperature=getattr(args, "temperature", 1.0),
        stats=stats,
        expected_sentences=lambda: task.expected_sentences,
    )
