"""Stock fairseq Transformer verifiers of every shape decode as ``--beam 1`` does.

* fast: the position table every verify pass reads is fairseq's own, for a
  learned table (``--decoder-learned-pos``: ``max_positions + padding_idx +
  1`` rows) and a sinusoidal one; an untrained learned-position verifier
  whose outputs run to the length limit (so that every row of its table is
  read) decodes as fairseq's ``--beam 1`` through every verify pass;
* slow (the probe): tiny verifiers of several architectures, each trained by
  stock ``fairseq-train`` for a few dozen updates, decode with ``--decoding
  loop-greedy`` and ``--decoding ngram`` exactly as stock ``fairseq-generate
  --beam 1``, sentence by sentence, at batch 1 and 8, on every backend.
"""
import pytest
import torch

import specdec_helpers as H
import fairseq_specdec  # noqa: F401
from fairseq import tasks

#: small enough that an untrained verifier's outputs reach the length limit
#: (max_positions - 1 tokens) and read the whole position table
SHORT_POSITIONS = ["--max-target-positions", "24", "--max-source-positions", "24"]


def untrained(data, *extra):
    """(model, task): an untrained stock Transformer (the toy verifier's shape plus ``extra``)."""
    _, cfg = H.train_args_namespace(data, "--task", "translation", *H.AR_ARCH_ARGS, "--cpu", *extra)
    task = tasks.setup_task(cfg.task)
    torch.manual_seed(11)
    return task.build_model(cfg.model).eval(), task


def with_references(model, task, opts):
    """(model, task, {batch size: fairseq's beam-1 outputs}) on the test split."""
    refs = {}
    for bsz in (1, 8):
        refs[bsz] = H.run_generator(H.seq_gen(model, task.target_dictionary, opts), model, H.batches(task, "test", bsz))
    return model, task, refs


@pytest.fixture(scope="module")
def learned_pos(toy_bin):
    """An untrained verifier with learned positions and a short length limit, and its beam-1 outputs."""
    model, task = untrained(toy_bin, "--decoder-learned-pos", "--encoder-learned-pos", *SHORT_POSITIONS)
    return with_references(model, task, dict(max_len_a=0, max_len_b=200, min_len=1))


ADAPTIVE_OPTS = dict(max_len_a=0, max_len_b=30, min_len=1, temperature=0.7)


@pytest.fixture(scope="module")
def adaptive_softmax(toy_bin):
    """An untrained verifier with an adaptive softmax (its own embeddings:
    fairseq's adaptive softmax has its own output layer), decoded at
    temperature 0.7, and its beam-1 outputs."""
    arch = [a for a in H.AR_ARCH_ARGS if a != "--share-all-embeddings"]
    _, cfg = H.train_args_namespace(toy_bin, "--task", "translation", *arch, "--cpu",
                                    "--adaptive-softmax-cutoff", "10,30")
    task = tasks.setup_task(cfg.task)
    torch.manual_seed(12)
    model = task.build_model(cfg.model).eval()
    assert model.decoder.adaptive_softmax is not None
    return with_references(model, task, ADAPTIVE_OPTS)


@pytest.mark.parametrize("learned", [True, False], ids=["learned", "sinusoidal"])
def test_position_table_is_what_fairseq_adds(toy_bin, learned):
    """Row t of the table is what fairseq's decoder adds to the token at
    index t when it decodes step by step; one row per position the decoder
    accepts."""
    from fairseq_specdec.generation.verify_pass import position_table

    extra = ["--decoder-learned-pos"] if learned else []
    model, _ = untrained(toy_bin, *extra, *SHORT_POSITIONS)
    decoder = model.decoder
    table = position_table(decoder)
    n = decoder.max_positions()
    assert n == 24 and table.shape == (n, decoder.embed_dim)
    tokens = torch.full((1, n), decoder.dictionary.index("a1"), dtype=torch.long)
    with torch.no_grad():
        for t in range(n):
            stock = decoder.embed_positions(tokens[:, : t + 1], incremental_state={})[0, -1]
            assert torch.equal(table[t], stock), f"position {t}"


