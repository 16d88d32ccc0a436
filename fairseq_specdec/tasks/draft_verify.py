"""The ``draft_verify`` task: fairseq's translation task plus speculative decoding.

* ``--decoding`` picks the generator ``task.build_generator`` returns
  (``autoregressive`` is fairseq's own SequenceGenerator, unchanged).
* No sentence is ever lost outside training: fairseq-fixed drops the last
  batch when its size is not a multiple of ``--required-batch-size-multiple``
  (default 8), so ``fairseq-generate --batch-size 1`` translated 49 of 50
  sentences.  Only the training split, loaded by the trainer, keeps the
  multiple (it matters for fp16 efficiency on GPUs); every other dataset is
  batched with a multiple of 1, which keeps every sentence.
"""
import logging
import os
from dataclasses import dataclass, field, fields
from typing import Optional

from fairseq.dataclass import ChoiceEnum
from fairseq.tasks import register_task
from fairseq.tasks.translation import TranslationConfig, TranslationTask

from ..generation.acceptance import VERIFY_SCORES
from ..generation.build import DRAFT_MAX_ROWS_CPU, build_speculative_generator
from ..generation.ngram import NGRAM_MIN_CONFIDENCE
from ..generation.options import BACKENDS, SPECULATIVE_CONFIG, SpeculativeOptions, option_name
from ..generation.registry import AUTOREGRESSIVE, DEFAULT_MIN_CONFIDENCE, decoding_help, get_decoding
from ..generation.services import GenerationServices
from ..models.init_from_verifier import init_blockwise_from_verifier, init_drafter_from_verifier
from ..models.protocol import BlockwiseHeadsModel, DrafterModel, SourceReadingDrafterModel, VerifierStateDrafterModel
from ..models.specdec_vsd import make_state_block_inputs
from .block_inputs import make_block_inputs, sentence_draws

logger = logging.getLogger(__name__)

VERIFY_SCORE_CHOICES = ChoiceEnum(list(VERIFY_SCORES))
SPECDEC_BACKEND_CHOICES = ChoiceEnum(list(BACKENDS))


#: block size k used when --block-size is not given (Xia et al. 2023 use 25)
DEFAULT_BLOCK_SIZE = 25


