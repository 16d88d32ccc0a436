"""The Spec-Drafter (``specdec_nat``): one non-autoregressive pass over the prefix and k masks."""
import torch

from ...models.protocol import SourceReadingDrafterModel
from .base import Drafter, TimedParts


def same_encoder(drafter, verifier) -> bool:
    """Whether ``drafter``'s encoder computes exactly ``verifier``'s: same
    module types and settings, equal tensors (the drafter's extra mask row of
    the embedding aside)."""
    d_enc, v_enc = drafter.encoder, verifier.encoder
    if type(d_enc) is not type(v_enc) or getattr(d_enc, "embed_scale", None) != getattr(v_enc, "embed_scale", None):
        return False
    d_state, v_state = d_enc.state_dict(), v_enc.state_dict()
    if set(d_state) != set(v_state):
        return False
    for name, v_tensor in v_state.items():
        d_tensor = d_state[name]
        if name == "embed_tokens.weight" and d_tensor.size(0) == v_tensor.size(0) + 1:
            d_tensor = d_tensor[:-1]
        if d_tensor.shape != v_tensor.shape or not torch.equal(d_tensor, v_tensor):
            return False
    return all(
        type(a) is type(b) and getattr(a, "normalize_before", None) == getattr(b, "normalize_before", None)
        for a, b in zip(d_enc.layers, v_enc.layers)
    )


class NATBlockDrafter(Drafter, TimedParts):
    """The Spec-Drafter (``specdec_nat``): one non-autoregressive pass over
    ``prefix + k masks``.  Its encoder runs once per batch, and not at all when
    it is identical to the verifier's (trained with ``--freeze-encoder``):
    the state's encoder output (the verifier's) is reused.  The drafter's
    log-probs are computed only ``with_scores`` (acceptance by drafter score
    or a confidence cut); otherwise a draft is the argmax of the logits.

    A row whose source is longer than the drafter can read
    (``model.max_source_length()``: trained with smaller
    ``--max-source-positions``/``--max-target-positions`` than the verifier)
    is never drafted: the loop takes greedy steps for it, as it does once a
    prefix outgrows the drafter (``max_positions``).  Its own encoder reads
    such a row as an empty source (EOS only), so that no position table is
    indexed past its end."""

    def __init__(self, model, verifier_model=None, with_scores: bool = True):
        if not isinstance(model, SourceReadingDrafterModel):
            raise ValueError(f"the drafter must be a specdec_nat model, got {type(model).__name__}")
        self.model = model
        self.max_positions = model.decoder.max_positions()
        self.max_source_length = model.max_source_length()
        self.encoder_out = None  # own encoder's output; None: read the state's
        self.shares_encoder = verifier_model is not None and same_encoder(model, verifier_model)
        self.with_scores = with_scores
        self.fits = None  # B bool: rows whose source the drafter reads (None: all)

    def describe(self) -> str:
        shared = ", sharing the verifier's encoder" if self.shares_encoder else ""
        return f"specdec_nat drafter{shared}"

    def timed_parts(self, k: int):
        yield self, "start_batch", "drafter start of batch (own encoder, or memory from the verifier's)"
        yield self, "propose", f"drafter pass (prefix + up to {k} masks)", False
        yield self.model.decoder, "output_layer", f"of which: drafter vocabulary projection (up to {k} rows)", False

    def start_batch(self, state) -> None:
        net_input = state.net_input
        src_tokens = net_input["src_tokens"]
        pad = self.model.encoder.padding_idx
        fits = src_tokens.ne(pad).long().sum(dim=1) <= self.max_source_length
        self.fits = None if bool(fits.all()) else fits
        if self.shares_encoder:
            self.encoder_out = None
            return
        if self.fits is not None:
            # rows too long for the drafter: an EOS-only source (never drafted)
            src_tokens = src_tokens.masked_fill(~fits.unsqueeze(1), pad)
            src_tokens[~fits, -1] = self.model.encoder.dictionary.eos()
            net_input = {**net_input, "src_tokens": src_tokens, "src_lengths": src_tokens.ne(pad).long().sum(dim=1)}
        self.encoder_out = self.model.encoder.forward_torchscript(net_input)

    def propose(self, state, k):
        encoder_out = self.encoder_out if self.encoder_out is not None else state.encoder_out
        return self.model.draft(encoder_out, state.tokens[:, 1:], state.lengths, k, self.with_scores, active=self.fits)

    def reorder(self, order, order_host):
        if self.encoder_out is not None:
            self.encoder_out = self.model.encoder.reorder_encoder_out(self.encoder_out, order)
        if self.fits is not None:
            self.fits = self.fits.index_select(0, order)
