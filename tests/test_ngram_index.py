"""The saved index of ``--decoding ngram`` (generation/ngram_index.py):
the same drafts as the corpus built in memory, refused when stale or of
another dictionary, read without pickle, built atomically, retrieval whose
memory does not grow with the corpus, and the bad corpora refused by name
before any output (fairseq-generate, fairseq-interactive)."""
import logging
import math
import os
import shutil
import tracemalloc

import numpy as np
import pytest
import torch

import specdec_helpers as H
from fairseq_specdec.generation import ngram_index as NI
from fairseq_specdec.generation.ngram import NgramCorpus, NgramDrafter

PAIR = "train.src-tgt"


def copy_data(toy_bin, dest, splits=("train",)):
    """A data directory of its own: the toy corpus's dictionaries and ``splits``."""
    os.makedirs(dest, exist_ok=True)
    for name in os.listdir(toy_bin):
        binarized = name.endswith((".bin", ".idx")) and any(name.startswith(f"{s}.src-tgt.") for s in splits)
        if name.startswith("dict.") or binarized:  # not the indexes other tests built beside the toy data
            shutil.copy(os.path.join(toy_bin, name), os.path.join(dest, name))
    return str(dest)


def dictionaries(data):
    from fairseq.data import Dictionary

    return Dictionary.load(os.path.join(data, "dict.src.txt")), Dictionary.load(os.path.join(data, "dict.tgt.txt"))


def split_source(data, split="train"):
    src_dict, tgt_dict = dictionaries(data)
    return NI.SplitSource(data, split, "src", "tgt", src_dict, tgt_dict)


def read_sentences(prefix):
    """Each sentence of a binarized split through fairseq's own dataset class."""
    from fairseq.data.indexed_dataset import MMapIndexedDataset

    dataset = MMapIndexedDataset(prefix)
    return [dataset[i].tolist() for i in range(len(dataset))]


def write_split(data, split, pairs):
    """Binarize (source ids, target ids) pairs as fairseq-preprocess's mmap format, ids as given."""
    from fairseq.data.indexed_dataset import MMapIndexedDatasetBuilder

    for side, lang in ((0, "src"), (1, "tgt")):
        prefix = os.path.join(data, f"{split}.src-tgt.{lang}")
        builder = MMapIndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
        for pair in pairs:
            builder.add_item(torch.tensor(pair[side], dtype=torch.int32))
        builder.finalize(prefix + ".idx")


from test_ngram import fake_state  # noqa: E402  (the drafter state the ngram tests share)


def test_saved_index_drafts_as_the_corpus_built_in_memory(toy_bin, tmp_path):
    data = copy_data(toy_bin, tmp_path / "data", ("train", "test"))
    source = split_source(data)
    directory, meta, arrays = NI.open_index(source, 4)
    assert directory == os.path.join(data, "train.src-tgt.ngram-order4")
    assert all(isinstance(a, np.memmap) for a in arrays.values())
    saved = NgramCorpus.from_arrays(arrays, 4)
    src_dict, tgt_dict = dictionaries(data)
    sources, targets = read_sentences(os.path.join(data, PAIR + ".src")), read_sentences(os.path.join(data, PAIR + ".tgt"))
    assert meta["sentences"] == len(targets) == 3000
    built = NgramCorpus(sources, targets, 4, bos=tgt_dict.eos(),
                        skip=(src_dict.pad(), src_dict.eos(), src_dict.bos(), src_dict.unk()))
    for name in NI.ARRAYS:
        want, got = getattr(built, name), getattr(saved, name)
        if name == "posting_starts":  # the saved one spans the whole dictionary, the built one the ids seen
            assert np.all(got[want.size:] == want[-1])
            got = got[:want.size]
        assert np.array_equal(want, got), name
    # drafts for the test split's sources, from a few output prefixes taken from the corpus's targets
    test_sources = read_sentences(os.path.join(data, "test.src-tgt.src"))
    pad, eos = tgt_dict.pad(), tgt_dict.eos()
    drafts = []
    for corpus in (built, saved):
        drafter = NgramDrafter(corpus, 20, pad, eos, min_confidence=0.0)
        state = fake_state([targets[i][: i % 5] for i in range(len(test_sources))], test_sources, pad, eos)
        drafter.start_batch(state)
        drafts.append(drafter.propose(state, 5)[0].tolist())
    assert drafts[0] == drafts[1]
    assert sum(t != pad for row in drafts[0] for t in row) > 100
    # a second open memory-maps the same files, not a new build
    stamp = os.stat(os.path.join(directory, "keys.npy")).st_mtime_ns
    assert NI.open_index(split_source(data), 4)[0] == directory
    assert os.stat(os.path.join(directory, "keys.npy")).st_mtime_ns == stamp


