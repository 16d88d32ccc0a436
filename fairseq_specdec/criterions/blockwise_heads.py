"""``blockwise_heads``: train the k-1 extra heads of a ``blockwise_transformer``
(Stern et al. 2018, section 5).

With teacher forcing, head i at target position t predicts the gold token
``y[t + i]``; the label-smoothed losses of all heads are summed.  By default
the base model is frozen (it runs in eval mode without gradient, so its
greedy output, and hence draft-verify's output, stays that of the original
verifier); ``--blockwise-finetune`` also trains the base with its own loss,
the paper's fine-tuning variant.  ``head{i}_acc`` is head i's accuracy: the
probability that its draft matches the gold token, a proxy for acceptance.

``--head-shortlist N`` restricts each head's softmax to the N most frequent
types plus the batch's gold tokens (a sampled softmax whose sample always
holds the gold token): an update's projection and softmax then cost about
``(N + distinct gold tokens) / V`` of the full ones.  ``head{i}_acc`` is then
the accuracy among those types, at most slightly above the full-vocabulary
one.  Heads are only drafters, so this changes no output of strict decoding.
"""
import math
from dataclasses import dataclass, field

import torch

from fairseq import metrics, utils
from fairseq.criterions import FairseqCriterion, register_criterion
from fairseq.criterions.label_smoothed_cross_entropy import label_smoothed_nll_loss
from fairseq.dataclass import FairseqDataclass

from ..models.protocol import BlockwiseHeadsModel


@dataclass
class BlockwiseHeadsConfig(FairseqDataclass):
    label_smoothing: float = field(default=0.1, metadata={"help": "epsilon for label smoothing"})
    blockwise_finetune: bool = field(
        default=False,
        metadata={"help": "also train the base model (its greedy output then changes)"},
    )
    head_shortlist: int = field(
        default=0,
        metadata={
            "help": "each head's softmax over the N most frequent types (dictionary order) plus the "
            "batch's gold tokens instead of the whole vocabulary (0: the whole vocabulary); an "
            "update then costs about N / V of the projection, and the drafter decodes over a "
            "shortlist too"
        },
    )


@register_criterion("blockwise_heads", dataclass=BlockwiseHeadsConfig)
class BlockwiseHeadsCriterion(FairseqCriterion):
    def __init__(self, task, label_smoothing, blockwise_finetune, head_shortlist=0):
        super().__init__(task)
        self.eps = label_smoothing
        self.finetune = blockwise_finetune
        if head_shortlist < 0:
            raise ValueError(f"--head-shortlist must be >= 0 (0: the whole vocabulary), got {head_shortlist}")
        self.head_shortlist = head_shortlist

    def forward(self, model, sample, reduce=True):
        if not isinstance(model, BlockwiseHeadsModel):
            raise ValueError("criterion blockwise_heads needs --arch blockwise_transformer")
        net_input = sample["net_input"]
        target = sample["target"]
        if self.finetune:
            features, _ = model(**net_input, features_only=True)
        else:
            base_was_training = model.training
            model.eval()
            with torch.no_grad():
                features, _ = model(**net_input, features_only=True)
            model.train(base_was_training)
        logging_output = {"nsentences": target.size(0)}
        total_loss, total_nll, n_tokens = 0.0, 0.0, 0
        if self.finetune:
            lprobs = utils.log_softmax(model.decoder.output_layer(features), dim=-1)
            mask = target.ne(self.padding_idx)
            loss, nll = label_smoothed_nll_loss(lprobs[mask], target[mask].unsqueeze(-1), self.eps, reduce=True)
            total_loss, total_nll, n_tokens = loss, nll, int(mask.sum())
        hidden = model.heads(features)  # B x T x (k-1) x C
        vocab, position = self.shortlist(target, len(self.task.target_dictionary))
        for i in range(hidden.size(2)):
            ahead = i + 1
            tgt = target[:, ahead:]
            mask = tgt.ne(self.padding_idx)
            logits = model.project_heads(hidden[:, : tgt.size(1), i][mask], frozen_projection=not self.finetune, vocab=vocab)
            lprobs = utils.log_softmax(logits, dim=-1)
            gold = tgt[mask] if position is None else position[tgt[mask]]
            loss, nll = label_smoothed_nll_loss(lprobs, gold.unsqueeze(-1), self.eps, reduce=True)
            total_loss = total_loss + loss
            total_nll = total_nll + nll
            n_tokens += int(mask.sum())
            logging_output[f"head{ahead + 1}_correct"] = int(lprobs.argmax(-1).eq(gold).sum())
            logging_output[f"head{ahead + 1}_total"] = int(mask.sum())
        logging_output.update(
            loss=total_loss.data, nll_loss=total_nll.data, ntokens=n_tokens, sample_size=n_tokens
        )
        return total_loss, n_tokens, logging_output

    def shortlist(self, target, num_types: int):
        """``(vocab, position)``: the types each head's softmax covers (the
        ``--head-shortlist`` most frequent plus the batch's gold tokens, sorted)
        and every type's index among them (-1: not covered); ``(None, None)``
        for the whole vocabulary."""
        if not 0 < self.head_shortlist < num_types:
            return None, None
        common = torch.arange(self.head_shortlist, device=target.device)
        vocab = torch.unique(torch.cat([common, target[target.ne(self.padding_idx)]]))
        position = torch.full((num_types,), -1, dtype=torch.long, device=target.device)
        position[vocab] = torch.arange(vocab.numel(), device=target.device)
        return vocab, position

    @staticmethod
    def reduce_metrics(logging_outputs) -> None:
        def total(key):
            return sum(log.get(key, 0) for log in logging_outputs)

        sample_size = max(total("sample_size"), 1)
        metrics.log_scalar("loss", total("loss") / sample_size / math.log(2), sample_size, round=3)
        metrics.log_scalar("nll_loss", total("nll_loss") / sample_size / math.log(2), sample_size, round=3)
        heads = sorted({k[: -len("_correct")] for log in logging_outputs for k in log if k.endswith("_correct")})
        for head in heads:
            metrics.log_scalar_sum(f"_{head}_correct", total(f"{head}_correct"))
            metrics.log_scalar_sum(f"_{head}_total", total(f"{head}_total"))
            metrics.log_derived(
                f"{head}_acc",
                lambda m, h=head: round(100.0 * m[f"_{h}_correct"].sum / m[f"_{h}_total"].sum, 2)
                if m[f"_{h}_total"].sum > 0
                else float("nan"),
            )

    @staticmethod
    def logging_outputs_can_be_summed() -> bool:
        return False
