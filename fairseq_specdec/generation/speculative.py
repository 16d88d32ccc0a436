"""The one speculative decoding loop: draft, verify, accept, commit, retire.

Every iteration, for all unfinished rows of the batch at once:

1. **draft**: the drafter proposes up to k tokens after each row's accepted
   prefix; the :class:`~fairseq_specdec.generation.draft_policy.DraftLengthPolicy`
   caps each row's draft (adaptive draft length, confidence cut) and says
   whether a batch of so many unfinished rows drafts at all (it hears each
   iteration's time);
2. **verify**: the verifier scores ``[last accepted token] + drafts`` in one
   pass over its KV cache (a :class:`~fairseq_specdec.generation.verify_pass.VerifyPass`),
   and fairseq's own ``--beam 1`` rules are applied to those log-probs (pad
   masked, ``--unkpen``, EOS forbidden before ``--min-len``, only EOS at the
   length limit); the greedy token of every slot is taken exactly as
   ``SequenceGenerator`` takes it (top-2 of log-prob plus the running score);
3. **accept**: the acceptance rule keeps the longest acceptable draft prefix,
   then the verifier's token at the first rejection (or the bonus token after
   all drafts); output stops at the first EOS;
4. **commit**: the verifier's cache is rolled back to the accepted prefix,
   the tokens are appended to the :class:`~fairseq_specdec.generation.state.DecodingState`,
   and the drafter hears what was accepted (``Drafter.update``);
5. **retire**: finished rows are finalized and leave the batch everywhere
   (``DecodingState.keep``).

Steps 2-3 after the pass (:meth:`SpeculativeGenerator._accept`) run as one
call of the native extension where the backend chose it (strict
verification on a CPU: :mod:`~fairseq_specdec.generation.backend`), else as
tensor operations; both give the same values.

With :class:`~fairseq_specdec.generation.acceptance.StrictAcceptance` the
output is the ``--beam 1`` output, whatever the drafter proposes.
"""
import math
import time
from dataclasses import dataclass
from typing import Dict, List, Optional

import numpy as np
import torch
from torch import Tensor

from ..kernels import rowgemm
from ..utils.encoder_out import max_output_length
from ..utils.projection import inference_scope
from .backend import Backend
from .draft_policy import DraftLengthPolicy
from .drafters import Drafter
from .iteration_graphs import IterationGraphs
from .stats import SpecDecStats
from .state import DecodingState, Feedback


@dataclass
class DecodeSettings:
    """fairseq's generation options the loop honours, as ``SequenceGenerator``
    does, and the draft policy.  ``block_size``: k, tokens drafted per pass
    (``--block-size``); ``max_len_a``/``max_len_b``/``min_len``/``lenpen``/
    ``unkpen``/``temperature``/``normalize_scores`` (``not --unnormalized``):
    fairseq's; ``draft_policy``: how many tokens each row drafts (default:
    ``k`` for every row); ``tree_nodes``: draft trees of this many nodes,
    at most k deep, instead of chains (0: chains)."""

    block_size: int
    max_len_a: float = 0
    max_len_b: int = 200
    min_len: int = 1
    normalize_scores: bool = True
    len_penalty: float = 1.0
    unk_penalty: float = 0.0
    temperature: float = 1.0
    draft_policy: Optional[DraftLengthPolicy] = None
    #: nodes per draft tree (``--draft-tree``; 0: the drafter's chain of k)
    tree_nodes: int = 0


def check_min_len(min_len: int, max_len_a: float, max_len_b: int, max_positions: int) -> None:
    """Refuse a ``--min-len`` that no batch can reach, before any output:
    longer than the verifier's positions allow, or, without ``--max-len-a``,
    than ``--max-len-b``.  (With ``--max-len-a`` the limit depends on each
    batch's source length: the loop refuses such a batch by name.)"""
    if min_len > max_positions - 1:
        raise ValueError(
            f"--min-len {min_len} is larger than any output the verifier allows: {max_positions - 1} tokens "
            f"(its {max_positions} target positions - 1); lower --min-len"
        )
    if max_len_a == 0 and min_len > max_len_b:
        raise ValueError(
            f"--min-len {min_len} is larger than the length limit --max-len-b {max_len_b} (with --max-len-a 0): "
            "no output could end; lower --min-len or raise --max-len-b"
        )