@dataclass
class DraftVerifyConfig(TranslationConfig):
    # a plain string, checked against the registry of decodings when the task
    # is set up, so that a decoding registered by another plugin is a choice too
    decoding: str = field(
        default=AUTOREGRESSIVE,
        metadata={"help": decoding_help()},
    )
    init_from_verifier: Optional[str] = field(
        default=None,
        metadata={
            "help": "training a drafter: copy this verifier checkpoint's encoder and embeddings "
            "into a specdec_nat drafter (the copied and kept tensors are logged), the whole verifier "
            "into a blockwise_transformer's base model (only the heads are new), or its embeddings "
            "and output projection into a specdec_vsd drafter, which also trains on its states "
            "(required there). Dictionaries must match"
        },
    )
    freeze_encoder: bool = field(
        default=False,
        metadata={
            "help": "training a specdec_nat drafter: keep its encoder (and embeddings) "
            "fixed, e.g. at the copy --init-from-verifier made; decoding then reuses "
            "the verifier's encoder output (use without --share-all-embeddings so "
            "the decoder keeps trainable embeddings)"
        },
    )
    drafter_path: Optional[str] = field(
        default=None,
        metadata={
            "help": "drafter checkpoint (specdec_nat or specdec_vsd) for --decoding draft-verify, "
            "read once per process (or give it as the second model: --path verifier.pt:drafter.pt)"
        },
    )
    verify_beta: int = field(
        default=1,
        metadata={
            "help": "relaxed verification: accept a draft among the verifier's top-beta "
            "tokens (1 = strict, identical to --beam 1)"
        },
    )
    verify_tau: float = field(
        default=0.0,
        metadata={
            "help": "relaxed verification: accept a draft whose score is within tau of "
            "the verifier's top-1 log-prob (a number >= 0, inf for no limit; no effect when "
            "--verify-beta is 1)"
        },
    )
    verify_score: VERIFY_SCORE_CHOICES = field(
        default="verifier",
        metadata={
            "help": "whose log-prob of the drafted token --verify-tau compares: the "
            "verifier's (Spec-Verification of Xia et al., Findings of EMNLP 2023, and the authors' "
            "code) or the drafter's (the ICLR 2023 submission's SpecDec++)"
        },
    )
    specdec_stats: Optional[str] = field(
        default=None,
        metadata={
            "help": "speculative decodings: write per-sentence statistics to this file (JSON lines: "
            "id, length, iterations, tokens accepted per iteration, time); a run starts it anew, and "
            "later generators of the same task (each translate() of the Python API) append to it"
        },
    )
    adaptive_draft: bool = field(
        default=False,
        metadata={
            "help": "speculative decodings: adapt each row's draft length to what was "
            "accepted (start at min(5, k), +2 after a fully accepted draft, -1 otherwise, "
            "within [1, --block-size]); the output does not change"
        },
    )
    draft_min_confidence: Optional[float] = field(
        default=None,
        metadata={
            "help": "speculative decodings: stop each draft before its first token whose "
            "drafter probability is below this (0 = off; drafters that return "
            f"probabilities only; default {DEFAULT_MIN_CONFIDENCE}, 0 for self-draft, each chosen by "
            "measurement, see docs/architecture.md, Draft length, and docs/self-draft.md); the output "
            "does not change"
        },
    )
    draft_max_rows: Optional[int] = field(
        default=None,
        metadata={
            "help": "speculative decodings: no row drafts while more than this many rows of the batch are "
            "unfinished (one verifier token per row and iteration until then; 0 = no limit). Default, for a "
            "verifier on a CPU: with strict verification, measured: a batch of any number of unfinished rows, one "
            "sentence included, drafts only where the loop's own timings show that drafting commits tokens faster "
            "than not drafting (docs/architecture.md; 0 makes every row draft); with relaxed verification (whose "
            f"output depends on what is drafted) {DRAFT_MAX_ROWS_CPU}. No limit elsewhere. Strict output does not change"
        },
    )
    draft_tree: Optional[int] = field(
        default=None,
        metadata={
            "help": "speculative decodings: draft a tree of this many nodes per row and iteration (several "
            "continuations, verified in one pass; each node attends to its ancestors only) instead of one "
            "chain of --block-size tokens; the tree is at most --block-size deep. Drafters that offer "
            "candidates: draft-verify with a specdec_vsd drafter, blockwise, ngram, ngram+draft-verify "
            "(0 = chains; default: chains, ngram+draft-verify 5 nodes); the output does not change"
        },
    )
    specdec_backend: SPECDEC_BACKEND_CHOICES = field(
        default="auto",
        metadata={
            "help": "speculative decodings: what computes the verify pass, the acceptance step and the "
            "drafters' passes. 'auto' (default): the fastest exact path for the device, chosen once per "
            "generator and logged with its reason: on a CPU with AVX2 the plugin's native C++ kernels "
            "(row-blocked products that cost about the same for 1 to 8 tokens, fused decoder and encoder "
            "layers, the strict acceptance step in one call); on a CUDA device the verify pass with static "
            "shapes replayed as CUDA graphs (whole iterations at batch 1 for a float32 verifier); elsewhere "
            "the lean pass with torch's products. 'reference': fairseq's own layer modules and torch's "
            "products throughout (fairseq's arithmetic: to compare, or to rule the kernels out). Strict "
            "output is the same greedy output on both; the kernels round differently from torch's BLAS, "
            "so a near-tie can differ from --beam 1 (docs/verify-kernels.md, Exactness)"
        },
    )
    ngram_split: str = field(
        default="train",
        metadata={
            "help": "--decoding ngram: the binarized split of the data directory whose target "
            "sentences it drafts from and whose sources it retrieves neighbours by (default train; "
            "best: the verifier's own greedy distillation of its training set)"
        },
    )
    ngram_order: int = field(
        default=4,
        metadata={"help": "--decoding ngram: the longest context, in tokens, whose continuation it looks up"},
    )
    ngram_neighbours: int = field(
        default=20,
        metadata={
            "help": "--decoding ngram: corpus sentences retrieved per source sentence (most rare source "
            "tokens in common), whose continuations come first (0: the whole corpus's only)"
        },
    )
    ngram_min_confidence: float = field(
        default=NGRAM_MIN_CONFIDENCE,
        metadata={
            "help": "--decoding ngram: a draft stops before the token at which the product of its "
            "tokens' confidences (a continuation seen c times in n occurrences of its context: "
            "c / (n + 1)) would fall below this; a row with no draft confident enough takes a greedy "
            f"step (default {NGRAM_MIN_CONFIDENCE}; 0: always draft k tokens where a context is known)"
        },
    )
    block_size: Optional[int] = field(
        default=None,
        metadata={
            "help": f"block size k: tokens the drafter predicts per pass. Training: the block of "
            f"masked targets (default {DEFAULT_BLOCK_SIZE}); decoding default: the drafter's training k (a "
            "specdec_vsd drafter on a CPU where the rowgemm kernel runs: at most 3, where it measured "
            "fastest). "
            "ngram: default 7, a cap (its confidence cut decides how much a row drafts); self-draft: default 16; "
            "input-guided: caps the draft length (default: no cap); blockwise: caps the heads used "
            "(default: all); a specdec_vsd drafter drafts at most its --max-block tokens; loop-greedy "
            "never drafts and refuses the option"
        },
    )