def strict(model, drafter, tgt_dict, verify_pass, opts):
    """A strict SpeculativeGenerator with ``opts`` whose verify pass is ``verify_pass``."""
    return H.make_generator(model, drafter, tgt_dict, 4, verifier=verify_pass, **opts)


def _verify_passes(model):
    """Every verify pass, built directly (the loop is the same for all)."""
    from fairseq_specdec.generation.lean_verifier import LeanVerifier
    from fairseq_specdec.generation.static_verifier import StaticVerifier
    from fairseq_specdec.generation.verifier import CachedVerifier

    passes = {
        "fairseq modules": CachedVerifier(model),
        "lean, torch products": LeanVerifier(model, gemm="torch"),
        "static shapes": StaticVerifier(model),
    }
    if H.gemm_available("rowgemm"):
        passes["lean, rowgemm products"] = LeanVerifier(model, gemm="rowgemm")
    return passes


@pytest.mark.parametrize("bsz", [1, 8])
def test_learned_positions_decode_as_beam1_through_every_verify_pass(learned_pos, bsz):
    """Drafts partly right (ragged rows) and outputs up to the length limit:
    every verify pass reads the learned table as fairseq does.  (The table
    used to be one row longer than the learned weight holds: building any
    speculative generator for such a verifier raised IndexError.)"""
    model, task, refs = learned_pos
    d = task.target_dictionary
    ref = refs[bsz]
    assert max(len(h["tokens"]) for h in ref.values()) == model.decoder.max_positions()  # the limit is reached
    for name, verify_pass in _verify_passes(model).items():
        gen = H.strict_generator(model, H.partly_right(ref, d), d, verify_pass)
        got = H.run_generator(gen, model, H.batches(task, "test", bsz))
        try:
            H.assert_identical(ref, got)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None


@pytest.mark.parametrize("bsz", [1, 8])
def test_adaptive_softmax_decodes_as_beam1_through_every_verify_pass(adaptive_softmax, bsz):
    """A verifier with an adaptive softmax (once refused): the verify pass
    hands its features to fairseq's own adaptive softmax, the temperature
    dividing them as fairseq's generator does; ragged rows exercise the
    passes that project only the slots read."""
    model, task, refs = adaptive_softmax
    d = task.target_dictionary
    for name, verify_pass in _verify_passes(model).items():
        verify_pass.temperature = ADAPTIVE_OPTS["temperature"]
        gen = strict(model, H.partly_right(refs[bsz], d), d, verify_pass, ADAPTIVE_OPTS)
        got = H.run_generator(gen, model, H.batches(task, "test", bsz))
        try:
            H.assert_identical(refs[bsz], got)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None


@pytest.mark.parametrize("backend", list(H.BACKEND_ARGS))
def test_output_dim_unlike_embed_decodes_as_beam1_without_a_per_pass_module(toy_bin, backend, monkeypatch):
    """``--decoder-output-dim`` unlike the embedding's adds the decoder's
    ``project_out_dim`` to every step: the auto backend computes it as its
    other products, laid out once (no call of the module per pass), and the
    output is fairseq's beam 1 on both backends."""
    arch = [a for a in H.AR_ARCH_ARGS if a != "--share-all-embeddings"]
    _, cfg = H.train_args_namespace(toy_bin, "--task", "translation", *arch, "--cpu", "--decoder-output-dim", "48")
    task = tasks.setup_task(cfg.task)
    torch.manual_seed(13)
    model = task.build_model(cfg.model).eval()
    assert model.decoder.project_out_dim is not None
    opts = dict(max_len_a=0, max_len_b=30, min_len=1)
    ref = H.run_generator(H.seq_gen(model, task.target_dictionary, opts), model, H.batches(task, "test", 8))
    calls = []
    original = model.decoder.project_out_dim.forward
    monkeypatch.setattr(model.decoder.project_out_dim, "forward", lambda x: calls.append(1) or original(x))
    cfg = H.generation_cfg(toy_bin, "--task", "draft_verify", "--beam", "1", "--decoding", "loop-greedy",
                           "--max-len-b", "30", *H.BACKEND_ARGS[backend])
    task = tasks.setup_task(cfg.task)
    gen = task.build_generator([model], cfg.generation)
    H.assert_identical(ref, H.run_generator(gen, model, H.batches(task, "test", 8)))
    if backend == "auto":
        assert calls == []
    else:
        assert calls  # fairseq's modules: the module itself


