"""The lean verify pass (``--specdec-backend auto``'s, where it applies)
computes the function fairseq's own layer modules compute.

* pass by pass, on ragged batches, its log-probs and final states equal those
  of :class:`CachedVerifier` (fairseq's modules) within float rounding, and
  the strict output equals fairseq's ``--beam 1``;
* the cache positions past a row's prefix (scratch) never reach the output,
  whatever they hold;
* with the native products each ReLU layer runs as one call of the C++
  extension (the fused layer), checked the same way;
* pre-norm and GELU decoders are computed too; decoders it cannot compute
  (NormFormer) fall back to fairseq's modules, and the log says why;
* where every layer is fused, the whole pass runs as one call of the
  extension (``rowgemm.DecoderPass``) and gives bit for bit what the same
  pass gives step by step from Python; a decoder whose pass holds more
  (an embedding layer norm, its own normalization) runs step by step;
* ``--specdec-backend`` reaches the generator fairseq-generate builds.
"""

import pytest
import torch

import specdec_helpers as H
from specdec_helpers import OPTION_SETS, assert_identical, partly_right, run_generator, seq_gen, strict_generator
import fairseq_specdec  # noqa: F401
from fairseq_specdec.generation import NATBlockDrafter, SpeculativeGenerator, StrictAcceptance
from fairseq_specdec.generation.lean_verifier import LeanVerifier, lean_unsupported_reason
from fairseq_specdec.generation.verifier import CachedVerifier
from fairseq_specdec.generation import resolve_backend


class PairedVerifier(H.PairedPass):
    """The lean pass (followed by the loop) and fairseq's layers on the same state."""

    def __init__(self, model, gemm="auto"):
        super().__init__(LeanVerifier(model, gemm=gemm), CachedVerifier(model))

    @property
    def lean(self):
        return self.main


class StepwiseLeanVerifier(LeanVerifier):
    """The lean pass with its fused layers called one by one from Python
    (the whole pass in one call switched off)."""

    def start(self):
        super().start()
        self.whole_pass = None


class ScratchPoisoningVerifier(LeanVerifier):
    """Fills every cache position past each row's prefix with large finite
    garbage after each commit: the invariant says nothing reads it."""

    def rollback(self, state, keep, keep_host, path=None):
        super().rollback(state, keep, keep_host, path)
        new_lengths = [n + k for n, k in zip(state.lengths_host, keep_host)]
        for store in (self.keys, self.values):
            for t in store:
                for r, n in enumerate(new_lengths):
                    t[r, :, n:] = torch.empty_like(t[r, :, n:]).uniform_(-1e4, 1e4)


@pytest.mark.slow  # needs the trained toy verifier
@pytest.mark.parametrize("gemm", H.GEMMS)
@pytest.mark.parametrize("opts", ["default", "max_len_3", "lenpen_unkpen_temp"])
@pytest.mark.parametrize("bsz", [1, 3, 16])
def test_lean_pass_equals_fairseq_layers_pass_by_pass(verifier, beam1_reference, tiny_drafter, opts, bsz, gemm):
    model, task = verifier
    d = task.target_dictionary
    ref = beam1_reference(opts, bsz)
    H.skip_unless_gemm(gemm)
    paired = PairedVerifier(model, gemm)
    assert paired.lean.gemm == gemm
    # under rowgemm each layer is one call of the C++ extension (attention,
    # norms and residuals included): compared pass by pass here
    assert paired.lean.fused == (gemm == "rowgemm")
    paired.lean.temperature = paired.ref.temperature = OPTION_SETS[opts].get("temperature", 1.0)
    drafter = partly_right(ref, d)
    got = run_generator(strict_generator(model, drafter, d, paired, opts=opts), model, H.batches(task, "test", bsz))
    assert_identical(ref, got)
    assert paired.passes > 0
    if bsz > 1 and opts == "default":
        assert paired.ragged_passes > 0  # the row-indexed cache writes were exercised


