"""Row-blocked float32 products for few-row passes (the C++ extension
``fairseq_specdec.kernels._native``) and the packed weight layout they read.

A BLAS picks its kernel by shape, and on the CPUs measured here a product of
4 rows against a large weight costs 2-5x one of 1 row although reading the
weight dominates both (docs/verify-kernels.md).  The extension streams each
weight once for all rows: :class:`PackedLinear` packs an ``nn.Linear``'s
weight once into panels of 8 columns, and a call sweeps them with a register
block of accumulators in AVX2 registers sized by its rows: 4 rows x 24
columns up to 4 rows, 6 x 16 up to 6, 8 x 8 up to 8, so that a call of up
to 8 rows reads each weight once (or, with ``FAIRSEQ_SPECDEC_ISA=avx512``,
AVX-512 blocks of 4 x 64 and 8 x 48 columns giving bitwise the same
products: :mod:`fairseq_specdec.kernels`).

**Arithmetic.** Each output element is the in-order float32 sum over the
input features of ``x[i, k] * W[n, k]`` (fused multiply-adds from 0), plus
the bias, then the optional ReLU.  A row's result depends on neither the
number of rows in the call nor the other rows; it is not bitwise a BLAS
result, so a greedy choice whose top two log-probs tie within rounding can
differ from ``fairseq-generate --beam 1`` (measured in docs/verify-kernels.md).

**bfloat16 panels** (``precision="bfloat16"``, drafters only): the weight
is rounded once to the nearest bfloat16 (ties to even) and packed at half the
bytes; each element is widened exactly to float32 in the kernel, so the
contract above holds for the rounded weight.  A decoding loop streams its
weights from memory at every pass, so half the bytes is less time where the
pass waits for memory (docs/verify-kernels.md).  A drafter that rounds
differently drafts differently, which a strict verification only rejects;
the verifier's products always read float32 panels.

**int8 panels** (``precision="int8"``, the int8 copy of ``--decoding
self-draft`` only): each weight row quantized symmetrically to int8 with its
own scale (its largest magnitude / 127), a quarter of the bytes.  Each row
of ``x`` is quantized too, symmetrically to 16-bit integers at its own
scale (small enough that no sum of K products overflows 32 bits), the
products are summed exactly in integers (AVX2 ``vpmaddwd``: pairs of k per
instruction), and each sum is scaled back to float32 and biased
(``csrc/rowgemm.cpp`` gives the formula).  A row's result depends on that
row alone, and the same blocks run on every instruction set.

The extension is built at install (``setup.py``) and is optional:
:func:`unavailable_reason` says why it cannot be used, and callers fall back
to torch's products.
"""
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from . import _ext, applies_to, ensure_chosen, unavailable_reason

#: rows one sweep of a weight computes: a call of up to this many rows reads
#: each weight once; a larger call sweeps blocks with groups of 6 rows, the
#: further groups from the caches
ROW_BLOCK = 8

#: fused activations of :meth:`PackedLinear.__call__`
ACTIVATIONS = {None: 0, "relu": 1}

#: element types of packed weights (:class:`PackedLinear`'s ``precision``)
PRECISIONS = ("float32", "bfloat16", "int8")


def fitting_block(weight: Tensor, k: int, most: int) -> int:
    """A draft length for passes over ``weight``'s model: where the kernel
    computes them (:func:`applies_to`), at most ``most`` (itself at most
    ``ROW_BLOCK - 1``, so that a verify pass of k + 1 rows reads each weight
    once); elsewhere ``k``."""
    return max(1, min(k, most, ROW_BLOCK - 1)) if applies_to(weight) else k


def int8_available() -> bool:
    """Whether the kernel runs here with int8 panels (an older build may not)."""
    return unavailable_reason() is None and hasattr(_ext, "pack_i8")


def bfloat16_available() -> bool:
    """Whether the kernel runs here with bfloat16 panels (an older build may not)."""
    return unavailable_reason() is None and hasattr(_ext, "pack_bf16")


