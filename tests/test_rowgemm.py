"""The row-blocked product kernel (``fairseq_specdec.kernels._native``) behind
``--specdec-backend auto`` on a CPU.

* it computes ``F.linear`` (and the fused ReLU) for every shape the packing
  has edge cases for: output features not a multiple of the 8-column panels
  or of the 24-column register block, row counts around the 4-row groups,
  inputs with leading dimensions, empty inputs;
* a row's result is bitwise the same whatever other rows share the call
  (the arithmetic contract the module documents);
* the AVX-512 blocks (run where the CPU has AVX-512F, and emulated on AVX2
  everywhere) give bitwise the AVX2 products; ``FAIRSEQ_SPECDEC_ISA``
  picks them at import, and refuses what it cannot pick, by name;
* it is built by the install (a silent fallback to torch would hide a broken
  build), and it refuses what it cannot compute, by name.
"""
import math
import os
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import specdec_helpers as H
from fairseq_specdec import kernels
from fairseq_specdec.kernels import rowgemm

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
    for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 33):
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
    """Bitwise, whatever register block the call's number of rows selects
    (4 x 24 columns up to 4 rows, 6 x 16 up to 6, 8 x 8 up to 8, groups of
    6 beyond) and wherever the row sits in its group."""
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(7976, 256, generator=g), torch.randn(7976, generator=g)
    lin = rowgemm.PackedLinear(weight, bias)
    x = torch.randn(37, 256, generator=g)
    together = lin(x)
    for i in (0, 3, 4, 17, 36):
        assert torch.equal(lin(x[i : i + 1]), together[i : i + 1])
        assert torch.equal(lin(x[max(0, i - 2) : i + 1])[-1], together[i])
    for m in range(1, 15):
        assert torch.equal(lin(x[:m]), together[:m]), m
    # 5 panels (40 columns): a tail block of fewer panels in the layouts of
    # 3 and 2 panels a block
    small = rowgemm.PackedLinear(weight[:40], bias[:40], "relu")
    alone = torch.cat([small(x[i : i + 1]) for i in range(14)])
    for m in range(1, 15):
        assert torch.equal(small(x[:m]), alone[:m]), m


@needs_kernel
@pytest.mark.parametrize("isa", ["avx512", "avx512-emulated"])
def test_avx512_blocks_give_the_avx2_products_bitwise(isa):
    """The AVX-512 register blocks (16-lane vectors over pairs of panels, 4
    rows x 64 columns or groups of 8 rows x 48 columns, an odd last panel in
    an AVX2 block) compute every element as the AVX2 blocks do: bitwise the
    same products for every element type, bias, ReLU, output width (odd and
    even panel counts, part blocks) and row count.  ``avx512`` runs where the
    CPU has AVX-512F; ``avx512-emulated`` runs the same code on AVX2
    instructions everywhere."""
    g = torch.Generator().manual_seed(5)
    before, checked = kernels.isa(), 0
    for out_features, in_features in [(1, 1), (7, 3), (16, 5), (23, 5), (40, 9), (49, 64), (64, 33), (100, 48),
                                      (1000, 96)]:
        weight, bias = torch.randn(out_features, in_features, generator=g), torch.randn(out_features, generator=g)
        xs = {m: torch.randn(m, in_features, generator=g) for m in (1, 2, 3, 4, 5, 7, 8, 9, 13, 17)}
        for precision in rowgemm.PRECISIONS:
            for activation, b in ((None, None), ("relu", bias)):
                lin = rowgemm.PackedLinear(weight, b, activation, precision=precision)
                avx2 = {m: lin(x) for m, x in xs.items()}
                with H.products_isa(isa):
                    assert kernels.isa() == isa
                    for m, x in xs.items():
                        assert torch.equal(lin(x), avx2[m]), (out_features, in_features, precision, activation, m)
                        checked += 1
    assert kernels.isa() == before  # the import-time choice restored
    assert checked == 9 * 3 * 2 * 10


