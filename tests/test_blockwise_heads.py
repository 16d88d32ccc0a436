"""Blockwise heads (paper 004): the criterion's ``--head-shortlist`` softmax and
the drafter's shortlist projection, each against a reference computed through
the full-vocabulary path (``head_logits``) and then restricted by hand."""
import math
import types

import pytest
import torch

import specdec_helpers as H

BLOCKWISE_ARGS = [
    "--task", "draft_verify", "--criterion", "blockwise_heads", "--blockwise-k", "3",
    *[a if a != "transformer" else "blockwise_transformer" for a in H.AR_ARCH_ARGS],
    "--dropout", "0.0", "--cpu", "--optimizer", "adam", "--max-update", "10",
]


@pytest.fixture(scope="module")
def built(toy_bin):
    """(model, task, cfg): an untrained blockwise_transformer whose heads are
    random (their second layer starts at zero, which would make every head
    the base prediction)."""
    from fairseq import tasks

    _, cfg = H.train_args_namespace(toy_bin, *BLOCKWISE_ARGS)
    task = tasks.setup_task(cfg.task)
    torch.manual_seed(3)
    model = task.build_model(cfg.model)
    with torch.no_grad():
        model.heads.fc2.normal_(std=0.2)
        model.heads.b1.normal_(std=0.1)
    return model.eval(), task, cfg


def criterion(task, shortlist):
    from fairseq_specdec.criterions.blockwise_heads import BlockwiseHeadsCriterion

    return BlockwiseHeadsCriterion(task, label_smoothing=0.0, blockwise_finetune=False, head_shortlist=shortlist)


def train_sample(task):
    return H.batches(task, "train", 16)[0]


def reference_nll(model, sample, pad, vocab=None):
    """Summed NLL of every head over ``vocab`` (None: every type), from the
    full-vocabulary logits restricted by indexing."""
    with torch.no_grad():
        features, _ = model(**sample["net_input"], features_only=True)
        logits = model.head_logits(features)  # B x T x (k-1) x V
    target, total = sample["target"], 0.0
    for i in range(logits.size(2)):
        tgt = target[:, i + 1:]
        mask = tgt.ne(pad)
        rows = logits[:, : tgt.size(1), i][mask]
        gold = tgt[mask]
        if vocab is not None:
            rows = rows[:, vocab]
            gold = torch.searchsorted(vocab, gold)
            assert torch.equal(vocab[gold], tgt[mask])
        total += -torch.log_softmax(rows, -1).gather(1, gold.unsqueeze(1)).sum().item()
    return total


def test_head_shortlist_covers_the_frequent_types_and_every_gold_token(built):
    model, task, _ = built
    sample = train_sample(task)
    pad = task.target_dictionary.pad()
    vocab, position = criterion(task, 6).shortlist(sample["target"], len(task.target_dictionary))
    gold = set(sample["target"][sample["target"].ne(pad)].tolist())
    assert set(range(6)) | gold == set(vocab.tolist())
    assert vocab.tolist() == sorted(vocab.tolist())
    assert torch.equal(position[vocab], torch.arange(vocab.numel()))
    outside = torch.ones(len(task.target_dictionary), dtype=torch.bool)
    outside[vocab] = False
    assert position[outside].eq(-1).all()


@pytest.mark.parametrize("shortlist", [6, 12])
def test_head_shortlist_loss_is_the_softmax_over_the_shortlist(built, shortlist):
    model, task, _ = built
    sample = train_sample(task)
    pad = task.target_dictionary.pad()
    crit = criterion(task, shortlist)
    vocab, _ = crit.shortlist(sample["target"], len(task.target_dictionary))
    assert vocab.numel() < len(task.target_dictionary)  # the toy batch does not use every type
    model.train()
    try:
        loss, sample_size, log = crit(model, sample)
        loss.backward()
    finally:
        model.eval()
    assert loss.item() == pytest.approx(reference_nll(model, sample, pad, vocab), rel=1e-5)
    assert model.heads.fc1.grad is not None and model.heads.fc1.grad.abs().sum() > 0
    assert model.decoder.output_projection.weight.grad is None  # the base stays frozen
    model.zero_grad(set_to_none=True)
    assert sample_size == sum(int(sample["target"][:, i + 1:].ne(pad).sum()) for i in range(2))
    full, *_ = criterion(task, 0)(model, sample)
    assert full.item() > loss.item()  # fewer competitors, lower loss: the softmax really is restricted


def test_head_shortlist_of_the_whole_vocabulary_is_the_full_softmax(built):
    model, task, _ = built
    sample = train_sample(task)
    pad = task.target_dictionary.pad()
    with torch.no_grad():
        full, *_ = criterion(task, 0)(model, sample)
        every, *_ = criterion(task, len(task.target_dictionary))(model, sample)
    assert full.item() == pytest.approx(reference_nll(model, sample, pad), rel=1e-5)
    assert every.item() == full.item()


def test_negative_head_shortlist_is_refused(built):
    _, task, _ = built
    with pytest.raises(ValueError, match="--head-shortlist must be >= 0"):
        criterion(task, -1)


