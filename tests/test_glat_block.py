"""The glat_block criterion: schedule, slot choice, and a forward on a tiny drafter."""
import math

import pytest
import torch

import specdec_helpers as H
import fairseq_specdec  # noqa: F401
from fairseq_specdec.criterions.glat_block import choose_glanced_slots, glance_ratio


@pytest.mark.parametrize(
    "updates,expected",
    [(0, 0.5), (50, 0.4), (25, 0.45), (100, 0.3), (1000, 0.3)],
)
def test_glance_ratio_schedule(updates, expected):
    assert glance_ratio(updates, 0.5, 0.3, 100) == pytest.approx(expected)


@pytest.mark.parametrize("anneal", [0, None])
def test_glance_ratio_without_annealing(anneal):
    for updates in (0, 10, 10_000):
        assert glance_ratio(updates, 0.5, 0.3, anneal) == 0.5


def test_choose_glanced_slots_counts_and_support():
    torch.manual_seed(0)
    for trial in range(50):
        valid = torch.rand(6, 9) < 0.6
        n_valid = valid.sum(1)
        n = (torch.rand(6) * (n_valid.float() + 1)).floor().long().clamp(max=n_valid)
        chosen = choose_glanced_slots(valid, n)
        assert chosen.dtype == torch.bool and chosen.shape == valid.shape
        assert not (chosen & ~valid).any()
        assert chosen.sum(1).tolist() == n.tolist()


def test_choose_glanced_slots_extremes():
    valid = torch.tensor([[True, False, True, True], [False, False, False, False], [True] * 4])
    assert choose_glanced_slots(valid, torch.tensor([3, 0, 0])).tolist() == [
        [True, False, True, True], [False] * 4, [False] * 4
    ]


def test_choose_glanced_slots_is_uniform():
    torch.manual_seed(1)
    valid = torch.tensor([[True, False, True, True, False, True]]).repeat(4000, 1)
    counts = choose_glanced_slots(valid, torch.ones(4000, dtype=torch.long)).sum(0)
    assert counts[1] == 0 and counts[4] == 0
    for c in counts[[0, 2, 3, 5]].tolist():  # expected 1000 each
        assert 850 < c < 1150


K = 8


@pytest.fixture(scope="module")
def setup(toy_bin):
    model, task, cfg = H.build_untrained_drafter(
        toy_bin, seed=11, block_size=K, extra=("--glance-anneal-updates", "100")
    )
    criterion = task.build_criterion(cfg.criterion)
    (sample,) = H.batches(task, "valid", 16)[:1]
    sample = task.add_block_inputs(sample, model, torch.Generator().manual_seed(3))
    return model, criterion, sample


def spy_decoder(model, monkeypatch):
    calls = []
    original = model.decoder.forward

    def forward(prev_output_tokens, encoder_out=None, block_mask=None, **kw):
        out = original(prev_output_tokens, encoder_out, block_mask=block_mask, **kw)
        calls.append((prev_output_tokens.clone(), block_mask.clone(), out[0].detach().clone()))
        return out

    monkeypatch.setattr(model.decoder, "forward", forward)
    return calls


def test_forward_train_mode_glances(setup, monkeypatch):
    model, criterion, sample = setup
    model.train()
    model.set_num_updates(50)  # ratio 0.4
    calls = spy_decoder(model, monkeypatch)
    loss, sample_size, log = criterion(model, sample)

    pad = criterion.padding_idx
    target = sample["block_target"]
    valid = sample["net_input"]["block_mask"] & target.ne(pad)
    n_valid = valid.sum(1)
    assert len(calls) == 2  # a first pass without gradient, then the glanced pass
    (prev1, mask1, logits1), (prev2, mask2, _) = calls
    assert torch.equal(prev1, sample["net_input"]["prev_output_tokens"])
    assert torch.equal(mask1, valid)
    correct = torch.zeros_like(valid)
    correct[valid] = logits1.argmax(-1).eq(target[valid])
    expected_glance = [math.floor(0.4 * (v - c)) for v, c in zip(n_valid.tolist(), correct.sum(1).tolist())]
    assert sum(expected_glance) > 0  # an untrained drafter gets most slots wrong

    glanced = prev2.ne(prev1)
    assert not (glanced & ~valid).any()
    assert glanced.sum(1).tolist() == expected_glance
    assert torch.equal(prev2[glanced], target[glanced])  # the gold token is revealed
    assert prev1[glanced].eq(model.mask_idx).all()
    assert torch.equal(mask2, valid & ~glanced)  # loss on the others only

    assert log["glanced"] == sum(expected_glance)
    assert log["block_total"] == int(n_valid.sum())
    assert log["block_correct"] == int(correct.sum())
    assert sample_size == log["sample_size"] == int(n_valid.sum()) - sum(expected_glance)
    assert log["glance_ratio"] == pytest.approx(0.4)
    assert torch.isfinite(loss) and loss.item() > 0
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and any(g.abs().sum() > 0 for g in grads)
    model.zero_grad()


def test_forward_eval_mode_never_glances(setup, monkeypatch):
    model, criterion, sample = setup
    model.eval()
    model.set_num_updates(0)
    calls = spy_decoder(model, monkeypatch)
    with torch.no_grad():
        loss, sample_size, log = criterion(model, sample)
    target = sample["block_target"]
    valid = sample["net_input"]["block_mask"] & target.ne(criterion.padding_idx)
    assert len(calls) == 1
    prev, mask, logits = calls[0]
    assert torch.equal(prev, sample["net_input"]["prev_output_tokens"])
    assert torch.equal(mask, valid)
    assert log["glanced"] == 0
    assert sample_size == log["block_total"] == int(valid.sum())
    assert log["block_correct"] == int(logits.argmax(-1).eq(target[valid]).sum())


def test_criterion_needs_block_inputs(setup, toy_bin):
    model, criterion, _ = setup
    (plain,) = H.batches(model_task(toy_bin), "valid", 4)[:1]
    with pytest.raises(ValueError, match="draft_verify"):
        criterion(model, plain)


def model_task(toy_bin):
    from fairseq import tasks

    return tasks.setup_task(H.generation_cfg(toy_bin, "--task", "draft_verify").task)
