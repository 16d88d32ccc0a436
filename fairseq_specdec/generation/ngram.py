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

Both are made from arrays built once per split and order and saved beside
the data (:mod:`.ngram_index`, ``scripts/ngram-index.py``), which every
decoding memory-maps; retrieval reads at most :data:`RETRIEVAL_BUDGET`
postings per sentence, so that neither start-up nor retrieval grows with
the corpus (docs/ngram.md).

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
import heapq
import logging
import time
from typing import Dict, List, Optional, Sequence

import numpy as np

from .drafters import Drafter, PathDrafter, TreeDrafter, padded_drafts, row_tails
from .options import NgramOptions
from .tree import tree_from_paths
from .ngram_index import (
    CONF_BITS, CONF_MAX, SplitSource, build_tables, context_keys_at as _context_keys, most_frequent as _most_frequent,
    open_index, table_values as _table_values,
)

logger = logging.getLogger(__name__)

_MASK = (1 << 64) - 1
_P = 1_000_003  # hash multiplier (as ngram_index's)
_ORDER_BITS = 8  # key = hash * 8 + n
#: corpus tables of at most this many contexts are kept as a dict too (about 100 MB at most), larger
#: ones are searched in their sorted (memory-mapped) keys
DICT_LIMIT = 1_000_000
#: postings read per sentence by retrieval, the rarest source tokens' first
#: (a cap: the cost of retrieval does not grow with the corpus)
RETRIEVAL_BUDGET = 1 << 14
#: --ngram-min-confidence's default (chosen by measurement: docs/architecture.md, "Drafting from a corpus")
NGRAM_MIN_CONFIDENCE = 0.25


