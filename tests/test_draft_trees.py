"""Draft trees: several continuations verified in one pass.

* a tree's depths, ancestors and root paths are those of its parent indices
  (hand-made trees);
* the tree builders keep the most probable prefixes (parallel candidates)
  and merge paths in a trie (host paths);
* strict decoding with trees equals fairseq's ``--beam 1`` on both backends,
  at batch 1 and in ragged batches, whichever branch holds the right
  continuation (first, middle or last sibling, or none), with pad nodes, and
  under fairseq's length and score options; the right branch is found (every
  reference token accepted when a branch holds it);
* after a tree pass the verify pass's cache holds the accepted path's
  entries only: the next pass reads what a chain of that path would have
  left;
* relaxed verification walks the tree with the same rule per node.
"""
import json
import random

import pytest
import torch

import specdec_helpers as H
from specdec_helpers import OPTION_SETS, assert_identical, run_generator
import fairseq_specdec  # noqa: F401
from fairseq_specdec.generation import SpecDecStats, TopBetaAcceptance
from fairseq_specdec.generation.drafters import Drafter, TreeDrafter
from fairseq_specdec.generation.lean_verifier import LeanVerifier
from fairseq_specdec.generation.verifier import CachedVerifier
from fairseq_specdec.generation.tree import DraftTree, chain_tree, tree_from_candidates, tree_from_paths
from fairseq_specdec.kernels import rowgemm


# ---------------------------------------------------------------- the tree's derived views
def hand_tree():
    """Slots: 0 root; 1, 2 children of the root; 3 child of 1; 4 child of 3; 5 child of 2."""
    parents = torch.tensor([[-1, 0, 0, 1, 3, 2]])
    return DraftTree(torch.tensor([[10, 11, 12, 13, 14]]), parents)


def test_depths_ancestors_and_paths_of_a_hand_made_tree():
    tree = hand_tree()
    assert tree.depths.tolist() == [[0, 1, 1, 2, 3, 2]]
    anc = tree.ancestors[0].int().tolist()
    assert anc[4] == [1, 1, 0, 1, 1, 0]  # root, 1, 3, itself
    assert anc[5] == [1, 0, 1, 0, 0, 1]  # root, 2, itself
    assert anc[2] == [1, 0, 1, 0, 0, 0]
    assert tree.max_depth == 3
    assert tree.paths[0, 4].tolist() == [0, 1, 3, 4]
    assert tree.paths[0, 5].tolist() == [0, 2, 5, 5]  # itself past its depth
    assert tree.paths[0, 0].tolist() == [0, 0, 0, 0]
    assert not tree.is_chain()
    assert chain_tree(torch.tensor([[5, 6, 7]])).is_chain()
    assert chain_tree(torch.tensor([[5, 6, 7]])).depths.tolist() == [[0, 1, 2, 3]]


def test_tree_from_candidates_keeps_the_most_probable_prefixes():
    # one row, 2 positions, 2 candidates each: p(a)=.6 p(b)=.3 at 1; p(c)=.5 p(d)=.4 at 2
    tokens = torch.tensor([[[1, 2], [3, 4]]])
    lprobs = torch.tensor([[[0.6, 0.3], [0.5, 0.4]]]).log()
    tree = tree_from_candidates(tokens, lprobs, nodes=4, pad=0)
    # prefixes by probability: a .6, ac .3, b .3, ad .24, bc .15, bd .12 -> a, b, ac, ad (ac and b tie at .3)
    got = set()
    for slot in range(1, tree.slots):
        path = tree.paths[0, slot][: int(tree.depths[0, slot]) + 1].tolist()
        seq = tuple(int(tree.tokens[0, s - 1]) for s in path[1:])
        got.add(seq)
    assert got == {(1,), (2,), (1, 3), (1, 4)}
    assert (tree.parents[0, 1:] < torch.arange(1, tree.slots)).all()


