"""make_block_inputs on hand-built targets (pure tensors)."""
import pytest
import torch

import specdec_helpers  # noqa: F401  (sys.path)
from fairseq_specdec.tasks import block_inputs as bi
from fairseq_specdec.tasks.block_inputs import make_block_inputs

PAD, EOS, MASK = 1, 2, 20

# rows of length 5, 3 and 2 (EOS counted), right-padded
TARGET = torch.tensor(
    [
        [5, 6, 7, 8, EOS],
        [9, 10, EOS, PAD, PAD],
        [11, EOS, PAD, PAD, PAD],
    ]
)
LENGTHS = [5, 3, 2]


def force_prefixes(monkeypatch, prefixes, lengths):
    """Make torch.rand return the u that yields the given prefix lengths:
    p = L - 1 - floor(L * u)."""
    us = [(L - 1 - p + 0.5) / L for p, L in zip(prefixes, lengths)]
    real_rand = torch.rand

    def fake_rand(*size, generator=None, **kw):
        n = size[0] if not isinstance(size[0], (tuple, list)) else size[0][0]
        assert n == len(us)
        return torch.tensor(us, dtype=torch.float)

    monkeypatch.setattr(bi.torch, "rand", fake_rand)
    return real_rand


def test_forced_prefixes_exact_tensors(monkeypatch):
    force_prefixes(monkeypatch, [2, 0, 1], LENGTHS)
    out = make_block_inputs(TARGET, PAD, MASK, k=3)
    M = MASK
    assert out.prefix_lengths.tolist() == [2, 0, 1]
    # width = max(p + k) = max(5, 3, 4) = 5
    assert out.prev_output_tokens.tolist() == [
        [5, 6, M, M, M],
        [M, M, M, PAD, PAD],
        [11, M, M, M, PAD],
    ]
    assert out.block_target.tolist() == [
        [PAD, PAD, 7, 8, EOS],
        [9, 10, EOS, PAD, PAD],
        [PAD, EOS, PAD, PAD, PAD],  # slots past the EOS have a pad target
    ]
    assert out.block_mask.tolist() == [
        [False, False, True, True, True],
        [True, True, True, False, False],
        [False, True, True, True, False],
    ]


def test_last_prefix_widens_past_target(monkeypatch):
    """p = L - 1 for every row: the block starts on the EOS and runs past the
    target's width, which is extended with pad."""
    force_prefixes(monkeypatch, [4, 2, 1], LENGTHS)
    out = make_block_inputs(TARGET, PAD, MASK, k=3)
    M = MASK
    assert out.prev_output_tokens.shape == (3, 7)
    assert out.prev_output_tokens.tolist() == [
        [5, 6, 7, 8, M, M, M],
        [9, 10, M, M, M, PAD, PAD],
        [11, M, M, M, PAD, PAD, PAD],
    ]
    assert out.block_target.tolist() == [
        [PAD, PAD, PAD, PAD, EOS, PAD, PAD],
        [PAD, PAD, EOS, PAD, PAD, PAD, PAD],
        [PAD, EOS, PAD, PAD, PAD, PAD, PAD],
    ]
    assert out.block_mask.sum(1).tolist() == [3, 3, 3]


def test_zero_prefix_narrows(monkeypatch):
    """p = 0 everywhere with k = 2: columns after max(p + k) = 2 are dropped."""
    force_prefixes(monkeypatch, [0, 0, 0], LENGTHS)
    out = make_block_inputs(TARGET, PAD, MASK, k=2)
    assert out.prev_output_tokens.tolist() == [[MASK, MASK]] * 3
    assert out.block_target.tolist() == [[5, 6], [9, 10], [11, EOS]]
    assert out.block_mask.all()


def test_real_rand_reaches_both_extremes(monkeypatch):
    """u = 0 gives p = L - 1 and u close to 1 gives p = 0 through the real formula."""
    for u, expected in ((0.0, [4, 2, 1]), (0.99999, [0, 0, 0])):
        monkeypatch.setattr(bi.torch, "rand", lambda n, generator=None, _u=u: torch.full((n,), _u))
        out = make_block_inputs(TARGET, PAD, MASK, k=2)
        assert out.prefix_lengths.tolist() == expected


