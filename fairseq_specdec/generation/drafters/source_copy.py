"""Input-guided aggressive decoding: the source itself is the draft (Ge et al. 2022)."""
from .base import Drafter, padded_drafts, row_tails


class SourceCopyDrafter(Drafter):
    """Input-guided aggressive decoding (Ge et al. 2022, section 3.1, Algorithm 1).

    The draft is the source itself: at the start, the whole source; later,
    when the output's last 1, 2 or 3 tokens occur exactly once in the source
    (the shortest unique n-gram wins), the rest of the source after that
    occurrence; otherwise no draft (the loop then takes one greedy step).
    The loop always appends the verifier's own token after the last accepted
    draft, which plays the role of the paper's never-matching sentinel.
    Source and target must share one dictionary.
    """

    def __init__(self, pad: int, eos: int, max_ngram: int = 3):
        self.pad, self.eos, self.max_ngram = pad, eos, max_ngram
        self.sources = []
        self.index = []

    def describe(self) -> str:
        return "the source (input-guided)"

    def start_batch(self, state) -> None:
        self.sources, self.index = [], []
        for row in state.net_input["src_tokens"].tolist():
            src = [t for t in row if t != self.pad]
            if src and src[-1] == self.eos:
                src = src[:-1]
            occurrences = {}
            for n in range(1, self.max_ngram + 1):
                for end in range(n, len(src) + 1):
                    occurrences.setdefault(tuple(src[end - n : end]), []).append(end)
            self.sources.append(src)
            self.index.append(occurrences)

    def _continuation(self, row: int, output):
        src, occurrences = self.sources[row], self.index[row]
        if not output:
            return src
        for n in range(1, min(self.max_ngram, len(output)) + 1):
            ends = occurrences.get(tuple(output[-n:]))
            if ends is None:
                return []  # a longer suffix cannot occur either
            if len(ends) == 1:
                return src[ends[0] :]
        return []

    def propose(self, state, k):
        # each row's output suffix (BOS left out), all rows in one read
        suffixes = row_tails(state, self.max_ngram, first=1)
        drafts = [self._continuation(i, suffix)[:k] for i, suffix in enumerate(suffixes)]
        return padded_drafts(drafts, self.pad, state.tokens), None

    def reorder(self, order, order_host):
        self.sources = [self.sources[i] for i in order_host]
        self.index = [self.index[i] for i in order_host]
