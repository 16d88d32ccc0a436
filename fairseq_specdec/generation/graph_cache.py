"""CUDA graphs captured once per key and replayed: what the static verify
pass and the whole-iteration capture share."""
from typing import Callable, Dict, Hashable

import torch


class GraphCache:
    """``run(key, fn)`` replays the graph captured for ``key``, capturing
    ``fn()`` first if the key is new: one eager run of ``fn`` on a side
    stream (it allocates and initialises the libraries' workspaces, so it
    must write only what the replay writes again), then the capture.  The
    graphs share one memory pool; their outputs stay the graphs' own tensors,
    overwritten by the next replay."""

    def __init__(self):
        self._graphs: Dict[Hashable, tuple] = {}
        self._pool = None
        #: replays and captures so far (for the log and the tests)
        self.replays = 0
        self.captures = 0

    def clear(self) -> None:
        """Forget every graph (what they read was freed or laid out anew)."""
        self._graphs.clear()

    def run(self, key: Hashable, fn: Callable[[], object]):
        captured = self._graphs.get(key)
        if captured is None:
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                outputs = fn()
            captured = self._graphs[key] = (graph, outputs)
            self.captures += 1
        graph, outputs = captured
        graph.replay()
        self.replays += 1
        return outputs
