"""The saved index of ``--decoding ngram``: its corpus tables as flat numpy
arrays, built once per binarized split and order, memory-mapped by every
later decoding.

An index is a directory ``{split}.{src}-{tgt}.ngram-order{N}`` beside the
binarized data (or, where the data directory is not writable, under the
cache directory: ``$XDG_CACHE_HOME/fairseq_specdec/ngram/`` or
``~/.cache/fairseq_specdec/ngram/``), holding

* ``meta.json``: what it was built from (format version, split, languages,
  order, sentence and token counts, a checksum of the sentence lengths, the
  fingerprints and sizes of both dictionaries, the largest token ids);
* ``sequences.npy`` (int32): every target sentence as ``order`` sentinels
  (-1), BOS, its tokens; ``offsets.npy`` (int64): where each starts;
* ``keys.npy`` (uint64, sorted) and ``values.npy``: the corpus table (see
  :mod:`.ngram`);
* ``postings.npy`` (int32) and ``posting_starts.npy`` (int64): for each
  source token type, the sentences whose source holds it, ascending
  (``postings[posting_starts[t]:posting_starts[t + 1]]``).

Every array is read with ``np.load(..., mmap_mode="r", allow_pickle=False)``:
an index cannot run code, however it was obtained.  It is written into a
temporary directory renamed into place when complete, so a failed or
interrupted build leaves nothing behind.  Building reads the split's
``.bin`` files memory-mapped and works in chunks of sentences and buckets
of contexts: its memory does not grow with the corpus (beyond the outputs,
written to memory-mapped files).
"""
import hashlib
import json
import logging
import math
import os
import shutil
import signal
import tempfile
import threading
import time
from typing import Callable, Dict, Optional, Sequence, Tuple

import numpy as np

from ..utils.dictionary import dictionary_fingerprint

logger = logging.getLogger(__name__)

FORMAT = "fairseq_specdec ngram index"
#: bumped whenever the files or their meaning change: an index of another version is refused (or rebuilt)
FORMAT_VERSION = 1
META = "meta.json"
ARRAYS = ("sequences", "offsets", "keys", "values", "postings", "posting_starts")

_P = 1_000_003  # hash multiplier
_ORDER_BITS = 8  # key = hash * 8 + n
#: tokens per chunk of sentences while building
CHUNK_TOKENS = 1 << 22
#: (context, next token) pairs per bucket of the corpus table's build
BUCKET_PAIRS = 1 << 24


class NgramIndexError(ValueError):
    """An index or split that cannot be used (the message names it and the fix)."""


# ---------------------------------------------------------------------------
# hashing and counting (shared with the drafter's per-sentence tables)

def context_keys_at(sequences: np.ndarray, starts: np.ndarray, order: int, orders: Sequence[int]):
    """Keys and next tokens of positions ``starts`` of ``sequences`` (each
    sequence preceded by ``order`` sentinels of -1) for the context lengths
    ``orders``.  Returns (keys uint64, next int64), one entry per position and
    order, orders ascending."""
    h = np.zeros(starts.shape[0], dtype=np.uint64)
    keys, nexts = [], []
    nxt = np.asarray(sequences[starts], dtype=np.int64)
    for n in range(1, order + 1):
        with np.errstate(over="ignore"):
            h = h * np.uint64(_P) + (np.asarray(sequences[starts - n], dtype=np.int64) + 1).astype(np.uint64)
            if n in orders:
                keys.append(h * np.uint64(_ORDER_BITS) + np.uint64(n))
                nexts.append(nxt)
    if not keys:
        return np.zeros(0, dtype=np.uint64), np.zeros(0, dtype=np.int64)
    return np.concatenate(keys), np.concatenate(nexts)


def most_frequent(keys: np.ndarray, nexts: np.ndarray):
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


#: a table value is ``next_token << CONF_BITS | q``, the confidence quantized to ``q / CONF_MAX``
CONF_BITS = 10
CONF_MAX = (1 << CONF_BITS) - 1


def table_values(nexts: np.ndarray, tops: np.ndarray, totals: np.ndarray) -> np.ndarray:
    """Table values: each next token with its confidence ``top / (total + 1)``,
    quantized to ``CONF_BITS`` bits (rounded down)."""
    q = (tops.astype(np.int64) * CONF_MAX) // (totals.astype(np.int64) + 1)
    return (nexts.astype(np.int64) << CONF_BITS) | q