@needs_kernel
def test_the_products_isa_is_measured_unless_asked_and_refused_by_name():
    """Unset, FAIRSEQ_SPECDEC_ISA gives every class of row counts the AVX2
    blocks on a CPU without AVX-512F and the AVX-512 ones on a CPU with it,
    timing nothing (the machine's description names them); a name picks the blocks for every class, checked at
    import; an unknown name, or avx512 on a CPU without AVX-512F, is refused
    naming the variable."""
    has_avx512 = "avx512f" in open("/proc/cpuinfo").read().split()
    assert kernels.has_avx512() == has_avx512
    code = ("from fairseq_specdec import kernels; from fairseq_specdec.bench import machine; "
            "print('ISA', kernels.isa()); print('TABLE', sorted(set(kernels.isa_by_rows().values()))); "
            "print('DESCRIBED', machine.describe()['plugin_isa'])")

    def isa_of(value):
        env = {kernels.ISA_ENV: value}  # None: unset
        return H.run([sys.executable, "-c", code], check=False, env=env, timeout=300)

    wide = "avx512" if has_avx512 else "avx2"
    for unset in (isa_of(None), isa_of("auto")):
        assert f"ISA {wide}\nTABLE ['{wide}']\nDESCRIBED {wide}" in unset.stdout, unset.stderr[-2000:]
    assert not hasattr(kernels, "measure_isas") and not hasattr(kernels, "ISA_MEASURED")  # nothing is timed
    for name in ("avx2", "avx512-emulated"):
        chosen = isa_of(name)  # named: every class
        assert f"ISA {name}\nTABLE ['{name}']\nDESCRIBED {name}" in chosen.stdout, chosen.stderr[-2000:]
    bad = isa_of("avx1024")
    assert bad.returncode != 0
    assert "FAIRSEQ_SPECDEC_ISA=avx1024: not an instruction set" in bad.stderr and "avx512-emulated" in bad.stderr
    forced = isa_of("avx512")
    if has_avx512:
        assert "ISA avx512\n" in forced.stdout, forced.stderr[-2000:]
    else:
        assert forced.returncode != 0 and "FAIRSEQ_SPECDEC_ISA=avx512: this CPU has no AVX-512F" in forced.stderr


@needs_kernel
def test_each_class_of_row_counts_runs_its_own_isa_bitwise_alike():
    """The instruction set is set per class of row counts (1, 2-4, 5-8, 9+):
    a product of m rows runs its class's blocks (a class on the emulated
    AVX-512 blocks, the others on AVX2, in every pattern), the products are
    bitwise those of AVX2 alone for every m, and :func:`kernels.isa` names
    each class's set, runs of equal classes joined."""
    g = torch.Generator().manual_seed(9)
    weight, bias = torch.randn(70, 37, generator=g), torch.randn(70, generator=g)
    lin = rowgemm.PackedLinear(weight, bias, "relu")
    xs = {m: torch.randn(m, 37, generator=g) for m in range(1, 18)}
    before = kernels.isa_by_rows()
    assert kernels.isa_classes() == [1, 2, 5, 9]
    try:
        kernels.set_isa_by_rows(dict.fromkeys(kernels.isa_classes(), "avx2"))
        reference = {m: lin(x) for m, x in xs.items()}
        for emulated in ([1], [2], [5], [9], [2, 5], [1, 9], [1, 2, 5, 9]):
            table = {first: "avx512-emulated" if first in emulated else "avx2" for first in kernels.isa_classes()}
            kernels.set_isa_by_rows(table)
            assert kernels.isa_by_rows() == table
            for m, x in xs.items():
                assert kernels._ext.isa_for_rows(m) == table[max(f for f in table if f <= m)]
                assert torch.equal(lin(x), reference[m]), (emulated, m)
        kernels.set_isa_by_rows({1: "avx2", 2: "avx512-emulated", 5: "avx512-emulated", 9: "avx2"})
        assert kernels.isa() == "avx2 (1 row), avx512-emulated (2-8 rows), avx2 (9+ rows)"
        kernels.set_isa_by_rows({1: "avx512-emulated", 2: "avx2", 5: "avx2", 9: "avx2"})
        assert kernels.isa() == "avx512-emulated (1 row), avx2 (2+ rows)"
        kernels.set_isa_by_rows(dict.fromkeys(kernels.isa_classes(), "avx512-emulated"))
        assert kernels.isa() == "avx512-emulated"
        with pytest.raises(ValueError, match=r"no class of products starts at \[3\] rows"):
            kernels.set_isa_by_rows({3: "avx2"})
        with pytest.raises(ValueError, match="no instruction set avx1024 for a class"):
            kernels.set_isa_by_rows({1: "avx2", 9: "avx1024"})
        assert kernels.isa() == "avx512-emulated"  # refused before any class changed
        if not kernels.has_avx512():
            with pytest.raises(ValueError, match="no AVX-512F"):
                kernels.set_isa_by_rows({1: "avx2", 9: "avx512"})
            assert kernels.isa() == "avx512-emulated"  # refused before any class changed
    finally:
        kernels.set_isa_by_rows(before)
    assert kernels.isa_by_rows() == before


