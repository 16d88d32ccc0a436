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
"""
import logging
import math
import time
from typing import Dict, List, Optional, Sequence

import numpy as np

from .drafters import Drafter, padded_drafts

logger = logging.getLogger(__name__)

_MASK = (1 << 64) - 1
_P = 1_000_003  # hash multiplier
_ORDER_BITS = 8  # key = hash * 8 + n
#: corpus tables of at most this many contexts are kept as a dict too
DICT_LIMIT = 4_000_000


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
    smallest id).  Returns (sorted distinct keys, their next tokens)."""
    if keys.size == 0:
        return keys, nexts
    order = np.lexsort((nexts, keys))
    k, t = keys[order], nexts[order]
    run = np.ones(k.size, dtype=bool)
    run[1:] = (k[1:] != k[:-1]) | (t[1:] != t[:-1])
    starts = np.flatnonzero(run)
    counts = np.diff(np.append(starts, k.size))
    rk, rt = k[starts], t[starts]
    best = np.lexsort((rt, -counts, rk))
    rk, rt = rk[best], rt[best]
    first = np.ones(rk.size, dtype=bool)
    first[1:] = rk[1:] != rk[:-1]
    return rk[first], rt[first]


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
        keys, nexts = _context_keys(seq, self._positions(np.arange(len(targets))), order, {1, order})
        self.keys, self.nexts = _most_frequent(keys, nexts)
        # a dict where it fits (a lookup of a few hundred nanoseconds), else a search of the sorted keys
        self._table = dict(zip(self.keys.tolist(), self.nexts.tolist())) if self.keys.size <= DICT_LIMIT else None
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
        self._postings: Dict[int, tuple] = {
            int(t): (int(f), int(c)) for t, f, c in zip(types.tolist(), first.tolist(), counts.tolist())
        }
        self._idf = {t: math.log(max(1, self.sentences) / c) for t, (_, c) in self._postings.items()}

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
        hits, weights = [], []
        for t in set(int(x) for x in source):
            posting = self._postings.get(t)
            if posting is None or self._idf[t] <= min_idf:
                continue
            first, n = posting
            hits.append(self._posting_rows[first : first + n])
            weights.append(np.full(n, self._idf[t]))
        if not hits:
            return np.zeros(0, dtype=np.int64)
        scores = np.bincount(np.concatenate(hits), weights=np.concatenate(weights), minlength=self.sentences)
        # the top ``count`` lie among the sentences scoring at least half the best, when there are that many
        candidates = np.flatnonzero(scores >= 0.5 * scores.max())
        if candidates.size < count:
            candidates = np.flatnonzero(scores)
        if candidates.size > count:
            candidates = candidates[np.argpartition(-scores[candidates], count - 1)[:count]]
        return candidates[np.lexsort((candidates, -scores[candidates]))]

    def table(self, sentences: np.ndarray) -> Dict[int, int]:
        """The neighbours' table of these sentences: key -> most frequent next token, every order."""
        positions = self._positions(np.asarray(sentences, dtype=np.int64))
        keys, nexts = _context_keys(self.sequences, positions, self.order, set(range(1, self.order + 1)))
        keys, nexts = _most_frequent(keys, nexts)
        return dict(zip(keys.tolist(), nexts.tolist()))

    def lookup(self, key: int) -> Optional[int]:
        """The corpus table's next token for this key (None where unknown)."""
        if self._table is not None:
            return self._table.get(key)
        at = int(np.searchsorted(self.keys, np.uint64(key)))
        return int(self.nexts[at]) if at < self.keys.size and int(self.keys[at]) == key else None


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
    host.  Drafts carry no log-probs (the confidence cut does not apply)."""

    def __init__(self, corpus: NgramCorpus, neighbours: int, pad: int, eos: int):
        if neighbours < 0:
            raise ValueError(f"--ngram-neighbours must be >= 0, got {neighbours}")
        self.corpus = corpus
        self.neighbours = neighbours
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
        draft: List[int] = []
        for _ in range(k):
            keys = context_keys(context, order)
            token = table.get(keys[-1])
            if token is None:
                token = self.corpus.lookup(keys[-1])
            n = order - 1
            while token is None and n > 0:
                token = table.get(keys[n - 1])
                n -= 1
            if token is None:
                token = self.corpus.lookup(keys[0])
            if token is None:
                break
            draft.append(token)
            context = context + [token]
            if token == self.eos:
                break
        return draft

    def propose(self, state, k):
        order = self.corpus.order
        drafts = []
        for i, n in enumerate(state.lengths_host):
            context = state.tokens[i, max(0, n + 1 - order) : n + 1].tolist()
            drafts.append(self._draft(self._table(i), context, k))
        return padded_drafts(drafts, self.pad, state.tokens), None

    def reorder(self, order, order_host) -> None:
        self.sources = [self.sources[i] for i in order_host]
        self.tables = [self.tables[i] for i in order_host]

    def describe(self) -> str:
        return (f"n-gram continuations of {self.corpus.sentences} corpus sentences (order {self.corpus.order}, "
                f"{self.neighbours} neighbours per sentence)")


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
