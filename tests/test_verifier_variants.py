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


@pytest.fixture(scope="module")
def learned_pos(toy_bin):
    """An untrained verifier with learned positions and a short length limit, and its beam-1 outputs."""
    model, task = untrained(toy_bin, "--decoder-learned-pos", "--encoder-learned-pos", *SHORT_POSITIONS)
    opts = dict(max_len_a=0, max_len_b=200, min_len=1)
    refs = {}
    for bsz in (1, 8):
        refs[bsz] = H.run_generator(H.seq_gen(model, task.target_dictionary, opts), model, H.batches(task, "test", bsz))
    return model, task, refs


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