class NgramCorpus:
    """The corpus side of :class:`NgramDrafter`: the target sentences as one
    array, the corpus table and an inverted index of the sources for
    retrieval, as arrays (in memory, or memory-mapped from a saved index:
    :meth:`from_arrays`, :mod:`.ngram_index`).

    ``sources`` / ``targets``: token id sequences of the corpus (targets end
    with EOS, as fairseq stores them); ``bos``: the token before each output
    (fairseq's EOS); ``skip``: source ids that never count for retrieval
    (pad, EOS, BOS, unk).  ``order`` >= 1 (:class:`~.options.NgramOptions`
    checks ``--ngram-order``)."""

    def __init__(self, sources: List[Sequence[int]], targets: List[Sequence[int]], order: int, bos: int,
                 skip: Sequence[int] = ()):
        if len(sources) != len(targets):
            raise ValueError("the corpus has a different number of source and target sentences")

        def flat(sentences):
            sizes = np.array([len(s) for s in sentences], dtype=np.int64)
            tokens = np.array([t for s in sentences for t in s], dtype=np.int64)
            return tokens, sizes

        (src, src_sizes), (tgt, tgt_sizes) = flat(sources), flat(targets)
        src_vocab = int(src.max()) + 1 if src.size else 1
        tgt_vocab = max(int(tgt.max()) + 1 if tgt.size else 1, bos + 1)
        self._attach(build_tables(src, src_sizes, tgt, tgt_sizes, order, bos, src_vocab, tgt_vocab, skip), order)

    @classmethod
    def from_arrays(cls, arrays: Dict[str, np.ndarray], order: int) -> "NgramCorpus":
        """A corpus over the arrays of :func:`.ngram_index.build_tables` (or a saved index's, memory-mapped)."""
        corpus = cls.__new__(cls)
        corpus._attach(arrays, order)
        return corpus

    def _attach(self, arrays: Dict[str, np.ndarray], order: int) -> None:
        self.order = order
        self.sequences, self.offsets = arrays["sequences"], arrays["offsets"]
        self.sentences = int(self.offsets.shape[0]) - 1
        self.keys, self.values = arrays["keys"], arrays["values"]
        self.postings, self.posting_starts = arrays["postings"], arrays["posting_starts"]
        # a dict where it is small (a lookup of a few hundred nanoseconds), else a search of the sorted keys
        self._table = dict(zip(self.keys.tolist(), self.values.tolist())) if self.keys.size <= DICT_LIMIT else None
        #: postings read per sentence at most (see :data:`RETRIEVAL_BUDGET`)
        self.budget = RETRIEVAL_BUDGET
        # retrieval's running scores, one per corpus sentence, all zero between calls (allocated
        # once: the pages a retrieval touches are its postings' sentences; not for concurrent use)
        self._scores = np.zeros(self.sentences, dtype=np.float64)

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
        out), best first (ties: corpus order).

        Its cost does not grow with the corpus: the postings of the source's
        tokens are read rarest token first, at most :attr:`budget` of them
        (the token that does not fit whole is read in part, its first
        sentences), so a sentence that shares only common tokens can be
        missed in a corpus where those are read in part."""
        if count <= 0 or self.sentences == 0:
            return np.zeros(0, dtype=np.int64)
        types = self.posting_starts.shape[0] - 1
        tokens = np.unique(np.asarray(list(source), dtype=np.int64))
        tokens = tokens[(tokens >= 0) & (tokens < types)]
        first = np.asarray(self.posting_starts[tokens], dtype=np.int64)
        df = np.asarray(self.posting_starts[tokens + 1], dtype=np.int64) - first
        known = df > 0
        first, df = first[known], df[known]
        idf = np.log(self.sentences / np.maximum(df, 1))
        useful = idf > min_idf
        first, df, idf = first[useful], df[useful], idf[useful]
        if df.size == 0:
            return np.zeros(0, dtype=np.int64)
        scores, left, hits = self._scores, self.budget, []
        for at in np.argsort(df, kind="stable").tolist():
            take = min(int(df[at]), left)
            rows = self.postings[first[at]: first[at] + take]
            scores[rows] += idf[at]  # a sentence is in a token's list once
            hits.append(rows)
            left -= take
            if left == 0:
                break
        hits = np.concatenate(hits)
        try:
            got = scores[hits]
            # the top ``count`` lie among the sentences scoring at least half the best, when there are that many
            candidates = np.unique(hits[got >= 0.5 * got.max()])
            if candidates.size < count:
                candidates = np.unique(hits)
            best = scores[candidates]
        finally:
            scores[hits] = 0.0
        if candidates.size > count:
            keep = np.argpartition(-best, count - 1)[:count]
            candidates, best = candidates[keep], best[keep]
        return candidates[np.lexsort((candidates, -best))].astype(np.int64)

    def table(self, sentences: np.ndarray) -> Dict[int, int]:
        """The neighbours' table of these sentences: key -> value (the most
        frequent next token and its confidence, :func:`_table_values`), every order."""
        positions = self._positions(np.asarray(sentences, dtype=np.int64))
        keys, nexts, tops, totals = _most_frequent(*_context_keys(self.sequences, positions, self.order,
                                                                  range(1, self.order + 1)))
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


class NgramDrafter(Drafter, PathDrafter, TreeDrafter):
    """Drafts from an :class:`NgramCorpus` (see the module docstring).  Before
    a row's first draft it retrieves the row's neighbours and makes their
    table; per iteration it reads the rows' last ``order`` tokens from the
    host.  A draft stops before the token at which the product of its
    tokens' confidences would fall below ``min_confidence`` (0: drafts of k
    tokens wherever a context is known).  Drafts carry no log-probs (the
    loop's ``--draft-min-confidence`` does not apply).  ``neighbours`` >= 0
    and ``min_confidence`` in [0, 1), as :class:`~.options.NgramOptions`
    checks them."""

    def __init__(self, corpus: NgramCorpus, neighbours: int, pad: int, eos: int,
                 min_confidence: float = NGRAM_MIN_CONFIDENCE):
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
        draft: List[int] = []
        # the product of the confidences so far, in units of 1 / CONF_MAX
        sure = float(CONF_MAX)
        floor = self._floor
        for _ in range(k):
            value = next(self._continuations(table, context_keys(context, order)), None)
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

    # -- draft trees ---------------------------------------------------------

    def _continuations(self, table: Dict[int, int], keys: List[int]):
        """The table entries the tables hold for a context (its
        :func:`context_keys`), in the order a draft prefers them: the
        neighbours' longest context, the corpus's full context, the
        neighbours' shorter ones, the corpus's last token.  A chain takes
        the first; a tree every one (:meth:`_candidates`)."""
        lookup = self.corpus.lookup
        for value in (table.get(keys[-1]), lookup(keys[-1])):
            if value is not None:
                yield value
        for n in range(len(keys) - 1, 0, -1):
            value = table.get(keys[n - 1])
            if value is not None:
                yield value
        value = lookup(keys[0])
        if value is not None:
            yield value

    def _candidates(self, table: Dict[int, int], context: List[int]) -> List[tuple]:
        """Every continuation the tables hold for ``context``, in the order of
        :meth:`_continuations`, each token once, with its confidence (a
        fraction)."""
        seen: Dict[int, float] = {}
        for value in self._continuations(table, context_keys(context, self.corpus.order)):
            seen.setdefault(value >> CONF_BITS, (value & CONF_MAX) / CONF_MAX)
        return list(seen.items())

    def tree_paths(self, state, k: int, nodes: int) -> List[List[tuple]]:
        """Per row, the ``nodes`` most confident draft prefixes (a path's
        confidence: the product of its tokens', as a chain's cut reads it),
        found best first over every continuation the tables hold (the
        competing continuations of each context: a trie of them), each at
        least ``min_confidence``, at most ``k`` tokens, none after an EOS:
        ``(tokens, confidence)`` pairs, parents first."""
        contexts = row_tails(state, self.corpus.order)
        floor = self.min_confidence
        rows = []
        for i, context in enumerate(contexts):
            table = self._table(i)
            heap = [(-1.0, 0, [])]
            count = 1
            out = []
            while heap and len(out) < nodes:
                negative, _, tokens = heapq.heappop(heap)
                if tokens:
                    out.append((tokens, -negative))
                    if len(tokens) >= k or tokens[-1] == self.eos:
                        continue
                for token, sure in self._candidates(table, context + tokens):
                    score = -negative * sure
                    if score >= floor and score > 0:
                        heapq.heappush(heap, (-score, count, tokens + [token]))
                        count += 1
            rows.append(out)
        return rows

    def propose_tree(self, state, k, nodes):
        return tree_from_paths(self.tree_paths(state, k, nodes), nodes, self.pad, state.tokens)

    def reorder(self, order, order_host) -> None:
        self.sources = [self.sources[i] for i in order_host]
        self.tables = [self.tables[i] for i in order_host]

    def describe(self) -> str:
        return (f"n-gram continuations of {self.corpus.sentences} corpus sentences (order {self.corpus.order}, "
                f"{self.neighbours} neighbours per sentence, drafts while confidence >= {self.min_confidence:g})")


def check_not_translated(task, split: str) -> None:
    """Refuse drafting from the split being translated (fairseq-generate's
    ``--gen-subset``, which it loads before building the generator; a split
    the trainer loaded to train on is no such split; fairseq-interactive
    loads none)."""
    dataset = getattr(task, "datasets", {}).get(split)
    if dataset is None:
        return
    is_training = getattr(task, "is_training_dataset", None)
    if is_training is not None and is_training(dataset):
        return
    raise ValueError(
        f"--ngram-split {split} is the split being translated (--gen-subset {split}): drafting from it would "
        "put its reference translations into the draft table (the output stays exact, but the speed and "
        "acceptance measured that way are inflated); draft from another split (default train, best the "
        "verifier's distillation of its training set)"
    )


def load_ngram_corpus(task, options: NgramOptions, cache: Optional[Dict[tuple, NgramCorpus]] = None) -> NgramCorpus:
    """The :class:`NgramCorpus` of the binarized split ``options.split`` of
    ``options.data_dir`` (source and target, the task's dictionaries), once
    per split and order in ``cache``
    (the task's :attr:`~fairseq_specdec.generation.services.GenerationServices.ngram_corpora`;
    None: not kept): the split's saved index memory-mapped, built and saved
    first where there is none (:func:`.ngram_index.open_index`)."""
    cache = {} if cache is None else cache
    split, order = options.split, options.order
    key = (split, order)
    if key in cache:
        return cache[key]
    check_not_translated(task, split)
    source = SplitSource(options.data_dir, split, options.source_lang, options.target_lang, task.source_dictionary,
                         task.target_dictionary)
    started = time.perf_counter()
    directory, meta, arrays = open_index(source, order)
    corpus = NgramCorpus.from_arrays(arrays, order)
    logger.info(f"n-gram drafter: {corpus.sentences} sentences of split '{split}', order {order}, "
                f"{corpus.keys.size} corpus contexts, ready in {time.perf_counter() - started:.1f} s ({directory})")
    cache[key] = corpus
    return corpus
