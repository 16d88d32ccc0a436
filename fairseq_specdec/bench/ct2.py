"""Optional CTranslate2 rows: the same verifier, converted to CTranslate2,
decoding the same sentences greedily.

``--rows ...,ct2`` adds the row "CTranslate2 greedy (float32)" (``ct2@bsN``),
``ct2-int8`` the row "CTranslate2 greedy (int8)" (weights quantized to int8
when the model is loaded).  They need the ``ctranslate2`` package, which is
not a dependency of the plugin (``pip install ctranslate2``, or the ``ct2``
extra); without it, asking for these rows is an error that names it.

The benchmark converts the verifier once per run into ``--out``/ct2-verifier
(:func:`convert`; the plugin is imported first, or torch's safe loader
refuses the fairseq checkpoint).  Each row then runs in its own worker
process, like every other row (:func:`run_ct2_worker`):

* the same sentences, in the same batches and order as the fairseq rows of
  its batch size (:func:`fairseq_specdec.bench.loading.batch_source`), given
  to CTranslate2 as the source side's token strings (the dictionary's
  symbols, BPE included, the final EOS left to CTranslate2);
* one ``translate_batch`` call per batch with ``beam_size=1`` and
  ``max_batch_size`` the batch size, one inter-op thread and ``--threads``
  intra-op threads;
* fairseq's length rules of ``--beam 1``: at least ``--min-len`` tokens
  before EOS, at most ``max_len = min(max_len_a * source length +
  max_len_b, max target positions - 1)`` tokens, after which fairseq forces
  EOS: CTranslate2 decodes at most ``max_len`` tokens and the row gets that
  EOS too;
* warm-up excluded, each batch timed alone, scored with the same BLEU code.

The output tokens are mapped back to the target dictionary's ids, so
"= beam 1" compares the same token strings as for every other row.

``scripts/interleave.py --ct2`` (``--ct2-int8``) times the same translator,
built by the same :func:`load_translator`, as one more row of an
interleaved run (:mod:`fairseq_specdec.bench.interleave`).
"""
import os
import time
from typing import Dict, List

from ..utils.encoder_out import max_output_length

#: row kind -> CTranslate2 compute type
COMPUTE_TYPES = {"ct2": "float32", "ct2-int8": "int8"}
LABELS = {kind: f"CTranslate2 greedy ({compute})" for kind, compute in COMPUTE_TYPES.items()}
#: where the converted verifier goes inside --out
MODEL_DIR = "ct2-verifier"
PACKAGE_HINT = "pip install ctranslate2"


def available() -> bool:
    try:
        import ctranslate2  # noqa: F401
    except ImportError:
        return False
    return True


def require(option: str) -> None:
    """``ValueError`` naming the package when the option asking for a
    CTranslate2 row (``"--rows ct2"``, ``"--ct2"``) cannot run."""
    if not available():
        raise ValueError(
            f"{option} needs the ctranslate2 package, which is not installed "
            f"({PACKAGE_HINT}; it is optional, not a dependency of fairseq-specdec)"
        )


def check_device(device: str) -> None:
    """``ValueError`` when CTranslate2 cannot decode on ``device``."""
    import ctranslate2

    if device == "cuda" and ctranslate2.get_cuda_device_count() == 0:
        raise ValueError("--rows ct2 on --device cuda: this ctranslate2 build sees no CUDA device")


def convert(verifier: str, data: str, src: str, tgt: str, out_dir: str) -> str:
    """Convert the fairseq verifier (dictionaries from ``data``) into a
    CTranslate2 model in ``out_dir`` (replaced if present); returns ``out_dir``."""
    import fairseq_specdec  # noqa: F401  (torch's safe loader accepts fairseq checkpoints)
    from ctranslate2.converters.fairseq import FairseqConverter

    return FairseqConverter(verifier, data, source_lang=src, target_lang=tgt).convert(out_dir, force=True)


