"""A drafter with fewer positions than the verifier (issue 14, defect 1).

A specdec_nat drafter trained with ``--max-source-positions 16
--max-target-positions 16`` beside a verifier with 1024 positions: its soft
copy looked the source positions up in the drafter's 16-row target position
table, so fairseq-generate died with an IndexError halfway through a test
set with longer sources.  A row whose source does not fit the drafter now
gets no draft (greedy steps), every other row drafts as before, and the
output is fairseq's ``--beam 1`` output, through fairseq-generate and
fairseq-interactive alike.
"""
import json
import re

import pytest
import torch

import specdec_helpers as H
import toy_corpus
from fairseq_specdec.generation import DecodingState, NATBlockDrafter

LIMIT = 16  # the small drafter's --max-source-positions / --max-target-positions
# words per line (the source adds an EOS): in-distribution lines, lines longer
# than the drafter's positions, one exactly at the limit, and an empty line
LENGTHS = [3, 25, 8, 40, 15, 16, 0, 12, 33, 5, 20, 1, 28, 10]
TOO_LONG = {i for i, n in enumerate(LENGTHS) if n + 1 > LIMIT}
MAX_LEN_B = "40"  # the toy verifier may loop on sources longer than it was trained on


def long_lines():
    import random

    rng = random.Random(11)
    src = [" ".join(f"a{rng.randrange(24)}" for _ in range(n)) for n in LENGTHS]
    return src, [" ".join(toy_corpus.translate(s.split())) for s in src]


@pytest.fixture(scope="module")
def long_bin(toy_bin, tmp_path_factory):
    """A test split with sources longer than LIMIT, binarized with toy_bin's dictionaries."""
    root = tmp_path_factory.mktemp("long")
    src, tgt = long_lines()
    for ext, lines in (("src", src), ("tgt", tgt)):
        (root / f"test.{ext}").write_text("\n".join(lines) + "\n")
    dest = root / "bin"
    H.run([
        H.cli("fairseq-preprocess"), "--source-lang", "src", "--target-lang", "tgt",
        "--testpref", root / "test", "--destdir", dest, "--workers", "1",
        "--srcdict", f"{toy_bin}/dict.src.txt", "--tgtdict", f"{toy_bin}/dict.tgt.txt",
    ])
    return str(dest)


def shrink_positions(state, limit):
    """A drafter checkpoint state with only ``limit`` positions: its learned
    decoder position table cut to ``limit`` rows (plus fairseq's padding rows)
    and ``--max-source-positions``/``--max-target-positions`` set to ``limit``."""
    from fairseq.models.transformer import DEFAULT_MAX_TARGET_POSITIONS

    def put(section, name, value):  # fairseq-train stores the model's options as a Namespace
        if isinstance(section, dict):
            section[name] = value
        else:
            setattr(section, name, value)

    # fairseq's learned table: max_target_positions + padding_idx + 1 rows
    weight = state["model"]["decoder.embed_positions.weight"]
    extra = weight.size(0) - DEFAULT_MAX_TARGET_POSITIONS
    assert extra == 2, weight.shape  # the drafter was trained with the default 1024 positions, pad 1
    state["model"]["decoder.embed_positions.weight"] = weight[: limit + extra].clone()
    for section in ("model", "task"):
        for name in ("max_source_positions", "max_target_positions"):
            put(state["cfg"][section], name, limit)
    return state


@pytest.fixture(scope="module")
def short_drafter(nat_checkpoint, tmp_path_factory):
    """The trained tiny drafter (k = 4), cut to LIMIT positions."""
    path = tmp_path_factory.mktemp("short_drafter") / "drafter16.pt"
    torch.save(shrink_positions(torch.load(nat_checkpoint), LIMIT), path)
    return str(path)


# ---------------------------------------------------------------- in process (fast)


def test_rows_too_long_for_the_drafter_get_no_draft(toy_bin):
    """No IndexError; rows whose source (EOS included) exceeds the drafter's
    positions are pad (no draft), the others are drafted as if alone."""
    model, task, _ = H.build_untrained_drafter(
        toy_bin, seed=3, block_size=4,
        extra=("--max-source-positions", str(LIMIT), "--max-target-positions", str(LIMIT)),
    )
    model.eval()
    d = task.source_dictionary
    lengths = [3, 25, 15, 16, 0]
    lines = [" ".join(f"a{i % 20}" for i in range(n)) for n in lengths]
    tokens = [d.encode_line(line, add_if_not_exist=False).long() for line in lines]
    from fairseq.data import data_utils

    net_input = {"src_tokens": data_utils.collate_tokens(tokens, d.pad(), left_pad=True),
                 "src_lengths": torch.tensor([len(t) for t in tokens])}
    prefix = torch.full((len(lines), 2), d.pad())
    prefix_lengths = torch.zeros(len(lines), dtype=torch.long)
    drafter = NATBlockDrafter(model, None, with_scores=True)
    drafter.start_batch(DecodingState({"net_input": net_input}, None, width=8, pad=d.pad(), bos=d.eos(), draft_k=4))
    drafts, lprobs = model.draft(drafter.encoder_out, prefix, prefix_lengths, 4, True, active=drafter.fits)
    fits = [n + 1 <= LIMIT for n in lengths]
    assert fits == [True, False, True, False, True]
    for row, ok in enumerate(fits):
        assert drafts[row].ne(d.pad()).all().item() is ok, (row, drafts[row])
        # a fitting row gets what it gets alone in its batch
        if ok:
            alone = {"src_tokens": tokens[row].unsqueeze(0), "src_lengths": torch.tensor([len(tokens[row])])}
            single = NATBlockDrafter(model, None, with_scores=True)
            single.start_batch(DecodingState({"net_input": alone}, None, width=8, pad=d.pad(), bos=d.eos(), draft_k=4))
            expected, _ = model.draft(single.encoder_out, prefix[:1], prefix_lengths[:1], 4, True)
            assert drafts[row].tolist() == expected[0].tolist()
    assert torch.isinf(lprobs[1]).all() and torch.isfinite(lprobs[0]).all()
    # the model alone (its own encoder over the uncut sources) does not crash either
    encoder_out = model.encoder.forward_torchscript(net_input)
    direct, _ = model.draft(encoder_out, prefix, prefix_lengths, 4, False)
    assert [bool(direct[row].ne(d.pad()).all()) for row in range(len(lines))] == fits


