"""Drafting from a corpus: the continuation of the output's last tokens that
is most frequent in the target side of a parallel corpus, preferring the
sentences whose source is most like the one being translated.

This is retrieval-based drafting (REST, He et al., NAACL 2024; prompt
lookup): no drafter model, no training, a draft for the price of a few
table lookups.  For a translation verifier the best corpus is what the
verifier itself outputs, the greedy distillation of its training set (the
Multi30k recipe's ``distill/bin``): strict verification accepts exactly the
verifier's greedy tokens, and those are what the table continues with.

Two tables, both keyed by a hash of the last ``n`` tokens (``n`` = 1 ..
``order``; a collision only costs a rejected draft, never a wrong output):

* the **neighbours' table**, made per sentence from the targets of the
  ``neighbours`` corpus sentences whose source shares the most rare source
  tokens (tokens weighted by inverse document frequency);
* the **corpus table**, made once: for contexts of ``order`` tokens and of
  1 token, the most frequent next token in the whole corpus.

A draft token is the neighbours' continuation of the longest context they
know, except that the corpus's continuation of a full ``order``-token
context comes before the neighbours' shorter ones; with neither, the
corpus's continuation of the last token.  A draft ends after an EOS.

**Confidence.**  Every table entry also says how sure it is: ``c / (n + 1)``
for a continuation seen ``c`` times among the ``n`` occurrences of its
context (a context seen once: 1/2; 9 times out of 10: 9/11), kept to 10
bits and rounded down (1/2 is 511/1023, so two such tokens in a row make
just under 1/4).  A draft goes on
while the product of its tokens' confidences, the drafter's estimate that
the verifier accepts the whole draft so far, stays at least
``min_confidence``; with none confident enough the row drafts nothing and
the loop takes a plain greedy step, which costs less than verifying a draft
that is likely rejected.
"""
import logging
import math
import time
from typing import Dict, List, Optional, Sequence

import numpy as np

from .drafters import Drafter, padded_drafts, row_tails

logger = logging.getLogger(__name__)

_MASK = (1 << 64) - 1
_P = 1_000_003  # hash multiplier
_ORDER_BITS = 8  # key = hash * 8 + n
#: corpus tables of at most this many contexts are kept as a dict too
DICT_LIMIT = 4_000_000
#: corpora of at most this many positions x --ngram-order keep the keys of every position (8 bytes each: 64 MB at most)
POSITION_KEYS_LIMIT = 8_000_000
#: a table value is ``next_token << CONF_BITS | q``, the confidence quantized to ``q / CONF_MAX``
CONF_BITS = 10
CONF_MAX = (1 << CONF_BITS) - 1
#: --ngram-min-confidence's default (chosen by measurement: docs/architecture.md, "Drafting from a corpus")
NGRAM_MIN_CONFIDENCE = 0.25


def _context_keys(sequences: np.ndarray, starts: np.ndarray, order: int, orders: Sequence[int]):
    """Keys and next tokens of every target position of ``sequences`` (int64,
    each sequence preceded by ``order`` sentinels of -1; ``starts``: the index
    of each position that has a next token to learn) for the context lengths
    ``orders``.  Returns (keys uint64, next int64), one entry per position and
    order."""
    h = np.zeros(starts.shape[0], dtype=np.uint64)
    keys, nexts = [], []
    nxt = sequences[starts]
    for n in range(1, order + 1):
        with np.errstate(over="ignore"):
            h = h * np.uint64(_P) + (sequences[starts - n] + 1).astype(np.uint64)
            if n in orders:
                keys.append(h * np.uint64(_ORDER_BITS) + np.uint64(n))
                nexts.append(nxt)
    return np.concatenate(keys), np.concatenate(nexts)


def _most_frequent(keys: np.ndarray, nexts: np.ndarray):
    """For each distinct key, its most frequent next token (ties: the
    smallest id), that token's count and the key's count.  Returns (sorted
    distinct keys, their next tokens, top counts, totals).  Two sorts: the
    keys to dense ids, then the (id, next) pairs as one integer."""
    if keys.size == 0:
        return keys, nexts, nexts, nexts
    distinct, ids = np.unique(keys, return_inverse=True)
    span = int(nexts.max()) + 1
    pairs, counts = np.unique(ids.astype(np.int64) * span + nexts, return_counts=True)
    group = pairs // span  # the key's id, ascending; every id has a pair
    starts = np.flatnonzero(np.diff(group, prepend=-1))
    totals = np.add.reduceat(counts, starts)
    # per key, the first of its pairs (smallest next) with the key's largest count
    best = np.flatnonzero(counts == np.maximum.reduceat(counts, starts)[group])
    best = best[np.diff(group[best], prepend=-1) != 0]
    return distinct, pairs[best] % span, counts[best], totals