def check_invariants(target, out, k):
    lengths = target.ne(PAD).sum(1)
    p = out.prefix_lengths
    assert ((p >= 0) & (p <= lengths - 1)).all()
    width = int((p + k).max())
    assert out.prev_output_tokens.shape == (target.size(0), width)
    padded = torch.cat([target, target.new_full((target.size(0), max(0, width - target.size(1))), PAD)], 1)
    for r in range(target.size(0)):
        pr, L = int(p[r]), int(lengths[r])
        prev, bt, bm = out.prev_output_tokens[r], out.block_target[r], out.block_mask[r]
        assert prev[:pr].tolist() == target[r, :pr].tolist()  # prefix = gold, never the EOS
        assert EOS not in prev[:pr].tolist()
        assert prev[pr : pr + k].eq(MASK).all()
        assert prev[pr + k :].eq(PAD).all()
        assert bm.nonzero().flatten().tolist() == list(range(pr, pr + k))
        assert bt[pr : pr + k].tolist() == padded[r, pr : pr + k].tolist()
        assert bt[:pr].eq(PAD).all() and bt[pr + k :].eq(PAD).all()
        assert bt[pr] != PAD  # the block always starts on a real token
        # the EOS is a target iff it falls inside the block
        assert (EOS in bt.tolist()) == (pr <= L - 1 < pr + k)


@pytest.mark.parametrize("k", [1, 2, 3, 8])
def test_invariants_over_many_cuts(k):
    g = torch.Generator().manual_seed(0)
    seen = [set() for _ in LENGTHS]
    for _ in range(300):
        out = make_block_inputs(TARGET, PAD, MASK, k=k, generator=g)
        check_invariants(TARGET, out, k)
        for r, p in enumerate(out.prefix_lengths.tolist()):
            seen[r].add(p)
    # every prefix length 0 .. L - 1 is drawn
    assert seen == [set(range(L)) for L in LENGTHS]


def test_generator_makes_cuts_reproducible():
    a = make_block_inputs(TARGET, PAD, MASK, 3, torch.Generator().manual_seed(5))
    b = make_block_inputs(TARGET, PAD, MASK, 3, torch.Generator().manual_seed(5))
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_single_token_rows():
    """A row that is only the EOS must get p = 0 and the EOS as its first block target."""
    target = torch.tensor([[EOS, PAD, PAD], [5, 6, EOS]])
    for seed in range(20):
        out = make_block_inputs(target, PAD, MASK, 2, torch.Generator().manual_seed(seed))
        check_invariants(target, out, 2)
        assert out.prefix_lengths[0] == 0
        assert out.block_target[0, 0] == EOS


def test_block_size_must_be_positive():
    with pytest.raises(ValueError):
        make_block_inputs(TARGET, PAD, MASK, k=0)


def test_sentence_draws_cut_a_sentence_the_same_in_any_batch():
    """Validation cuts depend on the sentence id only, not on its batch."""
    ids = torch.tensor([10, 11, 12])
    whole = make_block_inputs(TARGET, PAD, MASK, 3, draws=bi.sentence_draws(ids))
    # rows 12 and 10 alone, in another order and with less padding
    sub = make_block_inputs(TARGET[[2, 0]], PAD, MASK, 3, draws=bi.sentence_draws(ids[[2, 0]]))
    assert sub.prefix_lengths.tolist() == whole.prefix_lengths[[2, 0]].tolist()
    # no random state is consumed
    torch.manual_seed(0)
    a = torch.rand(1)
    torch.manual_seed(0)
    make_block_inputs(TARGET, PAD, MASK, 3, draws=bi.sentence_draws(ids))
    assert torch.equal(torch.rand(1), a)


def test_sentence_draws_spread_evenly_over_consecutive_ids():
    u = bi.sentence_draws(torch.arange(1000))
    assert ((u >= 0) & (u < 1)).all()
    counts = torch.histc(u.float(), bins=10, min=0, max=1)
    assert counts.min() >= 80 and counts.max() <= 120  # a cut at every prefix length, about equally often