def node_set(tree, row=0, pad=None):
    """The token sequences of a tree's root paths (pad nodes left out)."""
    out = set()
    for s in range(1, tree.slots):
        if pad is not None and int(tree.tokens[row, s - 1]) == pad:
            continue
        path = tree.paths[row, s][: int(tree.depths[row, s]) + 1].tolist()
        out.add(tuple(int(tree.tokens[row, p - 1]) for p in path[1:]))
    return out


@pytest.mark.parametrize("seed", range(5))
def test_host_and_tensor_trees_from_candidates_agree(seed):
    """The host search (a CPU's) and the tensor operations (a GPU's) keep the same prefixes."""
    from fairseq_specdec.generation.tree import tree_from_candidate_tensors

    g = torch.Generator().manual_seed(seed)
    # distinct candidates at each position, as a top-k gives them
    tokens = torch.stack([torch.randperm(45, generator=g)[:3] + 5 for _ in range(12)]).view(3, 4, 3)
    lprobs = torch.randn(3, 4, 3, generator=g).sort(dim=-1, descending=True).values.log_softmax(-1)
    for nodes in (1, 4, 9):
        host = tree_from_candidates(tokens, lprobs, nodes, pad=0)
        tensors = tree_from_candidate_tensors(tokens, lprobs, nodes, pad=0)
        for row in range(3):
            assert node_set(host, row, 0) == node_set(tensors, row, 0)
            assert len(node_set(host, row, 0)) == nodes


def test_tree_from_candidates_never_drafts_pad():
    tokens = torch.tensor([[[0, 2], [3, 4]]])  # the best first candidate is pad
    lprobs = torch.tensor([[[0.9, 0.05], [0.5, 0.4]]]).log()
    tree = tree_from_candidates(tokens, lprobs, nodes=3, pad=0)
    depth1 = [int(tree.tokens[0, s - 1]) for s in range(1, tree.slots) if int(tree.depths[0, s]) == 1]
    assert 2 in depth1
    for s in range(1, tree.slots):  # a pad node has nothing real under it
        if int(tree.tokens[0, s - 1]) == 0:
            assert all(int(tree.parents[0, c]) != s or int(tree.tokens[0, c - 1]) == 0 for c in range(1, tree.slots))


def test_tree_from_paths_merges_common_prefixes():
    rows = [[([5, 6, 7], 0.9), ([5, 8], 0.5), ([9], 0.4)], [([4], 0.3)]]
    tree = tree_from_paths(rows, nodes=4, pad=1, like=torch.zeros(1, dtype=torch.long))
    # row 0: 5 (.9), 6 (.9), 7 (.9), 8 (.5): the 4 best nodes; 9 (.4) is cut
    seqs = set()
    for s in range(1, tree.slots):
        if int(tree.tokens[0, s - 1]) == 1:
            continue
        path = tree.paths[0, s][: int(tree.depths[0, s]) + 1].tolist()
        seqs.add(tuple(int(tree.tokens[0, p - 1]) for p in path[1:]))
    assert seqs == {(5,), (5, 6), (5, 6, 7), (5, 8)}
    assert tree.tokens[1].tolist() == [4, 1, 1, 1]  # row 1: one node, then pad