def _table_values(nexts: np.ndarray, tops: np.ndarray, totals: np.ndarray) -> np.ndarray:
    """Table values: each next token with its confidence ``top / (total + 1)``
    (see the module docstring), quantized to ``CONF_BITS`` bits (rounded down)."""
    q = (tops * CONF_MAX) // (totals + 1)
    return (nexts << CONF_BITS) | q


class NgramCorpus:
    """The corpus side of :class:`NgramDrafter`, built once per corpus:
    the target sentences as one array, the corpus table and an inverted index
    of the sources for retrieval.

    ``sources`` / ``targets``: token id sequences of the corpus (targets end
    with EOS, as fairseq stores them); ``bos``: the token before each output
    (fairseq's EOS); ``skip``: source ids that never count for retrieval
    (pad, EOS, BOS, unk)."""

    def __init__(self, sources: List[Sequence[int]], targets: List[Sequence[int]], order: int, bos: int,
                 skip: Sequence[int] = ()):
        if order < 1:
            raise ValueError(f"--ngram-order must be >= 1, got {order}")
        if len(sources) != len(targets):
            raise ValueError("the corpus has a different number of source and target sentences")
        self.order = order
        self.sentences = len(targets)
        # targets: [order sentinels][bos][target ...] per sentence, one array
        lengths = np.array([len(t) for t in targets], dtype=np.int64)
        span = lengths + 1 + order
        self.offsets = np.zeros(len(targets) + 1, dtype=np.int64)
        np.cumsum(span, out=self.offsets[1:])
        seq = np.full(int(self.offsets[-1]), -1, dtype=np.int64)
        for i, t in enumerate(targets):
            at = int(self.offsets[i]) + order
            seq[at] = bos
            seq[at + 1 : at + 1 + len(t)] = np.asarray(t, dtype=np.int64)
        self.sequences = seq
        every = self._positions(np.arange(len(targets)))
        # the keys of every context length at every position of ``sequences``, where they fit
        # (the tables below then read them instead of hashing the sentences again)
        self._position_keys = None
        if seq.size * order <= POSITION_KEYS_LIMIT:
            self._position_keys = np.zeros((order, seq.size), dtype=np.uint64)
            self._position_keys[:, every] = _context_keys(seq, every, order, range(1, order + 1))[0].reshape(order, -1)
        self.keys, nexts, tops, totals = _most_frequent(*self._keys_at(every, sorted({1, order})))
        #: per key of ``keys``, its table value (see :func:`_table_values`)
        self.values = _table_values(nexts, tops, totals)
        # a dict where it fits (a lookup of a few hundred nanoseconds), else a search of the sorted keys
        self._table = dict(zip(self.keys.tolist(), self.values.tolist())) if self.keys.size <= DICT_LIMIT else None
        # retrieval: source token -> sentences (distinct tokens per sentence), inverse document frequency
        skip = set(skip)
        rows, cols = [], []
        for i, s in enumerate(sources):
            distinct = {int(t) for t in s} - skip
            rows.extend([i] * len(distinct))
            cols.extend(distinct)
        rows_a, cols_a = np.asarray(rows, dtype=np.int64), np.asarray(cols, dtype=np.int64)
        by_type = np.argsort(cols_a, kind="stable")
        self._posting_rows = rows_a[by_type]
        types, first, counts = np.unique(cols_a[by_type], return_index=True, return_counts=True)
        # source token -> (first index in _posting_rows, sentences, inverse document frequency)
        self._postings: Dict[int, tuple] = {
            int(t): (int(f), int(c), math.log(max(1, self.sentences) / c))
            for t, f, c in zip(types.tolist(), first.tolist(), counts.tolist())
        }

    def _positions(self, sentences: np.ndarray) -> np.ndarray:
        """Indexes into ``sequences`` of the target tokens (each with a context) of these sentences."""
        if sentences.size == 0:
            return np.zeros(0, dtype=np.int64)
        first = self.offsets[sentences] + self.order + 1
        last = self.offsets[sentences + 1]
        count = last - first
        base = np.repeat(first - np.cumsum(np.append(0, count[:-1])), count)
        return base + np.arange(int(count.sum()))

    def neighbours(self, source: Sequence[int], count: int, min_idf: float = 1.0) -> np.ndarray:
        """The ``count`` corpus sentences whose sources share the most source
        tokens with ``source``, each shared token weighted by its inverse
        document frequency (tokens in more than 1/e of the sentences left
        out), best first."""
        if count <= 0 or self.sentences == 0:
            return np.zeros(0, dtype=np.int64)
        spans = [self._postings.get(t) for t in set(int(x) for x in source)]
        spans = [p for p in spans if p is not None and p[2] > min_idf]
        if not spans:
            return np.zeros(0, dtype=np.int64)
        hits = np.concatenate([self._posting_rows[first : first + n] for first, n, _ in spans])
        weights = np.repeat([idf for _, _, idf in spans], [n for _, n, _ in spans])
        scores = np.bincount(hits, weights=weights, minlength=self.sentences)
        # the top ``count`` lie among the sentences scoring at least half the best, when there are that many
        candidates = np.flatnonzero(scores >= 0.5 * scores.max())
        if candidates.size < count:
            candidates = np.flatnonzero(scores)
        if candidates.size > count:
            candidates = candidates[np.argpartition(-scores[candidates], count - 1)[:count]]
        return candidates[np.lexsort((candidates, -scores[candidates]))]

    def _keys_at(self, positions: np.ndarray, orders: Sequence[int]):
        """Keys and next tokens of these positions of ``sequences`` for the
        context lengths ``orders`` (ascending), as :func:`_context_keys`
        returns them: read from the kept position keys, else hashed."""
        if self._position_keys is None:
            return _context_keys(self.sequences, positions, self.order, set(orders))
        rows = [n - 1 for n in orders]
        keys = self._position_keys[np.ix_(rows, positions)].ravel()
        return keys, np.tile(self.sequences[positions], len(rows))

    def table(self, sentences: np.ndarray) -> Dict[int, int]:
        """The neighbours' table of these sentences: key -> value (the most
        frequent next token and its confidence, :func:`_table_values`), every order."""
        positions = self._positions(np.asarray(sentences, dtype=np.int64))
        keys, nexts, tops, totals = _most_frequent(*self._keys_at(positions, range(1, self.order + 1)))
        return dict(zip(keys.tolist(), _table_values(nexts, tops, totals).tolist()))

    def lookup(self, key: int) -> Optional[int]:
        """The corpus table's value for this key (None where unknown)."""
        if self._table is not None:
            return self._table.get(key)
        at = int(np.searchsorted(self.keys, np.uint64(key)))
        return int(self.values[at]) if at < self.keys.size and int(self.keys[at]) == key else None