@pytest.mark.slow
@pytest.mark.parametrize("isa", H.ISAS)
@pytest.mark.parametrize("opts", ["default", "max_len_3"])
def test_native_pass_equals_fairseq_on_every_instruction_set(verifier, beam1_reference, tiny_drafter, opts, isa):
    """The check above with the native products on each instruction set the
    CPU runs (AVX-512 where it has AVX-512F; its emulation on AVX2
    everywhere): each pass equals fairseq's layers within rounding, and the
    strict output equals ``--beam 1``."""
    model, task = verifier
    d = task.target_dictionary
    ref = beam1_reference(opts, 16)
    H.skip_unless_gemm("rowgemm")
    with H.products_isa(isa):
        paired = PairedVerifier(model, "rowgemm")
        assert paired.lean.fused
        drafter = partly_right(ref, d)
        got = run_generator(strict_generator(model, drafter, d, paired, opts=opts), model, H.batches(task, "test", 16))
    assert_identical(ref, got)
    assert paired.passes > 0


@pytest.mark.slow
@pytest.mark.parametrize("gemm", H.GEMMS)
@pytest.mark.parametrize("bsz", [1, 16])
def test_scratch_cache_positions_never_reach_the_output(verifier, beam1_reference, bsz, gemm):
    H.skip_unless_gemm(gemm)
    model, task = verifier
    d = task.target_dictionary
    ref = beam1_reference("default", bsz)
    drafter = partly_right(ref, d)
    clean = run_generator(strict_generator(model, drafter, d, LeanVerifier(model, gemm=gemm)), model, H.batches(task, "test", bsz))
    poisoned = run_generator(
        strict_generator(model, drafter, d, ScratchPoisoningVerifier(model, gemm=gemm)), model, H.batches(task, "test", bsz)
    )
    assert_identical(clean, poisoned, atol=0)
    assert_identical(ref, poisoned)


def untrained_transformer(toy_bin, *extra):
    """An untrained tiny Transformer (random weights) with the given options."""
    from fairseq import tasks

    _, cfg = H.train_args_namespace(
        toy_bin, "--task", "translation", *H.AR_ARCH_ARGS, "--dropout", "0.0", "--cpu", *extra
    )
    task = tasks.setup_task(cfg.task)
    torch.manual_seed(3)
    model = task.build_model(cfg.model).eval()
    task.load_dataset("test")
    return model, task


@pytest.mark.parametrize("extra", [
    ("--decoder-normalize-before", "--encoder-normalize-before"),
    ("--activation-fn", "gelu"),
])
@pytest.mark.parametrize("gemm", H.GEMMS)
def test_pre_norm_and_gelu_decoders(toy_bin, tiny_drafter, extra, gemm):
    H.skip_unless_gemm(gemm)
    model, task = untrained_transformer(toy_bin, *extra)
    assert lean_unsupported_reason(model.decoder) is None
    d = task.target_dictionary
    for bsz in (1, 5):
        paired = PairedVerifier(model, gemm)
        # the fused C++ layer covers ReLU layers, pre- or post-norm; GELU runs as operations
        assert paired.lean.fused == (gemm == "rowgemm" and "gelu" not in extra)
        gen = H.make_generator(model, NATBlockDrafter(tiny_drafter[0]), d, 3, verifier=paired, max_len_a=0, max_len_b=12)
        ref = run_generator(seq_gen(model, d, dict(max_len_a=0, max_len_b=12, min_len=1)), model, H.batches(task, "test", bsz))
        assert_identical(ref, run_generator(gen, model, H.batches(task, "test", bsz)))
        assert paired.passes > 0
        assert paired.widest > 1  # drafts were verified, not only one-token steps


