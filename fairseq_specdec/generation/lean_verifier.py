"""A lean verify pass: the verifier's decoder layers written out as plain
tensor operations over a preallocated, row-indexed KV cache.

:class:`~fairseq_specdec.generation.verifier.CachedVerifier`, its sibling
under :class:`~fairseq_specdec.generation.verify_pass.VerifyPass`, runs fairseq's own
layer modules, whose incremental path costs far more than its arithmetic on a
CPU: dictionary-held caches copied by ``torch.cat`` at every call, key padding
masks rebuilt, the encoder attention's head-averaged weights computed and
thrown away, three projections where one would do.  This module computes the
same function with the same weights: the same operations on the same values
(query scaled after its projection, float32 softmax, post- or pre-norm as the
layer says), minus the bookkeeping.  The query, key and value projections of
self-attention are one matrix product over the concatenated weights (each
output element is the same dot product).  Strict decoding stays identical to
``--beam 1``; the exactness tests run on both implementations.

Only the layer types of fairseq's Transformer are accepted
(:func:`lean_unsupported_reason` names what is not); the backend
(:mod:`~fairseq_specdec.generation.backend`) runs fairseq's own modules for
everything else.
"""
import math
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from fairseq.models import BaseFairseqModel, FairseqDecoder
from fairseq.models.transformer import TransformerDecoderBase, TransformerModelBase
from fairseq.modules.transformer_layer import TransformerDecoderLayerBase

from ..kernels import rowgemm
from ..utils.int8 import Int8Linear, int8_unavailable_reason
from ..utils.projection import ModuleParameters, cat_linears, shared_watch, transposed_linear
from ..utils.encoder_out import encoder_states
from .lean_encoder import LeanEncoder, lean_encoder_unsupported_reason
from .verify_pass import VerifyPass

#: how the lean pass computes its matrix products (the backend chooses;
#: ``torch-int8``: torch's quantized library, for the self-drafting copy only)
VERIFY_GEMMS = ("auto", "rowgemm", "torch", "torch-int8")

#: how the lean pass runs the verifier's encoder (the backend chooses)
ENCODER_IMPLS = ("auto", "lean", "fairseq")


def lean_unsupported_reason(decoder) -> Optional[str]:
    """Why the lean pass cannot compute this decoder's function (None: it can)."""
    if not isinstance(decoder, TransformerDecoderBase):
        return f"{type(decoder).__name__} is not a fairseq Transformer decoder"
    if getattr(decoder, "cross_self_attention", False):
        return "cross_self_attention"
    if getattr(decoder, "quant_noise", None) is not None:
        return "quant_noise_pq on the embeddings"
    for i, layer in enumerate(decoder.layers):
        if type(layer) is not TransformerDecoderLayerBase and type(layer).__name__ != "TransformerDecoderLayer":
            return f"layer {i} is a {type(layer).__name__}"
        if layer.encoder_attn is None:
            return f"layer {i} has no encoder attention"
        for name in ("c_attn", "attn_ln", "ffn_layernorm", "w_resid"):
            if getattr(layer, name, None) is not None:
                return f"layer {i} has {name} (NormFormer)"
        if getattr(layer, "cross_self_attention", False):
            return f"layer {i} uses cross_self_attention"
        for attn in (layer.self_attn, layer.encoder_attn):
            if attn.bias_k is not None or attn.add_zero_attn:
                return f"layer {i} has attention bias_k/add_zero_attn"
            if getattr(attn, "use_xformers", False):
                return f"layer {i} uses xformers attention"
    return None


def resolve_gemm(gemm: str, weight: Tensor) -> str:
    """The products for a verifier whose weights are like ``weight``:
    ``auto`` is ``rowgemm`` where the kernel runs (float32 weights on a CPU
    with AVX2/FMA, the extension built), else ``torch``."""
    if gemm not in VERIFY_GEMMS:
        raise ValueError(f"the lean pass's products must be one of {', '.join(VERIFY_GEMMS)}, got {gemm!r}")
    if gemm == "torch":
        return "torch"
    if gemm == "torch-int8":
        reason = int8_unavailable_reason()
        if reason is None and (weight.device.type != "cpu" or not weight.is_floating_point()):
            reason = f"the weights are {weight.dtype} on {weight.device} (it needs them on the CPU)"
        if reason is not None:
            raise ValueError(f"the int8 products cannot run: {reason}")
        return "torch-int8"
    if gemm == "rowgemm":
        reason = rowgemm.unavailable_reason()
        if reason is None and not rowgemm.applies_to(weight):
            reason = f"the verifier's weights are {weight.dtype} on {weight.device} (it needs float32 on the CPU)"
        if reason is not None:
            raise ValueError(f"the row-blocked products cannot run: {reason}")
        return "rowgemm"
    return "rowgemm" if rowgemm.applies_to(weight) else "torch"


