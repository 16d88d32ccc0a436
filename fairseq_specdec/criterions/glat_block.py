"""``glat_block``: glancing training on block-masked targets (Xia et al. 2023, Eq. 7).

For each sentence the ``draft_verify`` task has cut a random prefix and masked
the next k slots (:mod:`fairseq_specdec.tasks.block_inputs`).  In training:

1. a first decoder pass without gradient predicts the block;
2. per row, ``n = floor(ratio * wrong)`` block slots, where ``wrong`` counts the
   mispredicted slots that have a real target, are chosen uniformly among all
   slots that have a real target, and their gold token is revealed in the input;
3. the loss (label-smoothed NLL) is taken on the block slots that have a real
   target and were not revealed.

The ratio anneals linearly from ``--glance-ratio-start`` (0.5) to
``--glance-ratio-end`` (0.3) over ``--glance-anneal-updates`` updates
(default: ``--max-update``).  Validation never glances.  ``block_acc`` is the
accuracy of the first pass over the block slots, before any glancing: the
proxy for the acceptance rate at decoding time.
"""
import math
from dataclasses import dataclass, field
from typing import Optional

import torch
from omegaconf import II

from fairseq import metrics, utils
from fairseq.criterions import FairseqCriterion, register_criterion
from fairseq.criterions.label_smoothed_cross_entropy import label_smoothed_nll_loss
from fairseq.dataclass import FairseqDataclass


@dataclass
class GlatBlockConfig(FairseqDataclass):
    label_smoothing: float = field(
        default=0.1, metadata={"help": "epsilon for label smoothing, 0 means none"}
    )
    glance_ratio_start: float = field(
        default=0.5, metadata={"help": "glancing ratio at update 0"}
    )
    glance_ratio_end: float = field(
        default=0.3, metadata={"help": "glancing ratio after --glance-anneal-updates"}
    )
    glance_anneal_updates: Optional[int] = field(
        default=None,
        metadata={
            "help": "updates over which the ratio anneals linearly (default: "
            "--max-update; with neither, the ratio stays at the start value)"
        },
    )
    # not a command-line option: resolved from --max-update by fairseq's config
    max_update: int = II("optimization.max_update")


def glance_ratio(num_updates: int, start: float, end: float, anneal_updates: int) -> float:
    if anneal_updates is None or anneal_updates <= 0:
        return start
    return start + (end - start) * min(1.0, num_updates / anneal_updates)


def choose_glanced_slots(valid: torch.Tensor, n_glance: torch.Tensor) -> torch.Tensor:
    """B x T bool: ``n_glance[i]`` slots of row i chosen uniformly among ``valid[i]``."""
    scores = torch.rand(valid.shape, device=valid.device).masked_fill(~valid, 2.0)
    ranks = scores.argsort(dim=1).argsort(dim=1)
    return (ranks < n_glance.unsqueeze(1)) & valid


@register_criterion("glat_block", dataclass=GlatBlockConfig)
class GlatBlockCriterion(FairseqCriterion):
    def __init__(
        self, task, label_smoothing, glance_ratio_start, glance_ratio_end, glance_anneal_updates, max_update=0
    ):
        super().__init__(task)
        self.eps = label_smoothing
        self.ratio_start = glance_ratio_start
        self.ratio_end = glance_ratio_end
        self.anneal_updates = glance_anneal_updates if glance_anneal_updates else max_update

    def forward(self, model, sample, reduce=True):
        net_input = sample["net_input"]
        if "block_mask" not in net_input or "block_target" not in sample:
            raise ValueError(
                "criterion glat_block needs block-masked inputs: train with "
                "--task draft_verify and a specdec_nat or specdec_vsd model"
            )
        target = sample["block_target"]
        valid = net_input["block_mask"] & target.ne(self.padding_idx)
        n_valid = valid.sum(1)
        stats = {}
        ratio = glance_ratio(model.num_updates, self.ratio_start, self.ratio_end, self.anneal_updates)

        loss_slots = valid

        def glance(first_logits):
            nonlocal loss_slots
            correct = torch.zeros_like(valid)
            correct[valid] = first_logits.argmax(-1).eq(target[valid])
            n_correct = correct.sum(1)
            stats["block_correct"] = n_correct.sum().item()
            n_glance = torch.floor((n_valid - n_correct).float() * ratio).long()
            glanced = choose_glanced_slots(valid, n_glance)
            stats["glanced"] = glanced.sum().item()
            prev = torch.where(glanced, target, net_input["prev_output_tokens"])
            loss_slots = valid & ~glanced
            return prev, loss_slots

        glancing = model.training and ratio > 0
        # model-specific block inputs (e.g. the verifier's states for specdec_vsd)
        extra = {
            name: value
            for name, value in net_input.items()
            if name not in ("src_tokens", "src_lengths", "prev_output_tokens", "block_mask")
        }
        logits, _ = model(
            net_input["src_tokens"],
            net_input["src_lengths"],
            net_input["prev_output_tokens"],
            block_mask=valid,
            glance=glance if glancing else None,
            **extra,
        )
        lprobs = utils.log_softmax(logits, dim=-1)
        loss_target = target[loss_slots]
        if not glancing:
            stats["block_correct"] = lprobs.argmax(-1).eq(loss_target).sum().item()
            stats["glanced"] = 0
        loss, nll_loss = label_smoothed_nll_loss(
            lprobs, loss_target.unsqueeze(-1), self.eps, ignore_index=None, reduce=reduce
        )
        sample_size = loss_target.numel()
        logging_output = {
            "loss": loss.data,
            "nll_loss": nll_loss.data,
            "ntokens": sample_size,
            "nsentences": target.size(0),
            "sample_size": sample_size,
            "block_total": n_valid.sum().item(),
            "block_correct": stats["block_correct"],
            "glanced": stats["glanced"],
            "glance_ratio": ratio if glancing else 0.0,
        }
        return loss, sample_size, logging_output

    @staticmethod
    def reduce_metrics(logging_outputs) -> None:
        def total(key):
            return sum(log.get(key, 0) for log in logging_outputs)

        sample_size = total("sample_size")
        metrics.log_scalar("loss", total("loss") / max(sample_size, 1) / math.log(2), sample_size, round=3)
        metrics.log_scalar("nll_loss", total("nll_loss") / max(sample_size, 1) / math.log(2), sample_size, round=3)
        metrics.log_derived("ppl", lambda m: utils.get_perplexity(m["nll_loss"].avg))
        # "_"-prefixed meters are not printed; block_acc is derived from them
        metrics.log_scalar_sum("_block_correct", total("block_correct"))
        metrics.log_scalar_sum("_block_total", total("block_total"))
        metrics.log_derived(
            "block_acc",
            lambda m: round(100.0 * m["_block_correct"].sum / m["_block_total"].sum, 2)
            if m["_block_total"].sum > 0
            else float("nan"),
        )
        metrics.log_scalar_sum("_glanced", total("glanced"))
        n_log = max(len(logging_outputs), 1)
        metrics.log_scalar("glance_ratio", total("glance_ratio") / n_log, round=3)

    @staticmethod
    def logging_outputs_can_be_summed() -> bool:
        return False
