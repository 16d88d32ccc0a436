"""specdec_nat: model.draft() on an untrained tiny drafter built in-process."""
import math

import pytest
import torch

import specdec_helpers as H
import fairseq_specdec  # noqa: F401
from fairseq_specdec.models import specdec_nat
from fairseq_specdec.utils.dictionary import mask_index


@pytest.fixture(scope="module")
def batch(tiny_drafter):
    """Three test sentences of different source lengths, collated by fairseq
    (left-padded sources, right-padded targets, longest source first)."""
    model, task, _ = tiny_drafter
    task.load_dataset("test")
    ds = task.dataset("test")
    picked, seen = [], set()
    for i in range(len(ds)):  # distinct source lengths, all >= 6 (prefixes up to 5 fit)
        n = int(ds.src_sizes[i])
        if n >= 6 and n not in seen:
            picked.append(i)
            seen.add(n)
        if len(picked) == 3:
            break
    assert len(picked) == 3
    return ds.collater([ds[i] for i in picked])


def encode(model, src_tokens, src_lengths):
    return model.encoder(src_tokens, src_lengths=src_lengths)


def strip_left_pad(tokens, pad):
    return tokens[tokens.ne(pad)]


def test_mask_index_is_past_dictionary(tiny_drafter):
    model, task, _ = tiny_drafter
    d = task.target_dictionary
    assert model.mask_idx == mask_index(d) == len(d)
    assert model.decoder.embed_tokens.num_embeddings == len(d) + 1
    # the mask is never a prediction target: the output covers the real types only
    feats = torch.zeros(1, 1, model.decoder.embed_tokens.embedding_dim)
    assert model.decoder.output_layer(feats).size(-1) == len(d)


@pytest.mark.parametrize("k", [1, 4, 7])
def test_draft_shapes_and_values(tiny_drafter, batch, k):
    model, task, _ = tiny_drafter
    d = task.target_dictionary
    net = batch["net_input"]
    enc = encode(model, net["src_tokens"], net["src_lengths"])
    target = batch["target"]
    prefix_lengths = torch.tensor([0, 2, 5])
    tokens, log_probs = model.draft(enc, target[:, :5], prefix_lengths, k)
    assert tokens.shape == log_probs.shape == (3, k)
    assert tokens.dtype == torch.long
    assert not tokens.eq(d.pad()).any() and not tokens.eq(d.bos()).any()
    assert tokens.lt(len(d)).all()  # never the mask
    assert torch.isfinite(log_probs).all() and log_probs.le(0).all()


def test_draft_never_proposes_pad_or_bos_even_if_favoured(tiny_drafter, batch, monkeypatch):
    model, task, _ = tiny_drafter
    d = task.target_dictionary
    original = model.decoder.output_layer

    def biased(features):
        logits = original(features).clone()
        logits[..., d.pad()] += 1e4
        logits[..., d.bos()] += 1e4
        return logits

    monkeypatch.setattr(model.decoder, "output_layer", biased)
    net = batch["net_input"]
    enc = encode(model, net["src_tokens"], net["src_lengths"])
    tokens, log_probs = model.draft(enc, batch["target"][:, :3], torch.tensor([3, 0, 1]), 5)
    assert not tokens.eq(d.pad()).any() and not tokens.eq(d.bos()).any()
    assert torch.isfinite(log_probs).all() and log_probs.le(0).all()


def test_draft_matches_full_forward(tiny_drafter, batch):
    """One unpadded row: draft() is the argmax (pad/BOS excluded) of the logits
    model.forward() gives the block slots of ``prefix + k masks``."""
    model, task, _ = tiny_drafter
    d = task.target_dictionary
    src = strip_left_pad(batch["net_input"]["src_tokens"][2], d.pad()).unsqueeze(0)
    src_len = torch.tensor([src.size(1)])
    prefix = batch["target"][2, :3].unsqueeze(0)
    k = 4
    inp = torch.cat([prefix, torch.full((1, k), model.mask_idx)], 1)
    with torch.no_grad():
        logits, _ = model(src, src_len, inp)
    block = logits[0, 3:].float()
    block[:, d.pad()] = -math.inf
    block[:, d.bos()] = -math.inf
    expected_lp, expected_tok = torch.log_softmax(block, -1).max(-1)
    tokens, log_probs = model.draft(encode(model, src, src_len), prefix, torch.tensor([3]), k)
    assert tokens[0].tolist() == expected_tok.tolist()
    assert torch.allclose(log_probs[0], expected_lp, atol=1e-5)


