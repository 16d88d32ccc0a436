"""What every verify pass shares: the interface the loop calls and the steps
before and after the decoder layers.

A verify pass runs the verifier's decoder over ``m`` new tokens per row
against its own KV cache.  Two implementations are siblings under
:class:`VerifyPass`: :class:`~fairseq_specdec.generation.verifier.CachedVerifier`
runs fairseq's own layer modules (the reference backend), and
:class:`~fairseq_specdec.generation.lean_verifier.LeanVerifier` the same
layers as plain tensor operations over a preallocated cache (the fast
path; :mod:`~fairseq_specdec.generation.backend` chooses).
Both take their inputs from :meth:`VerifyPass._embed` and end in
:meth:`VerifyPass._finish`, so embeddings, positions, the final norm, the
output projection, the temperature and the log-softmax are one code.
"""
import math
from abc import ABC, abstractmethod
from typing import Dict, List, Optional

import torch
from torch import Tensor

from fairseq.models.transformer import TransformerDecoderBase
from fairseq.modules import LearnedPositionalEmbedding

from ..utils.projection import TransposedProjection


def position_table(decoder, device=None) -> Optional[Tensor]:
    """The decoder's positional embeddings as a table (None: it has none):
    row t is what fairseq adds to the target token at index t (BOS at 0),
    for every index the decoder accepts (``t < decoder.max_positions()``).

    The rows come from the decoder's own ``embed_positions`` module over a
    sequence of that many tokens, so every table fairseq builds is read as
    fairseq reads it: a learned table (``--decoder-learned-pos``) has
    ``max_positions + padding_idx + 1`` rows, the first ``padding_idx + 1``
    of them never used; a sinusoidal one is computed for the length asked.
    A pass clamps an index past the last row to it: those slots lie past the
    length limit, where decoding ends with EOS whatever they hold.

    A learned table's rows are a view of its weight (what fairseq's module
    reads, ``weight[padding_idx + 1 + t]``), so that a model trained after
    the pass was built is read with its new positions."""
    embed = decoder.embed_positions
    if embed is None:
        return None
    n = decoder.max_positions()
    if type(embed) is LearnedPositionalEmbedding and embed.padding_idx is not None:
        first = embed.padding_idx + 1
        return embed.weight.detach()[first:first + n]
    pad = getattr(embed, "padding_idx", None)
    pad = decoder.padding_idx if pad is None else pad
    if device is None:
        device = next(decoder.parameters()).device
    dummy = torch.full((1, n), pad + 1, dtype=torch.long, device=device)  # no padding: positions 0 .. n-1
    with torch.no_grad():
        return embed(dummy)[0]