@needs_kernel
def test_the_prefetch_changes_no_product_and_is_set_per_class():
    """Whether the float32 and bfloat16 products prefetch the next block of
    weights is set per class of row counts: every pattern gives bitwise the
    products of the prefetch everywhere, for 1 to 17 rows (each class, and
    the groups past 8 rows), on AVX2 and the emulated AVX-512 blocks; the
    table and its description follow the setting; an unknown class is
    refused before any class changes."""
    g = torch.Generator().manual_seed(11)
    weight, bias = torch.randn(203, 67, generator=g), torch.randn(203, generator=g)
    xs = {m: torch.randn(m, 67, generator=g) for m in range(1, 18)}
    before = kernels.prefetch_by_rows()
    firsts = kernels.isa_classes()
    try:
        for isa in ("avx2", "avx512-emulated"):
            with H.products_isa(isa):
                for precision in ("float32", "bfloat16"):
                    lin = rowgemm.PackedLinear(weight, bias, "relu", precision=precision)
                    kernels.set_prefetch_by_rows(dict.fromkeys(firsts, True))
                    assert all(kernels._ext.prefetch_for_rows(m) for m in xs)
                    reference = {m: lin(x) for m, x in xs.items()}
                    for off in ([1], [2], [5], [9], [1, 2], [1, 2, 5, 9]):
                        table = {first: first not in off for first in firsts}
                        kernels.set_prefetch_by_rows(table)
                        assert kernels.prefetch_by_rows() == table
                        for m, x in xs.items():
                            assert kernels._ext.prefetch_for_rows(m) == table[max(f for f in table if f <= m)]
                            assert torch.equal(lin(x), reference[m]), (isa, precision, off, m)
        kernels.set_prefetch_by_rows({1: False, 2: False, 5: True, 9: True})
        assert kernels.describe_prefetch() == "off (1-4 rows), on (5+ rows)"
        kernels.set_prefetch_by_rows(dict.fromkeys(firsts, False))
        assert kernels.describe_prefetch() == "off"
        with pytest.raises(ValueError, match=r"no class of products starts at \[3\] rows"):
            kernels.set_prefetch_by_rows({1: True, 3: True})
        assert kernels.describe_prefetch() == "off"  # refused before any class changed
    finally:
        kernels.set_prefetch_by_rows(before)
    assert kernels.prefetch_by_rows() == before


