"""Self-drafting: the verifier's own decoder, copied with int8 weights,
drafts; the float32 verifier checks (``--decoding self-draft``).

The copy is the lean pass (:class:`~fairseq_specdec.generation.lean_verifier.LeanVerifier`)
over the verifier's modules with its weights in int8, per output channel
(one scale per row), made once when the generator is first built.  Where
the backend lets drafters use the plugin's kernels
(``Backend.drafting.products``), its products read int8 panels in the
fused C++ layers (:mod:`~fairseq_specdec.kernels.rowgemm`: float32
activations, each weight widened exactly); elsewhere (``--specdec-backend
reference``, no extension) they are torch's quantized library's dynamic
linears (:class:`~fairseq_specdec.utils.int8.Int8Linear`: activations
quantized per call).  Embeddings, positions, layer norms and attention
stay float32.  It reads the
verifier's float32 encoder output (the encoder runs once per batch), and
keeps a KV cache of its own.

**The draft cache.**  For active row r, ``cached[r]`` (host ints) counts the
leading entries of the copy's self-attention cache that hold the copy's keys
and values of the committed tokens ``[BOS, y_1, ...]``; ``cached[r] <=
state.lengths[r]``, the verifier's count.  A :meth:`SelfDrafter.propose`
first feeds each row's tokens the cache lacks (its newest accepted token,
plus any earlier ones: after an iteration whose drafts were all accepted the
last of them was never fed, and iterations that drafted nothing feed
nothing) in one pass, then one token per step, each step's greedy token the
next step's input: all the steps in one call of the extension
(:meth:`~fairseq_specdec.generation.lean_verifier.LeanVerifier.draft_steps`)
where the backend allows its ``steps`` part, else a Python loop over the
copy's passes that computes the same.  Its entries past a row's accepted
prefix are scratch (the lean cache's invariant: a pass writes at the row's
length and never reads past its own input), so a rejected draft needs no
rollback: :meth:`SelfDrafter.update` only counts which of the fed drafts
were accepted.

A draft stops before its first token whose probability under the copy is
below ``min_confidence`` (``--draft-min-confidence``): the loop's draft
policy pads it out from there, and the copy stops stepping once every row
has stopped.  Whatever the
copy drafts, strict verification outputs the verifier's greedy tokens.
"""
import math
import weakref
from typing import List, Optional

import torch
from torch import Tensor

from ..kernels import rowgemm
from ..utils.int8 import int8_unavailable_reason
from .drafters import Drafter, TimedParts
from .lean_verifier import LeanVerifier, lean_unsupported_reason


def self_draft_unsupported_reason(model, native: bool) -> Optional[str]:
    """Why no int8 copy of ``model``'s decoder can draft with the kernels
    (``native``) or torch's library (None: one can)."""
    reason = None if native else int8_unavailable_reason()
    if reason is not None:
        return reason
    param = next(model.parameters())
    if param.device.type != "cpu":
        return f"the int8 copy runs on the CPU, and the verifier is on {param.device.type}"
    if param.dtype != torch.float32:
        return f"the verifier's weights are {param.dtype} (the copy is made from float32 weights)"
    return lean_unsupported_reason(model.decoder)


def native_int8(native: bool, model) -> bool:
    """Whether the copy's products read int8 panels of the kernels: where
    the backend allows native drafting and the kernel runs on the weights."""
    return native and rowgemm.int8_available() and rowgemm.applies_to(next(model.parameters()))


#: verifier model -> {native: its int8 copy's pass}, made once per model and
#: kind (a generator is built at every translate() of the hub interface);
#: the pass lays its weights out again when they change
_COPIES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def int8_copy(model, native: bool) -> LeanVerifier:
    """The int8 copy's pass of ``model`` (made at the first call): int8
    panels in the fused C++ layers (``native``), else torch's int8 library."""
    copies = _COPIES.setdefault(model, {})
    copy = copies.get(native)
    if copy is None:
        if native:
            copy = LeanVerifier(model, gemm="rowgemm", precision="int8", encoder="fairseq")
        else:
            copy = LeanVerifier(model, gemm="torch-int8", encoder="fairseq", fused_layers=False)
        copy.start()  # quantizes now: at load time, not in the first batch
        copies[native] = copy
    return copy


class _Rows:
    """What the copy's pass reads of a decoding state: row lengths (where
    the pass's first input sits), the encoder output and the row count."""

    def __init__(self, lengths: Tensor, lengths_host: List[int], encoder_out):
        self.lengths = lengths
        self.lengths_host = lengths_host
        self.encoder_out = encoder_out

    @property
    def size(self) -> int:
        return len(self.lengths_host)