def context_keys(context: Sequence[int], order: int) -> List[int]:
    """Keys of the last 1 .. ``order`` tokens of ``context`` (a shorter
    context is preceded by sentinels, as in the corpus)."""
    keys, h = [], 0
    for n in range(1, order + 1):
        token = context[-n] if n <= len(context) else -1
        h = (h * _P + token + 1) & _MASK
        keys.append((h * _ORDER_BITS + n) & _MASK)
    return keys


class NgramDrafter(Drafter):
    """Drafts from an :class:`NgramCorpus` (see the module docstring).  Before
    a row's first draft it retrieves the row's neighbours and makes their
    table; per iteration it reads the rows' last ``order`` tokens from the
    host.  A draft stops before the token at which the product of its
    tokens' confidences would fall below ``min_confidence`` (0: drafts of k
    tokens wherever a context is known).  Drafts carry no log-probs (the
    loop's ``--draft-min-confidence`` does not apply)."""

    def __init__(self, corpus: NgramCorpus, neighbours: int, pad: int, eos: int,
                 min_confidence: float = NGRAM_MIN_CONFIDENCE):
        check_options(corpus.order, neighbours, min_confidence)
        self.corpus = corpus
        self.neighbours = neighbours
        self.min_confidence = min_confidence
        # the cut in quantized units: a draft continues while prod(q / CONF_MAX) >= min_confidence
        self._floor = min_confidence * CONF_MAX
        self.pad, self.eos = pad, eos
        self.sources: List[List[int]] = []  # per row, its source tokens
        self.tables: List[Optional[Dict[int, int]]] = []  # per row, its neighbours' table (None: not made yet)

    def start_batch(self, state) -> None:
        # retrieval waits for a row's first draft (a large batch may not draft at first: --draft-max-rows)
        self.sources = [[t for t in row if t != self.pad] for row in state.net_input["src_tokens"].tolist()]
        self.tables = [None] * len(self.sources)

    def _table(self, i: int) -> Dict[int, int]:
        table = self.tables[i]
        if table is None:
            near = self.corpus.neighbours(self.sources[i], self.neighbours)
            table = self.tables[i] = self.corpus.table(near) if near.size else {}
        return table

    def _draft(self, table: Dict[int, int], context: List[int], k: int) -> List[int]:
        order = self.corpus.order
        lookup = self.corpus.lookup
        draft: List[int] = []
        # the product of the confidences so far, in units of 1 / CONF_MAX
        sure = float(CONF_MAX)
        floor = self._floor
        for _ in range(k):
            keys = context_keys(context, order)
            value = table.get(keys[-1])
            if value is None:
                value = lookup(keys[-1])
            n = order - 1
            while value is None and n > 0:
                value = table.get(keys[n - 1])
                n -= 1
            if value is None:
                value = lookup(keys[0])
            if value is None:
                break
            sure = sure * (value & CONF_MAX) / CONF_MAX
            if sure < floor:
                break
            token = value >> CONF_BITS
            draft.append(token)
            context = context + [token]
            if token == self.eos:
                break
        return draft

    def propose(self, state, k):
        # every row's last `order` tokens (BOS included), all rows in one read
        contexts = row_tails(state, self.corpus.order)
        drafts = [self._draft(self._table(i), context, k) for i, context in enumerate(contexts)]
        return padded_drafts(drafts, self.pad, state.tokens), None

    def reorder(self, order, order_host) -> None:
        self.sources = [self.sources[i] for i in order_host]
        self.tables = [self.tables[i] for i in order_host]

    def describe(self) -> str:
        return (f"n-gram continuations of {self.corpus.sentences} corpus sentences (order {self.corpus.order}, "
                f"{self.neighbours} neighbours per sentence, drafts while confidence >= {self.min_confidence:g})")