@pytest.mark.parametrize("backend", list(H.BACKEND_ARGS))
@pytest.mark.parametrize("decoding", ["loop-greedy", "ngram"])
def test_learned_positions_decode_as_beam1_on_every_backend(toy_bin, learned_pos, backend, decoding):
    """The generator fairseq-generate builds (task.build_generator), batch 8."""
    model, _, refs = learned_pos
    cfg = H.generation_cfg(toy_bin, "--task", "draft_verify", "--beam", "1", "--decoding", decoding,
                           *H.BACKEND_ARGS[backend])
    task = tasks.setup_task(cfg.task)
    gen = task.build_generator([model], cfg.generation)
    H.assert_identical(refs[8], H.run_generator(gen, model, H.batches(task, "test", 8)))


# ---------------------------------------------------------------- slow: the probe

#: the probe's base verifier: stock ``transformer``, tiny; each variant adds or replaces options
PROBE_BASE = [
    "--arch", "transformer", "--encoder-layers", "1", "--decoder-layers", "2",
    "--encoder-embed-dim", "32", "--decoder-embed-dim", "32",
    "--encoder-ffn-embed-dim", "64", "--decoder-ffn-embed-dim", "64",
    "--encoder-attention-heads", "2", "--decoder-attention-heads", "2",
]
SHARED = ["--share-all-embeddings"]
LABEL_SMOOTHED = ["--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1"]
#: variant -> its fairseq-train options beyond the base's (with or without
#: shared embeddings: an output dimension unlike the embedding's, and an
#: adaptive softmax, need the decoder's own; fairseq trains an adaptive
#: softmax with its own criterion only)
PROBE_VARIANTS = {
    "learned-positions": SHARED + LABEL_SMOOTHED + ["--encoder-learned-pos", "--decoder-learned-pos"],
    "pre-norm-gelu": SHARED + LABEL_SMOOTHED + [
        "--encoder-normalize-before", "--decoder-normalize-before", "--activation-fn", "gelu"],
    "output-dim-unlike-embed": LABEL_SMOOTHED + ["--decoder-output-dim", "24"],
    "layernorm-embedding-no-scale": SHARED + LABEL_SMOOTHED + ["--layernorm-embedding", "--no-scale-embedding"],
    "no-positions": SHARED + LABEL_SMOOTHED + ["--no-token-positional-embeddings"],
    "3-heads-odd-dims-1-layer": SHARED + LABEL_SMOOTHED + [
        "--encoder-embed-dim", "33", "--decoder-embed-dim", "33", "--encoder-attention-heads", "3",
        "--decoder-attention-heads", "3", "--encoder-ffn-embed-dim", "50", "--decoder-ffn-embed-dim", "50",
        "--decoder-layers", "1"],
    "adaptive-softmax": ["--adaptive-softmax-cutoff", "10,30", "--criterion", "adaptive_loss",
                         "--ddp-backend", "legacy_ddp"],
}
#: both decodings and fairseq's beam 1 stop at this length (an undertrained
#: verifier repeats a token until the limit: it bounds the probe's time)
PROBE_MAX_LEN = ["--max-len-b", "40"]


def probe_batches(task, bsz):
    """The probe's batches of the test split: every sentence at batch 8; at
    batch 1 every other sentence in fairseq's order (shortest first), which
    halves the probe's longest part and still spans every length."""
    batches = H.batches(task, "test", bsz)
    return batches if bsz > 1 else batches[::2]