def test_the_prefetch_is_dropped_where_the_probes_measured_it_faster_without():
    """pick_prefetch_by_rows: a class keeps the prefetch unless the
    geometric mean over the probes (weights the cache holds, weights
    streamed from memory) of the median over the paired rounds of its time
    without over its time with is at most 1 - PREFETCH_MARGIN: a near-tie on one
    probe does not forfeit a large gain on the other, a large loss on one
    is not taken for a small gain on the other, and one slow round decides
    nothing."""
    def probes(cached, streamed):
        return {"16 MiB": {"on": [1.0, 1.0, 1.0], "off": cached}, "64 MiB": {"on": [2.0, 2.0, 2.0], "off": streamed}}

    times = {1: probes([1.05, 1.06, 1.04], [1.4, 1.5, 1.4]),  # 5% slower cached, 0.7x streamed: dropped
             2: probes([0.98, 0.98, 0.98], [2.0, 2.0, 2.0]),  # 2% on one, a tie on the other: within the margin
             5: probes([0.8, 0.8, 0.8], [2.6, 2.6, 2.6]),     # 0.8x cached, 1.3x streamed: kept
             9: {"16 MiB": {"on": [1.0, 5.0, 1.0], "off": [1.0, 1.0, 1.0]},  # only one round hit
                 "64 MiB": {"on": [1.0, 5.0, 1.0], "off": [1.0, 1.0, 1.0]}}}
    assert kernels.pick_prefetch_by_rows(times) == {1: False, 2: True, 5: True, 9: True}
    assert kernels.pick_prefetch_by_rows({2: times[2]}, margin=0.0) == {2: False}


@needs_kernel
def test_measuring_the_prefetch_times_the_classes_up_to_8_rows_and_leaves_it_on():
    """measure_prefetch times each class of at most 8 rows with and without
    the prefetch on both probes, on one thread (the count restored), and
    leaves every class prefetching; choose_prefetch_by_rows applies what
    pick_prefetch_by_rows makes of it."""
    before, threads = kernels.prefetch_by_rows(), torch.get_num_threads()
    try:
        times = kernels.measure_prefetch(rounds=1)
        assert torch.get_num_threads() == threads
        assert sorted(times) == [1, 2, 5]
        assert kernels.isa_probe_rows() == {1: 1, 2: 4, 5: 8, 9: 32}  # each class at its largest rows, 32 for 9+
        assert all(sorted(by) == sorted(kernels.PREFETCH_PROBES) for by in times.values()), times
        assert all(sorted(t) == ["off", "on"] and all(len(ms) == 1 and 0 < ms[0] < 1e4 for ms in t.values())
                   for by in times.values() for t in by.values()), times
        assert set(kernels.prefetch_by_rows().values()) == {True}
        measured = kernels.choose_prefetch_by_rows()
        want = kernels.pick_prefetch_by_rows(measured)
        assert kernels.prefetch_by_rows() == {**want, 9: True}
    finally:
        kernels.set_prefetch_by_rows(before)


@needs_kernel
def test_the_prefetch_is_measured_at_first_use_unless_asked_and_refused_by_name():
    """FAIRSEQ_SPECDEC_PREFETCH unset: nothing is measured at import; the
    first packed weight measures the classes of up to 8 rows (9+ keep the
    prefetch) and the machine's description holds the times; ``on`` and
    ``off`` set every class and measure nothing; another value is refused
    at import, naming the variable."""
    code = ("from fairseq_specdec import kernels; from fairseq_specdec.bench import machine; import torch; "
            "print('AT IMPORT', sorted(kernels.PREFETCH_MEASURED)); "
            "from fairseq_specdec.kernels import rowgemm; rowgemm.PackedLinear(torch.ones(8, 8)); "
            "print('MEASURED', sorted(kernels.PREFETCH_MEASURED), 'plugin_prefetch_measured' in machine.describe()); "
            "print('TABLE', kernels.prefetch_by_rows()[9], sorted(set(kernels.prefetch_by_rows().values())))")

    def run(value):
        return H.run([sys.executable, "-c", code], check=False, env={kernels.PREFETCH_ENV: value}, timeout=300)

    unset = run(None)
    assert "AT IMPORT []\nMEASURED [1, 2, 5] True\nTABLE True" in unset.stdout, unset.stderr[-2000:]
    for value, table in (("on", "[True]"), ("off", "[False]")):
        chosen = run(value)
        assert f"AT IMPORT []\nMEASURED [] False\nTABLE {value == 'on'} {table}" in chosen.stdout, chosen.stderr[-2000:]
    bad = run("sometimes")
    assert bad.returncode != 0
    assert "FAIRSEQ_SPECDEC_PREFETCH=sometimes: the choices are auto, on, off" in bad.stderr, bad.stderr[-2000:]