class SpeculativeGenerator:
    """Drop-in for fairseq's ``SequenceGenerator`` (``--beam 1`` contract).

    Device -> host reads per iteration: one stacked ``.tolist()`` of the
    per-row counts the loop retires rows and places cache entries by (the
    algorithm needs it).  ``host_checks`` adds a read of the drafts that only
    skips work (cutting the verified width after a drafted EOS or pad, and not
    projecting the slots past a ragged row's draft) and sums the running
    scores on the host.  They pay where a verified row costs real time and
    host memory is the device's (a CPU), not where a read stalls the device
    queue (CUDA), so ``None`` (the default) turns them on everywhere but CUDA.  Either way the
    output is the same: a slot past a stop is never accepted, and both sums
    add in SequenceGenerator's order."""

    #: None: host checks on every device but CUDA; True / False: always / never
    host_checks: Optional[bool] = None

    def __init__(self, backend: Backend, drafter: Drafter, acceptance, tgt_dict, settings: DecodeSettings,
                 stats: Optional[SpecDecStats] = None, progress=None):
        """``backend``: what computes an iteration
        (:func:`~fairseq_specdec.generation.backend.resolve_backend`: its
        verify pass holds the verifier model); ``settings``: fairseq's
        options and the draft policy; ``stats``: where per-sentence
        statistics go; ``progress``: the task's sentence counter (the
        statistics line is logged when every sentence is decoded)."""
        if settings.temperature <= 0:
            raise ValueError("--temperature must be greater than 0")
        if settings.temperature != backend.verifier.temperature:
            raise ValueError(f"the backend's verify pass applies temperature {backend.verifier.temperature}, "
                             f"the settings say {settings.temperature}")
        block_size = settings.block_size
        self.policy = settings.draft_policy or DraftLengthPolicy(block_size)
        if self.policy.k != block_size:
            raise ValueError(f"the draft policy's k ({self.policy.k}) is not --block-size {block_size}")
        self.backend = backend
        self.verifier = backend.verifier
        self.drafter = drafter
        #: whole iterations of batches of one sentence on fixed buffers (eager
        #: with ``static``, captured with ``iteration``), where the drafter can
        #: work on such buffers
        self.iteration_graphs = None
        #: nodes per draft tree (0: chains)
        self.tree_nodes = settings.tree_nodes
        if self.tree_nodes < 0:
            raise ValueError(f"--draft-tree must be >= 0 (0 = chains), got {self.tree_nodes}")
        if self.tree_nodes and not drafter.drafts_trees:
            raise ValueError(f"--draft-tree {self.tree_nodes}: the drafter ({drafter.describe()}) drafts chains only; "
                             "drop --draft-tree")
        if not self.tree_nodes and drafter.trees_only:
            raise ValueError(f"the drafter ({drafter.describe()}) drafts trees only: give --draft-tree N (N > 0)")
        if self.tree_nodes and self.policy.adaptive:
            raise ValueError("--draft-tree shapes each draft by the drafter's confidence: drop --adaptive-draft")
        if backend.iteration in ("static", "iteration") and not self.tree_nodes and drafter.static_inputs():
            self.iteration_graphs = IterationGraphs(self.verifier.device, torch.float32,
                                                    graphs=backend.iteration == "iteration")
        self.acceptance = acceptance
        #: steps 2-3 after the verify pass as one call of the extension (the backend's choice)
        self.fused_accept = backend.fused_accept
        #: iterations the fused call left to the tensor operations (a tie for a greedy pick)
        self.fused_ties = 0
        self.block_size = block_size
        self.pad, self.unk, self.eos = tgt_dict.pad(), tgt_dict.unk(), tgt_dict.eos()
        self.vocab_size = len(tgt_dict)
        self.max_len_a, self.max_len_b = settings.max_len_a, settings.max_len_b
        self.min_len = settings.min_len
        self.normalize_scores = settings.normalize_scores
        self.len_penalty = settings.len_penalty
        self.unk_penalty = settings.unk_penalty
        if self.fused_accept and self.unk_penalty != 0:
            raise ValueError("the backend's native acceptance step applies no --unkpen; resolve the backend "
                             "with the generator's --unkpen")
        self.max_len = self.verifier.model.max_decoder_positions()
        check_min_len(self.min_len, self.max_len_a, self.max_len_b, self.max_len)
        self.stats = stats if stats is not None else SpecDecStats()
        # counts sentences decoded against those the run's iterators handed out
        # (the task's SentenceCounter); the statistics line is logged when they meet
        self.progress = progress
        self.symbols_to_strip_from_output = {self.eos}

    def cuda(self):
        return self

    def _mask_lprobs(self, lprobs: Tensor, state: DecodingState, max_len: int, always: bool = False,
                     depths: Optional[Tensor] = None) -> None:
        """fairseq SequenceGenerator's per-step rules, in place.  Slot j of row r
        predicts output index ``state.lengths[r] + j`` (in a draft tree,
        ``state.lengths[r] + depths[r, j]``).  The length rules are
        applied where the host lengths say a slot can reach them, or
        ``always`` (a captured step, which reads no host length: where no slot
        reaches them they change nothing)."""
        # fairseq's lprobs[lprobs != lprobs] = -inf, in one pass (isnan + masked_fill costs 4-20x more)
        torch.nan_to_num_(lprobs, nan=-math.inf, posinf=math.inf, neginf=-math.inf)
        lprobs[:, :, self.pad] = -math.inf
        if self.unk_penalty != 0:
            lprobs[:, :, self.unk] -= self.unk_penalty
        m = lprobs.size(1)
        if always or min(state.lengths_host) < self.min_len or max(state.lengths_host) + m - 1 >= max_len:
            offsets = torch.arange(m, device=lprobs.device) if depths is None else depths
            steps = state.lengths.unsqueeze(1) + offsets
            lprobs[:, :, self.eos].masked_fill_(steps < self.min_len, -math.inf)
            at_limit = (steps >= max_len).unsqueeze(-1)
            lprobs[:, :, : self.eos].masked_fill_(at_limit, -math.inf)
            lprobs[:, :, self.eos + 1 :].masked_fill_(at_limit, -math.inf)

    def _draft_width(self, state: DecodingState, max_len: int) -> int:
        """How many tokens the drafter may propose this iteration: ``--block-size``,
        within the length limit, the drafter's positions and the draft policy."""
        k = max(0, min(self.block_size, max_len - min(state.lengths_host)))
        limit = self.drafter.max_positions
        if limit is not None:
            k = max(0, min(k, limit - max(state.lengths_host)))
        if self.policy.adaptive:
            k = min(k, max(state.draft_k))
        if not self.policy.drafts_at(state.size, state.batch_size):
            k = 0
        return k

    def _draft(self, state: DecodingState, k: int, host_checks: bool = True):
        """Step 1: B x k' drafts (k' <= k, may be 0), their drafter log-probs
        (or None) and, with ``host_checks``, each row's count of drafted
        tokens before its first pad (a host list; else None).  With
        ``host_checks``, k' ends at the last slot any row can still keep: a
        slot after a drafted EOS or a pad is never accepted (a drafted EOS
        itself is verified: it may be accepted)."""
        if k == 0:
            return state.tokens.new_zeros((state.size, 0)), None, None
        # a drafter may propose fewer than k tokens (pad = no draft)
        draft_tokens, draft_lprobs = self.drafter.propose(state, k)
        draft_tokens = self.policy.limit(draft_tokens, draft_lprobs, state.draft_k, self.pad)
        if not host_checks or draft_tokens.size(1) == 0:
            return draft_tokens, draft_lprobs, None
        # one read of a few host ints, then plain Python: cheaper than the
        # tensor operations that would find the same cut
        rows = draft_tokens.tolist()
        cut = 0
        for row in rows:
            width = len(row)
            for j, token in enumerate(row):
                if token == self.pad or token == self.eos:
                    width = j + (token == self.eos)
                    break
            cut = max(cut, width)
        if cut < draft_tokens.size(1):
            draft_tokens = draft_tokens[:, :cut]
            draft_lprobs = draft_lprobs[:, :cut] if draft_lprobs is not None else None
        drafted = []
        for row in rows:
            count = 0
            while count < cut and row[count] != self.pad:
                count += 1
            drafted.append(count)
        return draft_tokens, draft_lprobs, drafted

    @staticmethod
    def _running_scores(cum: Tensor, draft_vlp: Tensor, on_host: bool) -> Tensor:
        """B x (k + 1) float32 running scores before each slot along the draft
        path: ``cum``, then the drafted tokens' log-probs added one at a time,
        in float32, exactly as SequenceGenerator accumulates them (a scan
        kernel would add in another order).  ``on_host`` sums through numpy
        (a CPU tensor's memory is shared, so nothing is copied: 6 us against
        15-40 us for k = 3-10 as tensor operations); otherwise slot by slot on
        the device, with no read back."""
        n, k = draft_vlp.shape
        if on_host:
            running = np.empty((n, k + 1), dtype=np.float32)
            running[:, 0] = cum.cpu().numpy()
            if k > 0:
                path = np.concatenate([running[:, :1], draft_vlp.cpu().numpy()], axis=1)
                np.cumsum(path, axis=1, dtype=np.float32, out=running)
            return torch.from_numpy(running).to(cum.device)
        running = torch.empty((k + 1, n), dtype=torch.float32, device=cum.device)  # slot x row
        running[0] = cum
        for j in range(k):
            torch.add(running[j], draft_vlp[:, j], out=running[j + 1])
        return running.t()

    def _step(self, state, k: int, max_len: int, host_checks: bool, always_mask: bool = False) -> tuple:
        """Steps 1-3 of an iteration: everything it computes before the loop
        reads back (on the device only when ``host_checks`` is off: what a
        captured iteration runs, ``state`` then being the fixed buffers of
        :class:`~fairseq_specdec.generation.iteration_graphs.StaticState`).
        Returns ``(new_tokens, new_lprobs, n_new, cum, counts, features)``:
        per row the tokens to append (their first ``n_new``), their
        log-probs, the running score after them, the stacked counts the loop
        reads back (tokens added, finished, drafts accepted, drafts
        verified) and the verifier's final states of the pass."""
        verifier = self.verifier
        # 1. draft
        draft_tokens, draft_lprobs, drafted_host = self._draft(state, k, host_checks)
        k = draft_tokens.size(1)
        # 2. verify; in a ragged batch the slots after a row's last draft are
        # not projected (nothing reads them)
        if k == 0:
            lprobs = verifier.forward(state.last_tokens(), state)
        else:
            needed = None
            if drafted_host is not None and state.size > 1 and min(drafted_host) < k:
                drafted = torch.tensor(drafted_host, device=state.device)
                needed = torch.arange(k + 1, device=state.device).unsqueeze(0) <= drafted.unsqueeze(1)
            lprobs = verifier.forward(torch.cat([state.last_tokens(), draft_tokens], dim=1), state, needed)
        return self._accept(state, lprobs, draft_tokens, draft_lprobs, drafted_host, max_len, host_checks,
                            always_mask) + (verifier.last_features,)

    def _tree_step(self, state, k: int, max_len: int, host_checks: bool) -> tuple:
        """Steps 1-3 of an iteration with a draft tree of at most
        ``tree_nodes`` nodes and depth ``k``
        (:class:`~fairseq_specdec.generation.tree.DraftTree`): the drafter's
        tree, one verify pass over all its nodes, the acceptance rule walked
        from the root.  Returns what :meth:`_step` returns, the features
        gathered along each row's appended tokens (so that ``Feedback`` reads
        as after a chain), then the B x (1 + D) ``path`` of slots the verify
        pass's ``rollback`` keeps."""
        tree = self.drafter.propose_tree(state, k, self.tree_nodes)
        if tree.lprobs is not None and self.policy.needs_scores:  # the confidence cut, node by node
            tree.tokens = tree.tokens.masked_fill(tree.lprobs < self.policy.log_min_confidence, self.pad)
        if tree.size == 0:
            return self._step(state, 0, max_len, host_checks) + (None,)
        tokens = torch.cat([state.last_tokens(), tree.tokens], dim=1)
        lprobs = self.verifier.forward(tokens, state, tree=tree)
        out = self._fused_tail(lprobs, tree.tokens, state, [], max_len, tree.parents) if host_checks else None
        if out is not None:
            new_tokens, new_lprobs, n_new, cum, counts, path = out
            width = tree.max_depth + 1  # a row appends at most this many tokens
            counts[3] = tree.tokens.ne(self.pad).sum(1)
            out = (new_tokens[:, :width], new_lprobs[:, :width], n_new, cum, counts, path[:, :width])
        else:
            out = self._accept_tree(state, lprobs, tree, max_len, host_checks)
        path = out[-1]
        features = self.verifier.last_features
        if features is not None:
            features = features.gather(1, path.unsqueeze(-1).expand(-1, -1, features.size(-1)))
        return out[:-1] + (features, path)

    def _accept_tree(self, state, lprobs: Tensor, tree, max_len: int, host_checks: bool) -> tuple:
        """Steps 2-3 after a tree's verify pass with tensor operations (what
        the extension's ``strict_step`` computes under strict acceptance):
        fairseq's rules at each slot's depth, the running score of each slot
        along its root path, each slot's greedy token, the acceptance rule at
        every node (its token against its parent's log-probs and greedy
        token), the deepest root path of acceptable nodes (the first in slot
        order), its tokens and the verifier's token after it.  Returns
        ``(new_tokens, new_lprobs, n_new, cum, counts, path)``."""
        depths = tree.depths
        self._mask_lprobs(lprobs, state, max_len, depths=depths)
        bsz, m, vocab = lprobs.shape
        parents = tree.parents[:, 1:]
        parent_lprobs = lprobs.gather(1, parents.unsqueeze(-1).expand(-1, -1, vocab))  # B x n x V
        draft_vlp = parent_lprobs.gather(2, tree.tokens.unsqueeze(-1)).squeeze(-1)
        running = self._tree_running(state.cum, draft_vlp, tree.parents, on_host=host_checks)  # B x m
        greedy = self._greedy(lprobs + running.unsqueeze(-1))
        ok = self.acceptance(tree.tokens, tree.lprobs, parent_lprobs, greedy.gather(1, parents))
        bad = torch.cat([ok.new_zeros(bsz, 1), ~ok], dim=1)
        reach = ~(tree.ancestors & bad.unsqueeze(1)).any(dim=2)  # no unacceptable node on the root path
        chosen = torch.where(reach, depths, torch.full_like(depths, -1)).argmax(dim=1)  # the first deepest
        rows = torch.arange(bsz, device=lprobs.device)
        path = tree.paths[rows, chosen]  # B x (1 + D)
        n_accepted = depths[rows, chosen]
        path_tokens = torch.cat([state.last_tokens(), tree.tokens], dim=1).gather(1, path)
        greedy_path = greedy.gather(1, path)
        new_tokens = torch.cat([path_tokens[:, 1:], greedy_path[:, -1:]], dim=1)
        at = n_accepted.unsqueeze(1)
        new_tokens.scatter_(1, at, greedy_path.gather(1, at))
        path_lprobs = lprobs.gather(1, path.unsqueeze(-1).expand(-1, -1, vocab))
        new_lprobs = path_lprobs.gather(2, new_tokens.unsqueeze(-1)).squeeze(-1)
        drafted = tree.tokens.ne(self.pad).sum(dim=1)
        return self._appended(new_tokens, new_lprobs, running.gather(1, path), n_accepted, drafted) + (path,)

    @staticmethod
    def _tree_running(cum: Tensor, draft_vlp: Tensor, parents: Tensor, on_host: bool) -> Tensor:
        """B x (1 + n) float32 running scores before each slot of a tree: the
        parent's, plus the parent-slot log-prob of the node's token, one
        float32 addition per node (SequenceGenerator's order along every root
        path); ``on_host`` through numpy, as :meth:`_running_scores`."""
        bsz, n = draft_vlp.shape
        if on_host:
            running = np.empty((bsz, n + 1), dtype=np.float32)
            running[:, 0] = cum.cpu().numpy()
            vlp = draft_vlp.cpu().numpy()
            par = parents.cpu().numpy()
            rows = np.arange(bsz)
            for i in range(1, n + 1):
                running[:, i] = running[rows, par[:, i]] + vlp[:, i - 1]
            return torch.from_numpy(running).to(cum.device)
        running = torch.empty((bsz, n + 1), dtype=torch.float32, device=cum.device)
        running[:, 0] = cum
        for i in range(1, n + 1):
            torch.add(running.gather(1, parents[:, i : i + 1]).squeeze(1), draft_vlp[:, i - 1], out=running[:, i])
        return running

    def _appended(self, new_tokens: Tensor, new_lprobs: Tensor, running: Tensor, n_accepted: Tensor,
                  drafted: Tensor) -> tuple:
        """From a row's accepted drafts and the verifier's token after them
        (``new_tokens``, their log-probs, the running score before each) to
        ``(new_tokens, new_lprobs, n_new, cum, counts)``: output cut after
        the first EOS, the running score after the last appended token."""
        offsets = torch.arange(new_tokens.size(1), device=new_tokens.device)
        at = n_accepted.unsqueeze(1)
        is_eos = new_tokens.eq(self.eos) & (offsets.unsqueeze(0) <= at)
        has_eos = is_eos.any(dim=1)
        n_new = torch.where(has_eos, is_eos.int().argmax(dim=1) + 1, n_accepted + 1)
        last_new = (n_new - 1).unsqueeze(1)
        cum = running.gather(1, last_new).squeeze(1) + new_lprobs.gather(1, last_new).squeeze(1)
        counts = torch.stack([n_new, has_eos.long(), n_accepted, drafted])
        return new_tokens, new_lprobs, n_new, cum, counts

    def _accept(self, state, lprobs: Tensor, draft_tokens: Tensor, draft_lprobs: Optional[Tensor],
                drafted_host: Optional[List[int]], max_len: int, host_checks: bool, always_mask: bool = False) -> tuple:
        """Steps 2-3 after the verify pass: fairseq's rules applied to the
        B x (k + 1) x V ``lprobs``, each slot's greedy token, the acceptance
        rule, the tokens to append.  Returns ``(new_tokens, new_lprobs, n_new,
        cum, counts)`` (see :meth:`_step`).  One call of the extension where
        it runs (:meth:`_fused_tail`), else tensor operations; the two give
        the same values."""
        k = draft_tokens.size(1)
        if host_checks and (k == 0 or drafted_host is not None):
            fused = self._fused_tail(lprobs, draft_tokens, state, drafted_host or [], max_len)
            if fused is not None:
                return fused
        self._mask_lprobs(lprobs, state, max_len, always_mask)
        if k == 0:  # one token per row: the same values as below, in fewer operations
            return self._greedy_step(state, lprobs)
        if drafted_host is not None:
            drafted = torch.tensor(drafted_host, device=state.device)
        else:
            drafted = draft_tokens.ne(self.pad).long().cumprod(dim=1).sum(dim=1)
        draft_vlp = lprobs[:, :k].gather(2, draft_tokens.unsqueeze(-1)).squeeze(-1)
        running_t = self._running_scores(state.cum, draft_vlp, on_host=host_checks)
        greedy = self._greedy(lprobs + running_t.unsqueeze(-1))

        # 3. accept: the accepted drafts, then the verifier's token at the bifurcation
        ok = self.acceptance(draft_tokens, draft_lprobs, lprobs[:, :k], greedy[:, :k])
        n_accepted = ok.long().cumprod(dim=1).sum(dim=1)
        new_tokens = torch.cat([draft_tokens, greedy[:, -1:]], dim=1)
        at = n_accepted.unsqueeze(1)
        new_tokens.scatter_(1, at, greedy.gather(1, at))
        new_lprobs = lprobs.gather(2, new_tokens.unsqueeze(-1)).squeeze(-1)
        return self._appended(new_tokens, new_lprobs, running_t, n_accepted, drafted)

    def _fused_tail(self, lprobs: Tensor, draft_tokens: Tensor, state, drafted: List[int], max_len: int,
                    parents: Optional[Tensor] = None) -> Optional[tuple]:
        """Steps 2-3 after the verify pass (fairseq's rules, greedy picks,
        the acceptance rule (strict, or top-beta: ``acceptance.native``),
        the tokens to append) as one call of the extension
        (:func:`~fairseq_specdec.kernels.rowgemm.strict_step`):
        ``(new_tokens, new_lprobs, n_new, cum, counts)``, the values the
        tensor operations compute.  ``drafted``: each row's count of drafted
        tokens (the loop's host checks), empty where k = 0.  None where it
        does not run (not ``fused_accept``, log-probs not float32 on a CPU) or
        a greedy pick ties: the caller's tensor operations then take the
        iteration, from the same unchanged log-probs.  ``parents``: the drafts
        are a draft tree's nodes; the result then ends with the accepted path
        (:func:`~fairseq_specdec.kernels.rowgemm.strict_step`)."""
        if not (self.fused_accept and lprobs.dtype == torch.float32 and lprobs.device.type == "cpu"):
            return None
        out = rowgemm.strict_step(lprobs, draft_tokens, state.cum, state.lengths, drafted, self.pad, self.eos,
                                  self.min_len, max_len, parents, self.acceptance.native)
        if out is None:
            self.fused_ties += 1
        return out

    def _greedy(self, candidates: Tensor) -> Tensor:
        """Each slot's greedy token from its log-probs plus running score, as
        SequenceGenerator takes it: the first of its top 2."""
        return candidates.topk(min(2, self.vocab_size - 1), dim=-1).indices[..., 0]

    def _greedy_step(self, state, lprobs: Tensor) -> tuple:
        """Steps 2-3 of an iteration without drafts (B x 1 x V log-probs,
        fairseq's rules applied): each row's greedy token, picked as
        SequenceGenerator picks it (top-2 of log-prob plus the running
        score), its log-prob, the running score after it (the same float32
        addition), one token added, the row finished at an EOS."""
        greedy = self._greedy(lprobs + state.cum.view(-1, 1, 1))
        new_lprobs = lprobs[:, 0].gather(1, greedy)  # B x 1
        cum = state.cum + new_lprobs[:, 0]
        has_eos = greedy[:, 0].eq(self.eos).long()
        n_new = torch.ones_like(state.lengths)
        zeros = torch.zeros_like(state.lengths)
        counts = torch.stack([n_new, has_eos, zeros, zeros])
        return greedy, new_lprobs, n_new, cum, counts

    @torch.no_grad()
    def generate(self, models, sample: Dict, prefix_tokens=None, constraints=None, bos_token=None, **kwargs):
        # the weights are constant while a batch decodes: cached transposes
        # are checked once (fairseq_specdec.utils.projection)
        with inference_scope():
            return self._generate(sample, prefix_tokens, constraints, bos_token)

    def _generate(self, sample: Dict, prefix_tokens, constraints, bos_token):
        if prefix_tokens is not None:
            raise ValueError("speculative decoding does not support --prefix-size")
        if constraints is not None:
            raise ValueError("speculative decoding does not support --constraints")
        start_time = time.perf_counter()
        src_tokens = sample["net_input"]["src_tokens"]
        bsz, src_len = src_tokens.shape[:2]
        max_len = max_output_length(self.max_len_a, self.max_len_b, src_len, self.max_len)
        if self.min_len > max_len:  # fairseq's generator asserts here
            raise ValueError(
                f"--min-len {self.min_len} is larger than the length limit of this batch: {max_len} tokens "
                f"(--max-len-a {self.max_len_a} x {src_len} source tokens + --max-len-b {self.max_len_b}, "
                f"at most the verifier's {self.max_len} positions - 1); lower --min-len or raise "
                "--max-len-a / --max-len-b"
            )

        verifier = self.verifier
        verifier.start()
        state = DecodingState(
            sample,
            verifier.encode(sample["net_input"]),
            width=max_len + self.block_size + 2,
            pad=self.pad,
            bos=self.eos if bos_token is None else bos_token,
            draft_k=self.policy.initial(),
        )
        state.attach(verifier, self.drafter)
        self.drafter.start_batch(state)
        host_checks = self.host_checks if self.host_checks is not None else state.device.type != "cuda"
        iteration = self.iteration_graphs if bsz == 1 else None
        if iteration is not None:
            verifier.begin(state, replay=False)
            iteration.start(verifier.generation)
        accepted: List[List[int]] = [[] for _ in range(bsz)]
        ids_host = sample["id"].tolist() if "id" in sample else list(range(bsz))
        finalized: List[Optional[List[Dict]]] = [None] * bsz

        while state.size > 0:
            began, rows = time.perf_counter(), state.size
            k = self._draft_width(state, max_len)
            path = None
            if self.tree_nodes and k > 0:
                *step, path = self._tree_step(state, k, max_len, host_checks)
            elif iteration is not None:
                # one captured step (drafter, verify pass, rules, acceptance) per shape
                key = (k, max_len, verifier.rows, verifier.source, self.drafter.static_key())
                step = iteration.run(state, key, lambda inputs: self._step(inputs, k, max_len, False, True))
            else:
                step = self._step(state, k, max_len, host_checks)
            new_tokens, new_lprobs, n_new, cum, counts, features = step
            n_new_host, done_host, accepted_host, drafted_host = counts.tolist()

            # 4. commit: cache, state, drafter feedback, draft lengths
            verifier.rollback(state, n_new, n_new_host, path)
            state.commit(new_tokens, new_lprobs, n_new, n_new_host, cum)
            self.drafter.update(state, Feedback(drafted_host, accepted_host, n_new, features))
            self.policy.update(state.draft_k, drafted_host, accepted_host)
            now = time.perf_counter()
            self.policy.observe(rows, bsz, k > 0, sum(n_new_host), now - began)

            # 5. retire finished rows
            keep = []
            for i, row in enumerate(state.rows):
                accepted[row].append(n_new_host[i])  # a final EOS included
                if done_host[i]:
                    finalized[row] = self._finalize(state, i)
                    sample_id = ids_host[row]
                    self.stats.add(sample_id, state.lengths_host[i] - 1, accepted[row], now - start_time)
                else:
                    keep.append(i)
            if not keep:
                break
            state.keep(keep)

        if self.progress is not None and self.progress.decoded(bsz):
            self.stats.report()
        return finalized

    def _finalize(self, state: DecodingState, i: int) -> List[Dict]:
        """Row i's hypothesis in SequenceGenerator's format."""
        length = state.lengths_host[i]  # the EOS included
        score = state.cum[i].clone()
        if self.normalize_scores:
            score = score / (length ** self.len_penalty)
        return [
            {
                "tokens": state.tokens[i, 1 : length + 1].clone(),
                "score": score,
                "attention": torch.empty(0),
                "alignment": torch.empty(0),
                "positional_scores": state.pos_scores[i, 1 : length + 1].clone(),
            }
        ]
