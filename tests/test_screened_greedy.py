"""Screened greedy steps (``fairseq_specdec/generation/screened_greedy.py``):
the pick from the int8 copy of the vocabulary projection and exact float32
candidates, the scores deferred.

* the screen's pick, where it certifies one, is the largest float32 value
  of the kernel's product (pad and a banned column excluded); near ties,
  exact ties, a pad column above all, NaN inputs and a huge running score
  make it refuse;
  rows screened together get what each gets alone;
* decodings with it are bitwise those without it (``FAIRSEQ_SPECDEC_OFF=screen``),
  with its runs of steps in one call and without them
  (``FAIRSEQ_SPECDEC_OFF=runs``): tokens, positional scores and scores,
  also where picks are refused at a run's first step and in the middle of
  one (a model with an exact tie), with a temperature, the length rules and
  ``--min-len``, and in batches whose last rows are screened together while
  rows finish; and equal fairseq's ``--beam 1``;
* runs are for iterations that draft nothing by design: a drafter that was
  asked and proposed nothing gets one step an iteration;
* the backend builds it for strict verification with the native step only.
"""
import math
import time
from copy import deepcopy

import pytest
import torch

import specdec_helpers as H
from specdec_helpers import assert_identical, run_generator
import fairseq_specdec  # noqa: F401
from fairseq_specdec.generation import NoDrafter, StrictAcceptance, TopBetaAcceptance, resolve_backend
from fairseq_specdec.generation.drafters import Drafter
from fairseq_specdec.generation.draft_policy import RowsRule
from fairseq_specdec.kernels import rowgemm

pytestmark = pytest.mark.skipif(not rowgemm.screen_available(), reason="the extension has no screened pick here")


def _screen(V=1003, K=96, seed=0, scale=0.1):
    torch.manual_seed(seed)
    w = torch.randn(V, K) * scale
    b = torch.randn(V) * scale
    out = rowgemm.PackedLinear(w, b)
    return w, b, out, rowgemm.GreedyScreen(out, w)


def _one(screen, x, pad, temperature, cum_bound):
    """The screen of one row: (column or -1, lp_bound)."""
    columns, bounds = screen(x.unsqueeze(0), pad, temperature, [cum_bound])
    assert len(columns) == len(bounds) == 1
    return columns[0], bounds[0]


def _best(out, x, pad):
    exact = out(x.unsqueeze(0))[0]
    exact[pad] = -math.inf
    top2 = exact.topk(2)
    return int(top2.indices[0]), float(top2.values[0] - top2.values[1]), exact


def test_a_certified_pick_is_the_float32_products_largest_column():
    w, b, out, screen = _screen()
    certified = 0
    for trial in range(300):
        x = torch.randn(w.size(1)) * (10.0 ** (trial % 5 - 2))
        pad = (trial * 37) % w.size(0)
        column, lp_bound = _one(screen, x, pad, 1.0, 0.0)
        best, gap, exact = _best(out, x, pad)
        if column >= 0:
            certified += 1
            assert column == best, f"trial {trial}: picked {column}, the largest is {best} (gap {gap})"
            lp = torch.log_softmax(out(x.unsqueeze(0))[0], -1)[column]
            assert abs(float(lp)) <= lp_bound
    assert certified >= 250  # random rows rarely tie


def test_near_ties_are_refused_or_right():
    w, b, out, screen = _screen(V=64, K=32, seed=1)
    refused = 0
    for i, eps in enumerate([0.0, 1e-9, 1e-7, 1e-5, 1e-3, 1e-1]):
        w2 = w.clone()
        b2 = b.clone()
        w2[7] = w2[5] + eps  # column 7 a hair above column 5 along x = w[5]
        b2[7] = b2[5]
        out2 = rowgemm.PackedLinear(w2, b2)
        screen2 = rowgemm.GreedyScreen(out2, w2)
        x = w2[5] * 20.0
        column, _ = _one(screen2, x, 0, 1.0, 0.0)
        best, gap, exact = _best(out2, x, 0)
        if column < 0:
            refused += 1
        else:
            assert column == best and gap > 0, f"eps {eps}: picked {column}, largest {best}, gap {gap}"
        if eps == 0.0:
            assert column < 0  # an exact tie is never certified (fairseq's top-2 decides it)
    assert refused >= 2


