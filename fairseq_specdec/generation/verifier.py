"""The verify pass through fairseq's own layer modules (``--specdec-backend reference``).

fairseq's ``TransformerDecoder`` only decodes one new token per call when an
incremental state is given.  :class:`CachedVerifier` runs the same modules
(same weights, same embedding/position/layer code) over ``m`` new tokens at
once: embeddings at each row's absolute positions, a causal mask among the new
tokens, every cached key visible.  fairseq itself is not modified.
"""
import math
from typing import Dict, List, Optional

import torch
from torch import Tensor

from ..utils.encoder_out import encoder_states
from .verify_pass import VerifyPass


class CachedVerifier(VerifyPass):
    """The verify pass through fairseq's own layer modules, over their
    incremental state, which can be rolled back.

    Cache layout (see :class:`VerifyPass` for the invariant): entries are
    left-aligned, ``[0, n_r)`` of the time axis is valid, the rest (up to the
    longest row) is marked in ``prev_key_padding_mask``; the
    encoder-decoder attention caches are never trimmed.
    """

    impl = "fairseq"

    def __init__(self, model, temperature: float = 1.0):
        super().__init__(model, temperature)
        self.self_attns = [layer.self_attn for layer in self.decoder.layers]
        self.incremental_state: Dict[str, Dict[str, Optional[Tensor]]] = {}
        self._last_m = 0

    def start(self) -> None:
        self.incremental_state = {}
        super().start()

    def forward(self, tokens: Tensor, state, needed: Optional[Tensor] = None) -> Tensor:
        dec = self.decoder
        m = tokens.size(1)
        x = self._embed(tokens, state.lengths).transpose(0, 1)

        cached = self._cache_width()
        attn_mask = None
        if m > 1:
            attn_mask = torch.cat(
                [
                    x.new_zeros(m, cached),
                    torch.triu(x.new_full((m, m), -math.inf), 1),
                ],
                dim=1,
            )
        enc, enc_pad = encoder_states(state.encoder_out)
        for layer in dec.layers:
            x, _, _ = layer(
                x, enc, enc_pad, self.incremental_state, self_attn_mask=attn_mask
            )
        self._last_m = m
        return self._finish(x.transpose(0, 1), needed)

    def _cache_width(self) -> int:
        buf = self.self_attns[0]._get_input_buffer(self.incremental_state)
        key = buf.get("prev_key") if buf else None
        return 0 if key is None else key.size(2)

    def rollback(self, state, keep: Tensor, keep_host: List[int]) -> None:
        m = self._last_m
        width = self._cache_width()
        old = width - m
        new_lengths = state.lengths + keep
        lengths_host = [c + k for c, k in zip(state.lengths_host, keep_host)]
        target = max(lengths_host) if lengths_host else 0
        # Fast path (always at batch 1): every row's valid entries are [0, target)
        if all(c == old for c in state.lengths_host) and all(k == keep_host[0] for k in keep_host):
            index = None
        else:
            device = keep.device
            cols = torch.arange(width, device=device).unsqueeze(0)
            valid = (cols < state.lengths.unsqueeze(1)) | (
                (cols >= old) & (cols < old + keep.unsqueeze(1))
            )
            # stable sort puts each row's valid entries first, in order
            index = torch.sort((~valid).to(torch.uint8), dim=1, stable=True).indices[:, :target]
        pad_mask = None
        if any(n != target for n in lengths_host):
            pad_mask = torch.arange(target, device=keep.device).unsqueeze(0) >= new_lengths.unsqueeze(1)
        for attn in self.self_attns:
            buf = attn._get_input_buffer(self.incremental_state)
            for name in ("prev_key", "prev_value"):
                t = buf[name]
                if index is None:
                    buf[name] = t[:, :, :target]
                else:
                    g = index[:, None, :, None].expand(-1, t.size(1), -1, t.size(3))
                    buf[name] = t.gather(2, g)
            buf["prev_key_padding_mask"] = pad_mask
            attn._set_input_buffer(self.incremental_state, buf)

    def reorder(self, state, new_order: Tensor, new_order_host: List[int]) -> None:
        self.decoder.reorder_incremental_state_scripting(self.incremental_state, new_order)
        if self.last_features is not None:
            self.last_features = self.last_features.index_select(0, new_order)
        # drop padding columns no remaining row needs
        target = max(state.lengths_host) if state.lengths_host else 0
        if target < self._cache_width():
            for attn in self.self_attns:
                buf = attn._get_input_buffer(self.incremental_state)
                buf["prev_key"] = buf["prev_key"][:, :, :target]
                buf["prev_value"] = buf["prev_value"][:, :, :target]
                if buf.get("prev_key_padding_mask") is not None:
                    mask = buf["prev_key_padding_mask"][:, :target]
                    buf["prev_key_padding_mask"] = mask if bool(mask.any()) else None
                attn._set_input_buffer(self.incremental_state, buf)