class SelfDrafter(Drafter, TimedParts):
    """Drafts with the verifier's int8 copy (see the module docstring)."""

    def __init__(self, model, pad: int, eos: int, min_confidence: float = 0.0, native: bool = True,
                 steps: bool = False):
        """``native``: the backend lets drafters use the plugin's kernels
        (they are used where they run on the verifier's weights);
        ``steps``: it lets the copy's steps run as one call of them."""
        native = native_int8(native, model)
        reason = self_draft_unsupported_reason(model, native)
        if reason is not None:
            raise ValueError(f"--decoding self-draft cannot make an int8 copy of this verifier: {reason}")
        self.native = native
        #: the steps in one native call (where the copy's pass is one call), else the Python loop
        self.native_steps = native and steps
        self.copy = int8_copy(model, native)
        self.pad, self.eos = pad, eos
        self.min_confidence = min_confidence
        self.log_min_confidence = math.log(min_confidence) if min_confidence > 0 else -math.inf
        #: per active row: the copy's cache entries that hold committed tokens
        self.cached: List[int] = []
        # the last propose: the rows' lengths then and how many steps it ran
        self._base: Optional[List[int]] = None
        self._steps = 0

    def describe(self) -> str:
        how = "int8 panels, fused C++ layers" if self.native else "torch's quantized library"
        return f"the verifier's int8 copy ({how})"

    def start_batch(self, state) -> None:
        self.copy.start()
        self.cached = [0] * state.size
        self._base = None

    def propose(self, state, k: int):
        lengths = state.lengths_host
        behind = max(n - c for n, c in zip(lengths, self.cached))
        # one pass over every row's uncached tokens, its newest last: row r
        # feeds from max(n_r - behind, 0), so a shorter row's last input
        # slot is min(n_r, behind) and the slots after it are scratch
        starts = [max(n - behind, 0) for n in lengths]
        device = state.tokens.device
        first = torch.tensor(starts, dtype=torch.long, device=device)
        cols = first.unsqueeze(1) + torch.arange(behind + 1, device=device)
        tokens = state.tokens.gather(1, cols)
        rows = _Rows(first, starts, state.encoder_out)
        if behind == 0:
            lprobs = self.copy.forward(tokens, rows)[:, -1]
        else:  # only each row's newest token's slot is projected
            slot = state.lengths - first
            needed = torch.arange(behind + 1, device=device).unsqueeze(0) == slot.unsqueeze(1)
            lprobs = self.copy.forward(tokens, rows, needed)
            lprobs = lprobs.gather(1, slot.view(-1, 1, 1).expand(-1, 1, lprobs.size(-1)))[:, 0]
        if self.native_steps and self.copy.steps_in_one_call:
            drafts, scores = self.copy.draft_steps(lprobs, state, k, self.pad, self.eos, self.log_min_confidence)
        else:
            drafts, scores = self._steps_in_python(state, lprobs, k)
        self._base, self._steps = list(lengths), drafts.size(1)
        # the loop's draft policy cuts each row before its first unsure token
        # (the same --draft-min-confidence): here it only ends the stepping
        return drafts, scores

    def _steps_in_python(self, state, lprobs: Tensor, k: int):
        """The reference path of :meth:`LeanVerifier.draft_steps`: up to
        ``k`` greedy steps of the copy from ``lprobs`` (B x V, each row's
        newest token's), one pass per step.  Returns (drafts, their
        log-probs), B x steps."""
        lengths = state.lengths_host
        drafts, scores = [], []
        lengths_t = state.lengths
        going = None  # B bool: rows still drafting (confident so far, no EOS)
        for step in range(k):
            lprobs[:, self.pad] = -math.inf
            best, token = lprobs.max(dim=-1)
            drafts.append(token)
            scores.append(best)
            sure = (best >= self.log_min_confidence) & token.ne(self.eos)
            going = sure if going is None else going & sure
            if step == k - 1 or not bool(going.any()):
                break
            lengths_t = lengths_t + 1
            rows = _Rows(lengths_t, [n + step + 1 for n in lengths], state.encoder_out)
            lprobs = self.copy.forward(token.unsqueeze(1), rows)[:, -1]
        return torch.stack(drafts, 1), torch.stack(scores, 1)

    def update(self, state, feedback) -> None:
        """The copy's cache after the verdict: the fed inputs that are now
        committed are the row's newest token before the pass and its
        accepted drafts, up to the last draft fed (the pass fed
        ``steps - 1`` of them)."""
        if self._base is None:
            return  # nothing drafted this iteration: the cache is unchanged
        steps = self._steps
        # (a row that accepted a drafted EOS ends: it leaves in this iteration)
        self.cached = [min(n + 1 + min(a, steps - 1), now)
                       for n, a, now in zip(self._base, feedback.accepted, state.lengths_host)]
        self._base = None

    def reorder(self, order: Tensor, order_host: List[int]) -> None:
        self.cached = [self.cached[i] for i in order_host]
        rows = _Rows(None, [max(self.cached, default=0)], None)
        self.copy.reorder(rows, order, order_host)

    def timed_parts(self, k: int):
        yield self, "start_batch", "drafter start of batch"
        yield self, "propose", f"int8 copy's draft (up to {k} steps)", False
        yield self.copy, "forward", "of which: one int8 copy pass", False
        yield self.copy, "draft_steps", "of which: the copy's steps in one native call", False
        yield self, "update", "drafter feedback", False