def test_normformer_falls_back_to_fairseqs_modules_and_says_why(toy_bin):
    model, _ = untrained_transformer(toy_bin)
    # what a NormFormer decoder layer (fairseq's scale_attn) carries
    model.decoder.layers[1].attn_ln = torch.nn.LayerNorm(model.decoder.embed_dim)
    reason = lean_unsupported_reason(model.decoder)
    assert reason is not None and "NormFormer" in reason
    backend = resolve_backend("auto", model, StrictAcceptance())
    assert type(backend.verifier) is CachedVerifier
    assert "the lean pass does not run this verifier" in backend.describe() and "NormFormer" in backend.describe()
    with pytest.raises(ValueError, match="the lean verify pass cannot run this verifier: .*NormFormer"):
        LeanVerifier(model)
    with pytest.raises(ValueError, match="the lean pass's products must be one of"):
        LeanVerifier(untrained_transformer(toy_bin)[0], gemm="mkl")


@pytest.mark.slow
def test_backend_reaches_the_generator(ar_checkpoint, random_drafter_checkpoint, toy_bin):
    """fairseq-generate's --specdec-backend builds the verify pass it names,
    and the parts the task's services switch off (the benchmark's
    FAIRSEQ_SPECDEC_OFF) the pieces they name."""
    from fairseq import checkpoint_utils, tasks

    kinds = {}
    for backend, off in (("auto", ""), ("reference", ""), ("auto", "products"), ("auto", "encoder"), ("auto", "layers")):
        if off and not H.gemm_available("rowgemm"):
            continue
        argv = ["--task", "draft_verify", "--path", ar_checkpoint, "--decoding", "draft-verify",
                "--drafter-path", random_drafter_checkpoint, "--beam", "1", "--specdec-backend", backend]
        cfg = H.generation_cfg(toy_bin, *argv)
        task = tasks.setup_task(cfg.task)
        models, _ = checkpoint_utils.load_model_ensemble([ar_checkpoint], task=task)
        task.generation_services.parts_off = frozenset([off] if off else [])
        gen = task.build_generator(models, cfg.generation)
        kinds[(backend, off)] = gen.verifier.describe()
    # the toy verifier's layers are ReLU layers: natively each runs as one
    # fused call, its encoder's too (tests/test_lean_encoder.py)
    native = "lean (rowgemm products, fused C++ layers, fused C++ encoder)"
    default = native if H.gemm_available("rowgemm") else "lean (torch products)"
    want = {("auto", ""): default, ("reference", ""): "fairseq", ("auto", "products"): "lean (torch products)",
            ("auto", "encoder"): native.replace(", fused C++ encoder", ""),
            ("auto", "layers"): native.replace(", fused C++ layers", "")}
    assert kinds == {k: v for k, v in want.items() if k in kinds}


@pytest.mark.slow
@pytest.mark.parametrize("opts", ["default", "lenpen_unkpen_temp"])
@pytest.mark.parametrize("bsz", [1, 16])
def test_whole_pass_in_one_call_is_the_stepwise_pass_bit_for_bit(verifier, beam1_reference, opts, bsz):
    """On ragged batches of drafted chains, with a temperature too: every pass
    of the one-call pass equals the stepwise one exactly, and the strict
    output equals ``--beam 1``."""
    H.skip_unless_gemm("rowgemm")
    model, task = verifier
    d = task.target_dictionary
    ref = beam1_reference(opts, bsz)
    paired = H.BitwisePair(LeanVerifier(model, gemm="rowgemm"), StepwiseLeanVerifier(model, gemm="rowgemm"))
    paired.main.temperature = paired.ref.temperature = OPTION_SETS[opts].get("temperature", 1.0)
    got = run_generator(strict_generator(model, partly_right(ref, d), d, paired, opts=opts), model,
                        H.batches(task, "test", bsz))
    assert_identical(ref, got)
    assert paired.main.whole_pass is not None and paired.ref.whole_pass is None
    assert paired.passes > 0 and paired.widest > 1
    if bsz > 1:
        assert paired.ragged_passes > 0