@needs_kernel
def test_a_verify_pass_on_torchs_products_measures_nothing():
    """The choices wait for the native products: a lean verify pass on
    torch's products (a GPU's, or --specdec-backend reference's path) leaves
    them unmeasured; the first one on the native products measures them."""
    code = textwrap.dedent("""
        from fairseq_specdec import kernels
        from fairseq_specdec.bench.roofline import random_verifier
        from fairseq_specdec.generation.lean_verifier import LeanVerifier
        model = random_verifier(dict(layers=1, dim=16, ffn=32, heads=2, vocab=40))
        LeanVerifier(model, gemm="torch").start()
        print("TORCH", sorted(kernels.PREFETCH_MEASURED))
        LeanVerifier(model, gemm="rowgemm").start()
        print("NATIVE", sorted(kernels.PREFETCH_MEASURED))
    """)
    proc = H.run([sys.executable, "-c", code], check=False, env={kernels.PREFETCH_ENV: None}, timeout=300)
    assert "TORCH []\nNATIVE [1, 2, 5]" in proc.stdout, proc.stderr[-3000:]


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
def test_the_register_fma_probe_runs_its_rounds():
    """fma_rounds (the roofline's arithmetic peak) computes what it is asked
    to: its 16 accumulators of each lane start at j / 1000 and each round
    takes a -> 0.999 a + 0.001, so after n rounds they sum to lanes times
    sum_j (1 - (1 - j / 1000) 0.999^n); an instruction set the CPU lacks or
    that does not exist is refused by name."""
    def expected(lanes, n):
        return lanes * sum(1.0 - (1.0 - j / 1000.0) * 0.999 ** n for j in range(16))

    names = ["avx2"] + (["avx512"] if kernels.has_avx512() else [])
    for name in names:
        lanes = 16 if name == "avx512" else 8
        for n in (0, 1, 1000, 20000):
            assert math.isclose(kernels._ext.fma_rounds(name, n), expected(lanes, n), rel_tol=1e-3), (name, n)
    if not kernels.has_avx512():
        with pytest.raises(RuntimeError, match="no AVX-512F"):
            kernels._ext.fma_rounds("avx512", 1)
    with pytest.raises(RuntimeError, match="no instruction set sse"):
        kernels._ext.fma_rounds("sse", 1)


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
def test_fused_block_layer_computes_the_block_layers_operations(masked):
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
        lin = [rowgemm.PackedLinear(m.weight, m.bias) for m in (layer.self_qkv, layer.self_out, layer.cross_q,
                                                                 layer.cross_out, layer.fc1, layer.fc2)]
        norms = [(ln.weight, ln.bias) for ln in (layer.ln_self, layer.ln_cross, layer.ln_ffn)]
        d = 64 // layer.heads
        cross = tuple(t.reshape(3 * layer.heads, -1, d) for t in memory)
        scale = d ** -0.5
        fused = rowgemm.fused_layer(x, rowgemm.packed_pairs(lin), norms, float(layer.ln_self.eps), layer.heads, scale,
                                    layer.heads, scale, True, cross, ~mask.reshape(3, -1))
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
                            [3], keys, keys.clone())


