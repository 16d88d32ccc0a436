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

Steps 1-3 are one :class:`~fairseq_specdec.generation.iteration.Iteration`
over a draft tree (a chain is the tree whose node i hangs from node i - 1);
its acceptance step (:mod:`~fairseq_specdec.generation.accept_step`: tensor
operations, or one call of the native extension) and its runner (eager, or
whole iterations of a batch of one sentence on fixed buffers) are the
backend's choice (:mod:`~fairseq_specdec.generation.backend`).  Steps 4-5
are this module's loop.

With :class:`~fairseq_specdec.generation.acceptance.StrictAcceptance` the
output is the ``--beam 1`` output, whatever the drafter proposes.
"""
import time
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from ..utils.encoder_out import max_output_length
from ..utils.projection import inference_scope
from .accept_step import FairseqRules
from .backend import Backend
from .draft_policy import DraftLengthPolicy
from .drafters import Drafter, TreeDrafter
from .iteration import Iteration
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
        #: nodes per draft tree (0: chains)
        self.tree_nodes = settings.tree_nodes
        if self.tree_nodes and not isinstance(drafter, TreeDrafter):
            raise ValueError(f"--draft-tree {self.tree_nodes}: the drafter ({drafter.describe()}) drafts chains only; "
                             "drop --draft-tree")
        if not self.tree_nodes and isinstance(drafter, TreeDrafter) and drafter.trees_only:
            raise ValueError(f"the drafter ({drafter.describe()}) drafts trees only: give --draft-tree N (N > 0)")
        if self.tree_nodes and self.policy.adaptive:
            raise ValueError("--draft-tree shapes each draft by the drafter's confidence: drop --adaptive-draft")
        self.block_size = block_size
        self.pad, self.eos = tgt_dict.pad(), tgt_dict.eos()
        self.max_len_a, self.max_len_b = settings.max_len_a, settings.max_len_b
        self.min_len = settings.min_len
        self.normalize_scores = settings.normalize_scores
        self.len_penalty = settings.len_penalty
        rules = FairseqRules(self.pad, tgt_dict.unk(), self.eos, len(tgt_dict), settings.min_len,
                             settings.unk_penalty)
        #: the backend's strategies: steps 2-3 after the pass, and who runs an iteration
        self.step = backend.acceptance_step(acceptance, rules)
        #: greedy steps without the float32 vocabulary product, where the backend has them (else None)
        self.screened = backend.screened_greedy(acceptance, rules)
        self.eager, self.iteration_graphs = backend.runners(drafter, trees=self.tree_nodes > 0)
        self.iteration = Iteration(self.verifier, drafter, self.step, self.policy, block_size, self.tree_nodes,
                                   self.pad, self.eos, self.screened)
        self.max_len = self.verifier.model.max_decoder_positions()
        check_min_len(self.min_len, self.max_len_a, self.max_len_b, self.max_len)
        self.stats = stats if stats is not None else SpecDecStats()
        # counts sentences decoded against those the run's iterators handed out
        # (the task's SentenceCounter); the statistics line is logged when they meet
        self.progress = progress
        self.symbols_to_strip_from_output = {self.eos}

    def cuda(self):
        return self

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
            append=self.backend.append,
        )
        state.attach(verifier, self.drafter)
        self.drafter.start_batch(state)
        host_checks = self.host_checks if self.host_checks is not None else state.device.type != "cuda"
        runner = self.iteration_graphs if bsz == 1 and self.iteration_graphs is not None else self.eager
        runner.start_batch(state)
        accepted: List[List[int]] = [[] for _ in range(bsz)]
        ids_host = sample["id"].tolist() if "id" in sample else list(range(bsz))
        finalized: List[Optional[List[Dict]]] = [None] * bsz

        while state.size > 0:
            began, rows = time.perf_counter(), state.size
            k = self.iteration.draft_width(state, max_len)
            out, features = runner.run(state, self.iteration, k, max_len, host_checks)
            n_new_host, done_host, accepted_host, drafted_host = out.counts.tolist()

            # 4. commit: cache, state, drafter feedback, draft lengths
            verifier.rollback(state, out.n_new, n_new_host, out.path)
            state.commit(out.new_tokens, out.new_lprobs, out.n_new, n_new_host, out.cum)
            self.drafter.update(state, Feedback(drafted_host, accepted_host, out.n_new, features))
            self.policy.update(state.draft_k, drafted_host, accepted_host)
            now = time.perf_counter()
            # the deferred scores settled in this iteration are the earlier greedy iterations' work
            settled = self.screened.take_settle_seconds() if self.screened is not None else 0.0
            self.policy.observe(rows, bsz, k > 0, sum(n_new_host), now - began - settled)
            self.policy.charge(rows, bsz, False, settled)

            # 5. retire finished rows
            keep = []
            passes = out.passes  # a run of screened steps: one token a row each
            for i, row in enumerate(state.rows):
                if passes == 1:
                    accepted[row].append(n_new_host[i])  # a final EOS included
                else:
                    accepted[row].extend([1] * passes)
                if done_host[i]:
                    finalized[row] = self._finalize(state, i)
                    sample_id = ids_host[row]
                    self.stats.add(sample_id, state.lengths_host[i] - 1, accepted[row], now - start_time)
                else:
                    keep.append(i)
            if self.screened is not None:  # a finished row's scores, settled as it left
                self.policy.charge(rows, bsz, False, self.screened.take_settle_seconds())
            if not keep:
                break
            state.keep(keep)

        if self.screened is not None:
            self.stats.add_screened(*self.screened.take_counts())
        if self.progress is not None and self.progress.decoded(bsz):
            self.stats.report()
        return finalized

    def _finalize(self, state: DecodingState, i: int) -> List[Dict]:
        """Row i's hypothesis in SequenceGenerator's format."""
        if self.screened is not None:
            self.screened.settle(state)  # every row's: the finished rows leave the state after this
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