# ---------------------------------------------------------------- a drafter of test trees
def reference_tree_drafter(refs, d, seed=0, decoys=2, check_accepted=True):
    """Drafts, per row, a tree whose branches are decoy tokens except one
    (at a random sibling position, or none at all) that continues with the
    row's reference output up to a random depth; a few nodes are pad.  With
    ``check_accepted`` (strict verification, trees of every path) it checks
    after each pass that the reference branch was accepted whole."""
    words = [d.index(w) for w in ("b0", "b1", "b2", "b3")]

    class ReferenceTreeDrafter(Drafter, TreeDrafter):

        def __init__(self):
            self.rng = random.Random(seed)
            self.ids = None
            self.right = 0  # reference tokens drafted inside the trees
            self.planted = []  # per row of the last tree: its reference branch's length
            self.checked = 0  # iterations whose reference branch was checked as accepted

        def describe(self):
            return "reference tree (a test's drafter)"

        def start_batch(self, state):
            self.ids = state.sample["id"].tolist()

        def propose(self, state, k):
            raise AssertionError("the loop asks trees of this drafter")

        def propose_tree(self, state, k, nodes):
            rows, self.planted = [], []
            for i, row in enumerate(state.rows):
                n = state.lengths_host[i]
                ref = refs[self.ids[row]][n : n + k]
                good = ref[: self.rng.randint(0, len(ref))] if self.rng.random() < 0.8 else []
                paths = []
                for j in range(decoys):
                    decoy = [self.rng.choice(words) for _ in range(self.rng.randint(1, k))]
                    if good and decoy[: len(good)] == good:
                        continue
                    paths.append((decoy, 0.5))
                if self.rng.random() < 0.2:
                    paths.append(([d.pad()], 0.5))
                if good:
                    paths.insert(self.rng.randint(0, len(paths)), (good, 0.5))
                    self.right += len(good)
                self.planted.append(len(good))
                rows.append(paths)
            tree = tree_from_paths(rows, nodes, d.pad(), state.tokens)
            assert tree.max_depth <= k
            return tree

        def update(self, state, feedback):
            if check_accepted and self.planted:
                for planted, accepted in zip(self.planted, feedback.accepted):
                    assert accepted >= planted, "a tree's branch of reference tokens was not accepted"
                    self.checked += planted > 0
            self.planted = []

        def reorder(self, order, order_host):
            pass

    return ReferenceTreeDrafter()


#: the backends' tree paths: the native one (fused C++ layers and strict
#: step), the lean pass's torch operations, fairseq's modules, the
#: static-shape pass (CUDA's, run eagerly)
TREE_BACKENDS = {
    "auto": dict(backend="auto"),
    "lean-torch": dict(backend="auto", off=("products", "layers", "encoder", "accept")),
    "static": dict(backend="auto", static="static"),
    "reference": dict(backend="reference"),
}


def tree_generator(model, drafter, d, backend, opts="default", k=4, nodes=24, acceptance=None, stats=None,
                   verifier=None):
    return H.make_generator(model, drafter, d, k, acceptance=acceptance, stats=stats, tree_nodes=nodes,
                            verifier=verifier, **TREE_BACKENDS[backend], **OPTION_SETS[opts])


@pytest.mark.slow  # the trained toy verifier
@pytest.mark.parametrize("backend", list(TREE_BACKENDS))
@pytest.mark.parametrize("opts", list(OPTION_SETS))
@pytest.mark.parametrize("bsz", [1, 3, 16])
def test_strict_tree_decoding_equals_beam1(verifier, beam1_reference, backend, opts, bsz):
    if backend in ("lean-torch", "static") and opts != "default":
        pytest.skip("fairseq's options are checked on the native and reference paths (the suite's time)")
    model, task = verifier
    d = task.target_dictionary
    ref = beam1_reference(opts, bsz)
    drafter = reference_tree_drafter(H.output_tokens(ref), d, seed=bsz)
    gen = tree_generator(model, drafter, d, backend, opts)
    got = run_generator(gen, model, H.batches(task, "test", bsz))
    assert_identical(ref, got)
    assert drafter.right > 0 and drafter.checked > 0


@pytest.mark.slow
@pytest.mark.parametrize("bsz", [1, 3])
@pytest.mark.parametrize("gemm", H.GEMMS)
def test_tree_passes_equal_fairseq_layers_pass_by_pass(verifier, beam1_reference, bsz, gemm):
    """Every tree pass of the lean pass (fused C++ layers under rowgemm) gives
    the log-probs and states of fairseq's own modules with the tree's mask."""
    H.skip_unless_gemm(gemm)
    model, task = verifier
    d = task.target_dictionary
    ref = beam1_reference("default", bsz)
    paired = H.PairedPass(LeanVerifier(model, gemm=gemm), CachedVerifier(model))
    drafter = reference_tree_drafter(H.output_tokens(ref), d, seed=5)
    gen = tree_generator(model, drafter, d, "auto", verifier=paired)
    assert_identical(ref, run_generator(gen, model, H.batches(task, "test", bsz)))
    assert paired.passes > 0 and paired.widest > 5


