"""The paths a user takes outside fairseq-generate, each against stock fairseq:

- fairseq-interactive, lines on stdin, with a decoding that reads a corpus
  (``--decoding ngram``: the ``--ngram-split`` of the data directory given as
  fairseq-interactive's positional argument) and with a drafter checkpoint;
- a checkpoint laid out like a model-zoo archive of fairseq (one folder:
  ``model.pt``, ``dict.SRC.txt``, ``dict.TGT.txt``, ``bpecodes``), loaded
  through the hub API and through fairseq-interactive with BPE applied;
- an ensemble in ``--path``, refused.

Every output is compared with fairseq's own decoder at ``--beam 1`` under
``--task translation``: the plugin is loaded there only for its safe
checkpoint loader (stock fairseq cannot read a checkpoint under torch 2.13).
"""
import os
import shutil
import sys

import re

import pytest

import specdec_helpers as H

SRC, TGT = "src", "tgt"
#: the generator's statistics line: "<decoding>: N sentences, ..., Tok. X, ..."
STATS = re.compile(r"(\S+): (\d+) sentences, .* Tok\. (\d+\.\d+),")


def source_lines(toy_bin, n=None):
    """The toy corpus's raw source lines of the test split."""
    raw = os.path.join(os.path.dirname(toy_bin), "raw", f"test.{SRC}")
    with open(raw) as f:
        lines = f.read().splitlines()
    return lines if n is None else lines[:n]


def interactive(data, *args, stdin, plugin=True):
    """fairseq-interactive with ``stdin``, under the draft_verify task; with
    ``plugin`` False, fairseq's own translation task and decoder."""
    cmd = [H.cli("fairseq-interactive"), data, "--source-lang", SRC, "--target-lang", TGT, "--beam", "1",
           "--cpu", "--user-dir", H.USER_DIR, "--task", "draft_verify" if plugin else "translation", *args]
    proc = H.run(cmd, check=False, input=stdin, timeout=600)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))}\n{proc.stderr[-3000:]}"
    return proc


def h_lines(text):
    return [line for line in text.splitlines() if line.startswith("H-")]


def assert_interactive_matches_stock(ref, got, n):
    """Every input line translated once, the same tokens and scores as
    fairseq's own --beam 1 (scores within the helpers' tolerance)."""
    ref_hyps, got_hyps = H.parse_generate(ref.stdout), H.parse_generate(got.stdout)
    assert sorted(ref_hyps) == list(range(n)), "fairseq's own fairseq-interactive lost a line"
    H.assert_same_hypotheses(ref_hyps, got_hyps)
    assert len(h_lines(got.stdout)) == n


@pytest.fixture(scope="module")
def stock_interactive(toy_bin, ar_checkpoint):
    """fairseq's own fairseq-interactive --beam 1 on the toy test split's sources."""
    stdin = "\n".join(source_lines(toy_bin)) + "\n"
    return interactive(toy_bin, "--path", ar_checkpoint, "--buffer-size", "8", "--batch-size", "8",
                       stdin=stdin, plugin=False)


