"""The per-batch state of the speculative loop, and the feedback drafters get.

One :class:`DecodingState` per ``generate()`` call owns everything that
describes the rows still being decoded; drafters read it (never write it).
"""
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch
from torch import Tensor


@dataclass
class Feedback:
    """What every drafter hears after each verification (``Drafter.update``).

    ``drafted``: B, drafts verified per row (0 where a row had no draft);
    ``accepted``: B, drafts kept per row (host ints); ``n_new``: B tensor, tokens
    added per row (the accepted drafts, then the verifier's own token, cut at
    a first EOS); ``features``: B x m x C, the verifier's final decoder states
    of this pass (slot j read input j: the previous newest token, then the
    drafts), so ``features[r, n_new[r] - 1]`` is the state that predicted
    row r's newest token."""

    drafted: List[int]
    accepted: List[int]
    n_new: Tensor
    features: Optional[Tensor]

    def newest_states(self) -> Tensor:
        """B x C: for each row, the verifier state that predicted its newest token."""
        if self.features.size(1) == 1:  # a pass of one slot a row (no drafts): every row added one token
            return self.features[:, 0]
        index = (self.n_new - 1).view(-1, 1, 1).expand(-1, 1, self.features.size(-1))
        return self.features.gather(1, index).squeeze(1)


class DecodingState:
    """Accepted output and bookkeeping of the active rows of one batch.

    Invariants between two iterations, for active row ``i``:

    * ``tokens[i, 0]`` is the BOS; ``tokens[i, 1 : lengths[i] + 1]`` are the
      accepted output tokens; ``pos_scores`` holds their log-probs at the same
      columns; columns past ``lengths[i]`` are scratch;
    * ``lengths`` (device) and ``lengths_host`` (host) are equal, and equal
      the number of entries the verifier's self-attention cache holds for the
      row (every accepted token but the newest, plus the BOS);
    * ``cum[i]`` is the running score of the accepted tokens, accumulated in
      float32 one token at a time as fairseq's SequenceGenerator does;
    * ``rows[i]`` is the row's index in the original batch;
    * ``encoder_out`` is the verifier's encoder output of the active rows;
    * ``draft_k[i]`` is how many tokens the row's next draft may have;
    * ``net_input`` is the batch as given, in its original row order (it is
      not reordered: drafters read it in ``start_batch``);
    * ``last_tokens()`` is ``tokens[i, lengths[i]]`` (held from the commit
      that appended it where ``append`` made it, else gathered at the first
      call and held until the next commit or :meth:`keep`).

    :meth:`commit` writes the appended tokens with tensor operations, or in
    one call of ``append`` where the backend gives one
    (:func:`fairseq_specdec.kernels.rowgemm.append_rows`: the same values).

    :meth:`keep` retires rows everywhere at once, in this order: the state's
    own tensors and ``encoder_out`` (through the attached verify pass's
    ``reorder_encoder_out``), then the verify pass's caches, then the
    drafter's per-row state (:meth:`attach`), each given the order as a
    device tensor and as host ints.  When the verifier and the drafter hear of it, the
    state already describes the kept rows.
    """

    def __init__(
        self,
        sample: Dict,
        encoder_out,
        width: int,
        pad: int,
        bos: int,
        draft_k: int,
        append: Optional[Callable] = None,
    ):
        src_tokens = sample["net_input"]["src_tokens"]
        bsz = src_tokens.size(0)
        device = src_tokens.device
        self.sample = sample
        self.net_input = sample["net_input"]
        self.device = device
        self.encoder_out = encoder_out
        self.tokens = torch.full((bsz, width), pad, dtype=torch.long, device=device)
        self.tokens[:, 0] = bos
        self.pos_scores = torch.zeros((bsz, width), dtype=torch.float, device=device)
        self.lengths = torch.zeros(bsz, dtype=torch.long, device=device)
        self.lengths_host: List[int] = [0] * bsz
        self.cum = torch.zeros(bsz, dtype=torch.float, device=device)
        self.rows: List[int] = list(range(bsz))
        #: the sentences the batch began with (``size`` is those unfinished)
        self.batch_size = bsz
        self.draft_k: List[int] = [draft_k] * bsz
        self._verifier = None
        self._drafter = None
        #: the backend's native commit, or None (tensor operations)
        self._append = append
        self._newest: Optional[Tensor] = None
        #: the rows' screened steps whose scores are deferred, or None
        #: (:class:`~fairseq_specdec.generation.screened_greedy.DeferredScores`:
        #: while it holds steps, their positional scores are placeholders
        #: and ``cum`` lacks them)
        self.deferred = None

    def attach(self, verifier, drafter) -> None:
        """The verify pass (``reorder_encoder_out(encoder_out, order)``, then
        ``reorder(state, order, order_host)``) and the drafter
        (``reorder(order, order_host)``) that :meth:`keep` tells, in that
        order."""
        self._verifier, self._drafter = verifier, drafter

    @property
    def size(self) -> int:
        return len(self.rows)

    @property
    def width(self) -> int:
        """Target positions a row can reach: the longest output, a draft past
        it and the final EOS; a drafter's position tables need no more."""
        return self.tokens.size(1)

    def last_tokens(self) -> Tensor:
        """B x 1: each row's newest accepted token (the BOS before any); not
        to be changed in place."""
        if self._newest is None:
            self._newest = self.tokens.gather(1, self.lengths.unsqueeze(1))
        return self._newest

    def commit(self, new_tokens: Tensor, new_lprobs: Tensor, n_new: Tensor, n_new_host: List[int], cum: Tensor) -> None:
        """Append ``n_new[i]`` of ``new_tokens[i]`` to row i.  Columns past
        ``n_new`` are written too and stay scratch.  ``lengths`` becomes a
        new tensor (the old one is not changed)."""
        if self._append is not None:
            self.lengths, self._newest = self._append(self.tokens, self.pos_scores, self.lengths, new_tokens,
                                                      new_lprobs, n_new)
        else:
            cols = self.lengths.unsqueeze(1) + 1 + torch.arange(new_tokens.size(1), device=self.device)
            self.tokens.scatter_(1, cols, new_tokens)
            self.pos_scores.scatter_(1, cols, new_lprobs)
            self.lengths = self.lengths + n_new
            self._newest = None
        self.cum = cum
        self.lengths_host = [n + d for n, d in zip(self.lengths_host, n_new_host)]

    def keep(self, keep_host: List[int]) -> None:
        """Keep only the active rows ``keep_host`` (indices into the active rows)."""
        if len(keep_host) == self.size:
            return
        if self.deferred is not None:  # (the generator settles them before a row's hypothesis)
            raise RuntimeError("rows would leave a decoding state that holds deferred scores; settle them first")
        order = torch.tensor(keep_host, dtype=torch.long, device=self.device)
        self.tokens = self.tokens.index_select(0, order)
        self.pos_scores = self.pos_scores.index_select(0, order)
        self.lengths = self.lengths.index_select(0, order)
        self.cum = self.cum.index_select(0, order)
        self._newest = None
        self.lengths_host = [self.lengths_host[i] for i in keep_host]
        self.rows = [self.rows[i] for i in keep_host]
        self.draft_k = [self.draft_k[i] for i in keep_host]
        if self._verifier is not None:
            self.encoder_out = self._verifier.reorder_encoder_out(self.encoder_out, order)
            self._verifier.reorder(self, order, keep_host)
        if self._drafter is not None:
            self._drafter.reorder(order, keep_host)