def test_pad_nan_and_a_huge_running_score():
    w, b, out, screen = _screen(V=200, K=40, seed=2)
    x = torch.randn(40)
    best, _, _ = _best(out, x, pad=1)
    b2 = b.clone()
    b2[best] = 100.0  # the pad column above all: never picked
    out2 = rowgemm.PackedLinear(w, b2)
    column, _ = _one(rowgemm.GreedyScreen(out2, w), x, best, 1.0, 0.0)
    assert column != best
    assert column == _best(out2, x, best)[0] or column < 0
    y = x.clone()
    y[3] = float("nan")
    assert _one(screen, y, 1, 1.0, 0.0)[0] < 0
    assert _one(screen, x, 1, 1.0, 1e9)[0] < 0  # no margin survives the rounding of such a running score
    column, _ = _one(screen, x, 1, 0.5, 0.0)  # a temperature changes no order
    assert column in (-1, best)
    # a banned column (EOS before --min-len) is never picked: the next best is, as fairseq's rule gives
    columns, _ = screen(x.unsqueeze(0), 1, 1.0, [0.0], [best])
    exact = out(x.unsqueeze(0))[0]
    exact[1] = exact[best] = -math.inf
    assert columns[0] in (-1, int(exact.argmax())) and columns[0] != best
    with pytest.raises(RuntimeError, match="one ban per row"):
        screen(torch.stack([x, x]), 1, 1.0, [0.0, 0.0], [-1])


