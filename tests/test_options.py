"""The options of a speculative generator: one validated object, built once
from the task's config, and the only place generation reads options from."""
import dataclasses

import pytest

import specdec_helpers as H
from fairseq import tasks

from fairseq_specdec.generation.options import NgramOptions, SPECULATIVE_CONFIG, SpeculativeOptions


@pytest.fixture(scope="module")
def untrained_verifier(toy_bin):
    _, cfg = H.train_args_namespace(toy_bin, "--task", "translation", *H.AR_ARCH_ARGS, "--cpu")
    return tasks.setup_task(cfg.task).build_model(cfg.model).eval()


def parsed(toy_bin, *argv):
    return H.generation_cfg(toy_bin, "--task", "draft_verify", "--beam", "1", *argv)


# an option out of range, and the option the refusal must name
BAD = [
    (("--decoding", "nope"), "--decoding 'nope' is not a decoding"),
    (("--block-size", "0"), "--block-size must be >= 1"),
    (("--draft-min-confidence", "1.0"), "--draft-min-confidence must be in"),
    (("--draft-min-confidence", "-0.5"), "--draft-min-confidence must be in"),
    (("--draft-max-rows", "-1"), "--draft-max-rows must be"),
    (("--draft-tree", "-2"), "--draft-tree must be >= 0"),
    (("--verify-beta", "0"), "--verify-beta must be >= 1"),
    (("--verify-tau=-1"), "--verify-tau must be"),
    (("--ngram-order", "0"), "--ngram-order must be >= 1"),
    (("--ngram-neighbours", "-1"), "--ngram-neighbours must be >= 0"),
    (("--ngram-min-confidence", "1.5"), "--ngram-min-confidence must be in"),
    (("--temperature", "0"), "--temperature must be greater than 0"),
    (("--sampling",), "does not support --sampling"),
    (("--nbest", "2"), "does not support --nbest"),
]


@pytest.mark.parametrize("argv,message", BAD, ids=[" ".join(a if isinstance(a, tuple) else (a,)) for a, _ in BAD])
def test_an_option_out_of_range_is_refused_by_name_before_any_model_is_read(toy_bin, argv, message):
    argv = argv if isinstance(argv, tuple) else (argv,)
    if argv[:1] != ("--decoding",):
        argv = ("--decoding", "self-draft") + argv
    cfg = parsed(toy_bin, *argv)
    if argv[:2] == ("--decoding", "nope"):  # the task refuses it when set up, naming it as the options do
        with pytest.raises(ValueError, match=message):
            tasks.setup_task(cfg.task)
        with pytest.raises(ValueError, match=message):
            SpeculativeOptions.from_config(cfg.task, cfg.generation)
        return
    task = tasks.setup_task(cfg.task)
    with pytest.raises(ValueError, match=message):
        # no model at all: a refusal naming the option shows that it came before any model was looked at
        task.build_generator([], cfg.generation)


def test_a_backend_that_is_none_is_refused_by_name(toy_bin):
    """fairseq's parser already refuses it on the command line; from Python the options do."""
    cfg = parsed(toy_bin, "--decoding", "self-draft")
    options = SpeculativeOptions.from_config(cfg.task, cfg.generation)
    with pytest.raises(ValueError, match="--specdec-backend must be one of auto, reference, got 'fast'"):
        dataclasses.replace(options, backend="fast")


def test_every_speculative_option_of_the_config_reaches_the_options(toy_bin):
    """Changing any config field that only speculative decodings read
    changes the options object: none is dropped on the way."""
    base = parsed(toy_bin, "--decoding", "self-draft")
    default = SpeculativeOptions.from_config(base.task, base.generation)
    changed = {
        "drafter_path": ("--drafter-path", "x.pt"), "verify_beta": ("--verify-beta", "2"),
        "verify_tau": ("--verify-tau", "1.5"), "verify_score": ("--verify-score", "drafter"),
        "adaptive_draft": ("--adaptive-draft",), "draft_min_confidence": ("--draft-min-confidence", "0.5"),
        "draft_max_rows": ("--draft-max-rows", "3"), "draft_tree": ("--draft-tree", "4"),
        "block_size": ("--block-size", "3"), "specdec_backend": ("--specdec-backend", "reference"),
        "specdec_stats": ("--specdec-stats", "s.jsonl"), "ngram_split": ("--ngram-split", "valid"),
        "ngram_order": ("--ngram-order", "2"), "ngram_neighbours": ("--ngram-neighbours", "3"),
        "ngram_min_confidence": ("--ngram-min-confidence", "0.5"),
    }
    assert set(changed) == set(SPECULATIVE_CONFIG)
    for name, argv in changed.items():
        cfg = parsed(toy_bin, "--decoding", "self-draft", *argv)
        assert getattr(cfg.task, name) != getattr(base.task, name), name
        assert SpeculativeOptions.from_config(cfg.task, cfg.generation) != default, name
    for argv in (("--max-len-a", "1.5"), ("--max-len-b", "7"), ("--min-len", "2"), ("--unnormalized",),
                 ("--lenpen", "0.5"), ("--unkpen", "1"), ("--temperature", "0.5")):
        cfg = parsed(toy_bin, "--decoding", "self-draft", *argv)
        assert SpeculativeOptions.from_config(cfg.task, cfg.generation) != default, argv


def test_the_options_have_no_defaults_of_their_own():
    """The config's defaults are the only ones: every field must be given."""
    for cls in (SpeculativeOptions, NgramOptions):
        for field in dataclasses.fields(cls):
            assert field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING, \
                (cls.__name__, field.name)


class _NoConfig:
    """A task whose config cannot be read: generation must not need it."""

    def __init__(self, task):
        object.__setattr__(self, "_task", task)

    def __getattr__(self, name):
        if name == "cfg":
            raise AssertionError("generation read the task's config")
        return getattr(object.__getattribute__(self, "_task"), name)


@pytest.mark.parametrize("decoding", ["self-draft", "ngram", "draft-verify", "loop-greedy"])
def test_generation_reads_options_only_from_the_options_object(toy_bin, untrained_verifier, random_drafter_checkpoint,
                                                               decoding):
    from fairseq_specdec.generation.build import build_speculative_generator

    extra = ("--drafter-path", str(random_drafter_checkpoint)) if decoding == "draft-verify" else ()
    cfg = parsed(toy_bin, "--decoding", decoding, *extra)
    task = tasks.setup_task(cfg.task)
    options = SpeculativeOptions.from_config(task.cfg, cfg.generation)
    model = untrained_verifier
    gen = build_speculative_generator(_NoConfig(task), [model], options, task.generation_services)
    task.load_dataset("test")
    hyps = H.run_generator(gen, model, H.batches(task, "test", 4)[:2])
    assert len(hyps) == 8