def test_stale_or_foreign_index_beside_the_data_is_refused_by_name(toy_bin, tmp_path):
    data = copy_data(toy_bin, tmp_path / "data", ("train", "valid"))
    directory = NI.open_index(split_source(data), 3)[0]
    # the split binarized anew (here: the valid split's sentences in its place)
    for lang in ("src", "tgt"):
        for ext in ("bin", "idx"):
            shutil.copy(os.path.join(data, f"valid.src-tgt.{lang}.{ext}"), os.path.join(data, f"{PAIR}.{lang}.{ext}"))
    with pytest.raises(NI.NgramIndexError) as e:
        NI.open_index(split_source(data), 3)
    message = str(e.value)
    assert directory in message and "--ngram-split train" in message and "sentences 3000 (now 100)" in message
    assert "--force" in message
    # rebuilt on demand: then it matches
    NI.open_index(split_source(data), 3, rebuild=True)
    assert NI.read_meta(directory)["sentences"] == 100
    # another dictionary (one more symbol): refused, naming the dictionary
    with open(os.path.join(data, "dict.tgt.txt"), "a", encoding="utf-8") as f:
        f.write("zzzextra 1\n")
    with pytest.raises(NI.NgramIndexError, match="target dictionary checksum"):
        NI.open_index(split_source(data), 3)
    # an index of another format version
    meta_path = os.path.join(directory, NI.META)
    text = open(meta_path, encoding="utf-8").read().replace('"version": 1', '"version": 0')
    open(meta_path, "w", encoding="utf-8").write(text)
    with pytest.raises(NI.NgramIndexError, match="format version 0"):
        NI.open_index(split_source(data), 3)