# ---------------------------------------------------------------------------
# building

Alloc = Callable[[str, Tuple[int, ...], type], np.ndarray]


def in_memory(name: str, shape, dtype) -> np.ndarray:
    """An :data:`Alloc` of plain arrays (the in-memory build)."""
    return np.empty(shape, dtype=dtype)


def _chunks(sizes: np.ndarray, limit: int = CHUNK_TOKENS):
    """(first, last) sentence ranges of at most ``limit`` tokens each (a longer sentence alone)."""
    ends = np.cumsum(sizes)
    first, total = 0, 0
    n = sizes.size
    while first < n:
        last = int(np.searchsorted(ends, total + limit, side="right"))
        last = max(last, first + 1)
        yield first, last
        total = int(ends[last - 1])
        first = last


def _sentence_ids(first: int, sizes: np.ndarray) -> np.ndarray:
    return np.repeat(np.arange(first, first + sizes.size, dtype=np.int64), sizes)


def _write_sequences(tgt_tokens, tgt_sizes, order, bos, alloc: Alloc):
    n = tgt_sizes.size
    offsets = alloc("offsets", (n + 1,), np.int64)
    offsets[0] = 0
    np.cumsum(tgt_sizes + 1 + order, out=offsets[1:])
    seq = alloc("sequences", (int(offsets[-1]),), np.int32)
    token_starts = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(tgt_sizes, out=token_starts[1:])
    for first, last in _chunks(tgt_sizes):
        sizes = tgt_sizes[first:last]
        lo, hi = int(offsets[first]), int(offsets[last])
        part = np.full(hi - lo, -1, dtype=np.int32)
        part[offsets[first:last] - lo + order] = bos
        # token j of sentence i goes to offsets[i] + order + 1 + j
        shift = np.repeat(offsets[first:last] - lo + order + 1 - (token_starts[first:last] - token_starts[first]), sizes)
        part[shift + np.arange(shift.size)] = tgt_tokens[token_starts[first]:token_starts[last]]
        seq[lo:hi] = part
    return seq, offsets


def target_positions(offsets: np.ndarray, order: int, sentences: np.ndarray) -> np.ndarray:
    """Indexes into ``sequences`` of the target tokens (each with a context) of these sentences."""
    if sentences.size == 0:
        return np.zeros(0, dtype=np.int64)
    first = np.asarray(offsets[sentences], dtype=np.int64) + order + 1
    count = np.asarray(offsets[sentences + 1], dtype=np.int64) - first
    base = np.repeat(first - np.cumsum(np.append(0, count[:-1])), count)
    return base + np.arange(int(count.sum()))


def _chunk_positions(offsets, order, first, last):
    return target_positions(offsets, order, np.arange(first, last, dtype=np.int64))


#: sentences whose keys are sampled to cut the corpus table's build into key ranges
SAMPLE_SENTENCES = 200_000