@pytest.mark.slow
@pytest.mark.parametrize("bsz", [1, 3])
def test_tree_passes_in_one_call_equal_the_stepwise_pass_bit_for_bit(verifier, beam1_reference, bsz):
    """A tree pass as one call of the extension (the draft's depths placing
    the position rows, its ancestors masking attention) gives exactly what
    the fused layers give called one by one."""
    from test_lean_verifier import StepwiseLeanVerifier

    H.skip_unless_gemm("rowgemm")
    model, task = verifier
    d = task.target_dictionary
    ref = beam1_reference("default", bsz)
    paired = H.BitwisePair(LeanVerifier(model, gemm="rowgemm"), StepwiseLeanVerifier(model, gemm="rowgemm"))
    drafter = reference_tree_drafter(H.output_tokens(ref), d, seed=5)
    gen = tree_generator(model, drafter, d, "auto", verifier=paired)
    assert_identical(ref, run_generator(gen, model, H.batches(task, "test", bsz)))
    assert paired.main.whole_pass is not None
    assert paired.passes > 0 and paired.widest > 5


@pytest.mark.slow
@pytest.mark.parametrize("backend", list(TREE_BACKENDS))
def test_tree_cache_holds_only_the_accepted_path(verifier, beam1_reference, backend):
    """Poison every cache entry past each row's committed length after each
    rollback: the output stays --beam 1's, so nothing of a rejected branch
    (or of an accepted node's old slot) is read again."""
    model, task = verifier
    d = task.target_dictionary
    ref = beam1_reference("default", 3)
    drafter = reference_tree_drafter(H.output_tokens(ref), d, seed=7)
    gen = tree_generator(model, drafter, d, backend)
    verifier_pass = gen.verifier
    if not hasattr(verifier_pass, "keys"):
        pytest.skip("fairseq's modules keep no scratch past a row's entries")
    real = verifier_pass.rollback

    def poisoned(state, keep, keep_host, path=None):
        real(state, keep, keep_host, path)
        for store in (verifier_pass.keys, verifier_pass.values):
            for t in store:
                for r, n in enumerate(state.lengths_host):
                    t[r, :, n + keep_host[r]:] = 1e4

    verifier_pass.rollback = poisoned
    got = run_generator(gen, model, H.batches(task, "test", 3))
    assert_identical(ref, got)


@pytest.mark.slow
@pytest.mark.parametrize("backend", list(TREE_BACKENDS))
def test_relaxed_tree_with_zero_tolerance_is_strict(verifier, beam1_reference, backend):
    """Top-beta with tau 0 accepts exactly the greedy tokens: walked over a
    tree (natively on the auto backend, by tensor operations elsewhere) it
    gives --beam 1."""
    model, task = verifier
    d = task.target_dictionary
    ref = beam1_reference("default", 3)
    drafter = reference_tree_drafter(H.output_tokens(ref), d, seed=11, check_accepted=False)
    gen = tree_generator(model, drafter, d, backend, acceptance=TopBetaAcceptance(5, 0.0))
    assert gen.step.native == (backend == "auto")
    assert_identical(ref, run_generator(gen, model, H.batches(task, "test", 3)))


