"""The verifier's encoder as fused C++ layers (:class:`LeanEncoder`), which the
lean verify pass runs with the native products.

* it returns fairseq's encoder output dictionary, the layers' output equal to
  fairseq's ``TransformerEncoder`` within float rounding: post- and pre-norm,
  with an embedding layer norm, at batch 1 and on left-padded batches;
* padding is masked: a sentence encoded in a padded batch equals the same
  sentence encoded alone;
* weights changed after the first call are packed again;
* an encoder it cannot compute (GELU, a subclass overriding the forward) is
  named and left to fairseq's modules; with torch's products, or the
  ``encoder`` part switched off, the lean pass keeps fairseq's encoder.

End to end, strict decoding with it stays identical to ``--beam 1``: the
exactness tests of tests/test_lean_verifier.py and tests/test_generator.py
decode through it wherever the kernel runs.
"""
import pytest
import torch

import specdec_helpers as H
from fairseq_specdec.generation.lean_encoder import LeanEncoder, lean_encoder_unsupported_reason
from fairseq_specdec.generation.lean_verifier import LeanVerifier
from fairseq_specdec.kernels import rowgemm

needs_kernel = pytest.mark.skipif(rowgemm.unavailable_reason() is not None, reason=str(rowgemm.unavailable_reason()))


def untrained_transformer(toy_bin, *extra, seed=3):
    """An untrained tiny Transformer with the given options, its layer norms
    made non-trivial (an identity norm would hide a swapped weight)."""
    from fairseq import tasks

    _, cfg = H.train_args_namespace(toy_bin, "--task", "translation", *H.AR_ARCH_ARGS, "--dropout", "0.0", "--cpu", *extra)
    task = tasks.setup_task(cfg.task)
    torch.manual_seed(seed)
    model = task.build_model(cfg.model).eval()
    with torch.no_grad():
        for module in model.encoder.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.weight.uniform_(0.5, 1.5)
                module.bias.uniform_(-0.5, 0.5)
    task.load_dataset("test")
    return model, task


def encoded(encoder_out):
    """S x B x C output and B x S padding of an encoder output."""
    return encoder_out["encoder_out"][0], encoder_out["encoder_padding_mask"][0]


def assert_same_encoding(ref, got):
    assert set(got) == set(ref)
    (x_ref, pad_ref), (x_got, pad_got) = encoded(ref), encoded(got)
    assert torch.equal(pad_ref, pad_got)
    assert x_got.shape == x_ref.shape and x_got.is_contiguous()
    kept = ~pad_ref.t().unsqueeze(-1)  # what decoders read: the unpadded positions
    err = ((x_got - x_ref) * kept).abs().max().item()
    assert err < 1e-4, err
    assert torch.equal(ref["encoder_embedding"][0], got["encoder_embedding"][0])
    assert torch.equal(ref["src_lengths"][0], got["src_lengths"][0])


@needs_kernel
@pytest.mark.parametrize("extra", [(), ("--encoder-normalize-before",), ("--layernorm-embedding",)])
@pytest.mark.parametrize("bsz", [1, 5])
def test_equals_fairseqs_encoder(toy_bin, extra, bsz):
    model, task = untrained_transformer(toy_bin, *extra)
    assert lean_encoder_unsupported_reason(model.encoder) is None
    lean = LeanEncoder(model.encoder)
    padded = 0
    with torch.no_grad():
        for sample in H.batches(task, "test", bsz):
            net_input = sample["net_input"]
            padded += int(net_input["src_tokens"].eq(model.encoder.padding_idx).any())
            assert_same_encoding(model.encoder.forward_torchscript(net_input), lean(net_input))
    if bsz > 1:
        assert padded > 0  # the padded path was exercised


@needs_kernel
def test_padding_is_masked():
    """Sentence 0 encoded alone equals sentence 0 in a batch where it is left
    padded: no padded position reaches its output."""
    from fairseq.models.transformer import TransformerConfig, TransformerEncoderBase
    from fairseq.data import Dictionary

    d = Dictionary()
    for i in range(20):
        d.add_symbol(f"w{i}")
    cfg = TransformerConfig()
    cfg.encoder.embed_dim, cfg.encoder.ffn_embed_dim, cfg.encoder.layers, cfg.encoder.attention_heads = 16, 32, 2, 2
    cfg.dropout = 0.0
    torch.manual_seed(0)
    encoder = TransformerEncoderBase(cfg, d, torch.nn.Embedding(len(d), 16, padding_idx=d.pad())).eval()
    short = torch.tensor([[5, 6, 7, d.eos()]])
    long = torch.tensor([[8, 9, 10, 11, 12, 13, d.eos()]])
    batch = torch.cat([torch.cat([torch.full((1, 3), d.pad()), short], 1), long])  # left padded
    lean = LeanEncoder(encoder)
    with torch.no_grad():
        alone = lean({"src_tokens": short, "src_lengths": torch.tensor([4])})["encoder_out"][0]
        together = lean({"src_tokens": batch, "src_lengths": torch.tensor([4, 7])})["encoder_out"][0]
        ref = encoder.forward_torchscript({"src_tokens": short, "src_lengths": torch.tensor([4])})["encoder_out"][0]
    assert torch.allclose(together[3:, 0], alone[:, 0], atol=1e-5)
    assert torch.allclose(alone, ref, atol=1e-5)
    # the mask matters: the same batch with the padding taken for tokens differs
    with torch.no_grad():
        first = lean.layers[0]  # the first layer, packed by the calls above
        unmasked = first(encoder.forward_embedding(batch)[0], torch.zeros(batch.shape, dtype=torch.bool))
        masked = first(encoder.forward_embedding(batch)[0], batch.eq(d.pad()))
    assert not torch.allclose(unmasked[0, 3:], masked[0, 3:], atol=1e-3)