class PackedLinear:
    """``F.linear(x, weight, bias)`` (then ``activation``) through the
    row-blocked kernel, with ``weight`` packed once at construction, in
    float32, rounded to bfloat16 or quantized to int8 (``precision``, one of
    :data:`PRECISIONS`; the bias, the inputs and the sums stay float32).

    A snapshot: it does not see later changes to ``weight`` (its owner
    rebuilds it when the weights change).  Inputs of any leading shape;
    float32 on the CPU only.
    """

    def __init__(self, weight: Tensor, bias: Optional[Tensor] = None, activation: Optional[str] = None,
                 precision: str = "float32"):
        reason = unavailable_reason()
        if reason is not None:
            raise RuntimeError(reason)
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(a for a in ACTIVATIONS if a)} or None, got {activation!r}")
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
        if (precision == "bfloat16" and not bfloat16_available()) or (precision == "int8" and not int8_available()):
            raise RuntimeError(f"the C++ extension fairseq_specdec.kernels._native has no {precision} panels (an older "
                               "build); reinstall the plugin")
        ensure_chosen()  # the first packed weight: the products' instruction set and prefetch are settled first
        weight = weight.detach()
        self.out_features, self.in_features = weight.shape
        self.precision = precision
        pack = {"float32": _ext.pack, "bfloat16": _ext.pack_bf16, "int8": getattr(_ext, "pack_i8", None)}[precision]
        self.packed = pack(weight.float().contiguous())
        self.bias = _ext.pack_bias(bias.detach().float().contiguous()) if bias is not None else None
        self.activation = ACTIVATIONS[activation]

    def __call__(self, x: Tensor) -> Tensor:
        return _ext.linear(x, self.packed, self.out_features, self.bias, self.activation)


def packed_bias(linear: PackedLinear) -> Tensor:
    """The packed bias of ``linear`` (zeros where it has none)."""
    if linear.bias is not None:
        return linear.bias
    return _ext.pack_bias(torch.zeros(linear.out_features, dtype=torch.float32))


def packed_pairs(linears) -> list:
    """``(packed weight, packed bias)`` of each :class:`PackedLinear`: the
    form the extension's layers take them in (made once, not per call)."""
    return [(p.packed, packed_bias(p)) for p in linears]


def fused_layer_available() -> bool:
    """Whether the extension has the fused decoder layer (an older build may not)."""
    return unavailable_reason() is None and hasattr(_ext, "decoder_layer")


class FusedDecoderLayer:
    """One fairseq Transformer decoder layer (ReLU feed-forward) over a verify
    pass's new tokens in one call of the extension: the products through the
    packed weights, attention over the KV cache and the encoder output, the
    residuals and layer norms in C++ (``decoder_layer`` in
    ``csrc/rowgemm.cpp``).  The same function as the layer's operations:
    query scaled after its projection, float32 softmax (max subtracted),
    post- or pre-norm as the layer says; layer-norm statistics are summed in
    double, attention dot products in 8-lane float32 partial sums, so the
    last bits may differ from torch's operations (exactness is tested as for
    the products).

    ``qkv``, ``sa_out``, ``ca_q``, ``ca_out``, ``fc1`` (ReLU) and ``fc2`` are
    :class:`PackedLinear` of the layer's weights; the layer norms are read
    from ``layer``'s modules at construction (a snapshot, like the packs)."""

    def __init__(self, layer, qkv, sa_out, ca_q, ca_out, fc1, fc2):
        sa, ca = layer.self_attn, layer.encoder_attn
        self.weights = packed_pairs((qkv, sa_out, ca_q, ca_out, fc1, fc2))
        norms = (layer.self_attn_layer_norm, layer.encoder_attn_layer_norm, layer.final_layer_norm)
        self.norms = [(n.weight.detach().float().contiguous(), n.bias.detach().float().contiguous()) for n in norms]
        self.eps = float(norms[0].eps)
        self.scaling, self.c_scaling, self.c_heads = float(sa.scaling), float(ca.scaling), int(ca.num_heads)
        self.heads = int(sa.num_heads)
        self.normalize_before = bool(layer.normalize_before)

    def __call__(self, x: Tensor, starts: List[int], keys: Tensor, values: Tensor, cross: tuple,
                 enc_pad: Optional[Tensor], tree: Optional[Tensor] = None) -> Tensor:
        """``x``: B x m x C; ``starts`` (B host ints): where each row's new
        tokens go in ``keys``/``values`` (B x heads x capacity x d, written in
        place); ``cross``: the encoder attention's (B * heads) x S x d keys
        and values; ``enc_pad``: B x S, True at padding (or None); ``tree``:
        B x m x m bool, a draft tree's ancestors (input i attends to the
        inputs ``tree[b, i]`` marks, not to every input before it)."""
        return fused_layer(x, self.weights, self.norms, self.eps, self.heads, self.scaling, self.c_heads,
                           self.c_scaling, self.normalize_before, cross, enc_pad, starts, keys, values, tree)


