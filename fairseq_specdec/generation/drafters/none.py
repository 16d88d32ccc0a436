"""``loop-greedy``'s drafter: none (greedy decoding through the loop)."""
from .base import Drafter, NeverDrafts, StaticDrafter, TimedParts


class NoDrafter(Drafter, NeverDrafts, StaticDrafter, TimedParts):
    """Never drafts: the loop then takes the verifier's greedy tokens, one
    a pass (several passes an iteration where its greedy steps are
    screened: :mod:`~fairseq_specdec.generation.screened_greedy`)."""

    def describe(self) -> str:
        return "none: the verifier's greedy tokens, one a verify pass"

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