@pytest.mark.skipif(not rowgemm.bfloat16_available(), reason="the kernel or its bfloat16 panels are not available")
@pytest.mark.parametrize("shape", [(7, 5, 1), (100, 64, 4), (200, 96, 3), (41, 130, 9), (50, 40, 6), (33, 70, 8)])
def test_bfloat16_panels_compute_with_the_weight_rounded_to_bfloat16(shape):
    """A weight packed in bfloat16 gives bitwise what the float32 panels of
    the same weight rounded to bfloat16 (torch's round to nearest even)
    give: the kernel widens each element exactly and sums in the same
    order; a row's result does not depend on the other rows; the rounding
    happens (the float32 weight's result differs); bias and ReLU apply."""
    n, k, m = shape
    torch.manual_seed(n)
    weight, bias, x = torch.randn(n, k), torch.randn(n), torch.randn(m, k)
    rounded = weight.to(torch.bfloat16).float()
    for activation in (None, "relu"):
        half = rowgemm.PackedLinear(weight, bias, activation, precision="bfloat16")
        assert half.packed.dtype == torch.bfloat16
        assert half.packed.element_size() * half.packed.numel() * 2 == rowgemm.PackedLinear(weight).packed.numel() * 4
        got = half(x)
        assert torch.equal(got, rowgemm.PackedLinear(rounded, bias, activation)(x))
        assert torch.equal(got, torch.cat([half(x[i : i + 1]) for i in range(m)]))
        reference = F.linear(x.double(), rounded.double(), bias.double())
        if activation:
            reference = reference.clamp(min=0)
        torch.testing.assert_close(got.double(), reference, rtol=1e-5, atol=1e-4)
        if k > 8:
            assert not torch.equal(got, rowgemm.PackedLinear(weight, bias, activation)(x))


def test_packed_linear_refuses_an_unknown_precision():
    if rowgemm.unavailable_reason() is not None:
        pytest.skip(rowgemm.unavailable_reason())
    with pytest.raises(ValueError, match="precision must be one of float32, bfloat16, int8, got 'float16'"):
        rowgemm.PackedLinear(torch.randn(8, 8), precision="float16")


@pytest.mark.skipif(rowgemm.unavailable_reason() is not None or not rowgemm.draft_pick_available(),
                    reason="the kernel or its draft_pick is not available")
@pytest.mark.parametrize("precision", rowgemm.PRECISIONS)
def test_draft_pick_is_log_softmax_max_of_the_projection(precision):
    """The drafter's one-call pick: per row the first largest logit of the
    packed columns plus the extra columns plus the bias, and its log-softmax
    value, as torch computes them from the same (rounded) weight; a -inf bias
    never wins; an extra column can win; rows of any leading shape."""
    torch.manual_seed(4)
    weight, extra_t, bias = torch.randn(300, 48) * 0.3, torch.randn(48, 5) * 0.3, torch.randn(305)
    x = torch.randn(2, 3, 48)
    packed = rowgemm.PackedLinear(weight, precision=precision)
    used = weight.to(torch.bfloat16).float() if precision == "bfloat16" else weight
    if precision == "int8":  # each row rounded to int8 at its own scale (max |row| / 127)
        scale = weight.abs().amax(1, keepdim=True) / 127
        used = (weight / scale).round().clamp(-127, 127) * scale
    logits = torch.cat([F.linear(x, used), x @ extra_t], -1) + bias
    top = logits.argmax(-1)
    bias[top[0, 0]] = -math.inf  # the first row's winner is ruled out
    bias[300 + 2] = 50.0  # an extra column wins where nothing else is ruled out
    logits = torch.cat([F.linear(x, used), x @ extra_t], -1) + bias
    expected_lp, expected = torch.log_softmax(logits, -1).max(-1)
    best, lprob = rowgemm.draft_pick(x, packed, extra_t, bias)
    assert best.shape == lprob.shape == (2, 3) and best.dtype == torch.long
    assert torch.equal(best, expected) and (best == 302).all()
    torch.testing.assert_close(lprob, expected_lp, rtol=1e-5, atol=1e-5)
    # no extra columns, and a spread-out softmax (every exp term counts)
    best, lprob = rowgemm.draft_pick(x * 0.01, packed, None, torch.zeros(300))
    expected_lp, expected = torch.log_softmax(F.linear(x * 0.01, used), -1).max(-1)
    assert torch.equal(best, expected)
    torch.testing.assert_close(lprob, expected_lp, rtol=1e-5, atol=1e-5)
    assert lprob.max() < -5.0  # about log(1 / 300)
    with pytest.raises(RuntimeError, match="bias must be a contiguous float32 CPU vector of n_base \\+ E = 305"):
        rowgemm.draft_pick(x, packed, extra_t, torch.zeros(300))


