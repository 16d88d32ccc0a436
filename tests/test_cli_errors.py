"""Options draft-verify cannot honour fail before decoding, with a message naming them.

Most checks run in-process through ``task.build_generator`` (what
fairseq-generate calls); a few run the real fairseq-generate.
"""
import os
import re
import shutil

import pytest
import torch

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


@pytest.fixture(scope="module")
def bigger_dict_vsd_drafter(toy_bin, tmp_path_factory):
    """An untrained specdec_vsd drafter made for a verifier of another
    dictionary (two extra types): its embedding copies have two more rows."""
    root = tmp_path_factory.mktemp("bigger_vsd")
    data = _dict_variant(toy_bin, root / "data", lambda lines: lines + ["zz1 1", "zz2 1"])
    _, cfg = H.train_args_namespace(data, *H.VSD_ARGS, "--block-size", "4", "--cpu",
                                    "--source-lang", "src", "--target-lang", "tgt")
    task = tasks.setup_task(cfg.task)
    model = task.build_model(cfg.model, from_checkpoint=True)  # no verifier to copy: only the shapes matter
    return H.save_model_checkpoint(model, cfg, root / "vsd.pt")


def build(toy_bin, models, *argv, parts_off=frozenset()):
    cfg = H.generation_cfg(toy_bin, "--task", "draft_verify", "--beam", "1", *argv)
    task = tasks.setup_task(cfg.task)
    task.generation_services.parts_off = frozenset(parts_off)
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
        (["--retain-iter-history"], "--retain-iter-history"),
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


def test_vsd_drafter_of_another_dictionary_is_refused_by_name(toy_bin, untrained_verifier, bigger_dict_vsd_drafter):
    """A specdec_vsd drafter made for a verifier with another dictionary:
    the message errors.md promises, naming the file, not load_state_dict's
    size mismatch of its embedding copies."""
    with pytest.raises(ValueError) as err:
        build(toy_bin, [untrained_verifier[0]], *DV, "--drafter-path", bigger_dict_vsd_drafter)
    msg = str(err.value)
    assert "different target dictionary than the verifier's" in msg and bigger_dict_vsd_drafter in msg, msg
    assert "size mismatch" not in msg


def test_vsd_drafter_of_another_dictionary_in_path_is_refused(toy_bin, bigger_dict_vsd_drafter):
    """The drafter as the second model of --path: fairseq loads it itself, and
    the drafter's own load_state_dict refuses it with the same message."""
    from fairseq import checkpoint_utils

    task = tasks.setup_task(H.generation_cfg(toy_bin, "--task", "draft_verify").task)
    with pytest.raises(ValueError) as err:
        checkpoint_utils.load_model_ensemble([bigger_dict_vsd_drafter], task=task)
    msg = str(err.value)
    assert "specdec_vsd checkpoint was trained with a different target dictionary than the verifier's" in msg, msg


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


# ---- options of another decoding, messages ------------------------------------------


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


def test_option_reference_documents_what_verify_tau_accepts():
    """The option reference agrees with the option: negative values and NaN
    are refused (see the cases above), so the docs must not call the option
    ignored."""
    row = next(line for line in (H.ROOT / "docs" / "options.md").read_text().splitlines()
               if line.startswith("| `--verify-tau"))
    assert ">= 0" in row and "ignored" not in row.lower(), row


# ---- through the real fairseq-generate ------------------------------------------


SPECULATIVE_UNDER_AUTOREGRESSIVE = [
    (["--drafter-path", "missing.pt"], "--drafter-path"),
    (["--verify-beta", "3"], "--verify-beta"),
    (["--verify-tau", "1"], "--verify-tau"),
    (["--adaptive-draft"], "--adaptive-draft"),
    (["--specdec-backend", "reference"], "--specdec-backend"),
]


@pytest.mark.parametrize("argv,option", SPECULATIVE_UNDER_AUTOREGRESSIVE, ids=[o for _, o in SPECULATIVE_UNDER_AUTOREGRESSIVE])
def test_speculative_option_under_autoregressive(toy_bin, untrained_verifier, argv, option):
    """fairseq's own decoding would ignore these: refused, naming the option."""
    with pytest.raises(ValueError, match=f"{option} .*applies to speculative decodings only"):
        build(toy_bin, [untrained_verifier[0]], "--decoding", "autoregressive", *argv)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["missing drafter", "beam", "autoregressive", "corrupt --path", "corrupt --drafter-path"])