def test_draft_without_scores_proposes_the_same_tokens(tiny_drafter, batch):
    model, task, _ = tiny_drafter
    net = batch["net_input"]
    enc = encode(model, net["src_tokens"], net["src_lengths"])
    lengths = torch.tensor([4, 0, 2])
    tokens, log_probs = model.draft(enc, batch["target"][:, :4], lengths, 5)
    tokens_only, none = model.draft(enc, batch["target"][:, :4], lengths, 5, with_scores=False)
    assert none is None
    assert torch.equal(tokens_only, tokens)


def test_transposed_projection_matches_linear_and_follows_weight_updates():
    from fairseq_specdec.utils.projection import TransposedProjection

    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(50, 8, generator=gen)
    bias = torch.randn(50, generator=gen)
    x = torch.randn(3, 4, 8, generator=gen)
    linear = torch.nn.functional.linear
    project = TransposedProjection()
    with torch.no_grad():
        torch.testing.assert_close(project(x, weight), linear(x, weight))
        torch.testing.assert_close(project(x, weight, bias), linear(x, weight, bias))
        weight.mul_(-2.0)  # an in-place update (an optimizer step) must not leave a stale copy
        torch.testing.assert_close(project(x, weight), linear(x, weight))
        other = torch.randn(50, 8, generator=gen)
        torch.testing.assert_close(project(x, other), linear(x, other))
    # with gradients enabled the weight still receives its gradient
    trained = weight.clone().requires_grad_()
    project(x, trained).sum().backward()
    assert trained.grad is not None and trained.grad.abs().sum() > 0


def test_transposed_weights_follow_optimizer_updates_through_data():
    """fairseq's optimizers update ``p.data`` in place: no version bump, same
    storage; the cached transposes must still follow (a stale copy would
    validate a drafter with its first weights)."""
    from fairseq_specdec.utils.projection import TransposedProjection, cached_linear, inference_scope  # noqa: F401

    gen = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(8, 50).eval()
    x = torch.randn(3, 4, 8, generator=gen)
    project = TransposedProjection()
    with torch.no_grad():
        torch.testing.assert_close(cached_linear(layer, x), layer(x))
        torch.testing.assert_close(project(x, layer.weight), torch.nn.functional.linear(x, layer.weight))
        version = layer.weight._version
        layer.weight.data.mul_(-2.0)
        layer.bias.data.add_(1.0)
        assert layer.weight._version == version  # what makes a version-keyed cache stale
        torch.testing.assert_close(cached_linear(layer, x), layer(x))
        torch.testing.assert_close(project(x, layer.weight), torch.nn.functional.linear(x, layer.weight))
        # inside one scope the weights are taken as constant; the next scope checks again
        with inference_scope():
            torch.testing.assert_close(cached_linear(layer, x), layer(x))
        layer.weight.data.mul_(0.5)
        with inference_scope():
            torch.testing.assert_close(cached_linear(layer, x), layer(x))
    # training mode or gradients: the module itself (its weight gets the gradient)
    layer.train()
    cached_linear(layer, x).sum().backward()
    assert layer.weight.grad is not None and layer.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("lengths", [[0, 3, 5], [5, 0, 3]])
@pytest.mark.parametrize("k", [1, 3, 6])
def test_rows_do_not_depend_on_other_rows_padding(tiny_drafter, batch, k, lengths):
    model, task, _ = tiny_drafter
    d = task.target_dictionary
    net = batch["net_input"]
    target = batch["target"]
    prefix_lengths = torch.tensor(lengths)
    assert (batch["target"].ne(d.pad()).sum(1) > prefix_lengths).all()
    # beyond its own length a row's prefix holds junk (real tokens, not pad)
    prefix = target[:, :6].clone()
    prefix[prefix.eq(d.pad())] = d.unk()
    prefix[prefix_lengths.argmin(), :] = d.index("b1")
    tokens, log_probs = model.draft(encode(model, net["src_tokens"], net["src_lengths"]), prefix, prefix_lengths, k)
    for r in range(3):
        src = strip_left_pad(net["src_tokens"][r], d.pad()).unsqueeze(0)
        p = int(prefix_lengths[r])
        alone_tok, alone_lp = model.draft(
            encode(model, src, torch.tensor([src.size(1)])), target[r : r + 1, :p], torch.tensor([p]), k
        )
        assert tokens[r].tolist() == alone_tok[0].tolist(), f"row {r}"
        assert torch.allclose(log_probs[r], alone_lp[0], atol=1e-5), f"row {r}"


def test_tiny_arch_defaults(tiny_drafter):
    model, _, _ = tiny_drafter
    assert len(model.encoder.layers) == 2
    assert len(model.decoder.layers) == 1
    assert model.decoder.embed_tokens.embedding_dim == 64
    assert isinstance(model.decoder, specdec_nat.SpecDecNATDecoder)