def _corpus_table(seq, offsets, tgt_sizes, order, alloc: Alloc, value_dtype, spill_dir: Optional[str] = None):
    """The corpus table (contexts of 1 and ``order`` tokens).  Where it has
    more than :data:`BUCKET_PAIRS` (context, next token) pairs, one pass over
    the sentences spills the pairs to files by key range (ranges of about
    equal counts, cut at the quantiles of a sample's keys), and each range is
    counted alone: the memory of the build is about one range's."""
    orders = sorted({1, order})
    pairs = int(tgt_sizes.sum()) * len(orders)
    buckets = max(1, math.ceil(pairs / BUCKET_PAIRS))
    parts = []
    if buckets == 1:
        got = [context_keys_at(seq, _chunk_positions(offsets, order, a, b), order, orders)
               for a, b in _chunks(tgt_sizes)]
        k, x, tops, totals = most_frequent(np.concatenate([g[0] for g in got]), np.concatenate([g[1] for g in got]))
        parts.append((k, table_values(x, tops, totals).astype(value_dtype)))
    else:
        n = tgt_sizes.size
        pick = np.sort(np.random.default_rng(0).choice(n, size=min(n, SAMPLE_SENTENCES), replace=False))
        sample = np.sort(context_keys_at(seq, target_positions(offsets, order, pick), order, orders)[0])
        bounds = np.unique(sample[(np.arange(1, buckets) * sample.size) // buckets])
        with tempfile.TemporaryDirectory(prefix=".spill-", dir=spill_dir) as tmp:
            names = [(os.path.join(tmp, f"{b}.keys"), os.path.join(tmp, f"{b}.next")) for b in range(bounds.size + 1)]
            files = [(open(a, "wb"), open(b, "wb")) for a, b in names]
            try:
                for first, last in _chunks(tgt_sizes):
                    k, x = context_keys_at(seq, _chunk_positions(offsets, order, first, last), order, orders)
                    at = np.searchsorted(bounds, k, side="right")
                    by = np.argsort(at, kind="stable")
                    k, x = k[by], x[by].astype(np.int32)
                    ends = np.cumsum(np.bincount(at, minlength=bounds.size + 1))
                    for b, (fk, fx) in enumerate(files):
                        lo = int(ends[b - 1]) if b else 0
                        k[lo:ends[b]].tofile(fk)
                        x[lo:ends[b]].tofile(fx)
            finally:
                for fk, fx in files:
                    fk.close()
                    fx.close()
            for key_path, next_path in names:
                k = np.fromfile(key_path, dtype=np.uint64)
                x = np.fromfile(next_path, dtype=np.int32).astype(np.int64)
                os.remove(key_path)
                os.remove(next_path)
                k, x, tops, totals = most_frequent(k, x)
                parts.append((k, table_values(x, tops, totals).astype(value_dtype)))
    total = sum(k.size for k, _ in parts)
    keys_out = alloc("keys", (total,), np.uint64)
    values_out = alloc("values", (total,), value_dtype)
    at = 0
    for k, v in parts:  # key ranges ascend: the keys come out sorted
        keys_out[at:at + k.size] = k
        values_out[at:at + k.size] = v
        at += k.size
    return keys_out, values_out


def _postings(src_tokens, src_sizes, vocab: int, skip: Sequence[int], alloc: Alloc):
    """For each source token type (< ``vocab``), the sentences whose source
    holds it (once each, ascending): a counting pass, then a placing pass."""
    n = src_sizes.size
    skip_mask = np.zeros(vocab, dtype=bool)
    for s in skip:
        if 0 <= s < vocab:
            skip_mask[s] = True
    starts = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(src_sizes, out=starts[1:])

    def distinct(first, last):
        tokens = np.asarray(src_tokens[starts[first]:starts[last]], dtype=np.int64)
        ids = _sentence_ids(first, src_sizes[first:last])
        keep = ~skip_mask[tokens]
        # (token, sentence) once, by token then sentence
        pairs = np.unique(tokens[keep] * n + ids[keep])
        return pairs // n, pairs % n

    df = np.zeros(vocab, dtype=np.int64)
    for first, last in _chunks(src_sizes):
        df += np.bincount(distinct(first, last)[0], minlength=vocab)
    posting_starts = alloc("posting_starts", (vocab + 1,), np.int64)
    posting_starts[0] = 0
    np.cumsum(df, out=posting_starts[1:])
    postings = alloc("postings", (int(posting_starts[-1]),), np.int32)
    cursor = np.array(posting_starts[:-1], dtype=np.int64)
    for first, last in _chunks(src_sizes):  # sentences ascend: each token's list comes out ascending
        tokens, ids = distinct(first, last)
        if tokens.size == 0:
            continue
        run = np.flatnonzero(np.diff(tokens, prepend=-1))
        rank = np.arange(tokens.size) - np.repeat(run, np.diff(np.append(run, tokens.size)))
        postings[cursor[tokens] + rank] = ids
        cursor += np.bincount(tokens, minlength=vocab)
    return postings, posting_starts


def build_tables(src_tokens, src_sizes, tgt_tokens, tgt_sizes, order: int, bos: int, src_vocab: int,
                 tgt_vocab: int, skip: Sequence[int] = (), alloc: Alloc = in_memory,
                 spill_dir: Optional[str] = None) -> Dict[str, np.ndarray]:
    """Every array of an index (see the module docstring) from the flat
    tokens of both sides and their sentence lengths, with vectorised numpy
    over chunks of sentences; ``alloc`` makes each output array (in memory,
    or a memory-mapped file of the index being written); ``spill_dir``:
    where a large corpus table's build spills its key ranges (default: the
    system's temporary directory)."""
    src_sizes = np.asarray(src_sizes, dtype=np.int64)
    tgt_sizes = np.asarray(tgt_sizes, dtype=np.int64)
    seq, offsets = _write_sequences(tgt_tokens, tgt_sizes, order, bos, alloc)
    value_dtype = np.uint32 if (tgt_vocab << CONF_BITS) < (1 << 32) else np.int64
    keys, values = _corpus_table(seq, offsets, tgt_sizes, order, alloc, value_dtype, spill_dir)
    postings, posting_starts = _postings(src_tokens, src_sizes, src_vocab, skip, alloc)
    return {"sequences": seq, "offsets": offsets, "keys": keys, "values": values,
            "postings": postings, "posting_starts": posting_starts}


# ---------------------------------------------------------------------------
# the split's files

def split_prefixes(data_dir: str, split: str, src: str, tgt: str, option: str = "--ngram-split"):
    """The binarized files' prefixes (source, target) of ``split`` in
    ``data_dir``, as fairseq's translation task names them."""
    from fairseq.data import indexed_dataset

    for a, b in ((src, tgt), (tgt, src)):
        base = os.path.join(data_dir, f"{split}.{a}-{b}.")
        if all(indexed_dataset.dataset_exists(base + lang, "mmap") or indexed_dataset.dataset_exists(base + lang, "lazy")
               for lang in (src, tgt)):
            return base + src, base + tgt
    raise FileNotFoundError(
        f"{option} {split}: no binarized split '{split}' in the data directory {data_dir} "
        f"(no {split}.{src}-{tgt}.{src}.bin/.idx); give a split that fairseq-preprocess made "
        "(the recipe's distillation: train)"
    )


def read_side(prefix: str, option: str, split: str):
    """(flat tokens memory-mapped, sentence lengths int64) of one side of a
    split binarized by fairseq-preprocess (``--dataset-impl mmap``)."""
    from fairseq.data import indexed_dataset

    if indexed_dataset.infer_dataset_impl(prefix) != "mmap":
        raise NgramIndexError(
            f"{option} {split}: {prefix}.idx is not a memory-mapped fairseq split; --decoding ngram reads "
            "splits binarized with fairseq-preprocess's default --dataset-impl mmap"
        )
    index = indexed_dataset.MMapIndexedDataset.Index(indexed_dataset.index_file_path(prefix))
    dtype, sizes = index.dtype, np.array(index.sizes, dtype=np.int64)
    del index
    path = indexed_dataset.data_file_path(prefix)
    expected = int(sizes.sum()) * np.dtype(dtype).itemsize
    if os.path.getsize(path) != expected:
        raise NgramIndexError(
            f"{option} {split}: {path} holds {os.path.getsize(path)} bytes where its index describes "
            f"{expected}: a damaged or partly written split; binarize it again"
        )
    if expected == 0:
        return np.zeros(0, dtype=dtype), sizes
    return np.memmap(path, dtype=dtype, mode="r"), sizes


def describe_split(split, src, tgt, order, src_sizes, tgt_sizes, src_dict, tgt_dict, bos) -> dict:
    """What an index is built from: the fields its ``meta.json`` records and a later decoding compares."""
    digest = hashlib.sha256()
    digest.update(np.ascontiguousarray(src_sizes, dtype="<i8").tobytes())
    digest.update(np.ascontiguousarray(tgt_sizes, dtype="<i8").tobytes())
    return {
        "format": FORMAT, "version": FORMAT_VERSION, "split": split, "source_lang": src, "target_lang": tgt,
        "order": int(order), "bos": int(bos), "sentences": int(tgt_sizes.size),
        "source_tokens": int(src_sizes.sum()), "target_tokens": int(tgt_sizes.sum()),
        "sizes_sha256": digest.hexdigest(),
        "source_dictionary": str(dictionary_fingerprint(src_dict)), "source_dictionary_size": len(src_dict),
        "target_dictionary": str(dictionary_fingerprint(tgt_dict)), "target_dictionary_size": len(tgt_dict),
    }


#: meta fields whose difference makes an index stale, with what to call them
COMPARED = (
    ("version", "format version"), ("split", "split"), ("source_lang", "source language"),
    ("target_lang", "target language"), ("order", "order"), ("bos", "BOS id"), ("sentences", "sentences"),
    ("source_tokens", "source tokens"), ("target_tokens", "target tokens"),
    ("sizes_sha256", "checksum of the sentence lengths"), ("source_dictionary", "source dictionary checksum"),
    ("target_dictionary", "target dictionary checksum"),
)


def differences(meta: dict, want: dict):
    return [f"{name} {meta.get(field)!r} (now {want[field]!r})" for field, name in COMPARED
            if meta.get(field) != want[field]]


def check_ids(option, split, side, max_id, dictionary, dict_path):
    """Refuse a split whose token ids go past its dictionary (binarized with another one)."""
    if max_id >= len(dictionary):
        raise NgramIndexError(
            f"{option} {split}: its {side} sentences hold token id {max_id}, past the {side} dictionary "
            f"{dict_path} of {len(dictionary)} types: the split was binarized with another dictionary "
            f"(of at least {max_id + 1} types). Binarize it with the verifier's dictionaries "
            "(fairseq-preprocess --srcdict/--tgtdict, as the recipe's distillation does)"
        )


def _max_id(tokens) -> int:
    best = -1
    for at in range(0, tokens.shape[0], 1 << 24):
        best = max(best, int(np.max(tokens[at:at + (1 << 24)])))
    return best


# ---------------------------------------------------------------------------
# where an index lives

def index_name(split: str, src: str, tgt: str, order: int) -> str:
    return f"{split}.{src}-{tgt}.ngram-order{order}"


def cache_root() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "fairseq_specdec", "ngram")


def cache_dir_for(data_dir: str) -> str:
    """The cache directory of a data directory's indexes (one per real path)."""
    real = os.path.realpath(data_dir)
    tag = hashlib.sha256(real.encode("utf-8")).hexdigest()[:16]
    return os.path.join(cache_root(), f"{os.path.basename(real.rstrip(os.sep)) or 'data'}-{tag}")


def _writable(directory: str) -> bool:
    return os.path.isdir(directory) and os.access(directory, os.W_OK | os.X_OK)


# ---------------------------------------------------------------------------
# writing and reading

def _save(directory: str, build: Callable[[Alloc], dict], meta: dict) -> None:
    """Build into a temporary directory beside ``directory`` and rename it
    into place; on any failure, remove it (nothing half-written)."""
    parent = os.path.dirname(os.path.abspath(directory))
    try:
        os.makedirs(parent, exist_ok=True)
        _remove_leftovers(directory)
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(directory)}.tmp-{os.getpid()}-", dir=parent)
    except OSError as e:
        raise NgramIndexError(
            f"n-gram index: cannot write the index into {parent} ({e.strerror or e}). It goes beside the data "
            f"where the data directory is writable, else into the cache directory ({cache_root()}): make one of "
            "them writable, or set XDG_CACHE_HOME to a writable directory"
        ) from None
    previous = None
    if threading.current_thread() is threading.main_thread():
        # a build stopped by SIGTERM (a job scheduler's, kill's) removes its files too
        previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700: others may read an index as they read the data
        arrays = {}

        def alloc(name, shape, dtype):
            arrays[name] = np.lib.format.open_memmap(os.path.join(tmp, name + ".npy"), mode="w+", dtype=dtype,
                                                     shape=shape)
            return arrays[name]

        extra = build(alloc, tmp)
        for array in arrays.values():
            array.flush()
        del arrays
        with open(os.path.join(tmp, META), "w", encoding="utf-8") as f:
            json.dump({**meta, **extra}, f, indent=1, sort_keys=True)
        try:
            os.rename(tmp, directory)
        except OSError:
            if not os.path.isfile(os.path.join(directory, META)):
                raise
            # another process finished the same index first: keep theirs
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _terminate(signum, frame):
    raise SystemExit(128 + signum)


