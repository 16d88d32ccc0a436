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

    def forward(self, tokens: Tensor, state, needed: Optional[Tensor] = None, tree=None) -> Tensor:
        dec = self.decoder
        bsz, m = tokens.shape
        x = self._embed(tokens, state.lengths, None if tree is None else tree.depths).transpose(0, 1)

        cached = self._cache_width()
        enc, enc_pad = encoder_states(state.encoder_out)
        self._last_m = m
        if tree is not None:
            return self._finish(self._tree_layers(x, enc, enc_pad, tree, cached), needed)
        attn_mask = None
        if m > 1:
            attn_mask = torch.cat(
                [
                    x.new_zeros(m, cached),
                    torch.triu(x.new_full((m, m), -math.inf), 1),
                ],
                dim=1,
            )
        for layer in dec.layers:
            x, _, _ = layer(
                x, enc, enc_pad, self.incremental_state, self_attn_mask=attn_mask
            )
        return self._finish(x.transpose(0, 1), needed)

    def _tree_layers(self, x: Tensor, enc: Tensor, enc_pad: Optional[Tensor], tree, cached: int) -> Tensor:
        """The layers over a draft tree's slots (``x``: m x B x C): each slot
        sees the cache and its ancestors (``tree.ancestors``) through the
        layers' ``self_attn_mask``.  fairseq's attention takes one m x
        (cache + m) mask for every row, so rows whose trees differ run one at
        a time, each over its own slice of the incremental state, which is
        put together again afterwards.  Returns B x m x C."""
        m, bsz = x.size(0), x.size(1)
        ancestors = tree.ancestors

        def mask_of(seen: Tensor) -> Tensor:
            return torch.cat([x.new_zeros(m, cached), x.new_zeros(m, m).masked_fill(~seen, -math.inf)], dim=1)

        if bsz == 1 or bool((ancestors == ancestors[:1]).all()):
            attn_mask = mask_of(ancestors[0])
            for layer in self.decoder.layers:
                x, _, _ = layer(x, enc, enc_pad, self.incremental_state, self_attn_mask=attn_mask)
            return x.transpose(0, 1)
        outputs, states = [], []
        for b in range(bsz):
            sub = {key: {name: None if t is None else t[b : b + 1] for name, t in buf.items()}
                   for key, buf in self.incremental_state.items()}
            xb, attn_mask = x[:, b : b + 1], mask_of(ancestors[b])
            pad_b = enc_pad[b : b + 1] if enc_pad is not None else None
            for layer in self.decoder.layers:
                xb, _, _ = layer(xb, enc[:, b : b + 1], pad_b, sub, self_attn_mask=attn_mask)
            outputs.append(xb)
            states.append(sub)
        merged = {}
        for key in states[0]:
            merged[key] = {}
            for name in states[0][key]:
                parts = [st[key][name] for st in states]
                if all(t is None for t in parts):
                    merged[key][name] = None
                    continue
                like = next(t for t in parts if t is not None)
                merged[key][name] = torch.cat([t if t is not None else torch.zeros_like(like) for t in parts], dim=0)
        self.incremental_state = merged
        return torch.cat(outputs, dim=1).transpose(0, 1)

    def _cache_width(self) -> int:
        buf = self.self_attns[0]._get_input_buffer(self.incremental_state)
        key = buf.get("prev_key") if buf else None
        return 0 if key is None else key.size(2)

    def rollback(self, state, keep: Tensor, keep_host: List[int], path: Optional[Tensor] = None) -> None:
        m = self._last_m
        width = self._cache_width()
        old = width - m
        new_lengths = state.lengths + keep
        lengths_host = [c + k for c, k in zip(state.lengths_host, keep_host)]
        target = max(lengths_host) if lengths_host else 0
        if path is not None:
            # each row's prefix, then the entries of its accepted path's slots
            cols = torch.arange(target, device=keep.device).unsqueeze(0)
            j = (cols - state.lengths.unsqueeze(1)).clamp(0, path.size(1) - 1)
            index = torch.where(cols < state.lengths.unsqueeze(1), cols, old + path.gather(1, j))
            index = index.clamp(max=width - 1)  # past a row's length: padding, masked below
        # Fast path (always at batch 1 after a chain): every row's valid entries are [0, target)
        elif all(c == old for c in state.lengths_host) and all(k == keep_host[0] for k in keep_host):
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