@needs_kernel
def test_changed_weights_are_packed_again(toy_bin):
    model, task = untrained_transformer(toy_bin)
    lean = LeanEncoder(model.encoder)
    sample = next(iter(H.batches(task, "test", 2)))
    with torch.no_grad():
        before = encoded(lean(sample["net_input"]))[0]
        model.encoder.layers[1].fc2.weight.mul_(1.5)
        after = encoded(lean(sample["net_input"]))[0]
        assert_same_encoding(model.encoder.forward_torchscript(sample["net_input"]), lean(sample["net_input"]))
    assert not torch.allclose(before, after, atol=1e-3)


@needs_kernel
def test_what_it_cannot_compute_is_named_and_left_to_fairseq(toy_bin):
    model, _ = untrained_transformer(toy_bin, "--activation-fn", "gelu")
    assert "not ReLU" in lean_encoder_unsupported_reason(model.encoder)
    verifier = LeanVerifier(model, gemm="rowgemm")
    assert verifier.lean_encoder is None and "encoder" not in verifier.describe()

    model, _ = untrained_transformer(toy_bin)

    class Subclass(type(model.encoder)):
        def forward_embedding(self, src_tokens, token_embedding=None):
            return super().forward_embedding(src_tokens, token_embedding)

    model.encoder.__class__ = Subclass
    assert "overrides forward_embedding" in lean_encoder_unsupported_reason(model.encoder)
    with pytest.raises(ValueError, match="the lean encoder cannot run this encoder: .*overrides forward_embedding"):
        LeanEncoder(model.encoder)


@needs_kernel
def test_the_lean_pass_runs_it_under_rowgemm_only(toy_bin):
    model, task = untrained_transformer(toy_bin)
    sample = next(iter(H.batches(task, "test", 3)))
    net_input = sample["net_input"]
    ref = model.encoder.forward_torchscript(net_input)
    rowgemm_pass = LeanVerifier(model, gemm="rowgemm")
    assert rowgemm_pass.lean_encoder is not None and "fused C++ encoder" in rowgemm_pass.describe()
    calls = []
    original = rowgemm.FusedEncoderLayer.__call__
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rowgemm.FusedEncoderLayer, "__call__", lambda self, *a: calls.append(1) or original(self, *a))
        with torch.no_grad():
            assert_same_encoding(ref, rowgemm_pass.encode(net_input))
            assert len(calls) == len(model.encoder.layers)
            torch_pass = LeanVerifier(model, gemm="torch")
            assert torch_pass.lean_encoder is None
            torch_pass.encode(net_input)
            rowgemm_pass.use_fused = False  # what the tests comparing with the layers' operations switch off
            rowgemm_pass.encode(net_input)
            assert LeanVerifier(model, gemm="rowgemm", encoder="fairseq").lean_encoder is None
    assert len(calls) == len(model.encoder.layers)


@needs_kernel
def test_the_backend_runs_the_fused_encoder_where_it_can(toy_bin):
    from fairseq_specdec.generation import StrictAcceptance, resolve_backend

    model, _ = untrained_transformer(toy_bin)
    assert resolve_backend("auto", model, StrictAcceptance()).verifier.lean_encoder is not None
    assert resolve_backend("auto", model, StrictAcceptance(), off={"encoder"}).verifier.lean_encoder is None
    assert resolve_backend("auto", model, StrictAcceptance(), off={"products"}).verifier.lean_encoder is None
    with pytest.raises(ValueError, match=r"the fused encoder cannot run: .*torch's products"):
        LeanVerifier(model, gemm="torch", encoder="lean")
    with pytest.raises(ValueError, match="the lean pass's encoder must be one of auto, lean, fairseq"):
        LeanVerifier(model, encoder="fast")
    gelu, _ = untrained_transformer(toy_bin, "--activation-fn", "gelu")
    assert resolve_backend("auto", gelu, StrictAcceptance()).verifier.lean_encoder is None
    with pytest.raises(ValueError, match="the fused encoder cannot run: .*not ReLU"):
        LeanVerifier(gelu, encoder="lean")
