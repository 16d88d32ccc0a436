"""Drafting from a corpus (``--decoding ngram``) and the draft policy's row
limit (``--draft-max-rows``): the tables against counts made here by hand,
retrieval, and the strict output identical to fairseq's ``--beam 1``, in
process and through the stock fairseq-generate."""
import collections
import types

import numpy as np
import pytest
import torch

import specdec_helpers as H
from specdec_helpers import OPTION_SETS, assert_identical, check_stats, speculative_run
from fairseq_specdec.generation import DraftLengthPolicy, FixedRows, MeasuredRows
from fairseq_specdec.generation.ngram import NgramCorpus, NgramDrafter, _most_frequent, load_ngram_corpus
from fairseq_specdec.generation.options import NgramOptions

BOS = EOS = 2
PAD = 1


def fake_state(outputs, sources, pad=PAD, bos=BOS):
    """The few DecodingState fields the drafter reads: tokens (BOS, output), lengths_host, net_input."""
    width = max(len(o) for o in outputs) + 2
    tokens = torch.full((len(outputs), width), pad, dtype=torch.long)
    for i, o in enumerate(outputs):
        tokens[i, : len(o) + 1] = torch.tensor([bos] + o)
    src_width = max(len(s) for s in sources)
    src = torch.full((len(sources), src_width), pad, dtype=torch.long)
    for i, s in enumerate(sources):
        src[i, src_width - len(s):] = torch.tensor(s)  # left padded, as fairseq batches sources
    return types.SimpleNamespace(tokens=tokens, lengths_host=[len(o) for o in outputs],
                                 net_input={"src_tokens": src}, size=len(outputs))


def test_most_frequent_matches_counting():
    rng = np.random.default_rng(0)
    keys = rng.integers(0, 50, 2000).astype(np.uint64)
    nexts = rng.integers(0, 6, 2000).astype(np.int64)
    got_keys, got_nexts, got_tops, got_totals = _most_frequent(keys, nexts)
    counts = collections.defaultdict(collections.Counter)
    for k, t in zip(keys.tolist(), nexts.tolist()):
        counts[k][t] += 1
    want = {k: min(t for t, n in c.items() if n == max(c.values())) for k, c in counts.items()}
    assert got_keys.tolist() == sorted(want)
    assert dict(zip(got_keys.tolist(), got_nexts.tolist())) == want
    assert dict(zip(got_keys.tolist(), got_tops.tolist())) == {k: max(c.values()) for k, c in counts.items()}
    assert dict(zip(got_keys.tolist(), got_totals.tolist())) == {k: sum(c.values()) for k, c in counts.items()}


# three sentences: after "5 6" comes 7 twice, 9 once
SOURCES = [[20, 21, EOS], [22, 23, EOS], [20, 24, EOS]]
TARGETS = [[5, 6, 7, 8, EOS], [5, 6, 9, EOS], [5, 6, 7, 10, EOS]]


def test_corpus_continuation_is_the_most_frequent():
    corpus = NgramCorpus(SOURCES, TARGETS, order=2, bos=BOS, skip=(PAD, EOS))
    drafter = NgramDrafter(corpus, neighbours=0, pad=PAD, eos=EOS, min_confidence=0)
    state = fake_state([[], [5, 6]], [[30, EOS], [30, EOS]])  # sources the corpus never saw
    drafter.start_batch(state)
    drafts, scores = drafter.propose(state, 3)
    assert scores is None
    # from the start: 5 6 7 (the corpus's most frequent path); after "5 6": 7, then 8 (tie 8/10: the smaller id)
    assert drafts.tolist() == [[5, 6, 7], [7, 8, EOS]]


def random_corpus(sentences, seed=0, vocab=40):
    rng = np.random.default_rng(seed)
    sources = [rng.integers(3, vocab, rng.integers(1, 9)).tolist() + [EOS] for _ in range(sentences)]
    targets = [rng.integers(3, 12, rng.integers(0, 9)).tolist() + [EOS] for _ in range(sentences)]
    return sources, targets


