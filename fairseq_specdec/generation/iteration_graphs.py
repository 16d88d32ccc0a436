"""Whole iterations of a batch of one sentence as CUDA graphs (``--specdec-backend auto`` on a float32 CUDA verifier).

At batch 1 on a GPU, an iteration of the speculative loop launches its
kernels one by one from Python: the drafter's pass, the verify pass, fairseq's
masks, the running scores, acceptance.  With the verify pass alone in a graph
(the backend's choice for a half-precision verifier) an iteration of ``specdec_vsd`` still cost several
times a graphed greedy iteration (the figures: docs/gpu.md).
Here everything an iteration computes on the device before its one host read
is captured once per shape and replayed:

* the **inputs** the iteration reads from the decoding state (each row's
  newest token, its length and its running score) are copied into fixed
  buffers first, and the captured step reads them through a
  :class:`StaticState` instead of the state;
* the **drafter** works on buffers of fixed shapes and addresses after
  :meth:`~fairseq_specdec.generation.drafters.Drafter.static_inputs`
  (drafters that cannot say False, and their batches run as before);
* the **verify pass** is the static-shape pass of
  :class:`~fairseq_specdec.generation.static_verifier.StaticVerifier`, run
  eagerly inside the capture;
* the **outputs** (the new tokens, their log-probs, the counts the loop reads
  back, the running scores, the verifier's final states) are the graph's own
  tensors: the loop commits them to the state after the host read, as it
  commits an eager iteration's.

A shape is the key the loop gives (the draft width, whether fairseq's length
masks apply, the verify pass's and the drafter's buckets); its graph is
captured the first time it is met, after one eager run on a side stream, and
replayed after that.  With ``graphs=False`` the same step runs eagerly on the
same buffers (what the CPU tests run).
"""
from typing import Callable, Hashable

import torch
from torch import Tensor

from .graph_cache import GraphCache


class StaticState:
    """What the captured step reads of a :class:`~fairseq_specdec.generation.state.DecodingState`
    with one row: ``last_tokens()``, ``lengths`` and ``cum`` from fixed
    buffers (:meth:`load` copies them in), and the loaded state's host-side
    fields (``draft_k``, ``lengths_host``) and ``tokens`` (for its dtype and
    device only)."""

    size = 1

    def __init__(self, device: torch.device, dtype: torch.dtype):
        self.device = device
        self._last = torch.zeros(1, 1, dtype=torch.long, device=device)
        self.lengths = torch.zeros(1, dtype=torch.long, device=device)
        self.cum = torch.zeros(1, dtype=dtype, device=device)
        self._state = None

    def load(self, state) -> None:
        """Copy the state's inputs of the next iteration into the buffers."""
        self._state = state
        self._last.copy_(state.last_tokens())
        self.lengths.copy_(state.lengths)
        self.cum.copy_(state.cum)

    def last_tokens(self) -> Tensor:
        return self._last

    @property
    def tokens(self) -> Tensor:
        return self._state.tokens

    @property
    def draft_k(self):
        return self._state.draft_k

    @property
    def lengths_host(self):
        return self._state.lengths_host


class IterationGraphs:
    """The captured (``graphs=True``) or eager iterations of batches of one
    sentence, one per key, over one :class:`StaticState`: a runner of
    :class:`~fairseq_specdec.generation.iteration.Iteration` as
    :class:`~fairseq_specdec.generation.iteration.EagerRunner` is, for the
    static-shape verify pass ``verifier``
    (:class:`~fairseq_specdec.generation.static_verifier.StaticVerifier`)
    and a drafter that switched to fixed buffers (``static_inputs()``)."""

    def __init__(self, verifier, drafter, graphs: bool):
        device = verifier.device
        if graphs and device.type != "cuda":
            raise ValueError(f"whole iterations as CUDA graphs need a CUDA device, not {device}")
        self.verifier, self.drafter = verifier, drafter
        self.graphs = graphs
        self.inputs = StaticState(device, torch.float32)
        #: key -> the step's graph; its counts are read by the tests
        self.graph_cache = GraphCache()
        self._key = None  # what the captured graphs were made for
        #: steps run here
        self.runs = 0

    def start_batch(self, state) -> None:
        """A new batch: the verify pass starts it now (its buffers and
        buckets: what a captured iteration must not do) and runs its passes
        eagerly inside this runner's captures."""
        self.verifier.begin(state, replay=False)
        self.start(self.verifier.generation)

    def run(self, state, iteration, k: int, max_len: int, host_checks: bool) -> tuple:
        """``iteration`` on the fixed buffers, with no host read inside and
        fairseq's length rules applied unconditionally: one captured step
        (drafter, verify pass, rules, acceptance) per shape."""
        key = (k, max_len, self.verifier.rows, self.verifier.source, self.drafter.static_key())
        return self.replay(state, key, lambda inputs: iteration(inputs, k, max_len, False, True))

    def start(self, key: Hashable) -> None:
        """A new batch; ``key`` changes when the buffers the steps read were
        made anew (their graphs would read the old ones): then every graph is
        dropped."""
        if key != self._key:
            self.graph_cache.clear()
            self._key = key

    def replay(self, state, key: Hashable, step: Callable[[StaticState], tuple]) -> tuple:
        """``step(inputs)`` after the state's inputs are loaded, replayed from
        the graph of ``key`` (captured now if it is new)."""
        self.inputs.load(state)
        self.runs += 1
        if not self.graphs:
            return step(self.inputs)
        return self.graph_cache.run(key, lambda: step(self.inputs))