@pytest.fixture(scope="module")
def outputs_corpus(toy_bin, stock_interactive, tmp_path_factory):
    """A data directory whose train split pairs the test sources with stock
    --beam 1's outputs for them (the toy dictionaries): a corpus that holds
    every continuation the verifier will choose, so that drafts from it are
    accepted on any CPU, however the toy model trained there.  (The toy
    corpus's own train split gave 2 accepted drafts in 428 iterations on one
    machine and none on another.)"""
    lines = source_lines(toy_bin)
    hyps = H.parse_generate(stock_interactive.stdout)
    work = tmp_path_factory.mktemp("outputs-corpus")
    with open(work / f"train.{SRC}", "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(work / f"train.{TGT}", "w") as f:
        f.write("\n".join(hyps[i][1] for i in range(len(lines))) + "\n")
    dest = work / "bin"
    H.run([H.cli("fairseq-preprocess"), "--source-lang", SRC, "--target-lang", TGT, "--trainpref", work / "train",
           "--srcdict", os.path.join(toy_bin, f"dict.{SRC}.txt"), "--tgtdict", os.path.join(toy_bin, f"dict.{TGT}.txt"),
           "--destdir", dest, "--workers", "1"])
    return str(dest)


@pytest.mark.slow
@pytest.mark.parametrize("backend", sorted(H.BACKEND_ARGS))
def test_interactive_ngram_reads_the_data_directory_corpus(outputs_corpus, ar_checkpoint, stock_interactive,
                                                           toy_bin, backend):
    """``--decoding ngram`` under fairseq-interactive drafts from the train
    split of the data directory (its positional argument): identical to stock
    --beam 1, and drafts were read and accepted (Tok. well above 1: the
    corpus holds the outputs, so nearly every draft is right)."""
    lines = source_lines(toy_bin)
    got = interactive(outputs_corpus, "--path", ar_checkpoint, "--decoding", "ngram", "--ngram-split", "train",
                      "--ngram-min-confidence", "0", "--draft-max-rows", "0", "--buffer-size", "8", "--batch-size", "8",
                      *H.BACKEND_ARGS[backend], stdin="\n".join(lines) + "\n")
    assert_interactive_matches_stock(stock_interactive, got, len(lines))
    log = got.stdout + got.stderr
    assert f"n-gram drafter: {len(lines)} sentences of split 'train'" in log, log[-3000:]
    # the statistics (cumulative over the buffers): every line decoded, and
    # many more tokens than iterations
    stats = STATS.findall(log)
    assert stats and int(stats[-1][1]) == len(lines), stats
    assert float(stats[-1][2]) > 1.5, stats


@pytest.mark.slow
def test_interactive_self_draft(toy_bin, ar_checkpoint, stock_interactive):
    """``--decoding self-draft`` under fairseq-interactive (buffers of 8
    lines, every row drafting; the reference backend's copy is tested
    through fairseq-generate): identical to stock --beam 1, the drafts
    accepted."""
    lines = source_lines(toy_bin)
    got = interactive(toy_bin, "--path", ar_checkpoint, "--decoding", "self-draft", "--draft-max-rows", "0",
                      "--buffer-size", "8", "--batch-size", "8", stdin="\n".join(lines) + "\n")
    assert_interactive_matches_stock(stock_interactive, got, len(lines))
    stats = STATS.findall(got.stdout + got.stderr)
    assert stats and int(stats[-1][1]) == len(lines) and float(stats[-1][2]) > 1.5, stats


@pytest.mark.slow
def test_interactive_ngram_without_the_corpus_split_is_refused(toy_bin, ar_checkpoint):
    proc = H.run(
        [H.cli("fairseq-interactive"), toy_bin, "--source-lang", SRC, "--target-lang", TGT, "--beam", "1", "--cpu",
         "--user-dir", H.USER_DIR, "--task", "draft_verify", "--path", ar_checkpoint, "--decoding", "ngram",
         "--ngram-split", "no_such_split"],
        check=False, input="a1 a2\n", timeout=600)
    assert proc.returncode != 0
    assert "--ngram-split no_such_split" in proc.stderr
    assert not h_lines(proc.stdout)


@pytest.mark.slow
@pytest.mark.parametrize("backend", sorted(H.BACKEND_ARGS))
def test_interactive_with_a_drafter(toy_bin, ar_checkpoint, vsd_checkpoint, stock_interactive, backend):
    lines = source_lines(toy_bin)
    got = interactive(toy_bin, "--path", ar_checkpoint, "--decoding", "draft-verify", "--drafter-path",
                      vsd_checkpoint, "--buffer-size", "8", "--batch-size", "8", *H.BACKEND_ARGS[backend],
                      stdin="\n".join(lines) + "\n")
    assert_interactive_matches_stock(stock_interactive, got, len(lines))


# ---------------------------------------------------------------- a model-zoo-style folder


def learn_bpecodes(toy_bin, dest):
    """subword-nmt codes learnt on the toy training text (both sides), with
    enough merges that every toy word is one symbol, as in a real archive
    where frequent words are whole."""
    raw = os.path.join(os.path.dirname(toy_bin), "raw")
    text = dest.parent / "bpe-train.txt"
    with open(text, "w") as out:
        for side in (SRC, TGT):
            with open(os.path.join(raw, f"train.{side}")) as f:
                out.write(f.read())
    H.run([H.cli("subword-nmt"), "learn-bpe", "-s", "200", "-i", text, "-o", dest])
    return dest


@pytest.fixture(scope="module")
def zoo_folder(toy_bin, ar_checkpoint, tmp_path_factory):
    """The toy verifier laid out as fairseq's hub archives are: model.pt, the
    two dictionaries and bpecodes in one folder (no data, no train split).
    model.pt keeps only what a zoo checkpoint keeps (no optimizer state:
    scripts/pack-checkpoint.py)."""
    folder = tmp_path_factory.mktemp("zoo") / "toy.src-tgt.single_model"
    folder.mkdir()
    H.run([sys.executable, H.ROOT / "scripts" / "pack-checkpoint.py", ar_checkpoint, folder / "model.pt"])
    # a zoo checkpoint names its language pair (a folder has no train files to infer it from)
    import torch

    from fairseq_specdec import compat

    state = torch.load(str(folder / "model.pt"), map_location="cpu")
    assert state["cfg"]["task"]["source_lang"] is None  # the toy verifier was trained without naming them
    state["cfg"]["task"]["source_lang"], state["cfg"]["task"]["target_lang"] = SRC, TGT
    compat.save_checkpoint(state, str(folder / "model.pt"))
    for lang in (SRC, TGT):
        shutil.copy(os.path.join(toy_bin, f"dict.{lang}.txt"), folder / f"dict.{lang}.txt")
    learn_bpecodes(toy_bin, folder / "bpecodes")
    return folder


def test_learnt_bpecodes_keep_the_toy_words_whole(toy_bin, tmp_path):
    """The zoo folder's BPE is applied and the words the model knows come out
    whole (else the comparison below would run on unknown subwords)."""
    from subword_nmt.apply_bpe import BPE

    codes = learn_bpecodes(toy_bin, tmp_path / "bpecodes")
    with open(codes) as f:
        bpe = BPE(f)
    line = source_lines(toy_bin, 1)[0]
    assert bpe.process_line(line) == line
    assert "@@" in bpe.process_line("a1x7q")  # unseen words are split


@pytest.mark.slow
def test_zoo_folder_through_the_hub_api(toy_bin, zoo_folder):
    """from_pretrained on the folder alone (data_name_or_path defaults to the
    folder, checkpoint_file to model.pt), raw text with BPE: the output of
    fairseq's own hub interface at beam 1, for the decodings that need nothing
    but the model."""
    import fairseq_specdec  # noqa: F401  (the safe checkpoint loader, for fairseq's own hub too)
    from fairseq.models.transformer import TransformerModel

    from fairseq_specdec.hub import from_pretrained

    lines = source_lines(toy_bin, 12)
    bpe = dict(bpe="subword_nmt", bpe_codes=str(zoo_folder / "bpecodes"))
    stock = TransformerModel.from_pretrained(str(zoo_folder), **bpe)
    expected = stock.translate(lines, beam=1)
    assert all(expected)
    translator = from_pretrained(str(zoo_folder), decoding="loop-greedy", **bpe)
    assert translator.translate(lines) == expected


@pytest.mark.slow
def test_zoo_folder_through_fairseq_interactive(toy_bin, zoo_folder, vsd_checkpoint):
    """The CLI on the folder, as the docs show for a WMT archive: raw text on
    stdin, --tokenizer moses --bpe subword_nmt --bpe-codes FOLDER/bpecodes;
    identical to stock fairseq-interactive --beam 1 (greedy loop and a drafter)."""
    lines = source_lines(toy_bin, 20)
    stdin = "\n".join(lines) + "\n"
    common = ["--path", zoo_folder / "model.pt", "--tokenizer", "moses", "--bpe", "subword_nmt",
              "--bpe-codes", zoo_folder / "bpecodes", "--buffer-size", "4", "--batch-size", "4"]
    ref = interactive(zoo_folder, *common, stdin=stdin, plugin=False)
    for extra in (["--decoding", "loop-greedy"], ["--decoding", "draft-verify", "--drafter-path", vsd_checkpoint]):
        got = interactive(zoo_folder, *common, *extra, stdin=stdin)
        assert_interactive_matches_stock(ref, got, len(lines))
        # the detokenized text (D- lines) as well
        d = [line.split("\t")[2] for line in got.stdout.splitlines() if line.startswith("D-")]
        assert d == [line.split("\t")[2] for line in ref.stdout.splitlines() if line.startswith("D-")]


@pytest.mark.slow
def test_an_ensemble_is_refused(toy_bin, zoo_folder, ar_checkpoint):
    """A model-zoo ensemble (model1.pt:model2.pt) is refused with a message
    that says so; one of its models decodes (the tests above)."""
    proc = H.run(
        [H.cli("fairseq-interactive"), zoo_folder, "--source-lang", SRC, "--target-lang", TGT, "--beam", "1",
         "--cpu", "--user-dir", H.USER_DIR, "--task", "draft_verify", "--decoding", "loop-greedy",
         "--path", f"{zoo_folder / 'model.pt'}:{ar_checkpoint}"],
        check=False, input="a1 a2\n", timeout=600)
    assert proc.returncode != 0
    assert "ensembles are not supported" in proc.stderr, proc.stderr[-2000:]