@pytest.mark.slow
@pytest.mark.parametrize("bsz", [1, 3])
def test_relaxed_trees_natively_and_by_tensor_operations_agree(verifier, bsz):
    """The native step's top-beta walk over a tree gives the tensor
    operations' output, token for token and score for score."""
    model, task = verifier
    d = task.target_dictionary
    ref = H.output_tokens(run_generator(H.seq_gen(model, d, OPTION_SETS["default"]), model,
                                        H.batches(task, "test", bsz)))
    got = {}
    for name, off in (("native", ()), ("tensors", ("accept",))):
        drafter = reference_tree_drafter(ref, d, seed=13, decoys=3, check_accepted=False)
        gen = H.make_generator(model, drafter, d, 4, acceptance=TopBetaAcceptance(3, 1.0), tree_nodes=24, off=off,
                               **OPTION_SETS["default"])
        assert gen.step.native == (name == "native")
        got[name] = run_generator(gen, model, H.batches(task, "test", bsz))
    assert_identical(got["tensors"], got["native"], atol=0)


@pytest.mark.slow
def test_relaxed_tree_accepts_more_than_strict(verifier, beam1_reference, tmp_path):
    model, task = verifier
    d = task.target_dictionary
    ref = beam1_reference("default", 1)
    counts = {}
    for name, rule in (("strict", None), ("relaxed", TopBetaAcceptance(5, 10.0))):
        drafter = reference_tree_drafter(H.output_tokens(ref), d, seed=3, decoys=3, check_accepted=False)
        path = tmp_path / f"{name}.jsonl"
        gen = tree_generator(model, drafter, d, "auto", acceptance=rule, stats=SpecDecStats(str(path)))
        run_generator(gen, model, H.batches(task, "test", 1))
        stats = H.read_stats(path).values()
        counts[name] = sum(s["length"] for s in stats) / sum(len(s["accepted"]) for s in stats)
    assert counts["relaxed"] > counts["strict"]


def test_a_chain_drafter_refuses_trees(verifier_untrained):
    model, d = verifier_untrained
    from fairseq_specdec.generation import NoDrafter

    with pytest.raises(ValueError, match="--draft-tree 4: the drafter .* drafts chains only"):
        H.make_generator(model, NoDrafter(), d, 4, tree_nodes=4)
    with pytest.raises(ValueError, match="--adaptive-draft"):
        from fairseq_specdec.generation import DraftLengthPolicy

        H.make_generator(model, reference_tree_drafter({}, d), d, 4, tree_nodes=4,
                         draft_policy=DraftLengthPolicy(4, adaptive=True))


@pytest.fixture(scope="module")
def verifier_untrained(toy_bin):
    from test_lean_verifier import untrained_transformer

    model, task = untrained_transformer(toy_bin)
    return model, task.target_dictionary


# ---------------------------------------------------------------- every tree drafter, through fairseq-generate
def tok_of(out):
    import re

    return float(re.search(r"Tok\. ([0-9.]+)", out).group(1))


@pytest.fixture(scope="module")
def beam1_cli(ar_checkpoint, stock_beam1):
    """fairseq-generate --beam 1's hypotheses of a verifier (default: the
    toy Transformer) at a batch size."""
    return lambda bsz, path=ar_checkpoint: stock_beam1(path, batch_size=bsz)


@pytest.mark.slow
@pytest.mark.parametrize("backend", list(H.BACKEND_ARGS))
@pytest.mark.parametrize("bsz", [1, 16])
@pytest.mark.parametrize("decoding", ["draft-verify", "ngram", "ngram+draft-verify", "blockwise"])
def test_every_tree_drafter_is_exact_through_fairseq_generate(toy_bin, ar_checkpoint, vsd_checkpoint,
                                                             blockwise_checkpoint, beam1_cli, decoding, bsz, backend):
    if backend == "reference" and bsz == 1:
        pytest.skip("the reference backend's rows one at a time are checked at batch 16 (the suite's time)")
    path = blockwise_checkpoint if decoding == "blockwise" else ar_checkpoint
    extra = ["--drafter-path", vsd_checkpoint] if "draft-verify" in decoding else []
    if "ngram" in decoding:  # the toy corpus's continuations are seldom confident: draft them anyway
        extra += ["--ngram-min-confidence", "0"]
    ref = beam1_cli(bsz, path)  # the blockwise heads' own verifier: its own --beam 1
    proc = H.generate(toy_bin, path, "--decoding", decoding, "--draft-tree", "6", "--draft-max-rows", "0", *extra,
                      *H.BACKEND_ARGS[backend], task="draft_verify", batch_size=bsz)
    H.assert_same_hypotheses(ref, H.parse_generate(proc.stdout))
    out = proc.stdout + proc.stderr
    assert "draft trees of 6 nodes" in out
    assert tok_of(out) > 1.1, out[-2000:]  # drafts are accepted


