"""``specdec_vsd``: a Spec-Drafter that reads its verifier's states.

Still a non-autoregressive block drafter in the papers' sense (k slots
filled in one pass, bidirectional among themselves, a GLAT soft copy of the
source in each slot, trained with ``glat_block``), but it computes nothing
the verifier has already computed (future work in the SpecDec ICLR 2023 submission, Table 18):

* **no encoder**: it reads the verifier's encoder output (its cross-attention
  keys/values are projected once per sentence);
* **no prefix recomputation**: the accepted prefix reaches it as the
  verifier's final decoder state at the newest accepted token, which the
  verification pass computed anyway (the state that predicted that token),
  fused with that token's embedding, as EAGLE does; a drafting pass computes
  only ``1 + k`` rows, so its cost does not grow with the prefix;
* **no vocabulary of its own**: its output projection is the verifier's
  (a frozen copy, checked equal to the verifier's at decoding time), and at
  decoding time it projects onto a shortlist (the most frequent types plus
  the batch's source tokens), since a missed rare token only costs a
  rejected draft, never a wrong output.

Training runs the frozen verifier once, teacher-forced, over each sentence of
the verifier's own greedy-distilled data, and supervises a block at several
cut points of the sentence from that one pass
(:func:`make_state_block_inputs`).  For a cut after ``c`` accepted tokens the
context is ``(h[c-1], y[c])``, where ``h[c-1]`` is the verifier state that
predicted the newest token ``y[c]`` (a learned start state and the BOS for
``c = 0``), and the block targets are ``y[c+1 .. c+k]`` (pad past the EOS).
At decoding the loop hands the same state over in its feedback
(:class:`~fairseq_specdec.generation.state.Feedback`).
"""
import logging
import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from fairseq.dataclass import FairseqDataclass
from fairseq.models import BaseFairseqModel, register_model
from fairseq.modules import LayerNorm

from ..utils.projection import DerivedWeight, cached_linear
from .protocol import VerifierStateDrafterModel
from ..utils.dictionary import check_same_dictionary, dictionary_fingerprint, mask_index
from ..utils.encoder_out import source_padding

logger = logging.getLogger(__name__)


@dataclass
class SpecDecVSDConfig(FairseqDataclass):
    embed_dim: int = field(default=256, metadata={"help": "the verifier's decoder output dimension"})
    attention_heads: int = field(default=4, metadata={"help": "attention heads of the block layers"})
    ffn_embed_dim: int = field(default=1024, metadata={"help": "FFN dimension of the block layers"})
    layers: int = field(default=1, metadata={"help": "block layers (self-attention over the context and the block, cross-attention to the verifier's encoder output, FFN)"})
    dropout: float = field(default=0.1, metadata={"help": "dropout in training"})
    max_positions: int = field(
        default=1024,
        metadata={"help": "learned position table (target slots and source tokens); longer inputs reuse its last row"},
    )
    max_block: int = field(default=32, metadata={"help": "largest block size k the slot-offset table covers"})
    cuts_per_sentence: int = field(
        default=4,
        metadata={"help": "training: blocks supervised per sentence from one teacher-forced verifier pass (0: every cut)"},
    )
    shortlist: int = field(
        default=2000,
        metadata={
            "help": "decoding: project the drafter's states onto the N most frequent types plus the "
            "batch's source tokens (joined dictionaries) instead of the whole vocabulary (0: all types)"
        },
    )