def test_chunked_build_makes_the_same_tables(monkeypatch):
    """A corpus built in chunks of a few sentences and buckets of a few
    contexts (as a large one is) has the same tables as one built at once,
    and the corpus table searched in its sorted keys answers as the dict does."""
    import fairseq_specdec.generation.ngram as ngram
    import fairseq_specdec.generation.ngram_index as ngram_index

    sources, targets = random_corpus(300)
    whole = NgramCorpus(sources, targets, order=3, bos=BOS, skip=(PAD, EOS))
    monkeypatch.setattr(ngram_index, "CHUNK_TOKENS", 17)
    monkeypatch.setattr(ngram_index, "BUCKET_PAIRS", 100)
    monkeypatch.setattr(ngram, "DICT_LIMIT", 0)
    chunked = NgramCorpus(sources, targets, order=3, bos=BOS, skip=(PAD, EOS))
    assert whole._table is not None and chunked._table is None
    for name in ("sequences", "offsets", "keys", "values", "postings", "posting_starts"):
        assert getattr(whole, name).tolist() == getattr(chunked, name).tolist(), name
    assert whole.keys.size > 100  # several buckets
    for key in whole.keys.tolist()[::7] + [12345, 0]:
        assert whole.lookup(key) == chunked.lookup(key)
    for sentences in ([0], [1, 2], [5, 70, 299]):
        assert whole.table(np.array(sentences)) == chunked.table(np.array(sentences))
        assert len(whole.table(np.array(sentences))) > 0


def test_neighbours_come_first():
    corpus = NgramCorpus(SOURCES, TARGETS, order=2, bos=BOS, skip=(PAD, EOS))
    # the rare source tokens of sentence 1 find it, and its "5 6 9" wins over the corpus's "5 6 7"
    assert corpus.neighbours([22, 23, EOS], 2).tolist() == [1]
    # token 20 is in 2 of the 3 sentences (more than 1/e of them): it does not count
    assert corpus.neighbours([20, 24, EOS], 2).tolist() == [2]
    # equal scores: corpus order
    assert corpus.neighbours([24, 21, EOS], 3).tolist() == [0, 2]
    drafter = NgramDrafter(corpus, neighbours=1, pad=PAD, eos=EOS, min_confidence=0)
    state = fake_state([[5, 6], [5, 6]], [[22, 23, EOS], [30, EOS]])
    drafter.start_batch(state)
    assert drafter.propose(state, 2)[0].tolist() == [[9, EOS], [7, 8]]
    # rows leave: the kept row keeps its own table and source
    drafter.reorder(torch.tensor([1]), [1])
    assert drafter.propose(fake_state([[5, 6]], [[30, EOS]]), 1)[0].tolist() == [[7]]


def test_draft_stops_after_eos_and_where_nothing_is_known():
    corpus = NgramCorpus(SOURCES, TARGETS, order=3, bos=BOS, skip=(PAD, EOS))
    drafter = NgramDrafter(corpus, neighbours=0, pad=PAD, eos=EOS, min_confidence=0)
    state = fake_state([[5, 6, 9], [40, 41]], [[30, EOS], [30, EOS]])
    drafter.start_batch(state)
    # row 0: "... 9" -> EOS ends the draft; row 1: tokens the corpus never saw -> no draft (pad)
    assert drafter.propose(state, 4)[0].tolist() == [[EOS], [PAD]]


@pytest.mark.parametrize("floor, want", [(0.0, [5, 6, 7]), (0.25, [5, 6, 7]), (0.3, [5, 6]), (0.6, [5]), (0.8, [])])
def test_draft_stops_where_its_confidence_falls_below_the_floor(floor, want):
    """Confidences by hand: every sentence starts with 5 (3 of 3: 3/4), then 6
    (3/4), then 7 (2 of 3: 2/4); the draft's confidence is their product
    (0.75, 0.5625, 0.28125)."""
    corpus = NgramCorpus(SOURCES, TARGETS, order=2, bos=BOS, skip=(PAD, EOS))
    drafter = NgramDrafter(corpus, neighbours=0, pad=PAD, eos=EOS, min_confidence=floor)
    state = fake_state([[]], [[30, EOS]])
    drafter.start_batch(state)
    drafts = drafter.propose(state, 3)[0]
    assert drafts.tolist() == [want] if want else drafts.numel() == 0


def test_bad_settings_are_refused():
    good = dict(split="train", order=2, neighbours=0, min_confidence=0.0, data_dir="", source_lang=None,
                target_lang=None)
    NgramOptions(**good)
    for field, value, option in (("order", 0, "--ngram-order"), ("neighbours", -1, "--ngram-neighbours"),
                                 ("min_confidence", -0.1, "--ngram-min-confidence"),
                                 ("min_confidence", 1.0, "--ngram-min-confidence")):
        with pytest.raises(ValueError, match=option):
            NgramOptions(**dict(good, **{field: value}))