def test_read_only_data_goes_to_the_cache_which_is_rebuilt_when_stale(toy_bin, tmp_path, monkeypatch, caplog):
    data = copy_data(toy_bin, tmp_path / "data", ("train", "valid"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(NI, "_writable", lambda directory: False)
    caplog.set_level(logging.INFO, logger=NI.__name__)
    directory = NI.open_index(split_source(data), 2)[0]
    assert directory.startswith(str(tmp_path / "cache" / "fairseq_specdec" / "ngram"))
    assert not any(name.endswith("ngram-order2") for name in os.listdir(data))
    assert f"not writable: the index goes to the cache directory {directory}" in caplog.text
    for lang in ("src", "tgt"):
        for ext in ("bin", "idx"):
            shutil.copy(os.path.join(data, f"valid.src-tgt.{lang}.{ext}"), os.path.join(data, f"{PAIR}.{lang}.{ext}"))
    caplog.clear()
    assert NI.open_index(split_source(data), 2)[0] == directory
    assert f"rebuilding {directory}" in caplog.text
    assert NI.read_meta(directory)["sentences"] == 100
    assert sorted(os.listdir(os.path.dirname(directory))) == [os.path.basename(directory)]  # no leftovers


def test_a_failed_build_leaves_nothing(toy_bin, tmp_path, monkeypatch):
    data = copy_data(toy_bin, tmp_path / "data")
    before = sorted(os.listdir(data))

    def broken(*args, **kwargs):
        alloc = args[-1]
        alloc("sequences", (10,), np.int32)  # a file started, then the build fails
        raise MemoryError("out of memory")

    monkeypatch.setattr(NI, "build_tables", broken)
    with pytest.raises(MemoryError):
        NI.open_index(split_source(data), 4)
    assert sorted(os.listdir(data)) == before
    # what a killed build left (its process gone) is removed by the next build; a live one's is kept
    gone = os.path.join(data, ".train.src-tgt.ngram-order4.tmp-999999999-x")
    live = os.path.join(data, f".train.src-tgt.ngram-order4.tmp-{os.getpid()}-y")
    os.makedirs(gone)
    os.makedirs(live)
    monkeypatch.undo()
    NI.open_index(split_source(data), 4)
    assert not os.path.exists(gone) and os.path.exists(live)


def test_index_is_read_memory_mapped_without_pickle(toy_bin, tmp_path, monkeypatch):
    data = copy_data(toy_bin, tmp_path / "data")
    directory = NI.open_index(split_source(data), 4)[0]
    calls = []
    real_load = np.load

    def spy(path, *args, **kwargs):
        calls.append((os.path.basename(str(path)), kwargs.get("mmap_mode"), kwargs.get("allow_pickle")))
        return real_load(path, *args, **kwargs)

    monkeypatch.setattr(np, "load", spy)
    NI.open_index(split_source(data), 4)
    assert sorted(calls) == sorted((name + ".npy", "r", False) for name in NI.ARRAYS)
    monkeypatch.setattr(np, "load", real_load)
    # an array that only unpickling could read is refused, naming the file
    np.save(os.path.join(directory, "values.npy"), np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(NI.NgramIndexError, match="values.npy"):
        NI.open_index(split_source(data), 4)


def brute_force_scores(sources, query, skip, min_idf=1.0):
    """Today's retrieval scores by hand: idf-weighted shared source tokens (tokens of idf <= min_idf left out)."""
    df = {}
    for s in sources:
        for t in set(s) - set(skip):
            df[t] = df.get(t, 0) + 1
    idf = {t: math.log(len(sources) / c) for t, c in df.items()}
    return [sum(idf[t] for t in set(s) & set(query) if t in idf and idf[t] > min_idf) for s in sources]


def test_neighbours_within_the_budget_are_the_exact_ones_and_beyond_it_the_rarest_tokens_lead():
    rng = np.random.default_rng(1)
    sources = [rng.integers(3, 60, rng.integers(2, 10)).tolist() + [2] for _ in range(400)]
    targets = [[5, 2]] * len(sources)
    corpus = NgramCorpus(sources, targets, 2, bos=2, skip=(1, 2))
    for query in sources[:40]:
        scores = brute_force_scores(sources, query, (1, 2))
        got = corpus.neighbours(query, 7).tolist()
        # the 7 best scores, best first (sentences of equal scores, summed in another order, may swap)
        assert np.allclose([scores[i] for i in got], sorted(scores, reverse=True)[:7]), (got, query)
        assert got[0] == scores.index(max(scores)) or math.isclose(scores[got[0]], max(scores))
    # a budget smaller than the common tokens' lists: the sentence sharing the two rarest tokens still leads
    sources = [[10, 11, 2]] * 300 + [[12, 2], [13, 2], [12, 13, 10, 2]] + [[11, 2]] * 10
    corpus = NgramCorpus(sources, [[5, 2]] * len(sources), 2, bos=2, skip=(1, 2))
    corpus.budget = 5
    assert corpus.neighbours([12, 13, 10, 11, 2], 2).tolist()[0] == 302


def test_retrieval_allocates_nothing_of_corpus_length():
    """A corpus of 4 million tiny sentences, its arrays made directly: one
    retrieval's peak allocation stays below half a byte per corpus sentence
    (the old retrieval scored every sentence: 8 bytes each)."""
    n = 4_000_000
    order = 2
    # source token 5 in every sentence, 6 in every 3rd, 7 in every 1000th, 8 in ten; sentence 0 holds all
    lists = {5: np.arange(n), 6: np.arange(0, n, 3), 7: np.arange(0, n, 1000), 8: np.arange(0, n, n // 10)}
    vocab = 10
    starts = np.zeros(vocab + 1, dtype=np.int64)
    for t in range(vocab):
        starts[t + 1] = starts[t] + (lists[t].size if t in lists else 0)
    postings = np.concatenate([lists[t] for t in sorted(lists)]).astype(np.int32)
    arrays = {
        "sequences": np.array([-1, -1, 2, 5, 2], dtype=np.int32),
        "offsets": np.append(0, np.full(n, 5, dtype=np.int64)),  # sentence 0 holds the targets
        "keys": np.zeros(0, dtype=np.uint64), "values": np.zeros(0, dtype=np.uint32),
        "postings": postings, "posting_starts": starts,
    }
    corpus = NgramCorpus.from_arrays(arrays, order)
    assert corpus.sentences == n
    corpus.neighbours([5, 6, 7, 8, 2], 20)  # warm up
    tracemalloc.start()
    try:
        got = corpus.neighbours([5, 6, 7, 8, 2], 20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < n // 2, peak
    assert got[0] == 0 and got.size == 20
    assert not corpus._scores.any()  # the running scores are left at zero


# ---------------------------------------------------------------------------- the bad corpora, end to end

def generate_ngram(data, checkpoint, *extra):
    return H.generate(data, checkpoint, "--decoding", "ngram", *extra, task="draft_verify", check=False)


@pytest.mark.slow
def test_cli_refuses_a_corpus_of_another_dictionary_before_any_output(toy_bin, ar_checkpoint, tmp_path):
    data = copy_data(toy_bin, tmp_path / "data", ("test",))
    src_dict, tgt_dict = dictionaries(data)
    size = len(tgt_dict)
    # binarized with a larger dictionary: some ids past the verifier's
    write_split(data, "train", [([10, 11, 2], [10, size + 40, 2]), ([12, 2], [size + 717, 9, 2])])
    got = generate_ngram(data, ar_checkpoint)
    assert got.returncode != 0
    assert "--ngram-split train" in got.stderr and f"{size + 717}" in got.stderr and f"{size} types" in got.stderr
    assert f"at least {size + 718} types" in got.stderr
    assert "H-" not in got.stdout and "S-" not in got.stdout
    assert not [n for n in os.listdir(data) if "ngram" in n]  # nothing written


@pytest.mark.slow
def test_cli_refuses_an_empty_corpus_by_name(toy_bin, ar_checkpoint, tmp_path):
    data = copy_data(toy_bin, tmp_path / "data", ("test",))
    write_split(data, "train", [])
    got = generate_ngram(data, ar_checkpoint)
    assert got.returncode != 0
    assert "--ngram-split train: the split is empty" in got.stderr
    assert "Traceback" not in got.stderr.split("--ngram-split train")[-1]  # no second error (__del__) after it
    assert "H-" not in got.stdout


@pytest.mark.slow
def test_cli_refuses_drafting_from_the_split_being_translated(toy_bin, ar_checkpoint, tmp_path):
    data = copy_data(toy_bin, tmp_path / "data", ("train", "test"))
    got = generate_ngram(data, ar_checkpoint, "--ngram-split", "test")
    assert got.returncode != 0
    assert "--ngram-split test is the split being translated (--gen-subset test)" in got.stderr
    assert "reference translations" in got.stderr
    assert "H-" not in got.stdout


@pytest.mark.slow
def test_interactive_drafts_from_the_saved_index(toy_bin, ar_checkpoint, tmp_path):
    """fairseq-interactive has no --gen-subset: ngram works there, and its
    second run memory-maps the index the first one built."""
    data = copy_data(toy_bin, tmp_path / "data", ("train", "test"))
    lines = ["".join(chr(ord("a") + (i * 7 + j) % 26) + " " for j in range(5 + i % 4)).strip() for i in range(6)]
    common = [H.cli("fairseq-interactive"), data, "--path", ar_checkpoint, "--user-dir", H.USER_DIR,
              "--task", "draft_verify", "--source-lang", "src", "--target-lang", "tgt", "--beam", "1", "--cpu",
              "--buffer-size", "3", "--batch-size", "3"]

    def interactive(*extra):
        proc = H.run([*common, *extra], check=False, input="\n".join(lines) + "\n", timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc

    ref = interactive("--decoding", "autoregressive")
    first = interactive("--decoding", "ngram")
    assert "n-gram index: built" in first.stderr + first.stdout
    second = interactive("--decoding", "ngram")
    assert "n-gram index: memory-mapped" in second.stderr + second.stdout
    for got in (first, second):
        H.assert_same_hypotheses(H.parse_generate(ref.stdout), H.parse_generate(got.stdout))
    assert len(H.parse_generate(ref.stdout)) == len(lines)


def test_unwritable_cache_is_refused_by_name(toy_bin, tmp_path, monkeypatch):
    """Read-only data and a cache directory that cannot be made (here under
    a file, which stops root too): a refusal naming the directory and the
    way out, not an OSError traceback."""
    data = copy_data(toy_bin, tmp_path / "data")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker / "cache"))
    monkeypatch.setattr(NI, "_writable", lambda directory: False)
    with pytest.raises(NI.NgramIndexError, match=r"cannot write the index into .*XDG_CACHE_HOME"):
        NI.open_index(split_source(data), 2)


@pytest.mark.parametrize("array, damage", [
    ("values", "token"), ("sequences", "token"), ("offsets", "decreasing"), ("postings", "sentence"),
])
def test_index_with_out_of_range_entries_is_refused_when_opened(toy_bin, tmp_path, array, damage):
    """Well-formed .npy files whose entries the build cannot have written
    (a token id past the dictionary, offsets that go back, a sentence id
    past the corpus) are refused when the index is opened, naming the file
    and --force, before any decoding reads them."""
    data = copy_data(toy_bin, tmp_path / "data")
    directory = NI.open_index(split_source(data), 2)[0]
    path = os.path.join(directory, array + ".npy")
    values = np.load(path).copy()
    _, tgt_dict = dictionaries(data)
    if damage == "token":
        values[len(values) // 2] = (len(tgt_dict) + 5) << (NI.CONF_BITS if array == "values" else 0)
    elif damage == "decreasing":
        values[len(values) // 2] = values[-1] + 1
    else:
        values[0] = 10 ** 6
    np.save(path, values)
    with pytest.raises(NI.NgramIndexError, match=rf"{array}\.npy .*--force"):
        NI.open_index(split_source(data), 2)