class VerifyPass(ABC):
    """The verify pass's interface and shared steps.

    The loop calls, per batch: :meth:`encode` and :meth:`start`; per
    iteration: :meth:`forward` (log-probs of ``m`` new tokens per row; their
    keys and values are appended to the cache), then :meth:`rollback` (keep
    the accepted ones); and :meth:`reorder` when rows leave
    (from :meth:`~fairseq_specdec.generation.state.DecodingState.keep`).

    **Cache invariant** (between two :meth:`forward` calls, every
    implementation): for every active row r of the
    :class:`~fairseq_specdec.generation.state.DecodingState` with
    ``n_r = state.lengths[r]`` accepted target tokens after the BOS, the
    self-attention cache of every layer holds the keys and values of exactly
    ``[BOS, y_1, ..., y_{n_r - 1}]``: every accepted token except the newest,
    which is the first input of the next pass.  The encoder-decoder
    attention memory is computed once per sentence.  The cache lengths are the
    state's lengths: a pass keeps no copy.

    ``last_features`` (B x m x C) holds the final decoder states of the last
    pass (what drafters that read the verifier's states use)."""

    #: this implementation's name in the log
    impl = "?"

    def __init__(self, model, temperature: float = 1.0):
        decoder = model.decoder
        if not isinstance(decoder, TransformerDecoderBase):
            raise ValueError(
                f"draft-verify needs a fairseq Transformer verifier, got decoder "
                f"{type(decoder).__name__}"
            )
        self.model = model
        self.decoder = decoder
        self.temperature = temperature
        self.max_positions = decoder.max_positions()
        param = next(model.parameters())
        # row t = positional embedding of the token at index t (BOS at 0)
        self.position_table: Optional[Tensor] = position_table(decoder, param.device)
        self.last_features: Optional[Tensor] = None
        # fairseq's output_layer is output_projection(x) without adaptive softmax;
        # with it (--adaptive-softmax-cutoff), the features, which fairseq's
        # get_normalized_probs hands to the adaptive softmax's get_log_prob
        self.adaptive_softmax = getattr(decoder, "adaptive_softmax", None) is not None
        projection = getattr(decoder, "output_projection", None)
        self.vocab_size = len(decoder.dictionary)
        self._projection = TransposedProjection() if isinstance(projection, torch.nn.Linear) else None

    def describe(self) -> str:
        """The verify pass in a few words, for the log."""
        return self.impl

    def timed_parts(self, k: int):
        """``(object, method name, label[, required])`` of the calls the
        profiler times for this verify pass (see ``TimedParts.timed_parts``)."""
        yield self, "encode", "verifier encoder"
        yield self, "forward", f"verifier pass (up to {k + 1} tokens)"
        yield self, "logits", f"of which: verifier vocabulary projection (up to {k + 1} rows)"
        yield self, "rollback", "KV-cache rollback", False
        yield self, "reorder", "row removal", False

    def encode(self, net_input) -> Dict[str, List[Tensor]]:
        return self.model.encoder.forward_torchscript(net_input)

    def reorder_encoder_out(self, encoder_out, order: Tensor):
        """The encoder output of the rows in ``order`` (the state calls it
        when rows leave, before :meth:`reorder`)."""
        return self.model.encoder.reorder_encoder_out(encoder_out, order)

    def start(self) -> None:
        """A new batch: empty caches (subclasses empty theirs, then call this)."""
        self.last_features = None

    def _embed(self, tokens: Tensor, lengths: Tensor, depths: Optional[Tensor] = None) -> Tensor:
        """B x m x C inputs of the new tokens, row r's first at index
        ``lengths[r]`` (a device tensor: its row's absolute position), slot
        j at ``lengths[r] + j``, or at ``lengths[r] + depths[r, j]`` for a
        draft tree (B x m depths)."""
        dec = self.decoder
        x = dec.embed_scale * dec.embed_tokens(tokens)
        if dec.quant_noise is not None:
            x = dec.quant_noise(x)
        if dec.project_in_dim is not None:
            x = dec.project_in_dim(x)
        if self.position_table is not None:
            offsets = torch.arange(tokens.size(1), device=tokens.device) if depths is None else depths
            index = lengths.unsqueeze(1) + offsets
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
        if dec.project_out_dim is not None:  # --decoder-output-dim unlike the embedding's
            x = self._project_out(x)
        self.last_features = x  # B x m x C: what drafters reading the verifier's states use
        bsz, m = x.shape[:2]
        if needed is None:
            return self._log_probs(x)
        lprobs = x.new_full((bsz, m, self.vocab_size), -math.inf, dtype=torch.float)
        lprobs[needed] = self._log_probs(x[needed]).float()
        return lprobs

    def _project_out(self, x: Tensor) -> Tensor:
        """The decoder's ``project_out_dim`` (a linear without bias)."""
        return self.decoder.project_out_dim(x)

    def logits(self, x: Tensor) -> Tensor:
        """The verifier's output layer."""
        dec = self.decoder
        if self._projection is not None:
            proj = dec.output_projection
            return self._projection(x, proj.weight, proj.bias)
        return dec.output_layer(x)

    def _log_probs(self, x: Tensor) -> Tensor:
        """The verifier's output layer, temperature and log-softmax (as
        fairseq's SequenceGenerator: with an adaptive softmax, the
        temperature divides the features it reads)."""
        logits = self.logits(x)
        if self.temperature != 1.0:
            logits = logits.div_(self.temperature)
        if self.adaptive_softmax and logits.dim() == 2:  # its get_log_prob takes B x T x C
            return self.model.get_normalized_probs((logits.unsqueeze(0), None), log_probs=True)[0]
        return self.model.get_normalized_probs((logits, None), log_probs=True)

    # -- the interface each implementation provides --------------------------
    @abstractmethod
    def forward(self, tokens: Tensor, state, needed: Optional[Tensor] = None, tree=None) -> Tensor:
        """Log-probs (B x m x V, float) after each of the ``m`` new tokens.

        ``tokens[r, 0]`` is row r's newest accepted token and sits at index
        ``state.lengths[r]``; the others follow it.  Their keys/values are
        appended to the cache; call :meth:`rollback` next.  ``needed`` (B x m
        bool, optional): the slots whose log-probs the caller reads; the
        others are not projected onto the vocabulary and read -inf (in a
        ragged batch, the slots after a row's shorter draft).  ``tree`` (a
        :class:`~fairseq_specdec.generation.tree.DraftTree` of ``m`` slots):
        the new tokens are a draft tree, not a chain: slot j sits at index
        ``state.lengths[r] + tree.depths[r, j]`` and attends to the committed
        prefix and to its ancestors and itself among the new tokens
        (``tree.ancestors``), so its log-probs are those of the verifier
        decoding its root path alone.
        """

    @abstractmethod
    def rollback(self, state, keep: Tensor, keep_host: List[int], path: Optional[Tensor] = None) -> None:
        """Keep ``keep[r]`` of the entries the last :meth:`forward` appended
        for row r (the inputs that are now accepted, newest excluded): the
        first ``keep[r]`` of a chain, or, after a tree pass, those of slots
        ``path[r, :keep[r]]`` (the accepted root path, B x (1 + D) slot
        indices, ``path[r, 0] = 0``), placed as a chain would have placed
        them.  Called before ``state.commit`` of the same tokens, so that
        afterwards the cache invariant holds for the committed state: the
        cache holds the accepted path's entries and no other branch's."""

    @abstractmethod
    def reorder(self, state, new_order: Tensor, new_order_host: List[int]) -> None:
        """Keep only the rows in ``new_order`` (``state`` already holds the
        kept rows: lengths and encoder output)."""
