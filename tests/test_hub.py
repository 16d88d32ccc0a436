"""The Python API (issue 14, defect 3): fairseq_specdec.hub.from_pretrained
with flat keywords, greedy translate() without beam=1, the drafter read once,
a statistics line per translate(); the documented example (docs/usage.md) runs as written; the
flat-keyword call that fairseq would silently ignore is refused."""
import json
import logging
import os
import re
from pathlib import Path

import pytest

import specdec_helpers as H
import fairseq_specdec  # noqa: F401
from fairseq import checkpoint_utils, tasks
from fairseq.models.transformer import TransformerModel

USAGE = H.ROOT / "docs" / "usage.md"
STATS = re.compile(r"draft-verify: (\d+) sentences")


def readme_example() -> str:
    """The first python block of the "Python" section of docs/usage.md (the
    README links there)."""
    text = USAGE.read_text()
    section = text.split("\n## Python\n", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def readme_paths(code):
    """The relative paths the example names, as (verifier dir, checkpoint file, data dir, drafter)."""
    strings = dict(re.findall(r"(\w+)=\"([^\"]+)\"", code))
    verifier_dir = re.search(r"from_pretrained\(\s*\"([^\"]+)\"", code).group(1)
    return verifier_dir, strings["checkpoint_file"], strings["data_name_or_path"], strings["drafter_path"]


def counting_checkpoint_loads(monkeypatch):
    """{real path: times fairseq read it}."""
    counts = {}
    original = checkpoint_utils.load_checkpoint_to_cpu

    def load(path, *args, **kwargs):
        real = os.path.realpath(path)
        counts[real] = counts.get(real, 0) + 1
        return original(path, *args, **kwargs)

    monkeypatch.setattr(checkpoint_utils, "load_checkpoint_to_cpu", load)
    return counts


@pytest.mark.slow
def test_readme_python_api_example_runs_as_written(toy_bin, ar_checkpoint, nat_checkpoint, tmp_path,
                                                   monkeypatch, capsys, caplog):
    """The example, unchanged, in a directory laid out as it expects, with the
    toy models in place of the demo's: it prints fairseq's own beam-1
    translations, logs one statistics line per translate() and reads the
    drafter once."""
    code = readme_example()
    verifier_dir, checkpoint_file, data_dir, drafter = readme_paths(code)
    for link, target in ((Path(verifier_dir) / checkpoint_file, ar_checkpoint), (data_dir, toy_bin), (drafter, nat_checkpoint)):
        link = tmp_path / link
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(target)
    sentences = re.findall(r"translate\((\[.*?\]|\".*?\")\)", code)
    assert len(sentences) == 2, sentences

    # the reference: fairseq's own hub interface on the verifier, beam 1
    fairseq_hub = TransformerModel.from_pretrained(
        str(tmp_path / verifier_dir), checkpoint_file=checkpoint_file, data_name_or_path=str(tmp_path / data_dir)
    )
    expected = [str(fairseq_hub.translate(eval(s), beam=1)) for s in sentences]

    monkeypatch.chdir(tmp_path)
    loads = counting_checkpoint_loads(monkeypatch)
    capsys.readouterr()
    with caplog.at_level(logging.INFO):
        namespace = {}
        exec(compile(code, "docs/usage.md (Python)", "exec"), namespace)
    assert capsys.readouterr().out.splitlines() == expected
    translator = namespace["translator"]
    assert type(translator.task).__name__ == "DraftVerifyTask" and translator.task.cfg.decoding == "draft-verify"
    # one statistics line per translate(): 1 sentence, then 2
    lines = [r.getMessage() for r in caplog.records if r.name == "fairseq_specdec.generation"]
    assert [int(n) for line in lines for n in STATS.findall(line)] == [1, 2], lines
    assert loads.get(os.path.realpath(nat_checkpoint)) == 1, loads
    assert any("greedy" in r.getMessage() for r in caplog.records if r.name == "fairseq_specdec.hub")


@pytest.mark.slow
def test_hub_translations_equal_beam1_and_beam5_is_refused(toy_bin, ar_checkpoint, nat_checkpoint):
    from fairseq_specdec.hub import from_pretrained

    folder, name = os.path.split(ar_checkpoint)
    lines = ["a1 a2 a3 a4", "a5 a6", "a7 a8 a9 a10 a11 a12 a13"]
    hub = from_pretrained(folder, checkpoint_file=name, data_name_or_path=toy_bin, drafter_path=nat_checkpoint,
                          block_size=3)
    assert hub.task.cfg.block_size == 3  # a task option given flat reaches the task
    fairseq_hub = TransformerModel.from_pretrained(folder, checkpoint_file=name, data_name_or_path=toy_bin)
    assert hub.translate(lines) == fairseq_hub.translate(lines, beam=1)
    with pytest.raises(ValueError, match="beam"):
        hub.translate(lines, beam=5)
    # fairseq's own decoding through the helper keeps fairseq's beam default
    ar = from_pretrained(folder, checkpoint_file=name, data_name_or_path=toy_bin, decoding="autoregressive")
    assert ar.translate(lines) == fairseq_hub.translate(lines)


@pytest.mark.slow
def test_hub_self_draft_equals_beam1(toy_bin, ar_checkpoint):
    """from_pretrained(..., decoding="self-draft"): the int8 copy is made at
    load time and translate() gives fairseq's beam 1 translations."""
    from fairseq_specdec.hub import from_pretrained

    folder, name = os.path.split(ar_checkpoint)
    lines = _toy_sentences(toy_bin, 12)
    hub = from_pretrained(folder, checkpoint_file=name, data_name_or_path=toy_bin, decoding="self-draft")
    fairseq_hub = TransformerModel.from_pretrained(folder, checkpoint_file=name, data_name_or_path=toy_bin)
    assert hub.translate(lines) == fairseq_hub.translate(lines, beam=1)


# ---------------------------------------------------------------- fast: untrained models


@pytest.fixture(scope="module")
def translation_checkpoint(toy_bin, tmp_path_factory):
    """An untrained Transformer saved as fairseq-train --task translation saves it."""
    _, cfg = H.train_args_namespace(toy_bin, "--task", "translation", *H.AR_ARCH_ARGS, "--cpu")
    model = tasks.setup_task(cfg.task).build_model(cfg.model)
    path = tmp_path_factory.mktemp("hub_ckpt") / "checkpoint_best.pt"
    return H.save_model_checkpoint(model, cfg, path, criterion_name="CrossEntropyCriterion")


def test_flat_task_keyword_is_refused_not_dropped(toy_bin, translation_checkpoint, random_drafter_checkpoint):
    """fairseq applies flat keywords only to options the checkpoint already
    has: task='draft_verify' would leave a translation task that ignores
    decoding= and drafter_path=.  The plugin refuses the call and names the one
    that works."""
    folder, name = os.path.split(translation_checkpoint)
    with pytest.raises(ValueError) as err:
        TransformerModel.from_pretrained(
            folder, checkpoint_file=name, data_name_or_path=toy_bin, user_dir=H.USER_DIR,
            task="draft_verify", decoding="draft-verify", drafter_path=random_drafter_checkpoint,
        )
    msg = str(err.value)
    assert "fairseq_specdec.hub.from_pretrained" in msg and "translation" in msg and name in msg


def test_task_as_dict_refuses_the_default_beam_with_a_message(toy_bin, translation_checkpoint, random_drafter_checkpoint):
    """fairseq's own hub interface (task given as a dict) keeps translate()'s
    default beam 5: refused with a message saying what to do."""
    folder, name = os.path.split(translation_checkpoint)
    hub = TransformerModel.from_pretrained(
        folder, checkpoint_file=name, data_name_or_path=toy_bin,
        task={"_name": "draft_verify", "data": toy_bin, "decoding": "draft-verify", "drafter_path": random_drafter_checkpoint},
    )
    assert hub.task.cfg.decoding == "draft-verify"
    with pytest.raises(ValueError) as err:
        hub.translate("a1 a2")
    assert "beam=1" in str(err.value) and "fairseq_specdec.hub.from_pretrained" in str(err.value)
    assert len(hub.translate("a1 a2", beam=1, max_len_b=5).split()) <= 5


def test_helper_takes_flat_keywords(toy_bin, translation_checkpoint, random_drafter_checkpoint, monkeypatch, caplog):
    from fairseq_specdec.hub import SpecDecHubInterface, from_pretrained

    folder, name = os.path.split(translation_checkpoint)
    loads = counting_checkpoint_loads(monkeypatch)
    hub = from_pretrained(folder, checkpoint_file=name, data_name_or_path=toy_bin, decoding="draft-verify",
                          drafter_path=random_drafter_checkpoint, verify_beta=2, verify_tau=1.5, max_len_b=4)
    assert isinstance(hub, SpecDecHubInterface)
    cfg = hub.task.cfg
    assert (cfg._name, cfg.decoding, cfg.drafter_path, cfg.verify_beta, cfg.verify_tau) == (
        "draft_verify", "draft-verify", random_drafter_checkpoint, 2, 1.5)
    assert os.path.realpath(cfg.data) == os.path.realpath(toy_bin)
    with caplog.at_level(logging.INFO):
        for _ in range(3):
            assert len(hub.translate(["a1 a2 a3", "a4"])) == 2  # no beam given: greedy
    lines = [r.getMessage() for r in caplog.records if r.name == "fairseq_specdec.generation"]
    assert [int(n) for line in lines for n in STATS.findall(line)] == [2, 2, 2], lines
    assert loads.get(os.path.realpath(random_drafter_checkpoint)) == 1, loads
    with pytest.raises(ValueError, match="task"):
        from_pretrained(folder, checkpoint_file=name, data_name_or_path=toy_bin, task="translation")


@pytest.mark.parametrize("case", ["missing drafter file", "no drafter", "ngram_order=0", "block_size=0",
                                  "draft_treee=5", "max_len_bb=3"])
def test_refusals_come_when_the_translator_is_made(toy_bin, translation_checkpoint, random_drafter_checkpoint,
                                                    tmp_path, case):
    """Serving code loads at start-up: what the decoding refuses must raise
    from from_pretrained, not from the first translate()."""
    from fairseq_specdec.hub import from_pretrained

    missing = str(tmp_path / "no_such_drafter.pt")
    options, error, needle = {
        "missing drafter file": (dict(decoding="draft-verify", drafter_path=missing), FileNotFoundError, missing),
        "no drafter": (dict(decoding="draft-verify"), ValueError, "needs a drafter"),
        "ngram_order=0": (dict(decoding="ngram", ngram_order=0), ValueError, "--ngram-order"),
        "block_size=0": (dict(decoding="draft-verify", drafter_path=random_drafter_checkpoint, block_size=0),
                         ValueError, "--block-size"),
        # fairseq drops an override that matches no option: a typo would keep the default silently
        "draft_treee=5": (dict(decoding="ngram", draft_treee=5), ValueError, "did you mean 'draft_tree'"),
        "max_len_bb=3": (dict(decoding="ngram", max_len_bb=3), ValueError, "did you mean 'max_len_b'"),
    }[case]
    folder, name = os.path.split(translation_checkpoint)
    with pytest.raises(error) as err:
        from_pretrained(folder, checkpoint_file=name, data_name_or_path=toy_bin, **options)
    assert needle in str(err.value)


def _toy_sentences(toy_bin, n):
    raw = Path(toy_bin).parent / "raw" / "test.src"
    return raw.read_text().splitlines()[:n]


@pytest.mark.slow
@pytest.mark.parametrize("load_in", ["plain", "inference_mode"])
def test_hub_works_under_inference_mode_no_grad_and_plain(toy_bin, ar_checkpoint, random_drafter_checkpoint,
                                                          tmp_path, load_in):
    """Serving code wraps inference in torch.inference_mode(): the first
    translate() there raised "Inference tensors do not track version counter"
    (the cached weight layouts' fingerprints), and every later call too.  A
    model loaded inside inference_mode, or outside it, translates in all three
    modes, first call and later ones, as fairseq's beam 1 does."""
    import torch
    from fairseq_specdec.hub import from_pretrained

    sentences = _toy_sentences(toy_bin, 3)
    reference = TransformerModel.from_pretrained(
        os.path.dirname(ar_checkpoint), checkpoint_file=os.path.basename(ar_checkpoint), data_name_or_path=toy_bin
    )
    expected = [reference.translate(s, beam=1) for s in sentences]

    def load():
        return from_pretrained(
            os.path.dirname(ar_checkpoint), checkpoint_file=os.path.basename(ar_checkpoint),
            data_name_or_path=toy_bin, drafter_path=random_drafter_checkpoint,
        )

    if load_in == "inference_mode":
        with torch.inference_mode():
            translator = load()
    else:
        translator = load()
    for mode in (torch.inference_mode, torch.no_grad, torch.enable_grad, torch.inference_mode):
        with mode():
            assert translator.translate(sentences) == expected, mode.__name__


@pytest.mark.slow
def test_hub_statistics_file_keeps_every_translate_call(toy_bin, ar_checkpoint, random_drafter_checkpoint, tmp_path):
    """Each translate() builds a generator; the second one used to start the
    --specdec-stats file anew, keeping only its own rows.  A new translator
    (a new run) starts it anew."""
    from fairseq_specdec.hub import from_pretrained

    stats = tmp_path / "stats.jsonl"

    def load():
        return from_pretrained(
            os.path.dirname(ar_checkpoint), checkpoint_file=os.path.basename(ar_checkpoint),
            data_name_or_path=toy_bin, drafter_path=random_drafter_checkpoint, specdec_stats=str(stats),
        )

    translator = load()
    sentences = _toy_sentences(toy_bin, 3)
    translator.translate(sentences[0])
    translator.translate(sentences[1:])
    # ids restart at 0 in every translate(): count the rows
    assert sorted(json.loads(line)["id"] for line in stats.read_text().splitlines()) == [0, 0, 1]
    load().translate(sentences[0])
    assert len(stats.read_text().splitlines()) == 1