def test_row_rule_default_follows_the_verifier_device_and_the_acceptance():
    from fairseq_specdec.generation import AllRows, FixedRows, MeasuredRows, build_acceptance
    from fairseq_specdec.generation.build import DRAFT_MAX_ROWS_CPU, draft_rows_rule

    cpu = torch.nn.Linear(2, 2)
    strict, relaxed = build_acceptance(1, 0.0, "verifier"), build_acceptance(3, 1.0, "verifier")
    assert isinstance(draft_rows_rule(None, cpu, strict), MeasuredRows)
    # relaxed output depends on what is drafted: a fixed rule, never timings
    rule = draft_rows_rule(None, cpu, relaxed)
    assert isinstance(rule, FixedRows) and rule.max_rows == DRAFT_MAX_ROWS_CPU
    for acceptance in (strict, relaxed):
        assert isinstance(draft_rows_rule(0, cpu, acceptance), AllRows)
        assert draft_rows_rule(7, cpu, acceptance).max_rows == 7
    if torch.cuda.is_available():
        assert isinstance(draft_rows_rule(None, cpu.cuda(), strict), AllRows)


def test_row_limit_policy():
    policy = DraftLengthPolicy(4, rows=FixedRows(2))
    assert policy.drafts_at(1) and policy.drafts_at(2) and not policy.drafts_at(3)
    assert DraftLengthPolicy(4).drafts_at(10_000)


@pytest.fixture(scope="module")
def toy_corpus(verifier):
    model, task = verifier
    cfg = task.cfg  # the verifier's translation task: no --ngram-* options
    return load_ngram_corpus(task, NgramOptions("train", 4, 20, 0.25, cfg.data, cfg.source_lang, cfg.target_lang))


def mean_accepted(stats):
    tokens = sum(s["length"] + 1 for s in stats.values())  # EOS included
    return tokens / sum(s["iterations"] for s in stats.values())


@pytest.mark.parametrize("opts", list(OPTION_SETS))
@pytest.mark.parametrize("bsz", [1, 3, 16])
def test_ngram_exact(verifier, beam1_reference, toy_corpus, tmp_path, opts, bsz):
    model, task = verifier
    d = task.target_dictionary
    drafter = NgramDrafter(toy_corpus, 20, d.pad(), d.eos())
    got, stats = speculative_run(model, drafter, d, 3, OPTION_SETS[opts], H.batches(task, "test", bsz), tmp_path / "s.jsonl")
    assert_identical(beam1_reference(opts, bsz), got)
    check_stats(stats, got, 3)
    if opts == "default":
        # the tiny verifier's output is not its training targets, but some continuations are
        assert any(a >= 2 for s in stats.values() for a in s["accepted"])


@pytest.mark.parametrize("bsz", [1, 16])
def test_ngram_exact_without_confidence_cut(verifier, beam1_reference, toy_corpus, tmp_path, bsz):
    """Every known context drafted, k = 7: longer and more often rejected drafts, same output."""
    model, task = verifier
    d = task.target_dictionary
    drafter = NgramDrafter(toy_corpus, 20, d.pad(), d.eos(), min_confidence=0.0)
    got, stats = speculative_run(model, drafter, d, 7, OPTION_SETS["default"], H.batches(task, "test", bsz),
                                 tmp_path / "s.jsonl")
    assert_identical(beam1_reference("default", bsz), got)
    check_stats(stats, got, 7)


def test_a_distilled_corpus_drafts_the_verifier_output(verifier, beam1_reference, tmp_path):
    """With the verifier's own greedy outputs as the corpus (what distillation
    makes), each sentence retrieves itself and most drafts are accepted."""
    model, task = verifier
    d = task.target_dictionary
    ref = beam1_reference("default", 1)
    samples = list(H.batches(task, "test", 1))
    sources = [s["net_input"]["src_tokens"][0].tolist() for s in samples]
    targets = [ref[s["id"].item()]["tokens"].tolist() for s in samples]
    corpus = NgramCorpus(sources, targets, 4, bos=d.eos(), skip=(d.pad(), d.eos(), d.bos(), d.unk()))
    # no confidence cut: every context of this corpus is seen once (confidence 1/2 a token)
    got, stats = speculative_run(model, NgramDrafter(corpus, 5, d.pad(), d.eos(), 0.0), d, 3, OPTION_SETS["default"],
                                 samples, tmp_path / "s.jsonl")
    assert_identical(ref, got)
    assert mean_accepted(stats) > 2.5, mean_accepted(stats)


class CountingDrafter(NgramDrafter):
    """Records the batch size of every pass that drafted."""

    def setup(self):
        self.drafting_rows = []
        return self

    def propose(self, state, k):
        self.drafting_rows.append(state.size)
        return super().propose(state, k)


