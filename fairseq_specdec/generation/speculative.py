"""The one speculative decoding loop: draft, verify, accept, roll back.

Every iteration, for all unfinished rows of the batch at once:

1. the drafter proposes k tokens after each row's accepted prefix;
2. the verifier scores ``[last accepted token] + k drafts`` in one pass over
   its KV cache (:class:`~fairseq_specdec.generation.verifier.CachedVerifier`);
3. fairseq's own ``--beam 1`` rules are applied to those log-probs (pad
   masked, ``--unkpen``, EOS forbidden before ``--min-len``, only EOS at the
   length limit) and the greedy token of every slot is taken exactly as
   ``SequenceGenerator`` takes it (top-2 of log-prob plus the running score);
4. the acceptance rule keeps the longest acceptable draft prefix, then the
   verifier's token at the first rejection (or the bonus token after k
   accepted drafts); output stops at the first EOS;
5. the cache is rolled back to the accepted prefix; finished rows leave.

With :class:`~fairseq_specdec.generation.acceptance.StrictAcceptance` the
output is the ``--beam 1`` output, whatever the drafter proposes.
"""
import math
import time
from typing import Dict, List, Optional

import numpy as np
import torch
from torch import Tensor

from .acceptance import StrictAcceptance
from .drafters import Drafter
from .stats import SpecDecStats
from .verifier import CachedVerifier