class _TorchLinear:
    """``F.linear(x, weight, bias)`` (then ``activation``) as
    ``addmm(bias, x, weight.t().contiguous())``: the transpose made once."""

    def __init__(self, weight: Tensor, bias: Optional[Tensor], activation=None):
        self.weight_t = weight.detach().t().contiguous()
        self.bias = bias.detach() if bias is not None else None
        self.activation = activation

    def __call__(self, x: Tensor) -> Tensor:
        out = transposed_linear(x, self.weight_t, self.bias)
        return self.activation(out) if self.activation is not None else out


def make_linear(weight: Tensor, bias: Optional[Tensor], gemm: str, relu: bool = False, precision: str = "float32"):
    """A callable ``x -> F.linear(x, weight, bias)`` (then ReLU if ``relu``)
    for ``gemm`` (``rowgemm``, ``torch`` or ``torch-int8``), its weight laid
    out once; ``precision`` (``rowgemm`` only): the packed weights' element
    type (:data:`~fairseq_specdec.kernels.rowgemm.PRECISIONS`).  Anything but
    float32 products computes an approximation: for drafting copies only."""
    if gemm == "rowgemm":
        return rowgemm.PackedLinear(weight, bias, "relu" if relu else None, precision)
    if gemm == "torch-int8":
        return Int8Linear(weight, bias, relu)
    return _TorchLinear(weight, bias, F.relu if relu else None)


def _attend(q: Tensor, keys: Tensor, values: Tensor, bsz: int, heads: int, added=None, masked=None) -> Tensor:
    """Attention as fairseq's MultiheadAttention computes it, over
    ``(B * heads) x len x d`` matrices (keys/values may be strided views):
    scores, plus the additive mask ``added`` or with ``masked`` (True = no
    attention) set to -inf, float32 softmax, weighted values.  Returns
    B x m x (heads * d)."""
    m, d = q.size(1), q.size(2)
    scores = torch.bmm(q, keys.transpose(1, 2))
    length = scores.size(-1)
    if added is not None:
        scores = (scores.view(bsz, heads, m, length) + added).view(bsz * heads, m, length)
    if masked is not None:
        scores = scores.view(bsz, heads, m, length).masked_fill(masked, -math.inf).view(bsz * heads, m, length)
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).type_as(scores)
    return torch.bmm(probs, values).view(bsz, heads, m, d).transpose(1, 2).reshape(bsz, m, heads * d)


class _Layer:
    """One decoder layer's weights, gathered and laid out once for ``gemm``."""

    def __init__(self, layer, gemm: str, fuse: bool = True, precision: str = "float32"):
        sa, ca = layer.self_attn, layer.encoder_attn
        self.heads = sa.num_heads
        self.head_dim = sa.head_dim
        self.scaling = sa.scaling
        self.c_scaling = ca.scaling
        self.c_heads = ca.num_heads
        self.c_head_dim = ca.head_dim
        self.normalize_before = layer.normalize_before
        def linear(module, relu=False):
            return make_linear(module.weight, module.bias, gemm, relu, precision)

        self.qkv = make_linear(*cat_linears([sa.q_proj, sa.k_proj, sa.v_proj]), gemm, precision=precision)
        self.sa_out = linear(sa.out_proj)
        self.sa_ln = layer.self_attn_layer_norm
        self.ca_q = linear(ca.q_proj)
        self.ca_kv = make_linear(*cat_linears([ca.k_proj, ca.v_proj]), gemm, precision=precision)
        self.ca_out = linear(ca.out_proj)
        self.ca_ln = layer.encoder_attn_layer_norm
        # ReLU is fused into the first feed-forward product (the same values)
        relu = layer.activation_fn is F.relu
        self.fc1 = linear(layer.fc1, relu=relu)
        self.activation = None if relu else layer.activation_fn
        self.fc2 = linear(layer.fc2)
        self.final_ln = layer.final_layer_norm
        # the whole layer in one call of the extension, where its products are
        # rowgemm's and its feed-forward is ReLU (see rowgemm.FusedDecoderLayer)
        self.fused = None
        if fuse and gemm == "rowgemm" and fusable_layer(layer):
            self.fused = rowgemm.FusedDecoderLayer(layer, self.qkv, self.sa_out, self.ca_q, self.ca_out, self.fc1, self.fc2)


