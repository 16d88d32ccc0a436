"""Packed weights in memory advised to 2 MiB pages (csrc/rowgemm.cpp's
page chunks): where a weight lies never changes a product; the memory is
what the kernel is asked to back by huge pages (its own smaps says so);
chunks are freed with their weights; FAIRSEQ_SPECDEC_HUGE_PAGES turns it
off, once, at import, and refuses a value it does not know."""
import contextlib
import sys

import pytest
import torch

import specdec_helpers as H
from fairseq_specdec import kernels
from fairseq_specdec.kernels import rowgemm

needs_kernel = pytest.mark.skipif(rowgemm.unavailable_reason() is not None, reason=str(rowgemm.unavailable_reason()))
MIB = 1 << 20


def thp_setting():
    """The bracketed word of the kernel's transparent-huge-page setting (None: not readable)."""
    try:
        with open(kernels.THP_SETTING) as f:
            return next((w.strip("[]") for w in f.read().split() if w.startswith("[")), None)
    except OSError:
        return None


def mapping_of(address: int) -> dict:
    """The fields of /proc/self/smaps for the mapping that holds ``address``
    (``start``, ``end`` and its lines, e.g. ``THPeligible``)."""
    found = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                start, end = (int(x, 16) for x in head.split("-"))
                found = {"start": start, "end": end} if start <= address < end else None
            elif found is not None and ":" in head:
                found[head.rstrip(":")] = line.split(":", 1)[1].strip()
                if head == "VmFlags:":
                    return found
    raise AssertionError(f"no mapping holds {address:#x}")


@contextlib.contextmanager
def pages(on: bool):
    """Weights packed inside go to huge-page chunks (on) or stay in torch's memory."""
    before = kernels._ext.huge_pages()
    kernels._ext.set_huge_pages(on)
    try:
        yield
    finally:
        kernels._ext.set_huge_pages(before)


@needs_kernel
def test_products_are_the_same_wherever_the_weight_lies():
    """Every precision: the same weight packed into huge-page chunks and
    into torch's memory gives bitwise the same products, for a weight in a
    shared chunk and one larger than a chunk (a chunk of its own)."""
    g = torch.Generator().manual_seed(0)
    checked = 0
    for out_features, in_features in ((40, 24), (5000, 1700)):  # the second: 34 MB of float32 panels
        weight = torch.randn(out_features, in_features, generator=g)
        bias = torch.randn(out_features, generator=g)
        x = torch.randn(3, in_features, generator=g)
        for precision in rowgemm.PRECISIONS:
            with pages(False):
                small = rowgemm.PackedLinear(weight, bias, "relu", precision=precision)
            with pages(True):
                huge = rowgemm.PackedLinear(weight, bias, "relu", precision=precision)
            assert huge.packed.data_ptr() != small.packed.data_ptr()
            assert torch.equal(huge.packed, small.packed)
            assert torch.equal(huge(x), small(x)), (out_features, precision)
            checked += 1
    assert checked == 2 * len(rowgemm.PRECISIONS)


@needs_kernel
def test_packed_weights_lie_in_memory_advised_to_huge_pages():
    """On, a packed weight starts on a 4 KiB boundary of a mapping aligned
    to 2 MiB that the kernel counts as eligible for huge pages (where its
    setting is madvise, eligibility is the advice itself); off, a weight
    stays in torch's memory, not advised."""
    if thp_setting() != "madvise":
        pytest.skip(f"transparent huge pages are {thp_setting()!r} here: eligibility does not show the advice")
    weight = torch.randn(3000, 700)  # 8.4 MB of panels
    with pages(True):
        huge = rowgemm.PackedLinear(weight)
    where = mapping_of(huge.packed.data_ptr())
    assert huge.packed.data_ptr() % 4096 == 0
    assert where["start"] % (2 * MIB) == 0 and (where["end"] - where["start"]) % (2 * MIB) == 0
    assert where.get("THPeligible") == "1", where
    assert "hg" in where["VmFlags"].split(), where  # hg: MADV_HUGEPAGE
    with pages(False):
        small = rowgemm.PackedLinear(weight)
    assert "hg" not in mapping_of(small.packed.data_ptr())["VmFlags"].split()


@needs_kernel
def test_chunks_are_unmapped_with_their_weights():
    """Packing and dropping 8 MB weights 40 times (320 MB in all, ten chunks'
    worth) leaves at most the chunk being filled mapped beyond what was
    there: a chunk goes when its last weight does."""
    weight = torch.randn(3000, 700)

    def mapped():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))

    with pages(True):
        rowgemm.PackedLinear(weight)  # a chunk being filled, as after any packing
        before = mapped()
        for _ in range(40):
            kept = rowgemm.PackedLinear(weight)
            del kept
        grown = mapped() - before
    assert grown < 80 * MIB, f"{grown / MIB:.0f} MiB more mapped after 40 weights were packed and freed"


@needs_kernel
def test_the_variable_turns_them_off_once_and_refuses_other_values():
    code = ("import torch; from fairseq_specdec import kernels; from fairseq_specdec.kernels import rowgemm; "
            "print('PAGES', kernels.huge_pages()); "
            "p = rowgemm.PackedLinear(torch.randn(3000, 700)).packed; "
            "print('ALIGNED', p.data_ptr() % (2 << 20) == 0)")

    def run(value):
        return H.run([sys.executable, "-c", code], check=False, env={kernels.HUGE_PAGES_ENV: value}, timeout=300)

    on, off = run(None), run("0")
    assert "PAGES 2 MiB pages (transparent huge pages [" in on.stdout, on.stderr[-2000:]
    assert "PAGES 4 KiB pages (FAIRSEQ_SPECDEC_HUGE_PAGES=0)" in off.stdout, off.stderr[-2000:]
    assert "ALIGNED True" in on.stdout  # the first weight packed starts its chunk
    assert "PAGES 2 MiB" in run("1").stdout
    bad = run("yes")
    assert bad.returncode != 0 and "FAIRSEQ_SPECDEC_HUGE_PAGES=yes: give 0" in bad.stderr


def test_a_row_of_a_run_cannot_set_it():
    from fairseq_specdec.bench.loading import split_environment

    with pytest.raises(ValueError, match="FAIRSEQ_SPECDEC_HUGE_PAGES is read once"):
        split_environment(["--decoding", "loop-greedy", "FAIRSEQ_SPECDEC_HUGE_PAGES=0"])