def fused_layer(x: Tensor, weights, norms, eps: float, heads: int, scaling: float, c_heads: int, c_scaling: float,
                normalize_before: bool, cross: tuple, enc_pad: Optional[Tensor], starts: Optional[List[int]] = None,
                keys: Optional[Tensor] = None, values: Optional[Tensor] = None, tree: Optional[Tensor] = None) -> Tensor:
    """One call of the extension's ``decoder_layer``: ``weights`` are the
    :func:`packed_pairs` of six :class:`PackedLinear` (self-attention QKV and
    output, encoder-attention query and output, the two feed-forward
    products; the first feed-forward product is followed by ReLU), ``norms``
    three (weight, bias) pairs.  With ``keys``/``values`` (and ``starts``)
    self-attention is causal over that cache (written in place), or over a
    draft tree's ancestors with ``tree`` (B x m x m bool); without,
    bidirectional over the rows of ``x`` (B x m x C)."""
    (qkv_w, qkv_b), (so_w, so_b), (cq_w, cq_b), (co_w, co_b), (f1_w, f1_b), (f2_w, f2_b) = weights
    (sl_w, sl_b), (cl_w, cl_b), (fl_w, fl_b) = norms
    return _ext.decoder_layer(
        x.contiguous(), [] if starts is None else starts, qkv_w, qkv_b, so_w, so_b, sl_w, sl_b, keys, values,
        heads, scaling, cq_w, cq_b, co_w, co_b, cl_w, cl_b, cross[0], cross[1], enc_pad, c_heads, c_scaling,
        f1_w, f1_b, f2_w, f2_b, fl_w, fl_b, normalize_before, eps, tree,
    )


def decoder_pass_available() -> bool:
    """Whether the extension has the whole verify pass in one call (an older build may not)."""
    return unavailable_reason() is None and hasattr(_ext, "decoder_pass")