def hidden_columns(lengths: Tensor, last: Tensor, width: int, ancestors: Optional[Tensor] = None) -> Tensor:
    """B x m x width bool, True at the cache columns a pass's slot does not
    see: slot j of row r (at column ``last[r, j] = lengths[r] + j``) sees the
    row's prefix and the pass's slots up to itself, or, with a draft tree's
    ``ancestors`` (B x m x m), only its ancestors and itself among the
    pass's slots."""
    m = last.size(1)
    cols = torch.arange(width, device=lengths.device)
    hidden = cols.view(1, 1, -1) > last.unsqueeze(-1)
    if ancestors is not None:
        rel = cols.unsqueeze(0) - lengths.unsqueeze(1)  # B x width: the slot of a column, if in this pass
        in_pass = (rel >= 0) & (rel < m)
        seen = ancestors.gather(2, rel.clamp(0, m - 1).unsqueeze(1).expand(lengths.size(0), m, width))
        hidden = hidden | (in_pass.unsqueeze(1) & ~seen)
    return hidden


def fusable_layer(layer) -> bool:
    """Whether a (lean-supported) decoder layer runs as one call of the C++
    extension: ReLU feed-forward, affine layer norms with one epsilon, and an
    extension built with the fused layer."""
    norms = (layer.self_attn_layer_norm, layer.encoder_attn_layer_norm, layer.final_layer_norm)
    return rowgemm.fused_layer_available() and layer.activation_fn is F.relu and rowgemm.fusable_norms(norms)


def whole_pass_fits(model, adaptive_softmax: bool) -> bool:
    """Whether a verify pass of ``model``'s decoder computes nothing but what
    :class:`~fairseq_specdec.kernels.rowgemm.DecoderPass` does around its
    fused layers: inputs ``embed_scale * embed_tokens(tokens)`` plus a
    position row (no quantization noise, input projection, embedding layer
    norm or dropout at inference), at most an affine final ``LayerNorm``, no
    output projection of another width or adaptive softmax, and fairseq's
    own log-softmax (``get_normalized_probs`` not overridden)."""
    dec = model.decoder
    m, d = type(model), type(dec)
    fairseq_normalization = (
        m.get_normalized_probs in (BaseFairseqModel.get_normalized_probs, TransformerModelBase.get_normalized_probs)
        and m.get_normalized_probs_scriptable is BaseFairseqModel.get_normalized_probs_scriptable
        and d.get_normalized_probs is FairseqDecoder.get_normalized_probs
        and d.get_normalized_probs_scriptable is FairseqDecoder.get_normalized_probs_scriptable
        and not getattr(dec, "onnx_trace", False)
    )
    embed = dec.embed_tokens
    return (
        rowgemm.decoder_pass_available() and fairseq_normalization and not adaptive_softmax
        and type(embed) is torch.nn.Embedding and embed.max_norm is None
        and dec.quant_noise is None and dec.project_in_dim is None and dec.project_out_dim is None
        and dec.layernorm_embedding is None and not getattr(dec.dropout_module, "apply_during_inference", False)
        and (dec.layer_norm is None or rowgemm.fusable_norms([dec.layer_norm]))
    )


