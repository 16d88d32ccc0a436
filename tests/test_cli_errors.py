"""Options draft-verify cannot honour fail before decoding, with a message naming them.

Most checks run in-process through ``task.build_generator`` (what
fairseq-generate calls); a few run the real fairseq-generate.
"""
import os
import shutil

import pytest

import specdec_helpers as H
import fairseq_specdec  # noqa: F401
from fairseq import tasks


@pytest.fixture(scope="module")
def untrained_verifier(toy_bin):
    """An untrained stock Transformer: enough for checks made before decoding."""
    _, cfg = H.train_args_namespace(toy_bin, "--task", "translation", *H.AR_ARCH_ARGS, "--cpu")
    task = tasks.setup_task(cfg.task)
    return task.build_model(cfg.model).eval(), cfg


@pytest.fixture(scope="module")
def transformer_checkpoint(untrained_verifier, tmp_path_factory):
    model, cfg = untrained_verifier
    path = tmp_path_factory.mktemp("ckpt_tf") / "transformer.pt"
    return H.save_model_checkpoint(model, cfg, path, criterion_name="CrossEntropyCriterion")


def _dict_variant(toy_bin, dest, edit):
    os.makedirs(dest, exist_ok=True)
    with open(os.path.join(toy_bin, "dict.src.txt")) as f:
        lines = f.read().splitlines()
    lines = edit(lines)
    for side in ("src", "tgt"):
        with open(os.path.join(dest, f"dict.{side}.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")
    return str(dest)


def _drafter_on(data, path):
    model, _, cfg = H.build_untrained_drafter(
        data, seed=5, block_size=4, extra=("--source-lang", "src", "--target-lang", "tgt")
    )
    return H.save_model_checkpoint(model, cfg, path)


@pytest.fixture(scope="module")
def permuted_dict_drafter(toy_bin, tmp_path_factory):
    """A drafter whose dictionary has the same size but two symbols swapped."""
    root = tmp_path_factory.mktemp("permuted")

    def swap(lines):
        lines = list(lines)
        lines[0], lines[1] = lines[1], lines[0]
        return lines

    return _drafter_on(_dict_variant(toy_bin, root / "data", swap), root / "drafter.pt")


@pytest.fixture(scope="module")
def bigger_dict_drafter(toy_bin, tmp_path_factory):
    """A drafter trained on a dictionary with two extra types."""
    root = tmp_path_factory.mktemp("bigger")
    return _drafter_on(
        _dict_variant(toy_bin, root / "data", lambda lines: lines + ["zz1 1", "zz2 1"]), root / "drafter.pt"
    )


def build(toy_bin, models, *argv):
    cfg = H.generation_cfg(toy_bin, "--task", "draft_verify", "--beam", "1", *argv)
    task = tasks.setup_task(cfg.task)
    return task.build_generator(models, cfg.generation)


DV = ("--decoding", "draft-verify")


def test_valid_setup_builds(toy_bin, untrained_verifier, random_drafter_checkpoint):
    gen = build(toy_bin, [untrained_verifier[0]], *DV, "--drafter-path", random_drafter_checkpoint)
    assert type(gen).__name__ == "SpeculativeGenerator"
    assert gen.block_size == 4  # the drafter's training k
    gen = build(toy_bin, [untrained_verifier[0]], *DV, "--drafter-path", random_drafter_checkpoint,
                "--block-size", "2")
    assert gen.block_size == 2


@pytest.mark.parametrize(
    "argv,option",
    [
        (["--beam", "5"], "--beam"),
        (["--sampling"], "--sampling"),
        (["--sampling-topk", "5"], "--sampling-topk"),
        (["--sampling-topp", "0.9"], "--sampling-topp"),
        (["--prefix-size", "1"], "--prefix-size"),
        (["--no-repeat-ngram-size", "2"], "--no-repeat-ngram-size"),
        (["--nbest", "2"], "--nbest"),
        (["--print-alignment"], "--print-alignment"),
        (["--match-source-len"], "--match-source-len"),
        (["--diverse-beam-groups", "2"], "--diverse-beam-groups"),
        (["--constraints"], "--constraints"),
        (["--block-size", "0"], "--block-size"),
        (["--verify-beta", "0"], "--verify-beta"),
        (["--verify-beta", "2", "--verify-tau", "-1"], "--verify-tau"),
        (["--verify-tau", "-1"], "--verify-tau"),
    ],
)
def test_unsupported_options(toy_bin, untrained_verifier, random_drafter_checkpoint, argv, option):
    with pytest.raises(ValueError, match=option):
        build(toy_bin, [untrained_verifier[0]], *DV, "--drafter-path", random_drafter_checkpoint, *argv)


def test_missing_drafter_file(toy_bin, untrained_verifier, tmp_path):
    missing = str(tmp_path / "nope.pt")
    with pytest.raises(FileNotFoundError, match="nope.pt"):
        build(toy_bin, [untrained_verifier[0]], *DV, "--drafter-path", missing)


def test_no_drafter_given(toy_bin, untrained_verifier):
    with pytest.raises(ValueError, match="drafter"):
        build(toy_bin, [untrained_verifier[0]], *DV)


def test_transformer_is_not_a_drafter(toy_bin, untrained_verifier, transformer_checkpoint):
    with pytest.raises(ValueError, match="specdec_nat"):
        build(toy_bin, [untrained_verifier[0]], *DV, "--drafter-path", transformer_checkpoint)


def test_permuted_dictionary_rejected(toy_bin, untrained_verifier, permuted_dict_drafter):
    with pytest.raises(ValueError, match="dictionary"):
        build(toy_bin, [untrained_verifier[0]], *DV, "--drafter-path", permuted_dict_drafter)


def test_different_size_dictionary_rejected(toy_bin, untrained_verifier, bigger_dict_drafter):
    """A drafter trained on another dictionary (other size) must be refused
    with a message about the dictionaries, not an opaque tensor-shape error."""
    with pytest.raises(Exception) as err:
        build(toy_bin, [untrained_verifier[0]], *DV, "--drafter-path", bigger_dict_drafter)
    assert "dictionar" in str(err.value).lower(), f"{type(err.value).__name__}: {str(err.value)[:300]}"


def test_drafter_in_path_with_autoregressive(toy_bin, untrained_verifier, tiny_drafter):
    with pytest.raises(ValueError, match="draft-verify"):
        build(toy_bin, [untrained_verifier[0], tiny_drafter[0]], "--decoding", "autoregressive")


def test_drafter_given_twice(toy_bin, untrained_verifier, tiny_drafter, random_drafter_checkpoint):
    with pytest.raises(ValueError, match="drafter"):
        build(toy_bin, [untrained_verifier[0], tiny_drafter[0]], *DV, "--drafter-path", random_drafter_checkpoint)


def test_ensemble_of_verifiers(toy_bin, untrained_verifier, random_drafter_checkpoint):
    with pytest.raises(ValueError, match="verifier"):
        build(toy_bin, [untrained_verifier[0], untrained_verifier[0]], *DV, "--drafter-path", random_drafter_checkpoint)


def test_drafter_as_second_model_in_path(toy_bin, untrained_verifier, tiny_drafter):
    gen = build(toy_bin, [untrained_verifier[0], tiny_drafter[0]], *DV)
    assert gen.drafter.model is tiny_drafter[0]


# ---- real fairseq-generate runs -------------------------------------------------


def _assert_failed_before_decoding(proc, *needles):
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-2000:]
    assert not any(line.startswith("H-") for line in proc.stdout.splitlines())
    assert "Translated" not in out
    for needle in needles:
        assert needle in out, f"{needle!r} not in output:\n{out[-3000:]}"


