"""Drafters: what proposes the next k tokens in the speculative loop.

A drafter is a small object with three calls; a new drafting method is a new
class here, never a new loop:

* ``start(net_input, bsz)``: once per batch (encode the source once);
* ``draft(tokens, lengths, k) -> (draft_tokens B x k, draft_log_probs B x k or None)``
  where ``tokens`` is the B x T buffer of accepted target tokens (BOS at
  index 0, row r's accepted tokens at ``1 .. lengths[r]``);
* ``reorder(new_order)``: keep only these rows (finished rows leave).
"""
from typing import Optional, Tuple

import torch
from torch import Tensor


class Drafter:
    """Interface; see the module docstring."""

    #: largest prefix + block length the drafter accepts (None: unlimited)
    max_positions: Optional[int] = None

    def start(self, net_input, bsz: int) -> None:
        raise NotImplementedError

    def draft(self, tokens: Tensor, lengths: Tensor, k: int) -> Tuple[Tensor, Optional[Tensor]]:
        raise NotImplementedError

    def reorder(self, new_order: Tensor) -> None:
        raise NotImplementedError


class NATBlockDrafter(Drafter):
    """The Spec-Drafter (``specdec_nat``): one non-autoregressive pass over
    ``prefix + k masks``.  Its encoder runs once per batch."""

    def __init__(self, model):
        if not getattr(model, "is_block_drafter", False):
            raise ValueError(f"the drafter must be a specdec_nat model, got {type(model).__name__}")
        self.model = model
        self.max_positions = model.decoder.max_positions()
        self.encoder_out = None

    def start(self, net_input, bsz: int) -> None:
        self.encoder_out = self.model.encoder.forward_torchscript(net_input)

    def draft(self, tokens, lengths, k):
        return self.model.draft(self.encoder_out, tokens[:, 1:], lengths, k)

    def reorder(self, new_order):
        self.encoder_out = self.model.encoder.reorder_encoder_out(self.encoder_out, new_order)