class DecoderPass:
    """A whole verify pass of a decoder in one call of the extension
    (``decoder_pass`` in ``csrc/rowgemm.cpp``): the new tokens' inputs (the
    scaled embedding plus each slot's position row), every
    :class:`FusedDecoderLayer`, the optional final layer norm, the
    vocabulary projection ``output`` (a :class:`PackedLinear`), the
    temperature and the float32 log-softmax.  Each step is the operation the
    Python pass runs (the inputs as one float32 multiplication by the scale
    and one addition of the position row each, read straight from float32
    tables; the same ATen operations for the norm and the log-softmax; the
    same native layers and products), so its output is bitwise that pass's;
    what it saves is the Python and the small tensor operations between the
    steps.

    The layers' packed weights and norms are those of ``layers`` (a
    snapshot, rebuilt with them); the embedding, position table and final
    norm are passed at each call, read live from the decoder."""

    def __init__(self, layers, output: "PackedLinear"):
        self.tensors, self.scalars = [], []
        for layer in layers:
            (qkv, sa_out, ca_q, ca_out, fc1, fc2), (sa_ln, ca_ln, final_ln) = layer.weights, layer.norms
            self.tensors += [*qkv, *sa_out, *sa_ln, *ca_q, *ca_out, *ca_ln, *fc1, *fc2, *final_ln]
            self.scalars += [float(layer.heads), layer.scaling, float(layer.c_heads), layer.c_scaling,
                             float(layer.normalize_before), layer.eps]
        self.output = output

    def __call__(self, tokens: Tensor, depths: Optional[Tensor], starts: List[int], embed_weight: Tensor,
                 embed_scale: float, positions: Optional[Tensor], keys, values, cross, enc_pad: Optional[Tensor],
                 tree: Optional[Tensor], final_norm=None, temperature: float = 1.0, project: bool = True):
        """``(log-probs B x m x V, features B x m x C)`` of the new
        ``tokens`` (B x m; ``depths``: a draft tree's B x m node depths, or
        None for a chain), row r's first at position ``starts[r]`` (host
        ints: the rows' lengths); ``keys``/``values``: each layer's cache (written in place),
        ``cross``: each layer's encoder keys and values; ``final_norm``: the
        decoder's final ``LayerNorm`` or None; ``temperature`` divides the
        logits (unless 1).  ``project`` False: the pass stops at the
        features (the log-probs are None); :meth:`log_probs` of them gives
        bitwise what it would have returned."""
        (norm_w, norm_b, eps), out = self._norm(final_norm), self.output
        lprobs, features = _ext.decoder_pass(
            tokens, depths, starts, embed_weight, float(embed_scale), positions, self.tensors, self.scalars,
            keys, values, [c[0] for c in cross], [c[1] for c in cross], enc_pad, tree, norm_w, norm_b, eps,
            out.packed, out.out_features, out.bias, float(temperature), bool(project),
        )
        return (lprobs if project else None), features

    def log_probs(self, features: Tensor, temperature: float = 1.0) -> Tensor:
        """The pass's log-probs of its ``features`` (... x C): the vocabulary
        projection, the temperature and the float32 log-softmax, the same
        operations as inside the pass (a row's values depend on that row
        alone, so rows of several passes projected together are bitwise
        those of their passes)."""
        out = self.output
        return _ext.pass_log_probs(features, out.packed, out.out_features, out.bias, float(temperature))

    def draft_steps(self, first: Tensor, k: int, pad: int, eos: int, log_min_confidence: float, starts: List[int],
                    embed_weight: Tensor, embed_scale: float, positions: Optional[Tensor], keys, values, cross,
                    enc_pad: Optional[Tensor], final_norm=None, temperature: float = 1.0):
        """A self-drafter's greedy steps in one call (``decoder_steps`` in
        ``csrc/rowgemm.cpp``): from ``first`` (B x V, each row's log-probs
        of its newest token), up to ``k`` picks per row, each the best type
        but ``pad`` (``max`` with ``pad`` at -inf), fed back as the next
        token at ``starts[r] + step + 1`` through this pass (the other
        arguments are :meth:`__call__`'s) while any row is sure (every pick
        so far at least ``log_min_confidence`` and not ``eos``).  Returns
        ``(picks B x steps, their log-probs, the last pass's features or
        None)``; the caches' capacity must hold ``max(starts) + k``.  Only
        where :func:`decoder_steps_available` (the backend's ``steps`` part)."""
        (norm_w, norm_b, eps), out = self._norm(final_norm), self.output
        picks, scores, features = _ext.decoder_steps(
            first, int(k), int(pad), int(eos), float(log_min_confidence), starts, embed_weight, float(embed_scale),
            positions, self.tensors, self.scalars, keys, values, [c[0] for c in cross], [c[1] for c in cross],
            enc_pad, norm_w, norm_b, eps, out.packed, out.out_features, out.bias, float(temperature),
        )
        return picks, scores, features  # None: no pass ran (an undefined tensor)

    def screened_steps(self, tokens: Tensor, n: int, pad: int, eos: int, min_len: int, starts: List[int],
                       cum_bounds: List[float], screen: "GreedyScreen", embed_weight: Tensor, embed_scale: float,
                       positions: Optional[Tensor], keys, values, cross, enc_pad: Optional[Tensor], final_norm=None,
                       temperature: float = 1.0) -> Tuple[Tensor, List[float], Tensor]:
        """The verifier's greedy steps in one call (``screened_greedy_steps`` in
        ``csrc/rowgemm.cpp``): from ``tokens`` (B x 1, each row's newest, at
        ``starts[r]``), each step this pass up to its final states, then
        ``screen``'s certified pick of every row (EOS banned while the row's
        length is below ``min_len``), fed back as the row's next token; at
        most ``n`` steps, ending after a step in which any row picked
        ``eos`` or at one in which any pick is not certified.  Returns
        ``(picks B x s, the rows' running-score bounds grown by the picks'
        log-prob bounds, the final states B x t x C of every pass)``:
        ``t = s``, or ``s + 1`` where the last pass's picks were not
        certified.  The other arguments are :meth:`__call__`'s; the caches'
        capacity must hold ``max(starts) + n``."""
        (norm_w, norm_b, eps), out = self._norm(final_norm), self.output
        if screen.output is not out:
            raise ValueError("the screen certifies the picks of another projection than this pass's")
        return _ext.screened_greedy_steps(
            tokens, int(n), int(pad), int(eos), int(min_len), starts, [float(c) for c in cum_bounds], embed_weight,
            float(embed_scale), positions, self.tensors, self.scalars, keys, values, [c[0] for c in cross],
            [c[1] for c in cross], enc_pad, norm_w, norm_b, eps, out.packed, out.out_features, out.bias,
            screen.int8, screen.scales, screen.l1, float(temperature),
        )

    @staticmethod
    def _norm(final_norm):
        """The final norm's (weight, bias, eps), or (None, None, 1e-5)."""
        if final_norm is None:
            return None, None, 1e-5
        return final_norm.weight, final_norm.bias, float(final_norm.eps)