@pytest.mark.slow
def test_cli_missing_drafter(toy_bin, ar_checkpoint, tmp_path):
    missing = str(tmp_path / "missing_drafter.pt")
    proc = H.generate(toy_bin, ar_checkpoint, *DV, "--drafter-path", missing, task="draft_verify", check=False)
    _assert_failed_before_decoding(proc, "missing_drafter.pt", "no such file")


@pytest.mark.slow
def test_cli_beam(toy_bin, ar_checkpoint, random_drafter_checkpoint):
    proc = H.generate(toy_bin, ar_checkpoint, *DV, "--drafter-path", random_drafter_checkpoint, "--beam", "5",
                      task="draft_verify", check=False)
    _assert_failed_before_decoding(proc, "--beam")


@pytest.mark.slow
def test_cli_dictionary_mismatch(toy_bin, ar_checkpoint, permuted_dict_drafter):
    proc = H.generate(toy_bin, ar_checkpoint, *DV, "--drafter-path", permuted_dict_drafter,
                      task="draft_verify", check=False)
    _assert_failed_before_decoding(proc, "dictionary")


@pytest.mark.slow
def test_cli_transformer_as_drafter(toy_bin, ar_checkpoint):
    proc = H.generate(toy_bin, ar_checkpoint, *DV, "--drafter-path", ar_checkpoint,
                      task="draft_verify", check=False)
    _assert_failed_before_decoding(proc, "specdec_nat")