def check_options(order: int, neighbours: int, min_confidence: float) -> None:
    """Refuse out-of-range ``--ngram-*`` options (before any corpus is read)."""
    if order < 1:
        raise ValueError(f"--ngram-order must be >= 1, got {order}")
    if neighbours < 0:
        raise ValueError(f"--ngram-neighbours must be >= 0, got {neighbours}")
    if not 0.0 <= min_confidence < 1.0:
        raise ValueError(f"--ngram-min-confidence must be in [0, 1), got {min_confidence}")


def load_ngram_corpus(task, split: str, order: int) -> NgramCorpus:
    """The :class:`NgramCorpus` of the task's binarized ``split`` (source and
    target, the task's dictionaries), built once per task, split and order."""
    cache = task.__dict__.setdefault("_specdec_ngram_corpora", {})
    key = (split, order)
    if key in cache:
        return cache[key]
    previous = task.datasets.get(split)
    try:
        task.load_dataset(split)
    except FileNotFoundError as e:
        raise FileNotFoundError(
            f"--ngram-split {split}: no binarized split '{split}' in the data directory ({e}); "
            "give a split that fairseq-preprocess made (the recipe's distillation: train)"
        ) from None
    dataset = task.datasets[split]
    if previous is not None:
        task.datasets[split] = previous
    else:
        del task.datasets[split]
    if getattr(dataset, "tgt", None) is None:
        raise ValueError(f"--ngram-split {split}: the split has no target side to draft from")
    started = time.perf_counter()
    sources = [dataset.src[i].tolist() for i in range(len(dataset))]
    targets = [dataset.tgt[i].tolist() for i in range(len(dataset))]
    src_dict, tgt_dict = task.source_dictionary, task.target_dictionary
    corpus = NgramCorpus(sources, targets, order, bos=tgt_dict.eos(),
                         skip=(src_dict.pad(), src_dict.eos(), src_dict.bos(), src_dict.unk()))
    logger.info(f"n-gram drafter: {corpus.sentences} sentences of split '{split}', order {order}, "
                f"{corpus.keys.size} corpus contexts, built in {time.perf_counter() - started:.1f} s")
    cache[key] = corpus
    return corpus