def screen_available() -> bool:
    """Whether the extension has the screened greedy pick and its steps in
    one call (an older build may not)."""
    return (unavailable_reason() is None and hasattr(_ext, "screen_greedy")
            and hasattr(_ext, "screened_greedy_steps") and int8_available())


class GreedyScreen:
    """Each row's greedy pick over a vocabulary projection without reading
    its float32 weights (``screen_greedy`` in ``csrc/rowgemm.cpp``, which
    gives the bound): the projection's int8 copy estimates every column
    with a bound on its error against the float32 panels of ``output``, and
    only the columns whose bound reaches the best estimate's are summed
    exactly, from those panels.  The pick is *certified*: the column whose
    float32 value (the one the pass computes) is the largest by a margin
    that no float32 rounding of the log-softmax, or of a running score up to
    the row's ``cum_bound`` in magnitude, can close; else :meth:`__call__`
    returns -1 for the row.  The int8 estimates of all rows come from one
    product; a row's pick depends on that row alone.

    ``output``: the pass's float32 :class:`PackedLinear`; ``weight``: its
    float32 weight (V x C), read once here for the int8 copy (its scales
    read back from it) and its rows' absolute sums.  A snapshot, like
    :class:`PackedLinear`."""

    def __init__(self, output: "PackedLinear", weight: Tensor):
        if output.precision != "float32":
            raise ValueError(f"the screen certifies picks of float32 panels, not {output.precision} ones")
        weight = weight.detach().float().contiguous()
        self.output = output
        self.int8 = _ext.pack_i8(weight)
        self.scales = _ext.pack_i8_scales(self.int8, output.out_features)
        # each row's absolute sum, rounded up (the bound must not be too small)
        self.l1 = weight.double().abs().sum(1).mul(1 + 2 ** -20).float()

    def __call__(self, features: Tensor, pad: int, temperature: float, cum_bounds: List[float],
                 bans: Optional[List[int]] = None) -> Tuple[List[int], List[float]]:
        """``(columns, lp_bounds)`` for the rows of final ``features``
        (B x C): each row's certified greedy column (never ``pad``, nor the
        row's ``bans`` entry: a column the length rules forbid, or -1), or
        -1, and a bound on the magnitude of its log-prob (what the running
        score may grow by); ``cum_bounds``: a bound on each row's running
        score."""
        out = self.output
        if bans is None:
            bans = [-1] * features.size(0)
        return _ext.screen_greedy(features, self.int8, out.packed, out.out_features, out.bias, self.scales, self.l1,
                                  int(pad), float(temperature), [float(c) for c in cum_bounds], bans)


def decoder_steps_available() -> bool:
    """Whether the extension has the self-drafter's steps in one call (an older build may not)."""
    return unavailable_reason() is None and hasattr(_ext, "decoder_steps")


def fused_encoder_layer_available() -> bool:
    """Whether the extension has the fused encoder layer (an older build may not)."""
    return unavailable_reason() is None and hasattr(_ext, "encoder_layer")


def fusable_norms(norms) -> bool:
    """Whether the fused layers compute these layer norms: affine torch
    LayerNorms sharing one epsilon."""
    return all(isinstance(n, torch.nn.LayerNorm) and n.elementwise_affine for n in norms) and len({n.eps for n in norms}) == 1