# ---- issue 14: options of another decoding, messages ------------------------------


def test_drafter_alone_in_path(toy_bin, tiny_drafter):
    with pytest.raises(ValueError, match="--path holds only a drafter"):
        build(toy_bin, [tiny_drafter[0]], *DV)


def test_specdec_stats_into_a_missing_directory(toy_bin, untrained_verifier, random_drafter_checkpoint, tmp_path):
    """Created as fairseq creates --results-path; the statistics are written there."""
    stats = tmp_path / "new" / "dir" / "stats.jsonl"
    gen = build(toy_bin, [untrained_verifier[0]], *DV, "--drafter-path", random_drafter_checkpoint,
                "--specdec-stats", str(stats))
    model = untrained_verifier[0]
    task = tasks.setup_task(H.generation_cfg(toy_bin, "--task", "draft_verify").task)
    samples = H.batches(task, "test", 16)[:1]
    H.run_generator(gen, model, samples)
    gen.stats.close()
    assert sorted(H.read_stats(stats)) == sorted(samples[0]["id"].tolist())


def test_readme_documents_what_verify_tau_accepts():
    """The README's option table agrees with the option: negative values are
    refused (see the --verify-tau cases above), so the docs must not call the
    option ignored."""
    row = next(line for line in (H.ROOT / "README.md").read_text().splitlines() if line.startswith("| `--verify-tau"))
    assert ">= 0" in row and "ignored" not in row.lower(), row


@pytest.mark.slow
@pytest.mark.parametrize(
    "argv,option",
    [
        (["--drafter-path", "missing.pt"], "--drafter-path"),
        (["--verify-beta", "3"], "--verify-beta"),
        (["--verify-tau", "1"], "--verify-tau"),
        (["--adaptive-draft"], "--adaptive-draft"),
        (["--verify-gemm", "torch"], "--verify-gemm"),
    ],
    ids=["drafter-path", "verify-beta", "verify-tau", "adaptive-draft", "verify-gemm"],
)
def test_cli_speculative_option_under_autoregressive(toy_bin, transformer_checkpoint, argv, option):
    """fairseq's own decoding would ignore these: refused, naming the option."""
    proc = H.generate(toy_bin, transformer_checkpoint, "--decoding", "autoregressive", *argv,
                      task="draft_verify", check=False)
    _assert_failed_before_decoding(proc, option, "speculative")


@pytest.mark.slow
def test_cli_negative_verify_tau(toy_bin, transformer_checkpoint, random_drafter_checkpoint):
    proc = H.generate(toy_bin, transformer_checkpoint, *DV, "--drafter-path", random_drafter_checkpoint,
                      "--verify-tau", "-1", task="draft_verify", check=False)
    _assert_failed_before_decoding(proc, "--verify-tau")


@pytest.mark.slow
def test_cli_drafter_alone_in_path(toy_bin, random_drafter_checkpoint):
    proc = H.generate(toy_bin, random_drafter_checkpoint, *DV, task="draft_verify", check=False)
    _assert_failed_before_decoding(proc, "--path holds only a drafter")


@pytest.mark.slow
@pytest.mark.parametrize("where", ["--path", "--drafter-path"])
def test_cli_corrupt_checkpoint_is_named(toy_bin, transformer_checkpoint, tmp_path, where):
    corrupt = tmp_path / "corrupt_model.pt"
    data = open(transformer_checkpoint, "rb").read()
    corrupt.write_bytes(data[: len(data) // 3])
    if where == "--path":
        proc = H.generate(toy_bin, corrupt, *DV, task="draft_verify", check=False)
    else:
        proc = H.generate(toy_bin, transformer_checkpoint, *DV, "--drafter-path", corrupt, task="draft_verify",
                          check=False)
    _assert_failed_before_decoding(proc, f"cannot load checkpoint {corrupt}")
    assert "weights_only" not in proc.stdout + proc.stderr


@pytest.mark.slow
def test_cli_specdec_stats_into_a_missing_directory(toy_bin, transformer_checkpoint, random_drafter_checkpoint, tmp_path):
    stats = tmp_path / "not" / "yet" / "stats.jsonl"
    proc = H.generate(toy_bin, transformer_checkpoint, *DV, "--drafter-path", random_drafter_checkpoint,
                      "--max-len-b", "3", "--specdec-stats", stats, task="draft_verify", batch_size=16)
    assert sorted(H.read_stats(stats)) == list(range(50))
    assert sorted(H.parse_generate(proc.stdout)) == list(range(50))
