"""The verifier: a stock fairseq Transformer run over several new tokens per
row against its own incremental KV cache.

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

from fairseq.models.transformer import TransformerDecoderBase

from ..models.projection import TransposedProjection


class CachedVerifier:
    """Parallel verification with a KV cache that can be rolled back.

    **Cache invariant** (between two :meth:`forward` calls): for every active
    row r of the :class:`~fairseq_specdec.generation.state.DecodingState`
    with ``n_r = state.lengths[r]`` accepted target tokens after the BOS, the
    self-attention cache of every layer holds keys/values of exactly
    ``[BOS, y_1, ..., y_{n_r - 1}]``, i.e. every accepted token except the
    newest one, which is the first input of the next pass.  Entries are
    left-aligned: ``[0, n_r)`` of the time axis is valid, the rest (up to the
    longest row) is marked in ``prev_key_padding_mask``.  The encoder-decoder
    attention caches are computed once per sentence and never trimmed;
    leaving rows are removed from both by :meth:`reorder`, which the state's
    :meth:`~fairseq_specdec.generation.state.DecodingState.keep` calls.  The
    cache lengths are the state's lengths: the verifier keeps no copy.
    """

    #: what ``--verify-impl`` calls this implementation
    impl = "fairseq"

    def __init__(self, model, temperature: float = 1.0):
        decoder = model.decoder
        if not isinstance(decoder, TransformerDecoderBase):
            raise ValueError(
                f"draft-verify needs a fairseq Transformer verifier, got decoder "
                f"{type(decoder).__name__}"
            )
        if getattr(decoder, "adaptive_softmax", None) is not None:
            raise ValueError("draft-verify does not support verifiers with adaptive softmax")
        self.model = model
        self.decoder = decoder
        self.temperature = temperature
        self.max_positions = decoder.max_positions()
        param = next(model.parameters())
        # row t = positional embedding of the token at index t (BOS at 0)
        self.position_table: Optional[Tensor] = None
        if decoder.embed_positions is not None:
            n = min(self.max_positions, 4096) + 1
            dummy = torch.full((1, n), decoder.padding_idx + 1, dtype=torch.long, device=param.device)
            self.position_table = decoder.embed_positions(dummy)[0]
        self.self_attns = [layer.self_attn for layer in decoder.layers]
        self.incremental_state: Dict[str, Dict[str, Optional[Tensor]]] = {}
        self._last_m = 0
        self.last_features: Optional[Tensor] = None
        # fairseq's output_layer is output_projection(x) without adaptive softmax
        projection = getattr(decoder, "output_projection", None)
        self.vocab_size = len(decoder.dictionary)
        self._projection = TransposedProjection() if isinstance(projection, torch.nn.Linear) else None

    def describe(self) -> str:
        """The verify pass in a few words, for the log."""
        return self.impl

    def encode(self, net_input) -> Dict[str, List[Tensor]]:
        return self.model.encoder.forward_torchscript(net_input)

    def start(self) -> None:
        """A new batch: empty caches."""
        self.incremental_state = {}
        self.last_features = None

    def forward(self, tokens: Tensor, state, needed: Optional[Tensor] = None) -> Tensor:
        """Log-probs (B x m x V, float) after each of the ``m`` new tokens.

        ``tokens[r, 0]`` is row r's newest accepted token and sits at index
        ``state.lengths[r]``; the others follow it.  Their keys/values are
        appended to the cache; call :meth:`rollback` next.  ``needed`` (B x m
        bool, optional): the slots whose log-probs the caller reads; the
        others are not projected onto the vocabulary and read -inf (in a
        ragged batch, the slots after a row's shorter draft).
        """
        dec = self.decoder
        m = tokens.size(1)
        x = self._embed(tokens, state).transpose(0, 1)

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
        encoder_out = state.encoder_out
        enc = encoder_out["encoder_out"][0] if len(encoder_out["encoder_out"]) > 0 else None
        enc_pad = (
            encoder_out["encoder_padding_mask"][0]
            if len(encoder_out["encoder_padding_mask"]) > 0
            else None
        )
        for layer in dec.layers:
            x, _, _ = layer(
                x, enc, enc_pad, self.incremental_state, self_attn_mask=attn_mask
            )
        return self._finish(x.transpose(0, 1), needed)

    def _embed(self, tokens: Tensor, state) -> Tensor:
        """B x m x C inputs of the new tokens, each at its row's absolute position."""
        dec = self.decoder
        x = dec.embed_scale * dec.embed_tokens(tokens)
        if dec.quant_noise is not None:
            x = dec.quant_noise(x)
        if dec.project_in_dim is not None:
            x = dec.project_in_dim(x)
        if self.position_table is not None:
            index = state.lengths.unsqueeze(1) + torch.arange(tokens.size(1), device=tokens.device)
            index = index.clamp_(max=self.position_table.size(0) - 1)
            x = x + self.position_table[index]
        if dec.layernorm_embedding is not None:
            x = dec.layernorm_embedding(x)
        return dec.dropout_module(x)

    def _finish(self, x: Tensor, needed: Optional[Tensor]) -> Tensor:
        """From the last layer's output (B x m x C) to log-probs: final norm and
        projection; the features are kept for the drafters (``last_features``)."""
        dec = self.decoder
        if dec.layer_norm is not None:
            x = dec.layer_norm(x)
        if dec.project_out_dim is not None:
            x = dec.project_out_dim(x)
        self.last_features = x  # B x m x C: what drafters reading the verifier's states use
        bsz, m = x.shape[:2]
        self._last_m = m
        if needed is None:
            return self._log_probs(x)
        lprobs = x.new_full((bsz, m, self.vocab_size), -math.inf, dtype=torch.float)
        lprobs[needed] = self._log_probs(x[needed]).float()
        return lprobs

    def _logits(self, x: Tensor) -> Tensor:
        """The verifier's output layer."""
        dec = self.decoder
        if self._projection is not None:
            proj = dec.output_projection
            return self._projection(x, proj.weight, proj.bias)
        return dec.output_layer(x)

    def _log_probs(self, x: Tensor) -> Tensor:
        """The verifier's output layer, temperature and log-softmax."""
        logits = self._logits(x)
        if self.temperature != 1.0:
            logits = logits.div_(self.temperature)
        return self.model.get_normalized_probs((logits, None), log_probs=True)

    def _cache_width(self) -> int:
        buf = self.self_attns[0]._get_input_buffer(self.incremental_state)
        key = buf.get("prev_key") if buf else None
        return 0 if key is None else key.size(2)

    def rollback(self, state, keep: Tensor, keep_host: List[int]) -> None:
        """Keep the first ``keep[r]`` of the entries the last :meth:`forward`
        appended for row r (the inputs that are now accepted, newest excluded).
        Called before ``state.commit`` of the same tokens, so that afterwards
        the cache invariant holds for the committed state."""
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
        """Keep only the rows in ``new_order`` in the caches and in
        ``state.encoder_out`` (``state`` already holds the kept rows' lengths)."""
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
        state.encoder_out = self.model.encoder.reorder_encoder_out(state.encoder_out, new_order)


VERIFY_IMPLS = ("auto", "lean", "fairseq")


def build_verifier(model, temperature: float = 1.0, impl: str = "auto", gemm: str = "auto") -> CachedVerifier:
    """The verify pass: ``lean`` (:class:`~fairseq_specdec.generation.lean_verifier.LeanVerifier`,
    its products computed as ``gemm`` says: ``--verify-gemm``), ``fairseq``
    (:class:`CachedVerifier`, fairseq's own layer modules), or ``auto``: lean
    where it supports the verifier's layers, else fairseq's."""
    from .lean_verifier import VERIFY_GEMMS, LeanVerifier, lean_unsupported_reason

    if impl not in VERIFY_IMPLS:
        raise ValueError(f"--verify-impl must be one of {', '.join(VERIFY_IMPLS)}, got {impl!r}")
    if gemm not in VERIFY_GEMMS:
        raise ValueError(f"--verify-gemm must be one of {', '.join(VERIFY_GEMMS)}, got {gemm!r}")
    if impl == "fairseq":
        if gemm == "rowgemm":
            raise ValueError("--verify-gemm rowgemm needs the lean verify pass; drop --verify-impl fairseq")
        return CachedVerifier(model, temperature)
    reason = lean_unsupported_reason(getattr(model, "decoder", None)) if impl == "auto" else None
    if reason is not None:
        if gemm == "rowgemm":
            raise ValueError(f"--verify-gemm rowgemm needs the lean verify pass, which cannot run this verifier: {reason}")
        return CachedVerifier(model, temperature)
    return LeanVerifier(model, temperature, gemm)