@pytest.mark.slow
def test_combined_decoding_drafts_trees_by_default_and_refuses_chains(toy_bin, ar_checkpoint, vsd_checkpoint,
                                                                     nat_checkpoint, beam1_cli):
    proc = H.generate(toy_bin, ar_checkpoint, "--decoding", "ngram+draft-verify", "--drafter-path", vsd_checkpoint,
                      task="draft_verify", batch_size=1)
    H.assert_same_hypotheses(beam1_cli(1), H.parse_generate(proc.stdout))
    assert "draft trees of 5 nodes" in proc.stdout + proc.stderr
    for extra, message in ((["--drafter-path", vsd_checkpoint, "--draft-tree", "0"], "drafts trees only: give --draft-tree N"),
                           (["--drafter-path", nat_checkpoint], "drafts chains only: give a specdec_vsd drafter")):
        proc = H.generate(toy_bin, ar_checkpoint, "--decoding", "ngram+draft-verify", *extra, task="draft_verify",
                          check=False)
        assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-2000:]


@pytest.mark.slow
def test_a_chain_decoding_refuses_draft_trees_by_name(toy_bin, ar_checkpoint, nat_checkpoint):
    proc = H.generate(toy_bin, ar_checkpoint, "--decoding", "draft-verify", "--drafter-path", nat_checkpoint,
                      "--draft-tree", "4", task="draft_verify", check=False)
    assert proc.returncode != 0
    assert "--draft-tree 4" in proc.stderr and "drafts chains only" in proc.stderr


def test_chain_as_tree_script_times_both_forms(ar_checkpoint, toy_bin, tmp_path):
    """scripts/chain-as-tree.py (the figures in docs/architecture.md) names
    the machine and times each acceptance step on the chain and on the same
    chain as a plain tree; the two forms give the same result first."""
    out = tmp_path / "chain.json"
    proc = H.run([H.cli("python"), H.ROOT / "scripts" / "chain-as-tree.py", "--path", ar_checkpoint, "--data", toy_bin,
                  "--drafts", "4", "--calls", "3", "--json", out])
    assert "CPU: " in proc.stdout and "plugin products: " in proc.stdout
    figures = json.loads(out.read_text())
    assert figures["drafts"] == 4
    steps = ["tensor"] + (["native"] if rowgemm.strict_step_unavailable_reason() is None else [])
    for step in steps:
        assert figures[step]["chain_us"] > 0 and figures[step]["as_tree_us"] > 0
        assert f"{step:6s} acceptance step: chain" in proc.stdout