class SpeculativeGenerator:
    """Drop-in for fairseq's ``SequenceGenerator`` (``--beam 1`` contract)."""

    def __init__(
        self,
        verifier_model,
        drafter: Drafter,
        acceptance,
        tgt_dict,
        block_size: int,
        max_len_a: float = 0,
        max_len_b: int = 200,
        min_len: int = 1,
        normalize_scores: bool = True,
        len_penalty: float = 1.0,
        unk_penalty: float = 0.0,
        temperature: float = 1.0,
        stats: Optional[SpecDecStats] = None,
        expected_sentences=None,
    ):
        if block_size < 1:
            raise ValueError(f"--block-size must be >= 1, got {block_size}")
        if temperature <= 0:
            raise ValueError("--temperature must be greater than 0")
        self.verifier = CachedVerifier(verifier_model, temperature)
        self.drafter = drafter
        drafter.bind_verifier(self.verifier)
        self.acceptance = acceptance
        self.block_size = block_size
        self.pad, self.unk, self.eos = tgt_dict.pad(), tgt_dict.unk(), tgt_dict.eos()
        self.vocab_size = len(tgt_dict)
        self.max_len_a, self.max_len_b = max_len_a, max_len_b
        self.min_len = min_len
        self.normalize_scores = normalize_scores
        self.len_penalty = len_penalty
        self.unk_penalty = unk_penalty
        self.max_len = verifier_model.max_decoder_positions()
        self.stats = stats if stats is not None else SpecDecStats()
        # callable returning how many sentences the current run will decode
        self.expected_sentences = expected_sentences or (lambda: None)
        self.symbols_to_strip_from_output = {self.eos}

    def cuda(self):
        return self

    def _mask_lprobs(self, lprobs: Tensor, lengths: Tensor, lengths_host: List[int], max_len: int) -> None:
        """fairseq SequenceGenerator's per-step rules, in place.  Slot j of row r
        predicts output index ``lengths[r] + j``."""
        lprobs.masked_fill_(torch.isnan(lprobs), -math.inf)
        lprobs[:, :, self.pad] = -math.inf
        if self.unk_penalty != 0:
            lprobs[:, :, self.unk] -= self.unk_penalty
        m = lprobs.size(1)
        if min(lengths_host) < self.min_len or max(lengths_host) + m - 1 >= max_len:
            steps = lengths.unsqueeze(1) + torch.arange(m, device=lprobs.device)
            lprobs[:, :, self.eos].masked_fill_(steps < self.min_len, -math.inf)
            at_limit = (steps >= max_len).unsqueeze(-1)
            lprobs[:, :, : self.eos].masked_fill_(at_limit, -math.inf)
            lprobs[:, :, self.eos + 1 :].masked_fill_(at_limit, -math.inf)

    @torch.no_grad()
    def generate(self, models, sample: Dict, prefix_tokens=None, constraints=None, bos_token=None, **kwargs):
        if prefix_tokens is not None:
            raise ValueError("--decoding draft-verify does not support --prefix-size")
        if constraints is not None:
            raise ValueError("--decoding draft-verify does not support --constraints")
        start_time = time.perf_counter()
        net_input = sample["net_input"]
        src_tokens = net_input["src_tokens"]
        bsz, src_len = src_tokens.shape[:2]
        device = src_tokens.device
        max_len = min(int(self.max_len_a * src_len + self.max_len_b), self.max_len - 1)
        assert self.min_len <= max_len, "min_len cannot be larger than max_len, please adjust these!"

        verifier = self.verifier
        encoder_out = verifier.encode(net_input)
        verifier.start(bsz, device)
        self.drafter.start(net_input, bsz)

        k = self.block_size
        width = max_len + k + 2
        tokens = torch.full((bsz, width), self.pad, dtype=torch.long, device=device)
        tokens[:, 0] = self.eos if bos_token is None else bos_token
        pos_scores = torch.zeros((bsz, width), dtype=torch.float, device=device)
        lengths = torch.zeros(bsz, dtype=torch.long, device=device)  # output tokens so far
        cum = torch.zeros(bsz, dtype=torch.float, device=device)  # running score, as fairseq
        lengths_host = [0] * bsz
        rows = list(range(bsz))  # original row of each active row
        accepted: List[List[int]] = [[] for _ in range(bsz)]
        finalized: List[Optional[List[Dict]]] = [None] * bsz
        drafter_limit = self.drafter.max_positions

        while rows:
            n = len(rows)
            k_eff = max(0, min(k, max_len - min(lengths_host)))
            if drafter_limit is not None:
                k_eff = max(0, min(k_eff, drafter_limit - max(lengths_host)))
            if k_eff > 0:
                # a drafter may propose fewer than k_eff tokens (pad = no draft)
                draft_tokens, draft_lprobs = self.drafter.draft(tokens, lengths, k_eff)
                k_eff = draft_tokens.size(1)
                # drafts after a drafted EOS can never be kept: do not verify them
                eos_drafted = draft_tokens.eq(self.eos)
                if k_eff > 1 and bool(eos_drafted.any()):
                    first = torch.where(eos_drafted.any(1), eos_drafted.int().argmax(1) + 1, k_eff)
                    cut = int(first.max())
                    if cut < k_eff:
                        k_eff = cut
                        draft_tokens = draft_tokens[:, :cut]
                        draft_lprobs = draft_lprobs[:, :cut] if draft_lprobs is not None else None
            else:
                draft_tokens = tokens.new_zeros((n, 0))
                draft_lprobs = None
            m = k_eff + 1
            last = tokens.gather(1, lengths.unsqueeze(1))
            lprobs = verifier.forward(torch.cat([last, draft_tokens], dim=1), encoder_out)
            offsets = torch.arange(m, device=device)
            self._mask_lprobs(lprobs, lengths, lengths_host, max_len)

            # running score before each slot along the draft path, accumulated in
            # float32 one token at a time exactly as SequenceGenerator does
            draft_vlp = lprobs[:, :k_eff].gather(2, draft_tokens.unsqueeze(-1)).squeeze(-1)
            running = np.empty((n, m), dtype=np.float32)
            running[:, 0] = cum.cpu().numpy()
            if k_eff > 0:
                np.cumsum(
                    np.concatenate([running[:, :1], draft_vlp.cpu().numpy()], axis=1),
                    axis=1,
                    dtype=np.float32,
                    out=running,
                )
            running_t = torch.from_numpy(running).to(device)
            candidates = lprobs + running_t.unsqueeze(-1)
            greedy = candidates.topk(min(2, self.vocab_size - 1), dim=-1).indices[..., 0]

            if k_eff > 0:
                ok = self.acceptance(draft_tokens, draft_lprobs, lprobs[:, :k_eff], greedy[:, :k_eff])
                n_accepted = ok.long().cumprod(dim=1).sum(dim=1)
            else:
                n_accepted = lengths.new_zeros(n)
            # new tokens: the accepted drafts, then the verifier's token at the bifurcation
            new_tokens = torch.cat([draft_tokens, greedy[:, -1:]], dim=1)
            at = n_accepted.unsqueeze(1)
            new_tokens.scatter_(1, at, greedy.gather(1, at))
            new_lprobs = lprobs.gather(2, new_tokens.unsqueeze(-1)).squeeze(-1)
            is_eos = new_tokens.eq(self.eos) & (offsets.unsqueeze(0) <= at)
            has_eos = is_eos.any(dim=1)
            n_new = torch.where(has_eos, is_eos.int().argmax(dim=1) + 1, n_accepted + 1)

            # write the block; slots past n_new are overwritten by later iterations
            cols = lengths.unsqueeze(1) + 1 + offsets
            tokens.scatter_(1, cols, new_tokens)
            pos_scores.scatter_(1, cols, new_lprobs)
            last_new = (n_new - 1).unsqueeze(1)
            cum = running_t.gather(1, last_new).squeeze(1) + new_lprobs.gather(1, last_new).squeeze(1)
            lengths = lengths + n_new

            if self.drafter.needs_features:
                self.drafter.observe(verifier.last_features, n_new)
            n_new_host, done_host = torch.stack([n_new, has_eos.long()]).tolist()
            now = time.perf_counter()
            keep = []
            for i, row in enumerate(rows):
                lengths_host[i] += n_new_host[i]
                if done_host[i]:
                    accepted[row].append(n_new_host[i])  # the final EOS included
                    finalized[row] = self._finalize(tokens[i], pos_scores[i], lengths_host[i], cum[i])
                    sample_id = int(sample["id"][row]) if "id" in sample else row
                    self.stats.add(sample_id, lengths_host[i] - 1, accepted[row], now - start_time)
                else:
                    accepted[row].append(n_new_host[i])
                    keep.append(i)
            if not keep:
                break
            verifier.rollback(n_new, n_new_host)
            if len(keep) == n:
                continue
            order = torch.tensor(keep, dtype=torch.long, device=device)
            encoder_out = verifier.reorder(order, encoder_out, keep)
            self.drafter.reorder(order)
            tokens, pos_scores = tokens[order], pos_scores[order]
            lengths, cum = lengths[order], cum[order]
            lengths_host = [lengths_host[i] for i in keep]
            rows = [rows[i] for i in keep]

        self.stats.report(self.expected_sentences())
        return finalized

    def _finalize(self, tokens: Tensor, pos_scores: Tensor, length: int, cum: Tensor) -> List[Dict]:
        """One hypothesis in SequenceGenerator's format; ``length`` includes the EOS."""
        score = cum.clone()
        if self.normalize_scores:
            score = score / (length ** self.len_penalty)
        return [
            {
                "tokens": tokens[1 : length + 1].clone(),
                "score": score,
                "attention": torch.empty(0),
                "alignment": torch.empty(0),
                "positional_scores": pos_scores[1 : length + 1].clone(),
            }
        ]