class FusedEncoderLayer:
    """One fairseq Transformer encoder layer (ReLU feed-forward) in one call
    of the extension (``encoder_layer`` in ``csrc/rowgemm.cpp``): the
    self-attention's query, key and value products (``qkv``, one
    :class:`PackedLinear` of the three weights), its output product
    (``out``), the two feed-forward products (``fc1`` with ReLU, ``fc2``),
    residuals and layer norms, attention over each sentence's own rows with
    its padding masked.  The same function as the layer's operations,
    rounded as :class:`FusedDecoderLayer` is; the layer norms are read at
    construction (a snapshot, like the packs: its owner rebuilds it when
    the weights change)."""

    def __init__(self, layer, qkv: PackedLinear, out: PackedLinear, fc1: PackedLinear, fc2: PackedLinear):
        linears = (qkv, out, fc1, fc2)
        self.weights = packed_pairs(linears)
        self.norms = [(n.weight.detach().float().contiguous(), n.bias.detach().float().contiguous())
                      for n in (layer.self_attn_layer_norm, layer.final_layer_norm)]
        self.eps = float(layer.self_attn_layer_norm.eps)
        self.heads, self.scaling = int(layer.self_attn.num_heads), float(layer.self_attn.scaling)
        self.normalize_before = bool(layer.normalize_before)

    def __call__(self, x: Tensor, padding: Optional[Tensor]) -> Tensor:
        """``x``: B x S x C float32; ``padding``: B x S bool, True at padding
        (None: none).  Returns B x S x C."""
        (qkv_w, qkv_b), (out_w, out_b), (fc1_w, fc1_b), (fc2_w, fc2_b) = self.weights
        (sl_w, sl_b), (fl_w, fl_b) = self.norms
        pad = padding.contiguous() if padding is not None else None
        return _ext.encoder_layer(x.contiguous(), pad, qkv_w, qkv_b, out_w, out_b, sl_w, sl_b, self.heads,
                                  self.scaling, fc1_w, fc1_b, fc2_w, fc2_b, fl_w, fl_b, self.normalize_before, self.eps)


def block_input_available() -> bool:
    """Whether the extension has the drafting pass's input rows (an older build may not)."""
    return unavailable_reason() is None and hasattr(_ext, "block_input")


def block_input(states: Tensor, tokens: Tensor, embed: Tensor, scale: float, fuse: PackedLinear, base: Tensor,
                cuts: Tensor, offsets: Tensor, k: int) -> Tensor:
    """The input rows of a ``specdec_vsd`` drafting pass in one call of the
    extension (``block_input`` in ``csrc/rowgemm.cpp``): for each of the N
    rows, the context row ``fuse([states; scale * embed[tokens]])``, then its
    ``k`` slot rows ``base[n, min(cuts + j, P - 1)] + offsets[j] + context``.
    ``states``: N x C, ``tokens`` and ``cuts``: N, ``base``: N x P x C.
    Returns N x (1 + k) x C."""
    return _ext.block_input(states.contiguous(), tokens.contiguous(), embed.contiguous(), float(scale), fuse.packed,
                            packed_bias(fuse), base.contiguous(), cuts.contiguous(), offsets.contiguous(), int(k))


def strict_step_unavailable_reason() -> Optional[str]:
    """Why the extension's strict step cannot run here (None: it can).  It is
    plain C++ with no AVX2 code: it needs the extension, built with it."""
    if _ext is None:
        return unavailable_reason()
    if not hasattr(_ext, "strict_step"):
        return "the C++ extension fairseq_specdec.kernels._native was built without strict_step; reinstall the plugin"
    return None


def strict_step(lprobs: Tensor, drafts: Tensor, cum: Tensor, lengths: Tensor, drafted: List[int], pad: int, eos: int,
                min_len: int, max_len: int, parents: Optional[Tensor] = None, relaxed: Optional[tuple] = None
                ) -> Optional[tuple]:
    """The tail of a strict speculative iteration in one call of the extension
    (``strict_step`` in ``csrc/step.cpp``, whose comment states the contract):
    from the verify pass's B x (k + 1) x V float32 log-probs (read, not
    changed), the B x k drafts, the running scores ``cum`` and the output
    lengths of the rows, to ``(new_tokens, new_lprobs, n_new, cum, counts)``
    as the tensor acceptance step (``generation.accept_step.TensorStep``) computes them
    under strict acceptance and no ``--unkpen``.  ``drafted``: each row's
    count of drafted tokens (empty: the accepted counts stand in).  None where
    a slot the rows read has a tie for its largest log-prob plus running
    score: the tensor operations then decide it as fairseq's top-2 does.

    ``parents`` (B x (k + 1) int64): the drafts are a draft tree's nodes
    (:class:`~fairseq_specdec.generation.tree.DraftTree`), not a chain; the
    result then has a sixth member, B x (k + 1) ``path``: the slot each
    appended token was picked at (the accepted root path, then the verifier's
    slot).  ``relaxed`` ``(beta, tau)``: top-beta verification with the
    verifier's scores (:class:`~fairseq_specdec.generation.acceptance.TopBetaAcceptance`)
    instead of strict; a rank decided by equal values is reported as a tie."""
    beta, tau = relaxed if relaxed is not None else (1, 0.0)
    *out, path, tie = _ext.strict_step(lprobs.contiguous(), drafts.contiguous(), cum.contiguous(),
                                       lengths.contiguous(), drafted, int(pad), int(eos), int(min_len), int(max_len),
                                       None if parents is None else parents.contiguous(), relaxed is not None,
                                       int(beta), float(tau))
    if tie:
        return None
    return tuple(out) if parents is None else tuple(out) + (path,)