def test_rows_screened_together_get_what_each_gets_alone():
    w, b, out, screen = _screen(V=500, K=64, seed=3)
    torch.manual_seed(4)
    for rows in (2, 3, 4, 7):
        x = torch.randn(rows, 64) * torch.logspace(-2, 1, rows).unsqueeze(1)  # each row its own scale
        x[rows // 2, 5] = float("nan")  # a row that is refused, among others that are not
        cums = [0.0, 1e9, 3.0, 0.5, 2.0, 7.0, 1.0][:rows]  # one running score no margin survives
        columns, bounds = screen(x, 1, 1.0, cums)
        alone = [_one(screen, x[r], 1, 1.0, cums[r]) for r in range(rows)]
        assert list(zip(columns, bounds)) == alone
        assert columns[rows // 2] < 0 and columns[1] < 0
        for r in range(rows):
            if r not in (1, rows // 2):
                assert columns[r] == _best(out, x[r], 1)[0]
    with pytest.raises(RuntimeError, match="one cum_bound per row"):
        screen(torch.randn(2, 64), 1, 1.0, [0.0])


@pytest.fixture(scope="module")
def toy(verifier):
    return verifier


@pytest.fixture(scope="module")
def tied(verifier):
    """The toy verifier with a near tie made exact: the vocabulary
    projection's row of the type its greedy outputs pick most (after EOS)
    copied into a type they never pick, so that every step whose best is that
    type has two equal largest columns, which the screen never certifies
    (fairseq's top-2 decides them): refused picks in the middle of sentences
    and of runs of steps, as near ties give."""
    model, task = verifier
    d = task.target_dictionary
    out = run_generator(H.make_generator(model, NoDrafter(), d, 1, off=("screen",)), model, H.batches(task, "test", 8))
    counts = torch.bincount(torch.cat([h["tokens"] for h in out.values()]), minlength=len(d))
    counts[d.eos()] = -1
    common = int(counts.argmax())
    spare = next(t for t in range(d.nspecial, len(d)) if counts[t] == 0)
    copy = deepcopy(model)
    with torch.no_grad():
        weight = copy.decoder.output_projection.weight
        weight[spare] = weight[common]
    return copy, task


class Runs:
    """Records every run of screened steps: (rows, steps asked, steps
    certified, passes)."""

    def __init__(self, patch):
        self.calls = []
        real = rowgemm.DecoderPass.screened_steps

        def recorded(pass_, tokens, n, *args, **kwargs):
            picks, bounds, features = real(pass_, tokens, n, *args, **kwargs)
            self.calls.append((tokens.size(0), n, picks.size(1), features.size(1)))
            return picks, bounds, features

        patch.setattr(rowgemm.DecoderPass, "screened_steps", recorded)


def _decode(model, task, drafter=None, off=(), bsz=1, k=4, mixed=False, **opts):
    """The generator, its output on the test split (``mixed``: in
    :func:`~specdec_helpers.mixed_batches`) and its :class:`Runs`."""
    gen = H.make_generator(model, drafter or NoDrafter(), task.target_dictionary, k, off=off, **opts)
    with pytest.MonkeyPatch.context() as patch:
        runs = Runs(patch)
        out = run_generator(gen, model, (H.mixed_batches if mixed else H.batches)(task, "test", bsz))
    return gen, out, runs


@pytest.mark.parametrize("opts", ["default", "max_len_3", "min_len_15"])
def test_screened_decoding_is_bitwise_the_unscreened_one_and_beam1(toy, beam1_reference, opts):
    model, task = toy
    options = H.OPTION_SETS[opts]
    plain_gen, plain, _ = _decode(model, task, off=("screen",), **options)
    assert plain_gen.screened is None and "screened" not in plain_gen.stats.summary()
    for off in ((), ("runs",)):
        gen, got, runs = _decode(model, task, off=off, **options)
        assert gen.screened is not None
        assert_identical(plain, got, atol=0)
        assert_identical(beam1_reference(opts, 1), got)
        if opts != "max_len_3":
            assert gen.screened.screened > 0
            # loop-greedy runs several steps a call, each ending at the sentence's EOS; one a call with runs off
            assert max(n for _, n, _, _ in runs.calls) == (1 if off else gen.screened.max_steps)
            if not off:
                assert max(s for _, _, s, _ in runs.calls) > 1
        # every pass a one-token iteration in the statistics, whatever the calls
        assert gen.stats.iterations == gen.stats.tokens


def test_refused_picks_inside_runs_of_steps(tied):
    """A pick refused at a run's first step takes the ordinary step; one
    refused after certified steps ends the run, and the next iteration
    takes that step again, alone: every output bitwise that of the
    unscreened decoding and fairseq's --beam 1, at batch 1 and 8, with
    runs and without."""
    model, task = tied
    for bsz in (1, 8):
        _, plain, _ = _decode(model, task, off=("screen",), bsz=bsz)
        reference = run_generator(H.seq_gen(model, task.target_dictionary, H.OPTION_SETS["default"]), model,
                                  H.batches(task, "test", bsz))
        assert_identical(reference, plain)
        for off in ((), ("runs",)):
            gen, got, runs = _decode(model, task, off=off, bsz=bsz)
            assert_identical(plain, got, atol=0)
            assert gen.screened.uncertified > 0
            assert any(s == 0 for _, _, s, _ in runs.calls)  # refused at a run's first step
            if not off:
                # refused after certified steps: that pass is returned, not kept
                assert any(0 < s and t == s + 1 for _, _, s, t in runs.calls)


class _ProposesNothing(Drafter):
    """A drafter that is asked and never proposes (but does not declare
    that it never drafts)."""

    def describe(self):
        return "proposes nothing"

    def start_batch(self, state):
        pass

    def propose(self, state, k):
        return state.tokens.new_zeros((state.size, 0)), None

    def reorder(self, order, order_host):
        pass


def test_a_drafter_that_was_asked_gets_one_step_an_iteration(toy):
    """Runs are for iterations that draft nothing by design: a drafter that
    was asked and proposed nothing is asked again at the next token."""
    model, task = toy
    _, plain, _ = _decode(model, task, off=("screen",))
    gen, got, runs = _decode(model, task, drafter=_ProposesNothing())
    assert_identical(plain, got, atol=0)
    assert gen.screened.screened > 0 and {n for _, n, _, _ in runs.calls} == {1}


def test_temperature_and_batches_whose_rows_finish(toy):
    model, task = toy
    opts = dict(max_len_a=0, max_len_b=200, min_len=1, temperature=0.7)
    _, plain, _ = _decode(model, task, off=("screen",), **opts)
    gen, got, _ = _decode(model, task, **opts)
    assert gen.screened.screened > 0
    assert_identical(plain, got, atol=0)
    # batches of 8 whose rows finish at different steps: their last (up to 4)
    # unfinished rows are screened together, also while rows finish
    _, plain8, _ = _decode(model, task, off=("screen",), bsz=8, mixed=True)
    gen8, got8, runs8 = _decode(model, task, bsz=8, mixed=True)
    assert gen8.screened.screened > 0
    rows = [r for r, _, _, _ in runs8.calls]
    assert max(rows) == gen8.screened.max_rows == 4 and min(rows) == 1
    assert any(r > 1 and s > 1 for r, _, s, _ in runs8.calls)  # several rows, several steps, one call
    # the statistics line counts them
    assert (gen8.stats.screened, gen8.stats.uncertified) == (gen8.screened.screened, gen8.screened.uncertified)
    assert f"greedy steps screened {gen8.screened.screened}, not certified" in gen8.stats.summary()
    assert_identical(plain8, got8, atol=0)


def test_the_backend_screens_strict_native_steps_only(toy):
    model, task = toy
    d = task.target_dictionary
    assert resolve_backend("auto", model, StrictAcceptance()).screen
    assert not resolve_backend("auto", model, StrictAcceptance(), off=frozenset({"screen"})).screen
    assert not resolve_backend("auto", model, StrictAcceptance(), off=frozenset({"accept"})).screen
    assert not resolve_backend("reference", model, StrictAcceptance()).screen
    assert not resolve_backend("auto", model, TopBetaAcceptance(3, 1.0)).screen
    assert H.make_generator(model, NoDrafter(), d, 4, unk_penalty=-3.0).screened is None


class _AlternateRows(RowsRule):
    """Greedy and drafting iterations in turn (greedy first, per batch size
    as the loop asks), recording what the loop reports: its
    :meth:`observe` and :meth:`charge` calls."""

    def __init__(self):
        self.drafting = True
        self.observed, self.charged = [], []

    def drafts_at(self, rows, batch):
        self.drafting = not self.drafting
        return self.drafting

    def observe(self, rows, batch, drafted, tokens, seconds):
        self.observed.append((rows, drafted, seconds))

    def charge(self, rows, batch, drafted, seconds):
        self.charged.append((rows, drafted, seconds))


def test_the_loop_charges_settled_scores_to_the_greedy_iterations_not_to_the_one_they_ran_in(tied):
    """Scores deferred by screened steps and settled later, at a sentence's
    end or before a drafting iteration's pass (the tied model refuses picks
    in mid-sentence, so greedy runs stop early), are reported to the draft
    policy as greedy work (``charge``) and left out of the timing of the
    iteration they ran in: with each settle slowed by a sleep, no iteration
    is timed that long, and the charges add up to every sleep."""
    model, task = tied
    sleep = 0.05
    gen = H.make_generator(model, H.reference_drafter({}, filler=task.target_dictionary.nspecial),
                           task.target_dictionary, 3)
    assert gen.screened is not None
    rule = gen.policy.rows = _AlternateRows()
    settles = {"drafting": 0, "greedy": 0}
    real = type(gen.screened)._settle

    def slow(screened, state, deferred):
        settles["drafting" if rule.drafting else "greedy"] += 1
        time.sleep(sleep)
        return real(screened, state, deferred)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(type(gen.screened), "_settle", slow)
        run_generator(gen, model, H.batches(task, "test", 1)[:12])
    assert settles["drafting"] > 0 and settles["greedy"] > 0, settles  # both places were exercised
    assert all(not drafted for _, drafted, _ in rule.charged)
    assert sum(s for _, _, s in rule.charged) >= sleep * sum(settles.values())
    slowest = max(s for _, _, s in rule.observed)
    assert slowest < sleep, f"an iteration was timed with a settle in it: {slowest:.3f} s"