@register_task("draft_verify", dataclass=DraftVerifyConfig)
class DraftVerifyTask(TranslationTask):
    """Translation task whose generator can be a draft-then-verify decoder."""

    cfg: DraftVerifyConfig

    def __init__(self, cfg: DraftVerifyConfig, src_dict, tgt_dict):
        super().__init__(cfg, src_dict, tgt_dict)
        # ids of datasets the trainer loaded as its training split
        self._training_datasets = set()
        #: the --init-from-verifier model, once loaded (frozen_verifier())
        self._frozen_verifier = None
        get_decoding(cfg.decoding) if cfg.decoding != AUTOREGRESSIVE else None  # a clear error now
        #: what this task's generators share (loaded drafters, n-gram corpora,
        #: the sentence count, started statistics files), handed to each build
        self.generation_services = GenerationServices()

    @property
    def expected_sentences(self) -> int:
        return self.generation_services.sentences.expected

    def build_model(self, cfg, from_checkpoint=False):
        model = super().build_model(cfg, from_checkpoint)
        if isinstance(model, DrafterModel):
            # overwritten by the checkpoint's value when one is loaded
            model.train_block_size.fill_(self.train_block_size)
            if isinstance(model, VerifierStateDrafterModel):
                if not from_checkpoint:
                    if not self.cfg.init_from_verifier:
                        raise ValueError(
                            f"{type(model).__name__} reads its verifier's states: give the verifier "
                            "checkpoint with --init-from-verifier"
                        )
                    model.init_from_verifier(self.frozen_verifier())
            elif self.cfg.init_from_verifier and not from_checkpoint:
                init_drafter_from_verifier(
                    model, self.cfg.init_from_verifier, self.src_dict, self.tgt_dict
                )
            if self.cfg.freeze_encoder and not from_checkpoint:
                if not isinstance(model, SourceReadingDrafterModel):
                    raise ValueError(f"--freeze-encoder does not apply to {type(model).__name__} (it has no encoder)")
                model.freeze_encoder()
        elif isinstance(model, BlockwiseHeadsModel):
            if self.cfg.init_from_verifier and not from_checkpoint:
                init_blockwise_from_verifier(model, self.cfg.init_from_verifier)
        elif self.cfg.init_from_verifier and not from_checkpoint:
            raise ValueError(
                "--init-from-verifier applies to drafters (specdec_nat, specdec_vsd) and blockwise_transformer models"
            )
        return model

    def build_generator(self, models, args, seq_gen_cls=None, extra_gen_cls_kwargs=None, prefix_allowed_tokens_fn=None):
        if getattr(args, "score_reference", False):
            if any(isinstance(m, DrafterModel) for m in models) or self.cfg.drafter_path:
                raise ValueError(
                    "--score-reference scores the references with the verifier alone (fairseq's "
                    "scorer; a drafter cannot change a score): give only the verifier in --path, "
                    "without --drafter-path"
                )
            return super().build_generator(
                models, args, seq_gen_cls, extra_gen_cls_kwargs, prefix_allowed_tokens_fn
            )
        if self.cfg.decoding == AUTOREGRESSIVE:
            if any(isinstance(m, DrafterModel) for m in models):
                raise ValueError(
                    "a drafter was given in --path but --decoding is "
                    "'autoregressive'; use --decoding draft-verify"
                )
            self.check_no_speculative_options()
            return super().build_generator(
                models, args, seq_gen_cls, extra_gen_cls_kwargs, prefix_allowed_tokens_fn
            )
        options = SpeculativeOptions.from_config(self.cfg, args)
        return build_speculative_generator(self, models, options, self.generation_services)

    #: the options that only speculative decodings read (their defaults: DraftVerifyConfig's)
    SPECULATIVE_OPTIONS = SPECULATIVE_CONFIG

    def check_no_speculative_options(self) -> None:
        """Refuse options that fairseq's own decoding would silently ignore."""
        defaults = {f.name: f.default for f in fields(DraftVerifyConfig)}
        for name in self.SPECULATIVE_OPTIONS:
            value, default = getattr(self.cfg, name), defaults[name]
            if value != default:
                raise ValueError(
                    f"{option_name(name)} {value} applies to speculative decodings only, but --decoding is "
                    f"'{AUTOREGRESSIVE}': add --decoding draft-verify (or another speculative "
                    "decoding), or drop the option"
                )

    def load_dataset(self, split, epoch=1, combine=False, **kwargs):
        super().load_dataset(split, epoch=epoch, combine=combine, **kwargs)
        # fairseq's trainer loads its training subset with combine=True;
        # validation (fairseq-train) and generation (fairseq-generate) with False.
        if combine and split == self.cfg.train_subset:
            self._training_datasets.add(id(self.datasets[split]))

    @property
    def train_block_size(self) -> int:
        return self.cfg.block_size if self.cfg.block_size is not None else DEFAULT_BLOCK_SIZE

    def frozen_verifier(self):
        """The ``--init-from-verifier`` model, loaded once, in eval mode and
        without gradients: the teacher-forced states a ``specdec_vsd``
        drafter trains on.  It is not part of the drafter (not saved with it)."""
        if self._frozen_verifier is None:
            from fairseq import checkpoint_utils

            path = self.cfg.init_from_verifier
            if not path:
                raise ValueError("training a specdec_vsd drafter needs its verifier: --init-from-verifier FILE")
            if not os.path.isfile(path):
                raise FileNotFoundError(f"--init-from-verifier {path}: no such file")
            models, _ = checkpoint_utils.load_model_ensemble([path], task=self)
            verifier = models[0].eval()
            for param in verifier.parameters():
                param.requires_grad_(False)
            self._frozen_verifier = verifier
            logger.info(f"frozen verifier for the drafter's training inputs: {path}")
        return self._frozen_verifier

    def add_block_inputs(self, sample, model, generator=None, draws=None):
        """Block-mask the targets of ``sample`` for a block drafter (a fresh
        random cut every call, unless ``draws`` fixes them; see
        :func:`make_block_inputs`, and :func:`make_state_block_inputs` for
        drafters that read the verifier's states); other models get
        ``sample`` unchanged."""
        if not isinstance(model, DrafterModel) or sample is None or "target" not in sample:
            return sample
        if isinstance(model, VerifierStateDrafterModel):
            return self._add_state_block_inputs(sample, model, generator, draws)
        block = make_block_inputs(
            sample["target"], self.tgt_dict.pad(), model.mask_idx, self.train_block_size, generator, draws
        )
        net_input = dict(sample["net_input"])
        net_input["prev_output_tokens"] = block.prev_output_tokens
        net_input["block_mask"] = block.block_mask
        return {**sample, "net_input": net_input, "block_target": block.block_target}

    def _add_state_block_inputs(self, sample, model, generator, draws):
        verifier = self.frozen_verifier()
        param = next(model.parameters())
        if next(verifier.parameters()).device != param.device:
            verifier.to(param.device)
        net_input = dict(sample["net_input"])
        encoder_out, features = model.verifier_states(
            verifier, net_input["src_tokens"], net_input["src_lengths"], net_input["prev_output_tokens"]
        )
        if param.dtype != features.dtype:
            # fairseq-train --fp16 casts the drafter, not the frozen verifier, which stays
            # float32: its states are read in the drafter's precision
            from fairseq.utils import apply_to_sample

            encoder_out, features = apply_to_sample(
                lambda t: t.to(param.dtype) if t.is_floating_point() else t, (encoder_out, features)
            )
        blocks = make_state_block_inputs(
            sample["target"], self.tgt_dict.pad(), self.tgt_dict.eos(), model.mask_idx, self.train_block_size,
            model.cfg.cuts_per_sentence, generator, draws,
        )
        block_target = blocks.pop("block_target")
        net_input["prev_output_tokens"] = blocks.pop("prev_output_tokens")
        net_input["block_mask"] = blocks.pop("block_mask")
        net_input["state_blocks"] = dict(blocks, encoder_out=encoder_out, features=features)
        return {**sample, "net_input": net_input, "block_target": block_target}

    def train_step(self, sample, model, criterion, optimizer, update_num, ignore_grad=False):
        sample = self.add_block_inputs(sample, model)
        return super().train_step(sample, model, criterion, optimizer, update_num, ignore_grad)

    def valid_step(self, sample, model, criterion):
        # each sentence is cut by its id: the same cuts at every validation
        # (epochs are comparable) and in fairseq-validate, whatever the batching
        draws = sentence_draws(sample["id"]) if sample is not None and "id" in sample else None
        sample = self.add_block_inputs(sample, model, draws=draws)
        return super().valid_step(sample, model, criterion)

    def is_training_dataset(self, dataset) -> bool:
        return id(dataset) in self._training_datasets

    def get_batch_iterator(
        self,
        dataset,
        max_tokens=None,
        max_sentences=None,
        max_positions=None,
        ignore_invalid_inputs=False,
        required_batch_size_multiple=1,
        seed=1,
        num_shards=1,
        shard_id=0,
        **kwargs,
    ):
        training = self.is_training_dataset(dataset)
        if not training and required_batch_size_multiple != 1:
            logger.info(
                "batching a non-training split with --required-batch-size-multiple 1 "
                f"(not {required_batch_size_multiple}) so that no sentence is dropped"
            )
            required_batch_size_multiple = 1
        itr = super().get_batch_iterator(
            dataset,
            max_tokens=max_tokens,
            max_sentences=max_sentences,
            max_positions=max_positions,
            ignore_invalid_inputs=ignore_invalid_inputs,
            required_batch_size_multiple=required_batch_size_multiple,
            seed=seed,
            num_shards=num_shards,
            shard_id=shard_id,
            **kwargs,
        )
        if not training:
            shard = itr.frozen_batches[shard_id::num_shards]
            self.generation_services.sentences.expect(sum(len(batch) for batch in shard))
        return itr