@pytest.mark.parametrize("rule", ["strict", "relaxed"])
@pytest.mark.parametrize("bsz,k", [(1, 1), (1, 6), (5, 4)])
def test_a_chain_steps_as_the_same_chain_as_a_tree(toy_bin, rule, bsz, k):
    """A ChainTree's cheaper forms (slices, a running sum, the accepted count
    as a product) give what the tree forms give for the same chain handed
    over as a plain DraftTree, on both acceptance steps: tokens, log-probs,
    running scores and counts, bitwise; drafts planted to be accepted for a
    random number of slots, pads in some rows."""
    from fairseq_specdec.generation.accept_step import FairseqRules, NativeStep, TensorStep, native_step_unavailable
    from fairseq_specdec.generation.acceptance import StrictAcceptance

    vocab = 40
    rules = FairseqRules(pad=1, unk=3, eos=2, vocab_size=vocab, min_len=2)
    acceptance = StrictAcceptance() if rule == "strict" else TopBetaAcceptance(3, 1.0)
    steps = [TensorStep(acceptance, rules)]
    if native_step_unavailable(acceptance, 0.0) is None:
        steps.append(NativeStep(TensorStep(acceptance, rules)))
    g = torch.Generator().manual_seed(bsz * 10 + k)
    for trial in range(6):
        logits = torch.randn(bsz, k + 1, vocab, generator=g) * 3
        drafts = torch.randint(4, vocab, (bsz, k), generator=g)
        for r in range(bsz):
            right = int(torch.randint(0, k + 1, (1,), generator=g))
            for j in range(right):  # make draft j the greedy pick at its slot
                logits[r, j, drafts[r, j]] = logits[r, j].max() + 5
            if trial % 2 and r % 2:
                drafts[r, right:] = rules.pad
        lprobs = torch.log_softmax(logits, -1)
        lengths = torch.randint(0, 6, (bsz,), generator=g)
        last = torch.full((bsz, 1), 2)
        state = type("S", (), dict(lengths=lengths, lengths_host=lengths.tolist(), cum=-torch.rand(bsz, generator=g),
                                   size=bsz, last_tokens=staticmethod(lambda: last)))()
        chain = chain_tree(drafts)
        tree = DraftTree(drafts, chain.parents.clone())
        for step in steps:
            a = step(state, lprobs.clone(), chain, None, 12, True)
            b = step(state, lprobs.clone(), tree, None, 12, True)
            assert a.path is None and b.path is not None
            assert a.n_new.tolist() == b.n_new.tolist() and torch.equal(a.cum, b.cum)
            assert a.counts[:3].tolist() == b.counts[:3].tolist()
            for r, n in enumerate(a.n_new.tolist()):
                assert a.new_tokens[r, :n].tolist() == b.new_tokens[r, :n].tolist()
                assert torch.equal(a.new_lprobs[r, :n], b.new_lprobs[r, :n])
                assert b.path[r, : a.counts[2, r] + 1].tolist() == list(range(a.counts[2, r] + 1))


class RecordingPass:
    """A verify pass seen through a proxy that records every member the loop
    reads or writes on it."""

    def __init__(self, inner):
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "touched", set())

    def __getattr__(self, name):
        self.touched.add(name)
        return getattr(self._inner, name)

    def __setattr__(self, name, value):
        self.touched.add(name)
        setattr(self._inner, name, value)


@pytest.mark.slow
@pytest.mark.parametrize("drafts", ["chains", "trees"])
def test_the_loop_touches_only_what_the_verify_pass_declares(verifier, beam1_reference, drafts):
    """The loop, its iteration and the decoding state use no member of the
    verify pass that :class:`VerifyPass` does not declare (its methods and
    the attributes its ``__init__`` sets)."""
    from fairseq_specdec.generation.verify_pass import VerifyPass

    model, task = verifier
    d = task.target_dictionary
    ref = beam1_reference("default", 3)
    recording = RecordingPass(LeanVerifier(model))
    if drafts == "trees":
        gen = tree_generator(model, reference_tree_drafter(H.output_tokens(ref), d, seed=3), d, "auto",
                             verifier=recording)
    else:
        gen = H.make_generator(model, H.partly_right(ref, d), d, 4, verifier=recording, **OPTION_SETS["default"])
    assert_identical(ref, run_generator(gen, model, H.batches(task, "test", 3)))
    bare = type("Bare", (VerifyPass,), {name: lambda *args, **kwargs: None for name in VerifyPass.__abstractmethods__})
    declared = set(dir(VerifyPass)) | set(vars(bare(model)))
    assert {"forward", "rollback", "reorder"} <= recording.touched
    assert recording.touched <= declared, sorted(recording.touched - declared)