def generator(data, model, *argv):
    """(task, generator) as fairseq-generate builds them from ``argv``."""
    cfg = H.generation_cfg(data, "--beam", "1", *PROBE_MAX_LEN, *argv)
    task = tasks.setup_task(cfg.task)
    return task, task.build_generator([model], cfg.generation)


@pytest.fixture(scope="module")
def probe_verifiers(toy_bin, tmp_path_factory):
    """``get(variant) -> (model, {batch size: {id: tokens}})``: each variant
    trained once by stock fairseq-train (no --user-dir; 100 updates, a few
    seconds), loaded by fairseq's loader, and its outputs of fairseq's own
    ``--beam 1`` generator (the one fairseq-generate builds for ``--task
    translation``) on the test split."""
    cache = {}

    def get(variant):
        if variant not in cache:
            save_dir = tmp_path_factory.mktemp(f"probe_{variant}")
            cmd = [
                H.cli("fairseq-train"), toy_bin, "--task", "translation", *PROBE_BASE, *PROBE_VARIANTS[variant],
                "--optimizer", "adam", "--lr", "5e-3", "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "20",
                "--max-tokens", "2048", "--dropout", "0.0", "--no-epoch-checkpoints", "--cpu", "--seed", "1",
                "--max-update", "100", "--disable-validation", *H.DATA_LOADING_ARGS, "--save-dir", save_dir,
            ]
            H.run(cmd)
            model, _ = H.load_model(save_dir / "checkpoint_last.pt", toy_bin)
            task, stock = generator(toy_bin, model, "--task", "translation")
            assert type(stock).__name__ == "SequenceGenerator"
            refs = {bsz: H.output_tokens(H.run_generator(stock, model, probe_batches(task, bsz))) for bsz in (1, 8)}
            cache[variant] = model, refs
        return cache[variant]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("backend", list(H.BACKEND_ARGS))
@pytest.mark.parametrize("variant", list(PROBE_VARIANTS))
def test_probe_every_architecture_decodes_as_stock_beam1(toy_bin, probe_verifiers, variant, backend):
    """``--decoding loop-greedy`` (passes of one token), ``--decoding ngram``
    (drafting from the train split, trees of 5 nodes in every row of the
    batch) and ``--decoding self-draft`` (the architecture's own int8 copy
    drafting chains)
    through the generator fairseq-generate builds, at batch 8 (every
    sentence) and 1 (every other one): every sentence's tokens are fairseq's
    ``--beam 1``'s.  (Scores
    may differ in the last digits: see docs/verify-kernels.md.)"""
    model, refs = probe_verifiers(variant)
    # ngram's draft trees too: every node at its depth's position, the tree mask, the cache's path moved
    tree = ("--draft-tree", "5", "--ngram-min-confidence", "0", "--draft-max-rows", "0")
    # the int8 copy of each architecture drafts (every row, no confidence cut)
    self_draft = ("--draft-max-rows", "0", "--draft-min-confidence", "0")
    for decoding, extra in (("loop-greedy", ()), ("ngram", tree), ("self-draft", self_draft)):
        task, gen = generator(toy_bin, model, "--task", "draft_verify", "--decoding", decoding, *extra,
                              *H.BACKEND_ARGS[backend])
        assert type(gen).__name__ == "SpeculativeGenerator"
        for bsz in (1, 8):
            got = H.output_tokens(H.run_generator(gen, model, probe_batches(task, bsz)))
            if extra:  # the trees (the copy's chains) were drafted and accepted from
                assert gen.stats.iterations < gen.stats.tokens, (variant, backend, bsz)
            n = H.SPLIT_SIZES["test"]
            assert sorted(got) == sorted(refs[bsz]) and len(got) == (n if bsz > 1 else (n + 1) // 2)
            for i in sorted(got):
                assert got[i] == refs[bsz][i], (
                    f"{variant}, {backend}, --decoding {decoding} {' '.join(extra)}, batch {bsz}, sentence {i}:\n"
                    f" beam 1: {refs[bsz][i]}\n got:    {got[i]}"
                )