def test_row_limit_drafts_only_in_the_tail(verifier, beam1_reference, toy_corpus):
    model, task = verifier
    d = task.target_dictionary
    drafter = CountingDrafter(toy_corpus, 20, d.pad(), d.eos()).setup()
    gen = H.spec_gen(model, drafter, d, 3, dict(OPTION_SETS["default"], draft_policy=DraftLengthPolicy(3, rows=FixedRows(2))))
    got = H.run_generator(gen, model, H.batches(task, "test", 16))
    assert_identical(beam1_reference("default", 16), got)
    assert drafter.drafting_rows and max(drafter.drafting_rows) <= 2


class SkewedRows(MeasuredRows):
    """The measured rule, told that drafting iterations took ``factor``
    times their real time: far slower (or faster) than not drafting,
    whatever the machine's speed."""

    def __init__(self, factor):
        super().__init__(least=2, first_wait=4, tokens=0)
        self.factor = factor

    def observe(self, rows, batch, drafted, tokens, seconds):
        super().observe(rows, batch, drafted, tokens, seconds * (self.factor if drafted else 1.0))


def test_measured_rows_follow_the_loops_timings_and_keep_the_output(verifier, toy_corpus):
    """The loop times its iterations for the measured rule: where drafting is
    (made) slow, the rows of a batch of 16 draft only in the rule's trials,
    at one row; where it is fast, ever larger groups draft.  The output is
    --beam 1's either way."""
    model, task = verifier
    d = task.target_dictionary
    # rows that finish at different steps: a batch's tail passes through every group of rows
    samples = H.mixed_batches(task, "test", 16)
    reference = H.run_generator(H.seq_gen(model, d, OPTION_SETS["default"]), model, samples)
    drafting = {}
    for factor in (100.0, 0.01):
        drafter = CountingDrafter(toy_corpus, 20, d.pad(), d.eos()).setup()
        rule = SkewedRows(factor)
        gen = H.spec_gen(model, drafter, d, 3, dict(OPTION_SETS["default"], draft_policy=DraftLengthPolicy(3, rows=rule)))
        # the rule lives as long as its generator: what it measured carries over.  A group's trial
        # waits for the next smaller group's win, and a batch's tail visits its small groups only a
        # few times a run (how few depends on the tiny model, trained anew on each CPU): 8 runs
        for _ in range(8):
            got = H.run_generator(gen, model, samples)
            assert_identical(reference, got)
        drafting[factor] = drafter.drafting_rows
        assert sum(b.count[False] for b in rule.buckets.values()) > 0  # the loop reported its iterations
    slow, fast = drafting[100.0], drafting[0.01]
    # slow drafting: only trials (2 iterations each), at the last row of a batch: never past a losing group
    assert slow and set(slow) == {1} and len(slow) < len(fast), slow
    assert max(fast) >= 3, fast


def test_cli_matches_beam1(toy_bin, ar_checkpoint, stock_beam1):
    """Through the stock fairseq-generate, with the default row limit and without it."""
    ref = stock_beam1(ar_checkpoint, "--decoding", "autoregressive", batch_size=16)
    for extra in ([], ["--draft-max-rows", "0", "--ngram-neighbours", "5", "--ngram-order", "3",
                       "--ngram-min-confidence", "0"]):
        got = H.generate(toy_bin, ar_checkpoint, "--decoding", "ngram", *extra, task="draft_verify", batch_size=16)
        H.assert_same_hypotheses(ref, H.parse_generate(got.stdout))
        assert "ngram: 50 sentences" in got.stdout + got.stderr  # the statistics line


def test_cli_refuses_bad_options_before_reading_the_corpus(toy_bin, ar_checkpoint):
    """A bad --ngram-* value is named even where the split does not exist: it
    is checked before any corpus is read."""
    for option, value in (("--ngram-neighbours", "-1"), ("--ngram-order", "0"), ("--ngram-min-confidence", "1.5")):
        got = H.generate(toy_bin, ar_checkpoint, "--decoding", "ngram", option, value, "--ngram-split", "nosuchsplit",
                         task="draft_verify", check=False)
        assert got.returncode != 0
        assert option in got.stderr and "nosuchsplit" not in got.stderr


def test_cli_names_a_missing_split(toy_bin, ar_checkpoint):
    got = H.generate(toy_bin, ar_checkpoint, "--decoding", "ngram", "--ngram-split", "nosuchsplit",
                     task="draft_verify", check=False)
    assert got.returncode != 0
    assert "--ngram-split nosuchsplit" in got.stderr