# ---------------------------------------------------------------- the command-line tools (slow)

STATS = re.compile(r"draft-verify: (\d+) sentences, (\d+) tokens \(EOS included\), (\d+) iterations")


@pytest.mark.slow
@pytest.mark.parametrize("bsz", [1, 5])
def test_generate_with_a_drafter_shorter_than_the_sources(toy_bin, long_bin, ar_checkpoint, short_drafter, tmp_path, bsz):
    n = len(LENGTHS)
    ref = H.generate(long_bin, ar_checkpoint, "--decoding", "autoregressive", "--max-len-b", MAX_LEN_B,
                     task="draft_verify", batch_size=bsz)
    stats = tmp_path / "stats.jsonl"
    results = tmp_path / "results"
    # every row may draft (--draft-max-rows 0): what is drafted does not wait on the loop's timings
    proc = H.generate(long_bin, ar_checkpoint, "--decoding", "draft-verify", "--drafter-path", short_drafter,
                      "--max-len-b", MAX_LEN_B, "--specdec-stats", stats, "--results-path", results,
                      "--draft-max-rows", "0", task="draft_verify", batch_size=bsz)
    text = (results / "generate-test.txt").read_text()
    got = H.parse_generate(text)
    H.assert_same_hypotheses(H.parse_generate(ref.stdout), got)
    assert sorted(got) == list(range(n))
    assert f"Translated {n} sentences" in text
    (summary,) = STATS.findall(text)
    assert int(summary[0]) == n
    records = {r["id"]: r for r in map(json.loads, stats.read_text().splitlines())}
    assert sorted(records) == list(range(n))
    # a source the drafter cannot read is never drafted: one token per iteration
    for i in TOO_LONG:
        assert set(records[i]["accepted"]) == {1}, (i, records[i])
    # the other rows still draft, and the trained drafter gets some drafts accepted
    if bsz == 1:
        assert any(a > 1 for i, r in records.items() if i not in TOO_LONG for a in r["accepted"])


@pytest.mark.slow
def test_interactive_with_a_drafter_shorter_than_the_sources(toy_bin, long_bin, ar_checkpoint, short_drafter):
    src, _ = long_lines()
    common = [H.cli("fairseq-interactive"), long_bin, "--path", ar_checkpoint, "--user-dir", H.USER_DIR,
              "--task", "draft_verify", "--source-lang", "src", "--target-lang", "tgt", "--beam", "1",
              "--cpu", "--max-len-b", MAX_LEN_B, "--buffer-size", "4", "--batch-size", "4"]
    stdin = "\n".join(src) + "\n"

    def interactive(*extra):
        proc = H.run([*common, *extra], check=False, input=stdin, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc

    ref = interactive("--decoding", "autoregressive")
    got = interactive("--decoding", "draft-verify", "--drafter-path", short_drafter)
    ref_hyps, got_hyps = H.parse_generate(ref.stdout), H.parse_generate(got.stdout)
    assert sorted(ref_hyps) == list(range(len(src)))
    H.assert_same_hypotheses(ref_hyps, got_hyps)


def test_source_copy_drafter_with_empty_and_long_sources():
    """Input-guided drafting reads no position table: an empty source (EOS
    only) gives no draft, a long one at most k tokens."""
    from fairseq_specdec.generation import SourceCopyDrafter

    pad, eos = 1, 2
    long_source = list(range(10, 50))
    src_tokens = torch.tensor([[pad] * 40 + [eos], [pad] * 34 + [10, 11, 12, 13, 14, 15, eos], long_source + [eos]])
    drafter = SourceCopyDrafter(pad, eos)
    state = DecodingState({"net_input": {"src_tokens": src_tokens}}, None, width=8, pad=pad, bos=eos, draft_k=5)
    drafter.start_batch(state)
    drafts, _ = drafter.propose(state, 5)  # no output yet: BOS only
    assert drafts.tolist() == [[pad] * 5, [10, 11, 12, 13, 14], long_source[:5]]
