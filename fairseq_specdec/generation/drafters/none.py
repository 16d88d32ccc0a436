"""``loop-greedy``'s drafter: none (one verifier token per iteration)."""
from .base import Drafter, StaticDrafter, TimedParts


class NoDrafter(Drafter, StaticDrafter, TimedParts):
    """Never drafts: the loop then takes one verifier token per iteration
    (greedy decoding through the speculative loop)."""

    def describe(self) -> str:
        return "none: one verifier token per iteration"

    def timed_parts(self, k: int):
        return iter(())

    def start_batch(self, state) -> None:
        pass

    def propose(self, state, k):
        return state.tokens.new_zeros((state.size, 0)), None

    def reorder(self, order, order_host) -> None:
        pass

    def static_inputs(self) -> bool:
        return True

    def static_key(self) -> tuple:
        return ()