def _remove_leftovers(directory: str) -> None:
    """Remove the temporary directories of builds of ``directory`` whose
    process is gone (killed where it could not clean up)."""
    parent, base = os.path.dirname(os.path.abspath(directory)), os.path.basename(directory)
    for name in os.listdir(parent):
        for kind in ("tmp", "old"):
            head = f".{base}.{kind}-"
            if not name.startswith(head):
                continue
            pid = name[len(head):].split("-", 1)[0]
            if not pid.isdigit() or _alive(int(pid)):
                continue
            logger.info(f"n-gram index: removing {os.path.join(parent, name)}, left by a build that was stopped")
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def read_meta(directory: str) -> dict:
    path = os.path.join(directory, META)
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise NgramIndexError(f"n-gram index {directory}: cannot read {META} ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise NgramIndexError(f"n-gram index {directory}: {META} is not a {FORMAT}'s")
    return meta


def load_arrays(directory: str) -> Dict[str, np.ndarray]:
    """Every array of an index, memory-mapped, never unpickled."""
    arrays = {}
    for name in ARRAYS:
        path = os.path.join(directory, name + ".npy")
        try:
            arrays[name] = np.load(path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as e:
            raise NgramIndexError(f"n-gram index {directory}: cannot read {name}.npy ({e}); rebuild it with "
                                  "scripts/ngram-index.py DATA_DIR --split SPLIT --force (or delete the directory)") from None
    return arrays


def check_arrays(directory: str, arrays: Dict[str, np.ndarray], meta: dict, tgt_vocab: int, rebuild: str) -> None:
    """Refuse an index whose arrays cannot be what its build wrote: token
    ids outside the target dictionary (``sequences``, the tokens of
    ``values``), sentence ids past the corpus (``postings``), offsets that
    decrease or point past their array.  Reads ``sequences`` and ``values``
    once (a decoding would index the dictionary with them)."""
    def bad(what):
        raise NgramIndexError(f"n-gram index {directory}: {what}; the files are damaged or were changed. {rebuild}")

    seq, offsets, values = arrays["sequences"], arrays["offsets"], arrays["values"]
    postings, starts = arrays["postings"], arrays["posting_starts"]
    for name, table, size in (("offsets", offsets, seq.size), ("posting_starts", starts, postings.size)):
        if table.ndim != 1 or table.size == 0 or int(table[0]) != 0 or int(table[-1]) > size \
                or bool((np.diff(table) < 0).any()):
            bad(f"{name}.npy is not an increasing table of offsets into its {size} entries")
    if offsets.size - 1 != int(meta.get("sentences", offsets.size - 1)):
        bad(f"offsets.npy has {offsets.size - 1} sentences, meta.json {meta.get('sentences')}")
    if seq.size and (int(seq.min()) < -1 or int(seq.max()) >= tgt_vocab):  # -1: the padding before a sentence
        bad(f"sequences.npy holds token ids outside the target dictionary's {tgt_vocab} types")
    if values.size and (int(values.min()) < 0 or (int(values.max()) >> CONF_BITS) >= tgt_vocab):
        bad(f"values.npy holds next tokens outside the target dictionary's {tgt_vocab} types")
    if postings.size and (int(postings.min()) < 0 or int(postings.max()) >= offsets.size - 1):
        bad(f"postings.npy holds sentence ids outside the corpus's {offsets.size - 1} sentences")


class SplitSource:
    """A binarized split of a data directory and the dictionaries it must
    match: what :func:`open_index` builds an index from or checks one
    against."""

    def __init__(self, data_dir: str, split: str, src: str, tgt: str, src_dict, tgt_dict,
                 option: str = "--ngram-split"):
        self.data_dir, self.split, self.src, self.tgt = data_dir, split, src, tgt
        self.src_dict, self.tgt_dict, self.option = src_dict, tgt_dict, option
        self.src_prefix, self.tgt_prefix = split_prefixes(data_dir, split, src, tgt, option)
        self.src_tokens, self.src_sizes = read_side(self.src_prefix, option, split)
        self.tgt_tokens, self.tgt_sizes = read_side(self.tgt_prefix, option, split)
        if self.src_sizes.size != self.tgt_sizes.size:
            raise NgramIndexError(
                f"{option} {split}: {self.src_sizes.size} source and {self.tgt_sizes.size} target sentences"
            )
        if self.tgt_sizes.size == 0 or int(self.tgt_sizes.sum()) == 0:
            raise NgramIndexError(
                f"{option} {split}: the split is empty ({self.tgt_prefix}.bin holds no sentences); "
                "--decoding ngram drafts from a split's target sentences: binarize the corpus into it "
                "(the recipe's distillation: train), or name a split that has sentences"
            )

    @property
    def skip(self):
        d = self.src_dict
        return (d.pad(), d.eos(), d.bos(), d.unk())

    def describe(self, order: int) -> dict:
        return describe_split(self.split, self.src, self.tgt, order, self.src_sizes, self.tgt_sizes,
                              self.src_dict, self.tgt_dict, self.tgt_dict.eos())

    def check_meta_ids(self, meta: dict) -> None:
        check_ids(self.option, self.split, "source", int(meta["max_source_id"]), self.src_dict,
                  os.path.join(self.data_dir, f"dict.{self.src}.txt"))
        check_ids(self.option, self.split, "target", int(meta["max_target_id"]), self.tgt_dict,
                  os.path.join(self.data_dir, f"dict.{self.tgt}.txt"))

    def build_into(self, directory: str, order: int) -> None:
        """Write this split's index of ``order`` to ``directory`` (atomically)."""
        meta = self.describe(order)
        ids = {"max_source_id": _max_id(self.src_tokens), "max_target_id": _max_id(self.tgt_tokens)}
        self.check_meta_ids(ids)  # before anything is written

        def build(alloc, tmp):
            arrays = build_tables(self.src_tokens, self.src_sizes, self.tgt_tokens, self.tgt_sizes, order,
                                  self.tgt_dict.eos(), len(self.src_dict), len(self.tgt_dict), self.skip, alloc,
                                  spill_dir=tmp)
            return {**ids, "corpus_contexts": int(arrays["keys"].size)}

        _save(directory, build, meta)


def open_index(source: SplitSource, order: int, rebuild: bool = False) -> Tuple[str, dict, Dict[str, np.ndarray]]:
    """The index of ``source`` and ``order``: (its directory, its meta, its
    arrays memory-mapped).  Looked for beside the data, then in the cache
    directory; built where none is (beside the data where that is writable,
    else in the cache directory).  An index beside the data that does not
    match the split is refused by name (rebuild it with
    ``scripts/ngram-index.py --force``, or delete it); one in the cache
    directory, which only decodings write, is rebuilt (a log line says so).
    ``rebuild``: build anew wherever it is (the script's ``--force``)."""
    name = index_name(source.split, source.src, source.tgt, order)
    beside = os.path.join(source.data_dir, name)
    cached = os.path.join(cache_dir_for(source.data_dir), name)
    want = source.describe(order)
    for directory, refuse in ((beside, True), (cached, False)):
        if not os.path.isdir(directory):
            continue
        if rebuild:
            return _rebuild(source, order, directory, "--force")
        meta = read_meta(directory)
        stale = differences(meta, want)
        if stale:
            if refuse:
                raise NgramIndexError(
                    f"{source.option} {source.split}: the n-gram index {directory} was built from another "
                    f"corpus or dictionary ({'; '.join(stale)}). Rebuild it: python scripts/ngram-index.py "
                    f"{source.data_dir} --split {source.split} --order {order} --force (or delete the directory)"
                )
            return _rebuild(source, order, directory, "stale: " + "; ".join(stale))
        source.check_meta_ids(meta)
        started = time.perf_counter()
        arrays = load_arrays(directory)
        check_arrays(directory, arrays, meta, len(source.tgt_dict),
                     f"Rebuild it: python scripts/ngram-index.py {source.data_dir} --split {source.split} "
                     f"--order {order} --force (or delete the directory)")
        logger.info(f"n-gram index: memory-mapped {directory} ({meta['sentences']} sentences, "
                    f"{meta.get('corpus_contexts', '?')} corpus contexts) in {time.perf_counter() - started:.1f} s")
        return directory, meta, arrays
    if _writable(source.data_dir):
        directory = beside
    else:
        directory = cached
        logger.info(f"n-gram index: the data directory {source.data_dir} is not writable: the index goes to the "
                    f"cache directory {directory}")
    return _build(source, order, directory)


def _build(source: SplitSource, order: int, directory: str):
    started = time.perf_counter()
    logger.info(f"n-gram index: building {directory} from {source.tgt_sizes.size} sentences of split "
                f"'{source.split}' (once: later decodings memory-map it)")
    source.build_into(directory, order)
    meta = read_meta(directory)
    size = sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory))
    logger.info(f"n-gram index: built {directory} in {time.perf_counter() - started:.1f} s "
                f"({meta.get('corpus_contexts')} corpus contexts, {size / 2**20:.1f} MiB)")
    return directory, meta, load_arrays(directory)