def test_compact_rows_moves_the_kept_rows_up_in_place():
    """``compact_rows`` (the verify pass's row retirement): the kept rows'
    first ``width`` positions, every head, become the first rows, as
    index_select gives them; the tensor itself is changed (no copy), later
    positions are not; an order that is not increasing is refused."""
    if not rowgemm.compact_rows_available():
        pytest.skip("the extension has no compact_rows")
    g = torch.Generator().manual_seed(5)
    tensors = [torch.randn((6, 3, 10, 4), generator=g) for _ in range(3)]
    before = [t.clone() for t in tensors]
    pointers = [t.data_ptr() for t in tensors]
    order, width = [1, 2, 4, 5], 7
    rowgemm.compact_rows(tensors, order, width)
    for t, old, ptr in zip(tensors, before, pointers):
        assert t.data_ptr() == ptr
        want = old.index_select(0, torch.tensor(order))
        assert torch.equal(t[: len(order), :, :width], want[:, :, :width])
        assert torch.equal(t[len(order):], old[len(order):])  # rows past the kept ones: as they were
        assert torch.equal(t[0, :, width:], old[0, :, width:])  # positions past width: as they were
    with pytest.raises(RuntimeError, match="strictly increasing"):
        rowgemm.compact_rows(tensors, [2, 1], width)
    with pytest.raises(RuntimeError, match="past the capacity"):
        rowgemm.compact_rows(tensors, [0, 1], 11)


@needs_kernel
def test_a_cpu_with_avx512_runs_the_avx512_blocks_and_times_only_the_prefetch():
    """The path of a CPU with AVX-512F, run on any CPU: a fresh import of
    the kernels package over an extension that says it has AVX-512F (and
    runs the emulated blocks where asked for AVX-512) sets the AVX-512
    blocks for every class at import, timing nothing; the first packed
    weight measures the prefetch only, on those blocks."""
    code = textwrap.dedent("""
        import sys
        from fairseq_specdec import kernels
        ext = kernels._ext
        select, set_rows = ext.select_isa, ext.set_isa_for_rows
        real = lambda name: "avx512-emulated" if name == "avx512" else name
        ext.has_avx512 = lambda: True
        ext.select_isa = lambda name: select(real(name))
        ext.set_isa_for_rows = lambda first, name: set_rows(first, real(name))
        for name in [n for n in sys.modules if n.startswith("fairseq_specdec.kernels")]:
            if not name.endswith("._native"):
                del sys.modules[name]
        import fairseq_specdec.kernels as fresh
        assert fresh is not kernels and fresh._ext is ext
        print("AT IMPORT", sorted(set(ext.isa_for_rows(f) for f in fresh.isa_classes())), sorted(fresh.PREFETCH_MEASURED))
        import torch
        from fairseq_specdec.kernels import rowgemm
        rowgemm.PackedLinear(torch.ones(8, 8))  # the first use
        print("MEASURED", sorted(fresh.PREFETCH_MEASURED))
        print("ISA", fresh.isa())
    """)
    proc = H.run([sys.executable, "-c", code], check=False, env={kernels.ISA_ENV: None, kernels.PREFETCH_ENV: None},
                 timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "AT IMPORT ['avx512-emulated'] []" in proc.stdout, proc.stdout
    assert "MEASURED [1, 2, 5]" in proc.stdout and "ISA avx512-emulated\n" in proc.stdout, proc.stdout
