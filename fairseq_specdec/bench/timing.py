"""Decode the test set with one configuration: warm-up (excluded), then the
timed pass, whose statistics alone are reported."""
import resource
import time
from typing import Callable, Dict, Iterator, Tuple

from .loading import load_decoder


def synchronizer(device: str) -> Callable[[], None]:
    """What to call before reading the clock: waits for queued GPU work on cuda."""
    if device == "cuda":
        import torch

        return torch.cuda.synchronize
    return lambda: None


def fairseq_decode(task, models, generator) -> Callable[[Dict], list]:
    """``decode(sample)``: fairseq's ``task.inference_step`` with this generator."""
    return lambda sample: task.inference_step(generator, models, sample)


def warm_up(batches, decode: Callable[[Dict], object], sentences: int) -> None:
    """Decode the first ``sentences`` sentences once, untimed (every engine's
    warm-up: ``decode(sample)`` decodes one batch)."""
    done = 0
    for sample in batches():
        if done >= sentences:
            break
        decode(sample)
        done += len(sample["id"])


def timed_batches(batches, decode: Callable[[Dict], list], device: str = "cpu") -> Iterator[Tuple[Dict, list, float]]:
    """``(sample, output, ms)`` of every batch, each ``decode(sample)`` timed
    alone (on cuda with the GPU synchronized on both sides)."""
    sync = synchronizer(device)
    for sample in batches():
        sync()
        t0 = time.perf_counter()
        out = decode(sample)
        sync()
        yield sample, out, (time.perf_counter() - t0) * 1000.0


def reset_statistics(generator) -> None:
    """A fresh statistics object, so that the warm-up is not counted."""
    from fairseq_specdec.generation import SpecDecStats, SpeculativeGenerator

    if isinstance(generator, SpeculativeGenerator):
        generator.stats = SpecDecStats(name=generator.stats.name)


def run_worker(spec: Dict) -> Dict:
    """Decode the test set with one fairseq configuration (the plugin's
    decodings and fairseq's own); returns timings and hypotheses."""
    task, models, generator, batches = load_decoder(spec)
    decode = fairseq_decode(task, models, generator)
    if spec.get("filler"):  # load for an idle core: decode until killed, report nothing
        while True:
            for sample in batches():
                decode(sample)

    device = spec.get("device", "cpu")
    warm_up(batches, decode, spec.get("warmup", 20))
    reset_statistics(generator)
    if device == "cuda":
        import torch

        torch.cuda.reset_peak_memory_stats()

    hyps, per_sentence_ms = {}, {}
    start = time.perf_counter()
    for sample, out, dt in timed_batches(batches, decode, device):
        for i, sid in enumerate(sample["id"].tolist()):
            hyps[sid] = out[i][0]["tokens"].tolist()
            per_sentence_ms[sid] = dt / len(sample["id"])
    total = time.perf_counter() - start
    result = decoded_result(hyps, per_sentence_ms, total, task.target_dictionary)
    if device == "cuda":
        import torch

        result["peak_gpu_mb"] = torch.cuda.max_memory_allocated() / 2**20
    from fairseq_specdec.generation import SpeculativeGenerator

    if isinstance(generator, SpeculativeGenerator):
        stats = generator.stats  # the timed pass only (the warm-up had its own statistics object)
        result.update(tok=stats.mean_accepted, iterations=stats.iterations, out_tokens=stats.tokens,
                      histogram={str(n): c for n, c in sorted(stats.histogram.items())}, summary=stats.summary())
    else:
        result.update(one_token_per_step(hyps))
    return result


def decoded_result(hyps: Dict[int, list], per_sentence_ms: Dict[int, float], seconds: float, tgt_dict) -> Dict:
    """What every row reports of its timed pass: ``hyps`` (token ids, EOS
    last) and ``per_sentence_ms`` keyed by sentence id, the pass's wall time."""
    return {
        "seconds": seconds,
        "sentences": len(hyps),
        "tokens": {str(k): v for k, v in hyps.items()},
        "text": {str(k): tgt_dict.string(v[:-1] if v and v[-1] == tgt_dict.eos() else v) for k, v in hyps.items()},
        "ms": {str(k): v for k, v in per_sentence_ms.items()},
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
    }


def one_token_per_step(hyps: Dict[int, list]) -> Dict:
    """Statistics of a decoder without speculation: one token (EOS included) per step."""
    out_tokens = sum(len(v) for v in hyps.values())
    return dict(tok=1.0, iterations=out_tokens, out_tokens=out_tokens)
