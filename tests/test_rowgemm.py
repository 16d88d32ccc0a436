"""The row-blocked product kernel (``fairseq_specdec._rowgemm``) behind
``--verify-gemm rowgemm``.

* it computes ``F.linear`` (and the fused ReLU) for every shape the packing
  has edge cases for: output features not a multiple of the 8-column panels
  or of the 24-column register block, row counts around the 4-row groups,
  inputs with leading dimensions, empty inputs;
* a row's result is bitwise the same whatever other rows share the call
  (the arithmetic contract the module documents);
* it is built by the install (a silent fallback to torch would hide a broken
  build), and it refuses what it cannot compute, by name.
"""
import os

import pytest
import torch
import torch.nn.functional as F

from fairseq_specdec.utils import rowgemm

needs_kernel = pytest.mark.skipif(rowgemm.unavailable_reason() is not None, reason=str(rowgemm.unavailable_reason()))


def test_the_install_built_the_kernel():
    if os.environ.get("FAIRSEQ_SPECDEC_NO_EXT") in ("1", "true", "yes"):
        pytest.skip("FAIRSEQ_SPECDEC_NO_EXT is set: the install skipped the extension")
    assert rowgemm.unavailable_reason() is None


def reference(x, weight, bias, relu):
    out = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    return out.clamp_min(0) if relu else out


@needs_kernel
@pytest.mark.parametrize("out_features,in_features", [(1, 1), (7, 3), (8, 8), (23, 5), (24, 17), (25, 64), (49, 256), (1000, 96)])
@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_computes_linear_for_every_panel_and_row_edge(out_features, in_features, relu, with_bias):
    g = torch.Generator().manual_seed(out_features * 1000 + in_features)
    weight = torch.randn(out_features, in_features, generator=g)
    bias = torch.randn(out_features, generator=g) if with_bias else None
    lin = rowgemm.PackedLinear(weight, bias, "relu" if relu else None)
    for m in (1, 2, 3, 4, 5, 7, 8, 9, 33):
        x = torch.randn(m, in_features, generator=g)
        got = lin(x)
        assert got.shape == (m, out_features) and got.dtype == torch.float32
        # float32 sums of in_features products: error grows like sqrt(K)
        tol = 2e-6 * max(1.0, in_features ** 0.5) * (1 + x.abs().max().item() * weight.abs().max().item())
        assert (got.double() - reference(x, weight, bias, relu)).abs().max().item() < tol
        if relu:
            assert bool((got >= 0).all())


@needs_kernel
def test_a_rows_result_does_not_depend_on_the_other_rows():
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(7976, 256, generator=g), torch.randn(7976, generator=g)
    lin = rowgemm.PackedLinear(weight, bias)
    x = torch.randn(37, 256, generator=g)
    together = lin(x)
    for i in (0, 3, 4, 17, 36):
        assert torch.equal(lin(x[i : i + 1]), together[i : i + 1])
        assert torch.equal(lin(x[max(0, i - 2) : i + 1])[-1], together[i])


@needs_kernel
def test_leading_dimensions_and_empty_inputs():
    weight = torch.randn(30, 16)
    lin = rowgemm.PackedLinear(weight)
    x = torch.randn(2, 3, 16)
    assert torch.allclose(lin(x), x @ weight.t(), atol=1e-5)
    assert lin(torch.randn(0, 16)).shape == (0, 30)
    assert lin(x[:, :, :]).shape == (2, 3, 30)
    strided = torch.randn(16, 5).t()  # a non-contiguous input is read correctly
    assert torch.allclose(lin(strided), strided @ weight.t(), atol=1e-5)


@needs_kernel
def test_refuses_what_it_cannot_compute():
    lin = rowgemm.PackedLinear(torch.randn(8, 4))
    with pytest.raises(RuntimeError, match="x has 5 features, the weight 4"):
        lin(torch.randn(2, 5))
    with pytest.raises(RuntimeError, match="float32"):
        lin(torch.randn(2, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="activation must be one of"):
        rowgemm.PackedLinear(torch.randn(8, 4), activation="gelu")
    assert not rowgemm.applies_to(torch.randn(2, 2, dtype=torch.float16))


@needs_kernel
@pytest.mark.parametrize("masked", [False, True])
def test_fused_block_layer_computes_the_block_layers_operations(masked, monkeypatch):
    """The drafter's block layer (pre-norm, bidirectional self-attention over
    its own rows, encoder attention, ReLU feed-forward) as one call of the
    extension gives what its PyTorch operations give, within float rounding.
    The verifier's causal, cached variant is compared with fairseq's layers
    pass by pass in tests/test_lean_verifier.py."""
    from fairseq_specdec.models.specdec_vsd import BlockLayer

    torch.manual_seed(0)
    layer = BlockLayer(64, 4, 96, dropout=0.0).eval()
    with torch.no_grad():
        for ln in (layer.ln_self, layer.ln_cross, layer.ln_ffn):
            ln.weight.uniform_(0.5, 1.5)
            ln.bias.uniform_(-0.5, 0.5)
    x, enc = torch.randn(3, 5, 64), torch.randn(3, 7, 64)
    mask = torch.ones(3, 1, 1, 7, dtype=torch.bool)
    if masked:
        mask[1, ..., 4:] = False  # padding of the second sentence's source
    with torch.no_grad():
        memory = layer.memory(enc)
        assert layer._fused_args() is not None
        fused = layer(x, memory, mask)
        # a build without the fused layer (decided once per layer: the build cannot change)
        monkeypatch.setattr(rowgemm, "fused_layer_available", lambda: False)
        layer.__dict__.pop("_specdec_fused_args")
        assert layer._fused_args() is None
        ops = layer(x, memory, mask)
    assert torch.allclose(fused, ops, atol=2e-5, rtol=1e-4), (fused - ops).abs().max()
    if masked:  # the mask matters: without it the second row's output changes
        with torch.no_grad():
            unmasked = layer(x, memory, torch.ones_like(mask))
        assert not torch.allclose(unmasked[1], ops[1], atol=1e-3)


@needs_kernel
def test_fused_layer_refuses_a_cache_too_small_by_name():
    from fairseq_specdec.models.specdec_vsd import BlockLayer

    layer = BlockLayer(16, 2, 32, dropout=0.0).eval()
    lin = [rowgemm.PackedLinear(m.weight, m.bias) for m in (layer.self_qkv, layer.self_out, layer.cross_q,
                                                             layer.cross_out, layer.fc1, layer.fc2)]
    norms = [(ln.weight.detach(), ln.bias.detach()) for ln in (layer.ln_self, layer.ln_cross, layer.ln_ffn)]
    cross = (torch.randn(2, 3, 8), torch.randn(2, 3, 8))
    keys = torch.zeros(1, 2, 4, 8)
    with pytest.raises(RuntimeError, match="needs cache positions up to 6, capacity 4"):
        rowgemm.fused_layer(torch.randn(1, 3, 16), rowgemm.packed_pairs(lin), norms, 1e-5, 2, 0.35, 2, 0.35, False, cross, None,
                            torch.tensor([3]), keys, keys.clone())