def fake_batch(task, bsz=4, seed=0):
    """A decoding state and a feedback stand-in: B random verifier states."""
    g = torch.Generator().manual_seed(seed)
    d = task.target_dictionary
    src = torch.randint(d.nspecial, len(d), (bsz, 5), generator=g)
    state = types.SimpleNamespace(net_input={"src_tokens": src}, size=bsz, tokens=src.new_zeros(bsz, 1))
    states = torch.randn(bsz, 64, generator=g)
    feedback = types.SimpleNamespace(newest_states=lambda: states)
    return state, feedback, states


@pytest.mark.parametrize("shortlist", [0, 8])
def test_drafter_drafts_each_heads_best_allowed_type(built, shortlist):
    """The drafter's laid-out products (one for all first layers, one batched
    for the second) pick what head_logits would, over the allowed types."""
    from fairseq_specdec.generation.drafters import BlockwiseHeadsDrafter

    model, task, _ = built
    d = task.target_dictionary
    drafter = BlockwiseHeadsDrafter(model, shortlist=shortlist)
    state, feedback, states = fake_batch(task)
    with torch.no_grad():
        drafter.start_batch(state)
        drafter.update(state, feedback)
        logits = model.head_logits(states)  # B x (k-1) x V
    allowed = torch.zeros(len(d), dtype=torch.bool)
    if shortlist:
        allowed[:shortlist] = True
        allowed[state.net_input["src_tokens"].flatten()] = True  # joined dictionaries
    else:
        allowed[:] = True
    allowed[d.pad()] = allowed[d.bos()] = False
    expected = logits.masked_fill(~allowed, -math.inf).argmax(-1)
    assert torch.equal(drafter.propose(state, 2)[0], expected)
    assert torch.equal(drafter.propose(state, 1)[0], expected[:, :1])
    if shortlist:  # the shortlist really narrows the choice somewhere
        assert not torch.equal(expected, logits.masked_fill(~_not_special(d), -math.inf).argmax(-1))
    drafter.reorder(torch.tensor([2, 0]), [2, 0])
    assert torch.equal(drafter.propose(state, 2)[0], expected[[2, 0]])


def test_heads_run_only_when_a_draft_is_asked_for(built):
    """An iteration that does not draft costs the drafter no heads: update
    keeps the states, the first propose computes the heads once, a second
    propose (or a tree) reuses them, and rows retired in between are
    dropped from the states the heads then read."""
    from fairseq_specdec.generation.drafters import BlockwiseHeadsDrafter

    model, task, _ = built
    drafter = BlockwiseHeadsDrafter(model, shortlist=8)
    state, feedback, states = fake_batch(task)
    calls = []
    heads = drafter._heads
    drafter._heads = lambda: calls.append(drafter.states.size(0)) or heads()
    with torch.no_grad():
        drafter.start_batch(state)
        for _ in range(3):  # iterations that do not draft
            drafter.update(state, feedback)
        assert calls == []
        full = drafter.propose(state, 2)[0]
        drafter.propose(state, 1)
        assert calls == [4]
        drafter.update(state, feedback)
        drafter.reorder(torch.tensor([3, 1]), [3, 1])  # rows retire before the next draft
        assert torch.equal(drafter.propose(state, 2)[0], full[[3, 1]])
        assert calls == [4, 2]
        tree = drafter.propose_tree(state, 2, 3)
        assert calls == [4, 2, 2] and tree.size > 0
        drafter.propose_tree(state, 2, 3)
        assert calls == [4, 2, 2]


def _not_special(d):
    allowed = torch.ones(len(d), dtype=torch.bool)
    allowed[d.pad()] = allowed[d.bos()] = False
    return allowed


def test_drafter_has_no_draft_before_the_first_update(built):
    from fairseq_specdec.generation.drafters import BlockwiseHeadsDrafter

    model, task, _ = built
    drafter = BlockwiseHeadsDrafter(model)
    state, _, _ = fake_batch(task)
    drafter.start_batch(state)
    tokens, lprobs = drafter.propose(state, 2)
    assert tokens.shape == (4, 0) and lprobs is None


def test_blockwise_shortlist_option_reaches_the_drafter(built, toy_bin):
    from fairseq import tasks

    from fairseq_specdec.generation.drafters import BlockwiseHeadsDrafter

    model, _, _ = built
    assert BlockwiseHeadsDrafter(model).shortlist == 0  # the default 2000 covers the toy vocabulary
    _, cfg = H.train_args_namespace(toy_bin, *BLOCKWISE_ARGS, "--blockwise-shortlist", "7")
    small = tasks.setup_task(cfg.task).build_model(cfg.model)
    assert BlockwiseHeadsDrafter(small).shortlist == 7
    _, cfg = H.train_args_namespace(toy_bin, *BLOCKWISE_ARGS, "--blockwise-shortlist", "-1")
    with pytest.raises(ValueError, match="--blockwise-shortlist must be >= 0"):
        tasks.setup_task(cfg.task).build_model(cfg.model)
