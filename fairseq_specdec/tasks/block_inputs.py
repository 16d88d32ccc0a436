"""Block-masked training inputs for the Spec-Drafter (Xia et al. 2023, Eq. 5-7)."""
from typing import NamedTuple, Optional

import torch
from torch import Tensor


class BlockInputs(NamedTuple):
    prev_output_tokens: Tensor  #: B x T: ``y[:p]`` + k mask slots + right padding
    block_target: Tensor  #: B x T: ``y[p:p+k]`` in the block slots, pad elsewhere
    block_mask: Tensor  #: B x T bool: the k block slots (also those past EOS)
    prefix_lengths: Tensor  #: B: the prefix length p of each row


def sentence_draws(ids: Tensor) -> Tensor:
    """One draw in [0, 1) per sentence, a function of the sentence id alone
    (the Weyl sequence ``frac(id * golden ratio + 1/2)``, evenly spread over
    consecutive ids).  Validation cuts a sentence with it, so the cut is the
    same at every validation, in fairseq-train and fairseq-validate alike,
    whatever batch the sentence lands in."""
    return torch.remainder(ids.double() * 0.6180339887498949 + 0.5, 1.0)


def make_block_inputs(
    target: Tensor,
    pad: int,
    mask_idx: int,
    k: int,
    generator: Optional[torch.Generator] = None,
    draws: Optional[Tensor] = None,
) -> BlockInputs:
    """Cut each target row at a random prefix length and mask the next k slots.

    ``target`` is B x L, right-padded, each row ending with EOS and holding no
    BOS; L_i counts the EOS.  The prefix length p_i is uniform on
    {0, ..., L_i - 1}, so the prefix never contains the EOS and the block always
    starts on a real token.  Block slots past the EOS get a pad target (no
    loss); the EOS slot itself is a target.  Columns after the longest
    ``p + k`` are dropped.  ``draws`` (B values in [0, 1), e.g.
    :func:`sentence_draws`) fixes the cuts; otherwise they are drawn from
    ``generator``.
    """
    if k < 1:
        raise ValueError(f"block size must be >= 1, got {k}")
    bsz = target.size(0)
    lengths = target.ne(pad).sum(1)
    u = (draws if draws is not None else torch.rand(bsz, generator=generator)).to(target.device)
    prefix = lengths - (torch.floor(lengths.float() * u).long() + 1)
    prefix = prefix.clamp(min=0)
    width = int((prefix + k).max()) if bsz > 0 else k
    if target.size(1) < width:
        target = torch.cat([target, target.new_full((bsz, width - target.size(1)), pad)], 1)
    target = target[:, :width]
    cols = torch.arange(width, device=target.device).unsqueeze(0)
    start = prefix.unsqueeze(1)
    in_prefix = cols < start
    block = (cols >= start) & (cols < start + k)
    prev = torch.where(in_prefix, target, torch.full_like(target, pad))
    prev = prev.masked_fill(block, mask_idx)
    block_target = torch.where(block, target, torch.full_like(target, pad))
    return BlockInputs(prev, block_target, block, prefix)