def _rebuild(source: SplitSource, order: int, directory: str, why: str):
    logger.info(f"n-gram index: rebuilding {directory} ({why})")
    old = tempfile.mkdtemp(prefix=f".{os.path.basename(directory)}.old-{os.getpid()}-", dir=os.path.dirname(directory))
    os.rmdir(old)
    os.rename(directory, old)
    try:
        return _build(source, order, directory)
    except BaseException:
        if not os.path.exists(directory):
            os.rename(old, directory)
        raise
    finally:
        shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------------------
# the command (scripts/ngram-index.py)

def build_index_main(argv=None) -> str:
    """``scripts/ngram-index.py DATA_DIR --split train [--order N]``: build
    (or check) the saved index a ``--decoding ngram`` run of that data
    directory memory-maps.  Returns the index directory."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="ngram-index.py",
        description="Build the saved n-gram index of a binarized split (the corpus of fairseq-generate "
                    "--decoding ngram --ngram-split SPLIT --ngram-order N): flat numpy arrays beside the data "
                    "(or in the cache directory where the data directory is not writable), memory-mapped by "
                    "every later decoding. An index already there and up to date is kept.")
    parser.add_argument("data", metavar="DATA_DIR", help="the data directory of fairseq-generate (binarized with "
                        "fairseq-preprocess; its dict.SRC.txt and dict.TGT.txt are the verifier's)")
    parser.add_argument("--split", default="train", help="the split to draft from (decoding's --ngram-split; "
                        "default train)")
    parser.add_argument("--order", type=int, default=4, help="the longest context (decoding's --ngram-order; "
                        "default 4)")
    parser.add_argument("--source-lang", "-s", default=None, help="source language (default: inferred from "
                        "the file names, as fairseq does)")
    parser.add_argument("--target-lang", "-t", default=None, help="target language (default: inferred)")
    parser.add_argument("--force", action="store_true", help="build anew even where an index is there "
                        "(the fix for an index refused as stale)")
    args = parser.parse_args(argv)
    logging.basicConfig(format="%(asctime)s | %(levelname)s | %(name)s | %(message)s", level=logging.INFO, force=True)
    from fairseq.data import Dictionary, data_utils

    if args.order < 1:
        parser.error(f"--order must be >= 1, got {args.order}")
    if not os.path.isdir(args.data):
        parser.error(f"DATA_DIR {args.data}: no such directory")
    src, tgt = args.source_lang, args.target_lang
    if src is None or tgt is None:
        src, tgt = data_utils.infer_language_pair(args.data)
        if src is None:
            parser.error(f"DATA_DIR {args.data}: cannot infer the language pair from its files; give "
                         "--source-lang and --target-lang")
    dicts = []
    for lang in (src, tgt):
        path = os.path.join(args.data, f"dict.{lang}.txt")
        if not os.path.isfile(path):
            parser.error(f"DATA_DIR {args.data}: no dict.{lang}.txt (the dictionary decoding uses)")
        dicts.append(Dictionary.load(path))
    try:
        source = SplitSource(args.data, args.split, src, tgt, dicts[0], dicts[1], option="--split")
        directory, meta, _ = open_index(source, args.order, rebuild=args.force)
    except (NgramIndexError, FileNotFoundError) as e:
        raise SystemExit(f"ngram-index.py: error: {e}")
    print(f"{directory}: {meta['sentences']} sentences, {meta.get('corpus_contexts')} corpus contexts, "
          f"order {meta['order']}")
    return directory