class LeanVerifier(VerifyPass):
    """The lean verify pass: same interface and output as its sibling
    :class:`~fairseq_specdec.generation.verifier.CachedVerifier`.

    **Cache layout** (the invariant of :class:`VerifyPass`): for active row r
    with ``n_r = state.lengths[r]``, positions ``[0, n_r)`` of every layer's
    ``keys[l][r]`` / ``values[l][r]`` (``B x heads x capacity x head_dim``) hold
    the self-attention keys/values of ``[BOS, y_1, ..., y_{n_r - 1}]`` (every
    accepted token except the newest); positions from ``n_r`` on are scratch.
    A pass writes its ``m`` inputs at ``[n_r, n_r + m)`` and each row attends
    only to positions up to its own input's, so :meth:`rollback` has nothing
    to undo: committing ``n_new`` tokens makes ``[n_r, n_r + n_new)`` (the
    previous newest token and the accepted drafts) part of the prefix and
    leaves the rejected entries as scratch.  The encoder attention's keys and
    values are computed once per batch; :meth:`reorder` keeps the rows that
    stay in both.
    """

    impl = "lean"

    def __init__(self, model, temperature: float = 1.0, gemm: str = "auto", encoder: str = "auto",
                 fused_layers: bool = True, precision: str = "float32", screening: bool = False):
        """``precision``: the element type of the packed weights of the
        ``rowgemm`` products (float32 for a verifier; ``int8`` for the
        int8 copy that drafts in ``--decoding self-draft``); ``screening``:
        :meth:`start` makes :attr:`screen` (the backend's ``screen`` part)."""
        super().__init__(model, temperature)
        reason = lean_unsupported_reason(self.decoder)
        if reason is not None:
            raise ValueError(f"the lean verify pass cannot run this verifier: {reason}")
        #: ``rowgemm`` or ``torch``: how the matrix products are computed
        self.gemm = resolve_gemm(gemm, next(self.decoder.parameters()))
        if precision != "float32" and self.gemm != "rowgemm":
            raise ValueError(f"{precision} weights need the rowgemm products, and the pass computes with {self.gemm}")
        self.precision = precision
        self.output: Optional[object] = None  # the vocabulary projection, laid out for gemm
        self.project_out: Optional[object] = None  # the decoder's project_out_dim, laid out for gemm
        self.layers = []
        #: the weights the layouts below are made from, watched once per batch
        #: for every pass laid out from them (this verifier's and its int8 copy's)
        self._weights = shared_watch(self.decoder, f"lean pass layers, projection {self._projection is not None}")
        self._built: Optional[int] = None  # the weights' generation the layouts were made from
        self._layer_parameters = ModuleParameters(self.decoder.layers)
        self.keys: List[Tensor] = []
        self.values: List[Tensor] = []
        self.cross: Optional[List[tuple]] = None
        self.enc_mask: Optional[Tensor] = None
        self._bands = {}  # m -> causal mask band (see _causal_mask)
        #: run the fused C++ layers where they apply (tests switch it off to
        #: compare with the layers' operations)
        self.use_fused = True
        #: each layer as one call of the extension where it applies
        self.fused_layers = fused_layers
        #: a draft tree's accepted cache entries moved by one call of the
        #: extension (where it is built), else by tensor indexing
        self.native_moves = fused_layers and rowgemm.move_cache_entries_available()
        #: the rows kept after some finished moved up by one call of the
        #: extension (where it is built), else by tensor copies
        self.native_compact = fused_layers and rowgemm.compact_rows_available()
        #: the whole pass of a batch in one call of the extension where every
        #: layer is fused and the rest fits (made with the layers, in start)
        self.whole_pass: Optional[rowgemm.DecoderPass] = None
        #: whether :meth:`start` makes :attr:`screen` (the backend's ``screen`` part)
        self.screening = screening
        #: the greedy pick of one row without the float32 vocabulary product
        #: (:class:`~fairseq_specdec.kernels.rowgemm.GreedyScreen`, made in
        #: :meth:`start` where ``screening`` and the whole pass is one call), or None
        self.screen: Optional[rowgemm.GreedyScreen] = None
        dec = self.decoder
        #: the encoder as fused C++ layers, else None: fairseq's modules
        self.lean_encoder: Optional[LeanEncoder] = None
        if encoder not in ENCODER_IMPLS:
            raise ValueError(f"the lean pass's encoder must be one of {', '.join(ENCODER_IMPLS)}, got {encoder!r}")
        if encoder != "fairseq":
            reason = lean_encoder_unsupported_reason(getattr(model, "encoder", None))
            if reason is None and self.gemm != "rowgemm":
                reason = "the verify pass computes with torch's products"
            if reason is None:
                self.lean_encoder = LeanEncoder(model.encoder)
            elif encoder == "lean":
                raise ValueError(f"the fused encoder cannot run: {reason}")

    def _laid_out_weights(self) -> list:
        """The weights the lean pass lays out (an optimizer's update through
        ``p.data`` changes no version counter: see
        :mod:`fairseq_specdec.utils.projection`)."""
        weights = self._layer_parameters()
        if self._projection is not None:
            proj = self.decoder.output_projection
            weights += [proj.weight] + ([proj.bias] if proj.bias is not None else [])
        if self.decoder.project_out_dim is not None:
            weights.append(self.decoder.project_out_dim.weight)
        return weights

    def start(self) -> None:
        """A new batch: empty caches; the layers' weights gathered again if
        any changed since the last batch (a model trained in between)."""
        super().start()
        generation = self._weights.look(self._laid_out_weights)
        if generation != self._built:
            self.layers = [_Layer(layer, self.gemm, self.fused_layers, self.precision) for layer in self.decoder.layers]
            if self._projection is not None:
                proj = self.decoder.output_projection
                self.output = make_linear(proj.weight, proj.bias, self.gemm, precision=self.precision)
            out_dim = self.decoder.project_out_dim
            # --decoder-output-dim: laid out as the other products, not a few-row F.linear per pass
            self.project_out = (make_linear(out_dim.weight, out_dim.bias, self.gemm, precision=self.precision)
                                if out_dim is not None else None)
            self.whole_pass = rowgemm.DecoderPass([lw.fused for lw in self.layers], self.output) if self.one_call else None
            self.screen = (rowgemm.GreedyScreen(self.output, self.decoder.output_projection.weight)
                           if self.screening and self.whole_pass is not None and self.precision == "float32" else None)
            self._built = generation
        self.keys, self.values = [], []
        self.cross = None
        self.enc_mask = None

    def timed_parts(self, k: int):
        """The profiler's parts (``VerifyPass.timed_parts``); where the whole
        pass runs as one call, the vocabulary projection runs inside it and
        is timed only in the passes that still call it (a ragged pass that
        projects some slots only, or one with the native layers off); where
        steps are screened, the ordinary pass need not be called (every step
        of a greedy decoding at batch 1 may be screened)."""
        for part in super().timed_parts(k):
            optional = (self.one_call and part[1] == "logits") or (self.screening and part[1] == "forward")
            yield (*part[:3], False) if optional else part
        if self.screening:
            yield self, "screened_steps", "verifier pass, screened greedy steps (one or more a call)", False
            yield self, "log_probs", "verifier vocabulary projection of screened steps (settled, or not certified)", False

    @property
    def one_call(self) -> bool:
        """Whether the whole pass runs as one call of the extension
        (:class:`~fairseq_specdec.kernels.rowgemm.DecoderPass`, made in
        :meth:`start`): every layer fused, the vocabulary projection laid out
        for the kernel, and nothing else in the pass (:func:`whole_pass_fits`)."""
        return self.fused and self._projection is not None and whole_pass_fits(self.model, self.adaptive_softmax)

    @property
    def fused(self) -> bool:
        """Whether every layer runs as one call of the C++ extension
        (:class:`~fairseq_specdec.kernels.rowgemm.FusedDecoderLayer`): rowgemm
        products and layers :func:`fusable_layer` accepts."""
        return self.gemm == "rowgemm" and self.fused_layers and all(fusable_layer(layer) for layer in self.decoder.layers)

    def describe(self) -> str:
        parts = [f"{self.gemm} products" + (f" ({self.precision} weights)" if self.precision != "float32" else "")]
        if self.fused:
            parts.append("fused C++ layers")
        if self.lean_encoder is not None:
            parts.append("fused C++ encoder")
        return f"{self.impl} ({', '.join(parts)})"

    def encode(self, net_input):
        """The encoder output: through :class:`~fairseq_specdec.generation.lean_encoder.LeanEncoder`
        where it runs (and ``use_fused``), else fairseq's encoder."""
        if self.lean_encoder is not None and self.use_fused and not self.model.encoder.training:
            return self.lean_encoder(net_input)
        return super().encode(net_input)

    def _project_out(self, x: Tensor) -> Tensor:
        if self.project_out is None:
            return super()._project_out(x)
        return self.project_out(x)

    def logits(self, x: Tensor) -> Tensor:
        if self.output is None:
            return super().logits(x)
        return self.output(x)

    def _causal_mask(self, x: Tensor, m: int, start: int) -> Tensor:
        """m x (start + m) additive mask of a uniform pass: row i sees columns
        ``<= start + i``.  A view into one tensor per m, made once per
        capacity: ``band[i, j] = -inf`` where ``j - C > i`` (``C``: the cache
        capacity), sliced at ``C - start``; the values are those of
        ``cat([zeros(m, start), triu(full(m, m, -inf), 1)], 1)``."""
        capacity = self.keys[0].size(2)
        band = self._bands.get(m)
        if band is None or band.size(1) != 2 * capacity or band.dtype != x.dtype or band.device != x.device:
            j = torch.arange(2 * capacity, device=x.device) - capacity
            i = torch.arange(m, device=x.device).unsqueeze(1)
            band = x.new_zeros(m, 2 * capacity).masked_fill_(j.unsqueeze(0) > i, -math.inf)
            self._bands[m] = band
        return band[:, capacity - start : capacity + m]

    # -- cache -------------------------------------------------------------
    def _prepare(self, state, width: int) -> None:
        """Encoder attention memory (once per batch) and cache capacity >= width."""
        if self.cross is None:
            enc, pad = encoder_states(state.encoder_out)  # S x B x C, B x S
            self.enc_mask = pad[:, None, None, :] if pad is not None and bool(pad.any()) else None
            self.cross = []
            for lw in self.layers:
                s, b = enc.size(0), enc.size(1)
                # keys and values laid out by one copy: 2 x B x heads x S x head_dim
                kv = lw.ca_kv(enc).view(s, b, 2, lw.c_heads, lw.c_head_dim).permute(2, 1, 3, 0, 4).contiguous()
                self.cross.append(tuple(kv[j].view(b * lw.c_heads, s, lw.c_head_dim) for j in range(2)))
        capacity = self.keys[0].size(2) if self.keys else 0
        if width > capacity:
            new_capacity = max(width, 2 * capacity, 32)
            for store in (self.keys, self.values):
                for i, lw in enumerate(self.layers):
                    t = self.cross[i][0].new_zeros(state.size, lw.heads, new_capacity, lw.head_dim)
                    if i < len(store):
                        t[:, :, :capacity] = store[i]
                        store[i] = t
                    else:
                        store.append(t)

    # -- the pass ----------------------------------------------------------
    def forward(self, tokens: Tensor, state, needed: Optional[Tensor] = None, tree=None) -> Tensor:
        bsz, m = tokens.shape
        lengths_host = state.lengths_host
        depths = None if tree is None else tree.depths
        width = max(lengths_host) + m
        self._prepare(state, width)
        if self.use_fused and all(lw.fused is not None for lw in self.layers):
            pad = self._enc_pad(bsz)
            ancestors = None if tree is None else tree.ancestors.contiguous()
            if self.whole_pass is not None and needed is None and not self.decoder.training:
                lprobs, self.last_features = self.whole_pass(tokens, depths, lengths_host, tree=ancestors,
                                                             **self._whole_pass_memory(pad))
                return lprobs
            x = self._embed(tokens, state.lengths, depths).float().contiguous()
            for i, lw in enumerate(self.layers):
                x = lw.fused(x, lengths_host, self.keys[i], self.values[i], self.cross[i], pad, ancestors)
            return self._finish(x, needed)
        x = self._embed(tokens, state.lengths, depths)
        start = lengths_host[0]
        uniform = tree is None and all(n == start for n in lengths_host)
        # which cache positions each new token sees: a row's own prefix and
        # its inputs up to itself (a tree: its ancestors and itself); an
        # additive mask shared by every layer
        mask = None
        if uniform:
            if m > 1:
                mask = self._causal_mask(x, m, start)
            rows = positions = None
        else:
            last = state.lengths.unsqueeze(1) + torch.arange(m, device=tokens.device)  # B x m: each slot's cache position
            hidden = hidden_columns(state.lengths, last, width, None if tree is None else tree.ancestors)
            mask = x.new_zeros(bsz, 1, m, width).masked_fill_(hidden.unsqueeze(1), -math.inf)
            rows = torch.arange(bsz, device=tokens.device).unsqueeze(1)
            positions = last

        for i, lw in enumerate(self.layers):
            x = self._layer(lw, i, x, mask, start, width, rows, positions)
        return self._finish(x, needed)

    def _enc_pad(self, bsz: int) -> Optional[Tensor]:
        """The encoder's padding as the fused layers read it (B x S), or None."""
        return self.enc_mask.reshape(bsz, -1).contiguous() if self.enc_mask is not None else None

    def _whole_pass_memory(self, enc_pad: Optional[Tensor]) -> dict:
        """What :attr:`whole_pass` reads besides the new tokens and their
        positions (keyword arguments of its calls): the embedding and
        position tables, the caches, the encoder's keys and values and
        padding, the final norm and the temperature."""
        dec = self.decoder
        return dict(embed_weight=dec.embed_tokens.weight, embed_scale=dec.embed_scale, positions=self.position_table,
                    keys=self.keys, values=self.values, cross=self.cross, enc_pad=enc_pad, final_norm=dec.layer_norm,
                    temperature=self.temperature)

    @property
    def screens(self) -> bool:
        """Whether :meth:`screened_steps` can run: the screen is made (see
        :attr:`screen`), the fused layers are in use and the decoder is not
        training."""
        return self.screen is not None and self.use_fused and not self.decoder.training

    def screened_steps(self, tokens: Tensor, state, n: int, pad: int, eos: int, min_len: int,
                       cum_bounds: List[float]) -> Tuple[Tensor, List[float], Tensor]:
        """Up to ``n`` greedy steps of the rows from their newest ``tokens``
        (B x 1), each the pass of :meth:`forward` over one token a row up to
        its final states and :attr:`screen`'s certified pick, in one call
        (:meth:`~fairseq_specdec.kernels.rowgemm.DecoderPass.screened_steps`,
        which says when the steps end; where :attr:`screens`).  Returns
        ``(picks B x s, the rows' running-score bounds after them, the final
        states B x t x C)``, ``t`` being ``s`` or ``s + 1`` (a last pass
        whose picks were not certified); :meth:`log_probs` of a pass's
        states gives bitwise its log-probs.  ``last_features`` holds the
        certified steps' states (all ``t`` where ``s`` is 0).  The caches
        hold every pass's entries, as after ``t`` calls of :meth:`forward`
        with the picks; those of an uncertified last pass lie past the rows'
        lengths (scratch, the cache invariant)."""
        lengths_host = state.lengths_host
        self._prepare(state, max(lengths_host) + n)
        picks, bounds, features = self.whole_pass.screened_steps(
            tokens, n, pad, eos, min_len, lengths_host, cum_bounds, self.screen,
            **self._whole_pass_memory(self._enc_pad(len(lengths_host))))
        steps = picks.size(1)
        self.last_features = features[:, :steps] if steps else features
        return picks, bounds, features

    def log_probs(self, features: Tensor) -> Tensor:
        """:meth:`forward`'s log-probs of final states (... x C) from
        :meth:`screened_steps`, of one pass or of several stacked."""
        return self.whole_pass.log_probs(features, self.temperature)

    @property
    def steps_in_one_call(self) -> bool:
        """Whether :meth:`draft_steps` can run: the whole pass is one call
        (:attr:`one_call`, laid out), the fused layers are in use and the
        decoder is not training (the backend decides whether it is used)."""
        return self.whole_pass is not None and self.use_fused and not self.decoder.training

    def draft_steps(self, first: Tensor, state, k: int, pad: int, eos: int, log_min_confidence: float):
        """A drafter's greedy steps over this pass in one call of the
        extension (where :attr:`steps_in_one_call`): from ``first`` (B x V, each
        row's log-probs of its newest token, at position
        ``state.lengths_host[r]``), up to ``k`` picks, each row's best type
        but ``pad``, fed back one token a step (the first at
        ``lengths_host[r] + 1``) while any row's picks are all at least
        ``log_min_confidence`` and not ``eos``: what ``k`` calls of
        :meth:`forward` with those picks and the same stopping compute.
        Returns ``(picks B x steps, their log-probs)``; the cache holds the
        fed picks' entries, as after those calls."""
        lengths_host = state.lengths_host
        self._prepare(state, max(lengths_host) + k)
        picks, scores, features = self.whole_pass.draft_steps(
            first, k, pad, eos, log_min_confidence, lengths_host,
            **self._whole_pass_memory(self._enc_pad(len(lengths_host))))
        if features is not None:
            self.last_features = features
        return picks, scores

    def _layer(self, lw: _Layer, i: int, x: Tensor, mask, start: int, width: int, rows, positions) -> Tensor:
        bsz, m, _ = x.shape

        def self_attention(x: Tensor) -> Tensor:
            h, hd = lw.heads, lw.head_dim
            qkv = lw.qkv(x).view(bsz, m, 3, h, hd)
            # bmm over (B * heads) matrices, as fairseq computes attention; the
            # cache is read through strided views (torch.matmul would copy them)
            q = (qkv[:, :, 0] * lw.scaling).transpose(1, 2).reshape(bsz * h, m, hd)
            keys, values = self.keys[i], self.values[i]
            if rows is None:
                keys[:, :, start : start + m] = qkv[:, :, 1].transpose(1, 2)
                values[:, :, start : start + m] = qkv[:, :, 2].transpose(1, 2)
            else:
                keys[rows, :, positions] = qkv[:, :, 1]
                values[rows, :, positions] = qkv[:, :, 2]
            capacity = keys.size(2)
            k3 = keys.view(bsz * h, capacity, hd)[:, :width]
            v3 = values.view(bsz * h, capacity, hd)[:, :width]
            return lw.sa_out(_attend(q, k3, v3, bsz, h, added=mask))

        def encoder_attention(x: Tensor) -> Tensor:
            h, hd = lw.c_heads, lw.c_head_dim
            q = lw.ca_q(x).view(bsz, m, h, hd) * lw.c_scaling
            q = q.transpose(1, 2).reshape(bsz * h, m, hd)
            keys, values = self.cross[i]  # B*heads x S x head_dim
            return lw.ca_out(_attend(q, keys, values, bsz, h, masked=self.enc_mask))

        def feed_forward(x: Tensor) -> Tensor:
            hidden = lw.fc1(x)
            return lw.fc2(hidden if lw.activation is None else lw.activation(hidden))

        for sublayer, norm in ((self_attention, lw.sa_ln), (encoder_attention, lw.ca_ln), (feed_forward, lw.final_ln)):
            if lw.normalize_before:
                x = x + sublayer(norm(x))
            else:
                x = norm(x + sublayer(x))
        return x

    def rollback(self, state, keep: Tensor, keep_host: List[int], path: Optional[Tensor] = None) -> None:
        """After a chain, nothing to undo: see the cache invariant.  After a
        tree, the accepted path's entries are moved to where a chain would
        have put them: slot ``path[r, j]``'s entry (at ``n_r + path[r, j]``)
        to ``n_r + j``, for ``j < keep[r]``; every other entry of the pass
        is scratch past the row's length."""
        if path is None:
            return
        most = max(keep_host) if keep_host else 0
        if most <= 1:
            return  # slot 0 is in place
        src = path[:, :most]
        moved = src.ne(torch.arange(most, device=src.device)).any(1)  # rows whose path is not a chain
        if not bool(moved.any()):
            return
        rows = moved.nonzero().squeeze(1)
        base = state.lengths.index_select(0, rows).unsqueeze(1)
        src = base + src.index_select(0, rows)
        dst = (base + torch.arange(most, device=src.device)).expand_as(src)
        caches = self.keys + self.values
        if self.native_moves and all(t.dtype == torch.float32 and t.device.type == "cpu" for t in caches):
            rowgemm.move_cache_entries(caches, rows, src, dst)
            return
        r = rows.unsqueeze(1)
        for t in caches:
            t[r, :, dst] = t[r, :, src]  # the right side is gathered first: overlaps are safe

    def reorder(self, state, new_order: Tensor, new_order_host: List[int]) -> None:
        """Keep the rows ``new_order_host`` (increasing, as
        :meth:`DecodingState.keep` gives them), in place: each cache's and
        each encoder key/value tensor's kept rows are moved up to its first
        rows (a cache's first ``max(state.lengths_host)`` positions, the
        entries the kept rows hold), and the tensors become views of those
        rows; the rest of each row is scratch (the cache invariant).  One call
        of the extension where it runs, else tensor copies."""
        if self.last_features is not None:
            self.last_features = self.last_features.index_select(0, new_order)
        n = len(new_order_host)
        width = max(state.lengths_host) if state.lengths_host else 0
        caches = self.keys + self.values
        # each layer's encoder keys and values seen as B x heads x S x d (whole rows move)
        pairs = [tuple(t.unflatten(0, (-1, lw.c_heads)) for t in pair)
                 for lw, pair in zip(self.layers, self.cross or [])]
        cross = [t for pair in pairs for t in pair]
        if self.native_compact and all(t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()
                                       for t in caches + cross):
            rowgemm.compact_rows(caches, new_order_host, width)
            if cross:
                rowgemm.compact_rows(cross, new_order_host, cross[0].size(2))
        else:
            for t in caches:
                t[:n, :, :width] = t[:, :, :width].index_select(0, new_order)  # gathered first: overlaps are safe
            for t in cross:
                t[:n] = t.index_select(0, new_order)
        for store in (self.keys, self.values):
            for i, t in enumerate(store):
                store[i] = t[:n]
        if self.cross is not None:
            self.cross = [tuple(t[:n].flatten(0, 1) for t in pair) for pair in pairs]
        if self.enc_mask is not None:
            self.enc_mask = self.enc_mask.index_select(0, new_order)
            if not bool(self.enc_mask.any()):
                self.enc_mask = None