class BlockLayer(nn.Module):
    """Pre-norm Transformer layer over ``[context; block]`` rows: bidirectional
    self-attention, cross-attention to the (verifier's) encoder output, FFN."""

    def __init__(self, dim: int, heads: int, ffn: int, dropout: float):
        super().__init__()
        self.heads = heads
        self.self_qkv = nn.Linear(dim, 3 * dim)
        self.self_out = nn.Linear(dim, dim)
        self.cross_q = nn.Linear(dim, dim)
        self.cross_kv = nn.Linear(dim, 2 * dim)
        self.cross_out = nn.Linear(dim, dim)
        self.fc1 = nn.Linear(dim, ffn)
        self.fc2 = nn.Linear(ffn, dim)
        self.ln_self = LayerNorm(dim)
        self.ln_cross = LayerNorm(dim)
        self.ln_ffn = LayerNorm(dim)
        self.dropout = dropout

    def _heads(self, x: Tensor) -> Tensor:  # N x L x C -> N x H x L x d
        n, length, c = x.shape
        return x.view(n, length, self.heads, c // self.heads).transpose(1, 2)

    def memory(self, enc: Tensor) -> Tuple[Tensor, Tensor]:
        """Cross-attention keys and values of an encoder output (N x S x C):
        computed once per sentence."""
        k, v = cached_linear(self.cross_kv, enc).chunk(2, dim=-1)
        return self._heads(k).contiguous(), self._heads(v).contiguous()

    def forward(self, x: Tensor, memory: Tuple[Tensor, Tensor], memory_mask: Optional[Tensor]) -> Tensor:
        n, length, c = x.shape
        p = self.dropout if self.training else 0.0
        q, k, v = cached_linear(self.self_qkv, self.ln_self(x)).chunk(3, dim=-1)
        a = F.scaled_dot_product_attention(self._heads(q), self._heads(k), self._heads(v), dropout_p=p)
        x = x + F.dropout(cached_linear(self.self_out, a.transpose(1, 2).reshape(n, length, c)), p, self.training)
        q = self._heads(cached_linear(self.cross_q, self.ln_cross(x)))
        a = F.scaled_dot_product_attention(q, memory[0], memory[1], attn_mask=memory_mask, dropout_p=p)
        x = x + F.dropout(cached_linear(self.cross_out, a.transpose(1, 2).reshape(n, length, c)), p, self.training)
        h = F.dropout(F.relu(cached_linear(self.fc1, self.ln_ffn(x))), p, self.training)
        return x + F.dropout(cached_linear(self.fc2, h), p, self.training)


@register_model("specdec_vsd", dataclass=SpecDecVSDConfig)
class SpecDecVSDModel(BaseFairseqModel, VerifierStateDrafterModel):
    """See the module docstring."""

    def __init__(self, cfg: SpecDecVSDConfig, dictionary):
        super().__init__()
        self.cfg = cfg
        dim = cfg.embed_dim
        if dim % cfg.attention_heads:
            raise ValueError(f"--embed-dim {dim} is not a multiple of --attention-heads {cfg.attention_heads}")
        if cfg.shortlist < 0:
            raise ValueError(f"--shortlist must be >= 0 (0: the whole vocabulary), got {cfg.shortlist}")
        if cfg.cuts_per_sentence < 0:
            raise ValueError(f"--cuts-per-sentence must be >= 0 (0: every cut), got {cfg.cuts_per_sentence}")
        self.dictionary = dictionary
        self.padding_idx = dictionary.pad()
        self.mask_idx = mask_index(dictionary)
        self.num_types = len(dictionary)
        # frozen copies of the verifier's token embedding and output projection
        # (filled by init_from_verifier; saved with the checkpoint)
        self.register_buffer("embed_weight", torch.zeros(self.num_types, dim))
        self.register_buffer("output_weight", torch.zeros(self.num_types, dim))
        self.register_buffer("embed_scale", torch.tensor(math.sqrt(dim)))
        self.register_buffer("train_block_size", torch.tensor(0, dtype=torch.long))
        self.register_buffer(
            "dictionary_fingerprint", torch.tensor(dictionary_fingerprint(dictionary), dtype=torch.long)
        )
        self.start_state = nn.Parameter(torch.zeros(dim))
        self.fuse = nn.Linear(2 * dim, dim)
        self.positions = nn.Embedding(cfg.max_positions, dim)
        self.offsets = nn.Embedding(cfg.max_block, dim)
        self.copy_query = nn.Linear(dim, dim, bias=False)
        self.layers = nn.ModuleList(
            [BlockLayer(dim, cfg.attention_heads, cfg.ffn_embed_dim, cfg.dropout) for _ in range(cfg.layers)]
        )
        self.final_ln = LayerNorm(dim)
        nn.init.normal_(self.positions.weight, std=dim ** -0.5)
        nn.init.normal_(self.offsets.weight, std=dim ** -0.5)
        nn.init.normal_(self.start_state, std=dim ** -0.5)
        self.num_updates = 0

    @classmethod
    def build_model(cls, cfg, task):
        return cls(cfg, task.target_dictionary)

    def set_num_updates(self, num_updates):
        super().set_num_updates(num_updates)
        self.num_updates = num_updates

    def load_state_dict(self, state_dict, strict=True, model_cfg=None, args=None):
        """Refuse weights trained with another dictionary before the size
        mismatch of the embedding copies can hide the reason."""
        saved = state_dict.get("dictionary_fingerprint")
        if saved is not None:
            check_same_dictionary(saved, self.dictionary_fingerprint, "this specdec_vsd checkpoint")
        return super().load_state_dict(state_dict, strict=strict, model_cfg=model_cfg, args=args)

    def max_positions(self):
        return None  # positions past the table reuse its last row

    # ------------------------------------------------------------ the verifier
    def init_from_verifier(self, verifier) -> None:
        """Copy the verifier's token embedding, its scale and its output projection."""
        dec = verifier.decoder
        weight = dec.embed_tokens.weight
        if weight.shape != self.embed_weight.shape:
            raise ValueError(
                f"the verifier's target embedding is {tuple(weight.shape)}, this specdec_vsd drafter "
                f"expects {tuple(self.embed_weight.shape)} (--embed-dim must be the verifier's decoder dimension)"
            )
        if dec.project_out_dim is not None or dec.project_in_dim is not None:
            raise ValueError("specdec_vsd needs a verifier whose decoder input and output dimensions are equal")
        self.embed_weight.copy_(weight.detach())
        self.output_weight.copy_(verifier_output_weight(verifier).detach())
        self.embed_scale.fill_(float(dec.embed_scale))
        logger.info("specdec_vsd: copied the verifier's target embedding, scale and output projection (frozen)")

    def check_verifier(self, verifier, source: str) -> None:
        """Refuse a verifier that is not the one this drafter was trained on."""
        same = (
            tuple(self.output_weight.shape) == tuple(verifier_output_weight(verifier).shape)
            and torch.equal(self.output_weight, verifier_output_weight(verifier).to(self.output_weight))
            and torch.equal(self.embed_weight, verifier.decoder.embed_tokens.weight.to(self.embed_weight))
        )
        if not same:
            raise ValueError(
                f"the drafter ({source}) is a specdec_vsd drafter trained on another verifier: its copy of "
                "the verifier's embeddings differs from the --path verifier's (train it with "
                "--init-from-verifier pointing at this verifier)"
            )

    @staticmethod
    @torch.no_grad()
    def verifier_states(verifier, src_tokens, src_lengths, prev_output_tokens):
        """Teacher-forced pass of the frozen verifier: (encoder output, B x T x C
        final decoder states; state t predicted target t)."""
        encoder_out = verifier.encoder(src_tokens, src_lengths=src_lengths)
        features, _ = verifier.decoder(prev_output_tokens, encoder_out=encoder_out, features_only=True)
        return encoder_out, features

    # ------------------------------------------------------------ the block pass
    def _position_rows(self, index: Tensor) -> Tensor:
        return self.positions(index.clamp(0, self.positions.num_embeddings - 1))

    def source_memory(self, encoder_out, positions: int = 0) -> Dict[str, object]:
        """Per-sentence tensors every drafting pass reads: cross-attention
        keys/values per layer, the soft-copy keys and values, the mask.

        With ``positions`` (decoding), also ``copy_base`` (B x P x C): for
        each target position p < P (P = ``positions``, at most the position
        table's size), its position row plus its soft copy of the source.
        Both depend on the position only, so a drafting pass gathers its
        slots' rows instead of computing them; positions past P-1 take row
        P-1, as positions past the table take its last row."""
        enc = encoder_out["encoder_out"][0].transpose(0, 1)  # B x S x C
        src_embed = encoder_out["encoder_embedding"][0]  # B x S x C
        src_pad = source_padding(encoder_out)
        src_pos = (~src_pad).long().cumsum(1) - 1  # left or right padding alike
        memory = {
            "layers": [layer.memory(enc) for layer in self.layers],
            "mask": (~src_pad)[:, None, None, :],  # N x 1 x 1 x S: True = attend
            "copy_keys": (src_embed + self._position_rows(src_pos)).transpose(1, 2),  # B x C x S
            "copy_values": src_embed,
            "copy_pad": src_pad.unsqueeze(1),
        }
        if positions > 0:
            memory["copy_base"] = self.position_table(memory, positions)
        return memory

    def position_table(self, memory, positions: int) -> Tensor:
        """``copy_base`` of :meth:`source_memory`'s rows ``memory`` for
        positions 0 .. P-1, P = min(``positions``, the position table's
        size): a table made for fewer positions is the first rows of one
        made for more (each row is its position's alone), so a decoder can
        start small and grow it as its rows get longer."""
        pos, query = self._position_queries(min(positions, self.positions.num_embeddings))
        return self._soft_copy(query, memory) + pos

    def _soft_copy(self, query: Tensor, memory) -> Tensor:
        """The slots' soft copy of the source: attention of the position
        queries (N x k x C, or k x C for every row) over the source tokens'
        embeddings, keyed by embedding + position."""
        scores = torch.matmul(query, memory["copy_keys"]) / math.sqrt(query.size(-1))
        scores = scores.masked_fill(memory["copy_pad"], -math.inf)
        return torch.bmm(F.softmax(scores.float(), dim=-1).type_as(query), memory["copy_values"])

    def _position_queries(self, count: int) -> Tuple[Tensor, Tensor]:
        """The position rows of positions 0 .. count-1 and their soft-copy
        queries (count x C each): the whole table's, made once and kept
        (outside the state dict) until a weight they come from changes."""
        cache = self.__dict__.get("_specdec_position_queries")
        if cache is None:
            cache = self.__dict__["_specdec_position_queries"] = DerivedWeight(lambda pos, query: (pos, pos @ query.t()))
        pos, query = cache.get(self.positions.weight, self.copy_query.weight)
        return pos[:count], query[:count]

    @staticmethod
    def select_memory(memory, index: Tensor) -> Dict[str, object]:
        """:meth:`source_memory` of the rows ``index`` (repeats allowed)."""
        names = ("mask", "copy_keys", "copy_values", "copy_pad", "copy_base")
        return {
            "layers": [(k.index_select(0, index), v.index_select(0, index)) for k, v in memory["layers"]],
            **{name: memory[name].index_select(0, index) for name in names if name in memory},
        }

    def block_states(
        self, memory, ctx_states: Tensor, ctx_tokens: Tensor, cuts: Tensor, slot_tokens: Optional[Tensor], k: int,
    ) -> Tensor:
        """N x k x C states of the block slots.

        ``memory``: :meth:`source_memory` of the N rows; ``ctx_states`` (N x C):
        the verifier state that predicted the newest accepted token (or the
        start state); ``ctx_tokens`` (N): that token; ``cuts`` (N): accepted
        tokens so far; ``slot_tokens`` (N x k): the mask index, or a revealed
        gold token (glancing); None: every slot is masked (decoding).  The
        generation layer's native pass computes the same function with the
        plugin's kernels on a CPU (``fairseq_specdec.generation.drafters.vsd_native``)."""
        base = memory.get("copy_base") if slot_tokens is None else None
        x = F.dropout(self._input_rows(memory, ctx_states, ctx_tokens, cuts, slot_tokens, k, base),
                      self.cfg.dropout, self.training)
        for layer, layer_memory in zip(self.layers, memory["layers"]):
            x = layer(x, layer_memory, memory["mask"])
        return self.final_ln(x[:, 1:])

    def _input_rows(self, memory, ctx_states: Tensor, ctx_tokens: Tensor, cuts: Tensor, slot_tokens: Optional[Tensor],
                    k: int, base: Optional[Tensor]) -> Tensor:
        """N x (1 + k) x C: the context row, then the k slot rows (the slots'
        rows gathered from ``base`` where given: decoding)."""
        fuse_in = torch.cat([ctx_states, self.embed_scale * F.embedding(ctx_tokens, self.embed_weight)], -1)
        ctx = cached_linear(self.fuse, fuse_in)
        index = cuts.unsqueeze(1) + torch.arange(k, device=cuts.device)  # N x k target positions
        if base is not None:  # decoding: position row + soft copy, gathered
            index = index.clamp_(max=base.size(1) - 1).unsqueeze(-1).expand(-1, -1, base.size(-1))
            slots = base.gather(1, index) + self.offsets.weight[:k]
        else:
            pos = self._position_rows(index)  # N x k x C
            copied = self._soft_copy(cached_linear(self.copy_query, pos), memory)
            is_mask = slot_tokens.eq(self.mask_idx) if slot_tokens is not None else None
            if is_mask is not None and not bool(is_mask.all()):
                revealed = self.embed_scale * F.embedding(slot_tokens.masked_fill(is_mask, self.padding_idx), self.embed_weight)
                copied = torch.where(is_mask.unsqueeze(-1), copied, revealed)
            slots = copied + pos + self.offsets.weight[:k].unsqueeze(0)
        return torch.cat([ctx.unsqueeze(1), slots + ctx.unsqueeze(1)], dim=1)

    # ------------------------------------------------------------ training
    def forward(self, src_tokens, src_lengths, prev_output_tokens, block_mask=None, glance=None, state_blocks=None, **kwargs):
        """Logits (``block_mask.sum()`` x V) of the block slots ``block_mask``
        selects; ``prev_output_tokens`` (N x k) are the slot tokens, and
        ``state_blocks`` (from :func:`make_state_block_inputs`) holds the
        verifier's outputs and each block's sentence, cut and context."""
        if state_blocks is None:
            raise ValueError("specdec_vsd trains on block inputs of the draft_verify task (--task draft_verify)")
        rows = state_blocks["rows"]
        memory = self.select_memory(self.source_memory(state_blocks["encoder_out"]), rows)
        features = state_blocks["features"]  # B x T x C
        cuts = state_blocks["cuts"]
        prev_state = features[rows, (cuts - 1).clamp(min=0)]
        ctx_states = torch.where((cuts > 0).unsqueeze(1), prev_state, self.start_state.expand_as(prev_state))
        ctx_tokens = state_blocks["ctx_tokens"]

        def logits(slot_tokens, mask):
            states = self.block_states(memory, ctx_states, ctx_tokens, cuts, slot_tokens, slot_tokens.size(1))
            return F.linear(states[mask], self.output_weight)

        if glance is not None:
            with torch.no_grad():
                first = logits(prev_output_tokens, block_mask)
            prev_output_tokens, block_mask = glance(first)
        return logits(prev_output_tokens, block_mask), {}


def verifier_output_weight(verifier) -> Tensor:
    dec = verifier.decoder
    projection = getattr(dec, "output_projection", None)
    if not isinstance(projection, nn.Linear) or projection.bias is not None:
        raise ValueError("specdec_vsd needs a verifier whose output layer is a plain linear projection")
    return projection.weight


def make_state_block_inputs(
    target: Tensor,
    pad: int,
    bos: int,
    mask_idx: int,
    k: int,
    cuts_per_sentence: int,
    generator: Optional[torch.Generator] = None,
    draws: Optional[Tensor] = None,
) -> Dict[str, Tensor]:
    """Blocks at several cut points of every sentence.

    ``target``: B x T, right-padded, each row ending with EOS (length L_b
    counting it).  A cut ``c`` in ``[0, L_b - 1]`` has accepted ``y[1..c]``;
    its block targets are ``y[c+1 .. c+k]`` (pad past the EOS) and its context
    token is ``y[c]`` (the BOS for ``c = 0``).  ``cuts_per_sentence`` cuts per
    sentence (all L_b when 0 or when the sentence is shorter), drawn uniformly
    (with replacement) from ``generator``, or evenly spaced from ``draws``
    (one value in [0, 1) per sentence: the same cuts at every validation).

    Returns ``rows``, ``cuts``, ``ctx_tokens`` (N), ``block_target`` and
    ``prev_output_tokens`` (N x k, all the mask index) and ``block_mask``
    (N x k, all true)."""
    device = target.device
    lengths = target.ne(pad).sum(1)
    rows, cuts = [], []
    lengths_host = lengths.tolist()
    for b, length in enumerate(lengths_host):
        if length <= 0:
            continue
        n = length if cuts_per_sentence <= 0 or cuts_per_sentence >= length else cuts_per_sentence
        if n == length:
            c = torch.arange(length)
        elif draws is not None:
            u = torch.remainder(draws[b].double().cpu() + torch.arange(n, dtype=torch.double) / n, 1.0)
            c = torch.floor(u * length).long()
        else:
            c = torch.randint(0, length, (n,), generator=generator)
        rows.append(torch.full((c.numel(),), b, dtype=torch.long))
        cuts.append(c)
    rows = torch.cat(rows).to(device)
    cuts = torch.cat(cuts).to(device)
    padded = torch.cat([target, target.new_full((target.size(0), k), pad)], 1)
    block_target = padded[rows.unsqueeze(1), cuts.unsqueeze(1) + torch.arange(k, device=device)]
    prev = target[rows, (cuts - 1).clamp(min=0)]
    ctx_tokens = torch.where(cuts > 0, prev, torch.full_like(prev, bos))
    return {
        "rows": rows,
        "cuts": cuts,
        "ctx_tokens": ctx_tokens,
        "block_target": block_target,
        "prev_output_tokens": torch.full_like(block_target, mask_idx),
        "block_mask": torch.ones_like(block_target, dtype=torch.bool),
    }