def source_tokens(sample, src_dict) -> List[List[str]]:
    """The source side of a fairseq batch as token strings: padding and the
    final EOS removed (CTranslate2 adds the EOS itself)."""
    pad, eos = src_dict.pad(), src_dict.eos()
    batch = []
    for row in sample["net_input"]["src_tokens"].tolist():
        ids = [i for i in row if i != pad]
        if ids and ids[-1] == eos:
            ids = ids[:-1]
        batch.append([src_dict[i] for i in ids])
    return batch


def target_ids(tokens: List[str], tgt_dict) -> List[int]:
    """CTranslate2's output tokens as target dictionary ids, EOS last (the
    EOS fairseq forces at the length limit when CTranslate2 stopped there)."""
    ids = [tgt_dict.index(t) for t in tokens]
    if not ids or ids[-1] != tgt_dict.eos():
        ids.append(tgt_dict.eos())
    return ids


def max_length(cfg, src_len: int, max_target_positions: int) -> int:
    """fairseq's ``--beam 1`` length limit for a batch whose padded source
    (EOS included) has ``src_len`` tokens."""
    gen = cfg.generation
    return max_output_length(gen.max_len_a, gen.max_len_b, src_len, max_target_positions)


def load_translator(spec: Dict):
    """The CTranslate2 model ``spec["path"]`` ready to decode the test set,
    as :func:`fairseq_specdec.bench.loading.load_decoder` readies a fairseq
    row: returns ``(task, batches, translate)``.  ``batches()`` yields the
    same batches, in the same order, as every fairseq row of the spec's
    batch size; ``translate(sample)`` decodes one of them greedily
    (``translate_batch`` with ``beam_size=1``, ``max_batch_size`` the batch
    size, fairseq's ``--beam 1`` length rules) and returns each sentence's
    output token strings (:func:`target_ids` maps them to the target
    dictionary).  The translator has one inter-op thread and
    ``spec["threads"]`` intra-op threads, compute type
    ``spec["compute_type"]``.  Used by the benchmark's worker
    (:func:`run_ct2_worker`) and by ``scripts/interleave.py --ct2``."""
    import ctranslate2

    from .loading import batch_source, setup_task

    cfg, task = setup_task(spec)
    max_positions = task.max_positions()
    batches = batch_source(spec, task, cfg, max_positions)
    src_dict = task.source_dictionary
    translator = ctranslate2.Translator(
        spec["path"], device=spec.get("device", "cpu"), compute_type=spec["compute_type"], inter_threads=1,
        intra_threads=spec["threads"],
    )

    def translate(sample) -> List[List[str]]:
        src_len = sample["net_input"]["src_tokens"].size(1)
        results = translator.translate_batch(
            source_tokens(sample, src_dict), beam_size=1, max_batch_size=spec["batch_size"],
            return_end_token=True, max_input_length=0, min_decoding_length=cfg.generation.min_len,
            max_decoding_length=max_length(cfg, src_len, max_positions[1]),
        )
        return [r.hypotheses[0] for r in results]

    return task, batches, translate


def run_ct2_worker(spec: Dict) -> Dict:
    """Decode the test set with the CTranslate2 model ``spec["path"]``."""
    from .timing import decoded_result, one_token_per_step, timed_batches, warm_up

    task, batches, translate = load_translator(spec)
    tgt_dict = task.target_dictionary
    device = spec.get("device", "cpu")
    warm_up(batches, translate, spec.get("warmup", 20))
    hyps, per_sentence_ms = {}, {}
    start = time.perf_counter()
    for sample, out, dt in timed_batches(batches, translate, device):
        for sid, tokens in zip(sample["id"].tolist(), out):
            hyps[sid] = target_ids(tokens, tgt_dict)
            per_sentence_ms[sid] = dt / len(out)
    result = decoded_result(hyps, per_sentence_ms, time.perf_counter() - start, tgt_dict)
    result.update(one_token_per_step(hyps))
    return result


def model_dir(out: str) -> str:
    return os.path.join(os.path.abspath(out), MODEL_DIR)