@pytest.mark.parametrize("extra", [(), ("--decoder-normalize-before", "--encoder-normalize-before")])
def test_whole_pass_with_and_without_a_final_layer_norm(toy_bin, tiny_drafter, extra):
    """Post-norm (no final norm) and pre-norm (a final LayerNorm) decoders,
    drafts verified in chains: bit for bit the stepwise pass."""
    H.skip_unless_gemm("rowgemm")
    model, task = untrained_transformer(toy_bin, *extra)
    assert (model.decoder.layer_norm is not None) == bool(extra)
    d = task.target_dictionary
    for bsz in (1, 5):
        paired = H.BitwisePair(LeanVerifier(model, gemm="rowgemm"), StepwiseLeanVerifier(model, gemm="rowgemm"))
        gen = H.make_generator(model, NATBlockDrafter(tiny_drafter[0]), d, 3, verifier=paired, max_len_a=0, max_len_b=12)
        ref = run_generator(seq_gen(model, d, dict(max_len_a=0, max_len_b=12, min_len=1)), model, H.batches(task, "test", bsz))
        assert_identical(ref, run_generator(gen, model, H.batches(task, "test", bsz)))
        assert paired.main.whole_pass is not None
        assert paired.passes > 0 and paired.widest > 1


def test_a_pass_holding_more_runs_step_by_step(toy_bin):
    """An embedding layer norm, or a model normalizing its own way, is not in
    the one-call pass: the layers still run fused, one call each."""
    H.skip_unless_gemm("rowgemm")
    model, _ = untrained_transformer(toy_bin)
    plain = LeanVerifier(model, gemm="rowgemm")
    plain.start()
    assert plain.whole_pass is not None

    model, _ = untrained_transformer(toy_bin, "--layernorm-embedding")
    lean = LeanVerifier(model, gemm="rowgemm")
    lean.start()
    assert lean.fused and lean.whole_pass is None

    model, _ = untrained_transformer(toy_bin)

    class OwnNormalization(type(model)):
        def get_normalized_probs(self, net_output, log_probs, sample=None):
            return super().get_normalized_probs(net_output, log_probs, sample)

    model.__class__ = OwnNormalization
    lean = LeanVerifier(model, gemm="rowgemm")
    lean.start()
    assert lean.fused and lean.whole_pass is None


class AtenInputsLeanVerifier(LeanVerifier):
    """The one-call pass given its embedding table as a strided view of the
    same values: the extension then makes the inputs with ATen's operations
    instead of reading the table directly."""

    def start(self):
        super().start()
        whole = self.whole_pass
        if whole is not None:
            def strided(tokens, depths, starts, *, embed_weight, **kwargs):
                view = embed_weight.t().contiguous().t()
                assert not view.is_contiguous() and torch.equal(view, embed_weight)
                return whole(tokens, depths, starts, embed_weight=view, **kwargs)

            self.whole_pass = strided


@pytest.mark.parametrize("scale", [None, 5.3])
def test_whole_pass_inputs_read_directly_round_as_atens(toy_bin, tiny_drafter, scale):
    """The one-call pass reads a float32 embedding and position table
    directly: bit for bit the inputs of ATen's operations (the same pass
    given a strided table) and of the stepwise pass's Python, also with an
    embedding scale that is not a power of two."""
    H.skip_unless_gemm("rowgemm")
    model, task = untrained_transformer(toy_bin)
    if scale is not None:
        model.decoder.embed_scale = scale
    d = task.target_dictionary
    for other in (AtenInputsLeanVerifier, StepwiseLeanVerifier):
        for bsz in (1, 5):
            paired = H.BitwisePair(LeanVerifier(model, gemm="rowgemm"), other(model, gemm="rowgemm"))
            gen = H.make_generator(model, NATBlockDrafter(tiny_drafter[0]), d, 3, verifier=paired, max_len_a=0,
                                   max_len_b=12)
            run_generator(gen, model, H.batches(task, "test", bsz))
            assert paired.main.whole_pass is not None
            assert paired.passes > 0 and paired.widest > 1
