"""Registration and the draft_verify task (in-process, fast)."""
import pytest
import torch

import specdec_helpers as H
import fairseq_specdec  # noqa: F401
from fairseq import tasks


def test_registration():
    from fairseq.criterions import CRITERION_REGISTRY
    from fairseq.models import ARCH_MODEL_REGISTRY, MODEL_REGISTRY
    from fairseq.tasks import TASK_REGISTRY

    assert "draft_verify" in TASK_REGISTRY
    assert "specdec_nat" in MODEL_REGISTRY
    for arch in ("specdec_nat_tiny", "specdec_nat_base", "specdec_nat_multi30k"):
        assert ARCH_MODEL_REGISTRY[arch] is MODEL_REGISTRY["specdec_nat"]
    assert "glat_block" in CRITERION_REGISTRY


def test_user_dir_import_registers(toy_bin):
    """--user-dir on the command line works on top of the package import."""
    cfg = H.generation_cfg(toy_bin, "--task", "draft_verify", "--decoding", "draft-verify",
                           "--block-size", "3", "--verify-beta", "2", "--verify-tau", "1.5",
                           "--verify-score", "drafter")
    task = tasks.setup_task(cfg.task)
    assert type(task).__name__ == "DraftVerifyTask"
    assert (task.cfg.decoding, task.cfg.block_size, task.cfg.verify_beta) == ("draft-verify", 3, 2)
    assert (task.cfg.verify_tau, task.cfg.verify_score) == (1.5, "drafter")


def test_defaults(toy_bin):
    cfg = H.generation_cfg(toy_bin, "--task", "draft_verify")
    assert cfg.task.decoding == "autoregressive"
    assert cfg.task.verify_beta == 1
    assert cfg.task.verify_tau == 0.0
    assert cfg.task.verify_score == "verifier"
    assert cfg.task.block_size is None


def _all_ids(task, split, max_sentences, multiple):
    task.load_dataset(split)
    itr = task.get_batch_iterator(
        dataset=task.dataset(split),
        max_sentences=max_sentences,
        required_batch_size_multiple=multiple,
    ).next_epoch_itr(shuffle=False)
    ids = []
    for batch in itr:
        ids += batch["id"].tolist()
    return ids


@pytest.mark.parametrize("split", ["test", "test1"])
@pytest.mark.parametrize("bsz", [1, 7, 64])
def test_no_sentence_dropped_in_process(toy_bin, split, bsz):
    task = tasks.setup_task(H.generation_cfg(toy_bin, "--task", "draft_verify").task)
    ids = _all_ids(task, split, bsz, multiple=8)  # fairseq-generate's default multiple
    n = H.SPLIT_SIZES[split]
    assert sorted(ids) == list(range(n))
    assert task.expected_sentences == n


def test_stock_translation_task_drops_sentences(toy_bin):
    """Documents the trap the task works around: stock fairseq-fixed drops the
    last incomplete batch of a non-training split (49 of 50 at batch size 1)."""
    task = tasks.setup_task(H.generation_cfg(toy_bin, "--task", "translation").task)
    ids = _all_ids(task, "test", 1, multiple=8)
    assert len(ids) < 50, (
        "stock fairseq no longer drops sentences: the draft_verify workaround may be unnecessary"
    )


def test_training_split_keeps_batch_multiple(toy_bin):
    """Only the trainer's training split (combine=True) keeps the multiple."""
    _, cfg = H.train_args_namespace(toy_bin, *H.NAT_ARGS, "--cpu", "--max-update", "10")
    task = tasks.setup_task(cfg.task)
    task.load_dataset("train", combine=True)
    assert task.is_training_dataset(task.dataset("train"))
    itr = task.get_batch_iterator(
        dataset=task.dataset("train"), max_sentences=16, required_batch_size_multiple=8
    ).next_epoch_itr(shuffle=False)
    sizes = [len(b["id"]) for b in itr]
    assert sizes and all(s % 8 == 0 for s in sizes)
    task.load_dataset("valid")
    assert not task.is_training_dataset(task.dataset("valid"))


def test_block_inputs_only_for_drafters(toy_bin, tiny_drafter, verifier_like_model):
    model, task, _ = tiny_drafter
    task.load_dataset("valid")
    (sample,) = H.batches(task, "valid", 8)[:1]
    assert task.add_block_inputs(sample, verifier_like_model) is sample
    out = task.add_block_inputs(sample, model, torch.Generator().manual_seed(0))
    net = out["net_input"]
    assert net["prev_output_tokens"].eq(model.mask_idx).sum(1).eq(task.train_block_size).all()
    assert net["block_mask"].shape == out["block_target"].shape == net["prev_output_tokens"].shape
    # the original sample is not modified
    assert "block_mask" not in sample["net_input"] and "block_target" not in sample


def test_drafter_records_training_block_size(toy_bin):
    model, task, _ = H.build_untrained_drafter(toy_bin, block_size=6)
    assert int(model.train_block_size) == 6
    assert model.mask_idx == len(task.target_dictionary)


def test_glance_anneal_defaults_to_max_update(toy_bin):
    """GlatBlockConfig documents glance_anneal_updates' default as --max-update;
    through fairseq's command-line parsing the criterion must see it."""
    _, cfg = H.train_args_namespace(toy_bin, *H.NAT_ARGS, "--cpu", "--max-update", "123")
    task = tasks.setup_task(cfg.task)
    criterion = task.build_criterion(cfg.criterion)
    assert criterion.anneal_updates == 123


@pytest.fixture(scope="module")
def verifier_like_model(toy_bin):
    """An untrained stock transformer (not a block drafter)."""
    _, cfg = H.train_args_namespace(toy_bin, "--task", "translation", *H.AR_ARCH_ARGS, "--cpu")
    task = tasks.setup_task(cfg.task)
    return task.build_model(cfg.model)


def test_validation_cuts_do_not_depend_on_the_batching(toy_bin, tiny_drafter, monkeypatch):
    """valid_step cuts every sentence by its id: two batchings of the valid
    split give each sentence the same block inputs (fairseq-train and
    fairseq-validate batch differently)."""
    from fairseq.tasks.translation import TranslationTask

    model, task, _ = tiny_drafter
    task.load_dataset("valid")
    seen = {}

    def record(self, sample, model, criterion):
        for sid, prev in zip(sample["id"].tolist(), sample["net_input"]["prev_output_tokens"]):
            seen.setdefault(sid, []).append(prev[prev.ne(task.tgt_dict.pad())].tolist())
        return 0.0, 1, {}

    monkeypatch.setattr(TranslationTask, "valid_step", record)  # the model's loss is not needed
    for bsz in (3, 16):
        for sample in H.batches(task, "valid", bsz):
            task.valid_step(sample, model, None)
    assert seen and all(len(v) == 2 for v in seen.values())
    assert len({len(H.batches(task, "valid", b)) for b in (3, 16)}) == 2  # two batchings indeed
    assert all(a == b for a, b in seen.values())