def test_cli_refuses_before_decoding(toy_bin, transformer_checkpoint, random_drafter_checkpoint, tmp_path, case):
    """The refusals tested in-process above reach a fairseq-generate user,
    naming the option or file, before any sentence is decoded: one case per
    path an error takes (the generator builder, fairseq's generation options,
    the task's guard of its own decoding, the safe checkpoint loader)."""
    corrupt = tmp_path / "corrupt_model.pt"
    data = open(transformer_checkpoint, "rb").read()
    corrupt.write_bytes(data[: len(data) // 3])
    missing = str(tmp_path / "missing_drafter.pt")
    path, argv, needles = {
        "missing drafter": (transformer_checkpoint, [*DV, "--drafter-path", missing], ["missing_drafter.pt", "no such file"]),
        "beam": (transformer_checkpoint, [*DV, "--drafter-path", random_drafter_checkpoint, "--beam", "5"], ["--beam"]),
        "autoregressive": (transformer_checkpoint, ["--decoding", "autoregressive", "--verify-beta", "3"],
                           ["--verify-beta", "speculative"]),
        "corrupt --path": (corrupt, [*DV], [f"cannot load checkpoint {corrupt}"]),
        "corrupt --drafter-path": (transformer_checkpoint, [*DV, "--drafter-path", corrupt], [f"cannot load checkpoint {corrupt}"]),
    }[case]
    proc = H.generate(toy_bin, path, *argv, task="draft_verify", check=False)
    _assert_failed_before_decoding(proc, *needles)
    assert "weights_only" not in proc.stdout + proc.stderr


@pytest.mark.slow
def test_cli_specdec_stats_into_a_missing_directory(toy_bin, transformer_checkpoint, random_drafter_checkpoint, tmp_path):
    stats = tmp_path / "not" / "yet" / "stats.jsonl"
    proc = H.generate(toy_bin, transformer_checkpoint, *DV, "--drafter-path", random_drafter_checkpoint,
                      "--max-len-b", "3", "--specdec-stats", stats, task="draft_verify", batch_size=16)
    assert sorted(H.read_stats(stats)) == list(range(50))
    assert sorted(H.parse_generate(proc.stdout)) == list(range(50))


# ---- bad values and options that reach no decoder ------------------------------


@pytest.mark.parametrize("tau", ["nan", "-inf"])
def test_verify_tau_that_is_not_a_number_is_refused(toy_bin, untrained_verifier, random_drafter_checkpoint, tau):
    """NaN compares false with everything: relaxed decoding would silently accept nothing."""
    with pytest.raises(ValueError, match=f"--verify-tau must be .* got {tau}"):
        build(toy_bin, [untrained_verifier[0]], *DV, "--drafter-path", random_drafter_checkpoint,
              "--verify-beta", "2", f"--verify-tau={tau}")


def test_infinite_verify_tau_is_no_limit(toy_bin, untrained_verifier, random_drafter_checkpoint):
    gen = build(toy_bin, [untrained_verifier[0]], *DV, "--drafter-path", random_drafter_checkpoint,
                "--verify-beta", "2", "--verify-tau", "inf")
    assert gen.step.rule.tau == float("inf")


@pytest.mark.parametrize("k", ["-1", "0", "2", "100000"])
def test_loop_greedy_refuses_a_block_size(toy_bin, untrained_verifier, k):
    """loop-greedy never drafts: a block size was logged as 1 whatever was
    given (one below 1 is refused with the options, for every decoding)."""
    message = "--block-size must be >= 1" if int(k) < 1 else f"--block-size does not apply \\(got {k}\\)"
    with pytest.raises(ValueError, match=message):
        build(toy_bin, [untrained_verifier[0]], "--decoding", "loop-greedy", "--block-size", k)


def test_specdec_stats_under_autoregressive_is_refused(toy_bin, untrained_verifier, tmp_path):
    stats = tmp_path / "stats.jsonl"
    with pytest.raises(ValueError, match="--specdec-stats .* applies to speculative decodings only"):
        build(toy_bin, [untrained_verifier[0]], "--decoding", "autoregressive", "--specdec-stats", str(stats))
    assert not stats.exists()


@pytest.mark.parametrize("where", ["directory", "under a file"])
def test_specdec_stats_that_cannot_be_a_file_is_named(toy_bin, untrained_verifier, tmp_path, where):
    if where == "directory":
        stats = tmp_path
    else:
        (tmp_path / "plain").write_text("x")
        stats = tmp_path / "plain" / "stats.jsonl"
    with pytest.raises(ValueError, match=f"--specdec-stats {stats}"):
        build(toy_bin, [untrained_verifier[0]], "--decoding", "loop-greedy", "--specdec-stats", str(stats))


@pytest.mark.parametrize("how", ["in --path", "--drafter-path"])
def test_score_reference_with_a_drafter_says_what_to_do(toy_bin, untrained_verifier, tiny_drafter,
                                                        random_drafter_checkpoint, how):
    """It used to say 'use --decoding draft-verify', which the user had given."""
    models = [untrained_verifier[0]] + ([tiny_drafter[0]] if how == "in --path" else [])
    extra = ["--drafter-path", random_drafter_checkpoint] if how == "--drafter-path" else []
    with pytest.raises(ValueError, match="--score-reference scores the references with the verifier alone"):
        build(toy_bin, models, *DV, "--score-reference", *extra)


def test_score_reference_without_a_drafter_scores(toy_bin, untrained_verifier):
    gen = build(toy_bin, [untrained_verifier[0]], *DV, "--score-reference")
    assert type(gen).__name__ == "SequenceScorer"


@pytest.fixture(scope="module")
def untrained_vsd(toy_bin, transformer_checkpoint):
    """An untrained specdec_vsd drafter of ``transformer_checkpoint`` (k = 4, offsets for 6 slots)."""
    _, cfg = H.train_args_namespace(
        toy_bin, "--task", "draft_verify", "--arch", "specdec_vsd", "--criterion", "glat_block",
        "--embed-dim", "64", "--attention-heads", "2", "--ffn-embed-dim", "128", "--block-size", "4", "--max-block", "6", "--init-from-verifier", transformer_checkpoint,
        "--cpu", "--optimizer", "adam",
    )
    task = tasks.setup_task(cfg.task)
    return task.build_model(cfg.model).eval()


def test_vsd_block_size_beyond_its_slot_table_is_refused(toy_bin, untrained_verifier, untrained_vsd):
    """It crashed mid-run (a tensor-size error) after writing part of the results."""
    verifier = untrained_verifier[0]
    assert build(toy_bin, [verifier, untrained_vsd], *DV, "--block-size", "6").block_size == 6
    with pytest.raises(ValueError, match="--block-size 7: the drafter .* at most 6 tokens per pass"):
        build(toy_bin, [verifier, untrained_vsd], *DV, "--block-size", "7")


@pytest.mark.parametrize("kernel", ["rowgemm", "none"])
def test_vsd_default_block_size_follows_the_product_kernel(toy_bin, untrained_verifier, untrained_vsd, kernel, monkeypatch):
    """Without --block-size: k = 3 (the drafter's KERNEL_BLOCK) where the
    row-blocked kernel runs (the untrained drafter says it was trained with
    k = 4), else the training k; an explicit --block-size always wins."""
    from fairseq_specdec.kernels import rowgemm

    verifier = untrained_verifier[0]
    if kernel == "rowgemm" and not rowgemm.applies_to(untrained_vsd.output_weight):
        pytest.skip(f"the rowgemm kernel does not run here: {rowgemm.unavailable_reason()}")
    assert int(untrained_vsd.train_block_size) == 4
    off = {"products"} if kernel == "none" else set()
    assert build(toy_bin, [verifier, untrained_vsd], *DV, parts_off=off).block_size == (3 if kernel == "rowgemm" else 4)
    assert build(toy_bin, [verifier, untrained_vsd], *DV, "--block-size", "5").block_size == 5


def test_vsd_of_another_verifier_in_path_names_path(toy_bin, untrained_vsd):
    """The refusal named --drafter-path for a drafter given in --path."""
    _, cfg = H.train_args_namespace(toy_bin, "--task", "translation", *H.AR_ARCH_ARGS, "--cpu", "--seed", "7")
    torch.manual_seed(7)
    other = tasks.setup_task(cfg.task).build_model(cfg.model).eval()
    with pytest.raises(ValueError, match="the second model in --path\\) is a specdec_vsd drafter trained on another"):
        build(toy_bin, [other, untrained_vsd], *DV)


def test_errors_doc_lists_every_option_refused_under_autoregressive():
    """docs/errors.md names the speculative options fairseq's own decoder
    would ignore: exactly those the task refuses."""
    import re

    from fairseq_specdec.tasks.draft_verify import DraftVerifyTask

    text = (H.ROOT / "docs" / "errors.md").read_text()
    section = text.split("## Options of speculative decoding under `--decoding autoregressive`", 1)[1]
    section = section.split("\n## ", 1)[0]
    listed = set(re.findall(r"`(--[a-z-]+)`", section)) - {"--path"}
    assert listed == {"--" + name.replace("_", "-") for name in DraftVerifyTask.SPECULATIVE_OPTIONS}


def test_vsd_drafter_computes_as_the_backend_says(toy_bin, untrained_verifier, untrained_vsd):
    """The specdec_vsd drafter's pass: natively (bfloat16 weights where the
    kernel runs with them) under auto, torch's operations under reference."""
    from fairseq_specdec.kernels import rowgemm

    verifier = untrained_verifier[0]
    auto = build(toy_bin, [verifier, untrained_vsd], *DV).drafter
    assert (auto.native is not None) == (rowgemm.unavailable_reason() is None)
    if auto.native is not None:
        assert auto.kernels.precision == ("bfloat16" if rowgemm.bfloat16_available() else "float32")
    reference = build(toy_bin, [verifier, untrained_vsd], *DV, "--specdec-backend", "reference").drafter
    assert reference.native is None and not reference.kernels.products
    assert "torch operations" in reference.describe()


@pytest.mark.parametrize("argv,needles", [
    (["--min-len", "20", "--max-len-b", "10"], ["--min-len 20", "--max-len-b 10"]),
    (["--min-len", "2000"], ["--min-len 2000", "1023 tokens"]),  # the toy verifier has 1024 target positions
], ids=["over --max-len-b", "over the positions"])
def test_min_len_that_no_output_can_reach_is_refused_when_built(toy_bin, untrained_verifier, argv, needles):
    """fairseq's own generator asserts on the first batch (a bare
    AssertionError); the limit is known before any output here."""
    with pytest.raises(ValueError) as err:
        build(toy_bin, [untrained_verifier[0]], "--decoding", "loop-greedy", *argv)
    assert all(n in str(err.value) for n in needles), str(err.value)


def test_min_len_over_a_batch_limit_is_refused_by_name(toy_bin, untrained_verifier):
    """With --max-len-a the limit depends on the batch's source length: a
    batch too short for --min-len is refused with a message naming the three
    options, not an AssertionError."""
    gen = build(toy_bin, [untrained_verifier[0]], "--decoding", "loop-greedy",
                "--max-len-a", "1", "--max-len-b", "0", "--min-len", "100")
    task = tasks.setup_task(H.generation_cfg(toy_bin, "--task", "draft_verify").task)
    with pytest.raises(ValueError) as err:
        H.run_generator(gen, untrained_verifier[0], H.batches(task, "test", 1)[:1])
    msg = str(err.value)
    assert all(n in msg for n in ("--min-len 100", "--max-len-a 1", "--max-len-b 0")), msg


# ---- a strict decoding never relaxes; refusals leave files alone; messages name the decoding


def _decodings(relaxed):
    from fairseq_specdec.generation.registry import DECODINGS

    return sorted(name for name, d in DECODINGS.items() if d.relaxed == relaxed)


@pytest.mark.parametrize("decoding", _decodings(relaxed=False))
@pytest.mark.parametrize("relaxed", [["--verify-beta", "3", "--verify-tau", "1"], ["--verify-beta", "2"]],
                         ids=["b3t1", "b2"])
def test_strict_decoding_refuses_relaxed_verification(toy_bin, untrained_verifier, decoding, relaxed):
    """A decoding registered as always strict (docs/options.md says so, from
    the same registry field) refuses --verify-beta > 1 by name, before its
    drafter is built (no corpus or drafter is needed to be refused)."""
    with pytest.raises(ValueError, match=rf"--decoding {re.escape(decoding)} is always strict.*--verify-beta"):
        build(toy_bin, [untrained_verifier[0]], "--decoding", decoding, *relaxed)


@pytest.mark.parametrize("decoding", _decodings(relaxed=False) + _decodings(relaxed=True))
def test_every_decoding_takes_strict_verification_options(decoding):
    """--verify-beta 1 is strict whatever --verify-tau says: no decoding
    refuses it (checked on the rule the builder makes)."""
    from fairseq_specdec.generation.acceptance import StrictAcceptance, build_acceptance
    from fairseq_specdec.generation.build import check_strictness
    from fairseq_specdec.generation.registry import get_decoding

    rule = build_acceptance(1, 5.0, "verifier")
    assert isinstance(rule, StrictAcceptance)
    check_strictness(get_decoding(decoding), rule)


def test_relaxed_decodings_build_a_relaxed_rule(toy_bin, untrained_verifier):
    """The decodings that take relaxed verification build it (self-draft
    needs no drafter file)."""
    assert "self-draft" in _decodings(relaxed=True)
    gen = build(toy_bin, [untrained_verifier[0]], "--decoding", "self-draft", "--verify-beta", "3", "--verify-tau", "1")
    assert (gen.step.rule.beta, gen.step.rule.tau) == (3, 1.0)


@pytest.mark.parametrize("bad", [["--draft-tree", "-1"], ["--draft-max-rows", "-1"], ["--block-size", "0"]],
                         ids=["draft-tree", "draft-max-rows", "block-size"])
def test_refused_run_leaves_the_statistics_file_alone(toy_bin, untrained_verifier, tmp_path, bad):
    """Every refusal comes before --specdec-stats is opened: an existing
    file keeps its contents."""
    stats = tmp_path / "stats.jsonl"
    stats.write_text('{"id": 0}\n')
    with pytest.raises(ValueError):
        build(toy_bin, [untrained_verifier[0]], "--decoding", "loop-greedy" if bad[0] != "--block-size" else "ngram",
              "--specdec-stats", str(stats), *bad)
    assert stats.read_text() == '{"id": 0}\n'


def test_missing_drafter_message_names_the_decoding_asked_for(toy_bin, untrained_verifier):
    with pytest.raises(ValueError, match=r"--decoding ngram\+draft-verify needs a drafter"):
        build(toy_bin, [untrained_verifier[0]], "--decoding", "ngram+draft-verify")


@pytest.mark.slow
@pytest.mark.parametrize("tool", ["fairseq-generate", "fairseq-interactive"])
def test_cli_refusal_is_one_argparse_style_line(toy_bin, transformer_checkpoint, tool):
    """A refusal of the plugin under a command-line tool: "TOOL: error:
    MESSAGE" on stderr, exit status 2, no Python traceback."""
    cmd = [H.cli(tool), toy_bin, "--path", transformer_checkpoint, "--task", "draft_verify", "--beam", "1", "--cpu",
           "--user-dir", H.USER_DIR, "--decoding", "ngram", "--verify-beta", "3", "--source-lang", "src",
           "--target-lang", "tgt"]
    proc = H.run(cmd, check=False, input="a1 a2\n", timeout=600)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith(f"{tool}: error: ")]
    assert len(lines) == 1 and "--decoding ngram is always strict" in lines[0], proc.stderr[-3000:]
    assert not any(line.startswith("H-") for line in proc.stdout.splitlines())


def test_python_api_keeps_raising_refusals(toy_bin, untrained_verifier):
    """Outside the command-line tools the hook is not installed: the
    exception reaches the caller (pytest here)."""
    from fairseq_specdec import compat

    assert not compat.install_cli_refusals("python")
    with pytest.raises(ValueError, match="always strict"):
        build(toy_bin, [untrained_verifier[0]], "--decoding", "ngram", "--verify-beta", "3")


def _outcome(toy_bin, model, argv):
    """"built", or the refusal of building a generator: its type and the
    options its message names (a drafter's description, which names its
    backend's products, may differ)."""
    try:
        gen = build(toy_bin, [model], *argv)
    except (ValueError, FileNotFoundError) as err:
        return type(err).__name__, re.findall(r"--[a-z][a-z-]+", str(err))
    stats = getattr(gen, "stats", None)
    if stats is not None:
        stats.close()
    return "built"


OPTION_SETS = [(), ("--draft-tree", "3"), ("--verify-beta", "3", "--verify-tau", "1"), ("--block-size", "2"),
               ("--draft-max-rows", "0"), ("--adaptive-draft",), ("--draft-min-confidence", "0.5")]


@pytest.mark.parametrize("decoding", sorted(__import__("fairseq_specdec").generation.registry.DECODINGS))
def test_both_backends_accept_and_refuse_the_same_options(toy_bin, untrained_verifier, random_drafter_checkpoint,
                                                          decoding):
    """Every registered decoding with each set of options: the auto and the
    reference backend build the same generators and refuse the same
    options, naming the same options (a probe of 53c8208 found no difference)."""
    from fairseq_specdec.generation.registry import get_decoding

    drafter = ["--drafter-path", random_drafter_checkpoint] if get_decoding(decoding).takes_drafter else []
    for options in OPTION_SETS:
        argv = ["--decoding", decoding, *drafter, *options]
        auto = _outcome(toy_bin, untrained_verifier[0], argv)
        reference = _outcome(toy_bin, untrained_verifier[0], argv + ["--specdec-backend", "reference"])
        assert auto == reference, (decoding, options, auto, reference)