def draft_pick_available() -> bool:
    """Whether the extension has the drafter's one-call pick (an older build may not)."""
    return unavailable_reason() is None and hasattr(_ext, "draft_pick")


def draft_pick(states: Tensor, base: PackedLinear, extra_t: Optional[Tensor], bias: Tensor):
    """A drafter's best type and its log-probability for each row of
    ``states`` (... x C), in one call of the extension (``draft_pick`` in
    ``csrc/rowgemm.cpp``): the logits ``states @ [W_base; extra_t.T].T + bias``
    (``base``: the packed :class:`PackedLinear` of the first types, no bias;
    ``extra_t``: C x E further columns, or None), then the first largest
    logit and ``-log(sum(exp(logits - max)))``: what ``torch.log_softmax(
    logits).max(-1)`` gives, up to float rounding (a vectorized exp).
    Returns (index into the N types, log-prob), each of shape ``...``."""
    lead = states.shape[:-1]
    best, lprob = _ext.draft_pick(states.reshape(-1, states.size(-1)).contiguous(), base.packed, base.out_features,
                                  extra_t, bias.contiguous())
    return best.view(lead), lprob.view(lead)


def move_cache_entries_available() -> bool:
    """Whether the extension has :func:`move_cache_entries` (an older build may not)."""
    return _ext is not None and hasattr(_ext, "move_cache_entries")


def move_cache_entries(caches: List[Tensor], rows: Tensor, src: Tensor, dst: Tensor) -> None:
    """In every cache (B x heads x capacity x d float32, contiguous, on the
    CPU), row ``rows[i]``'s entry at position ``src[i, j]`` moved to
    ``dst[i, j]``, in order of j (``move_cache_entries`` in
    ``csrc/step.cpp``; a draft tree's accepted path, whose slots only grow)."""
    _ext.move_cache_entries(caches, rows.contiguous(), src.contiguous(), dst.contiguous())


def append_rows_available() -> bool:
    """Whether the extension has :func:`append_rows` (an older build may not)."""
    return _ext is not None and hasattr(_ext, "append_rows")


def append_rows(tokens: Tensor, pos_scores: Tensor, lengths: Tensor, new_tokens: Tensor, new_lprobs: Tensor,
                n_new: Tensor) -> Tuple[Tensor, Tensor]:
    """The decoding loop's commit in one call (``append_rows`` in
    ``csrc/step.cpp``): row r's ``new_tokens`` and ``new_lprobs`` (B x n,
    every column, the scratch after ``n_new[r]`` included) written into
    ``tokens`` and ``pos_scores`` (B x W, contiguous CPU; changed in place)
    at columns ``lengths[r] + 1 ..``.  Returns ``(lengths + n_new, newest)``:
    new tensors, ``newest[r, 0]`` the row's last appended token."""
    return _ext.append_rows(tokens, pos_scores, lengths, new_tokens, new_lprobs, n_new)


def compact_rows_available() -> bool:
    """Whether the extension has :func:`compact_rows` (an older build may not)."""
    return _ext is not None and hasattr(_ext, "compact_rows")


def compact_rows(tensors: List[Tensor], order: List[int], width: int) -> None:
    """In every tensor (B x H x cap x d float32, contiguous, on the CPU), row
    ``order[i]``'s first ``width`` positions copied to row i, in place
    (``compact_rows`` in ``csrc/step.cpp``); ``order`` strictly increasing.
    The first ``len(order)`` rows are then the kept rows; the rest, and the
    positions from ``width`` on, are left as they were."""
    _ext.compact_rows(tensors, order, width)
