"""The roofline of the verify pass: what a pass of m tokens costs on this
machine, what it would cost if only arithmetic and weight reads counted, and
where the difference goes.

For a verifier (a checkpoint, or one of the :data:`SHAPES` with random
weights), on ``--threads`` threads (default 1):

* the machine: the float32 arithmetic peak (the faster of torch's 1024-cube
  product and, on one thread where the plugin's kernels run, fused
  multiply-adds on registers only at the widest vectors they have:
  :func:`fma_probe`) and the
  read bandwidth over a buffer the size of the decoder's weights (so a
  verifier whose weights fit in the caches is judged by the caches' speed),
  both timed in the same rounds as the passes, so that the ideal and the
  measured products come from the same minutes of the machine;
* for each product implementation the lean verify pass can use
  (torch's, and where the extension runs the native ``rowgemm``) and
  m = 1 ... ``--max-m``: the measured cost of one verify pass of m tokens at
  batch 1 over a prefix of ``--prefix`` tokens; its matrix products alone,
  run back to back with the same inputs; and the rest (attention, norms,
  residuals, per-operation overhead);
* the ideal cost of the products: the larger of reading every weight once
  and doing their arithmetic at the peak;
* the operations a pass runs (ATen calls) and what one costs when it does
  nothing (an empty-ish tensor op), so their product is the overhead no
  kernel removes;
* the break-even Tok.: a draft of k tokens pays only if it adds more than
  ``verify_ms[k + 1] / verify_ms[1]`` tokens per iteration (drafter and loop
  costs not counted, so this is a lower bound).

* the cost of verifying a draft tree of n nodes (the root, the newest
  accepted token, included) in one pass, n in :data:`TREE_SIZES`: a binary
  tree (node i's parent is node (i - 1) // 2), each node attending to its
  ancestors only (the tree mask of the verify pass).

* one step of ``--decoding self-draft``'s int8 copy (a pass of 1 token):
  int8 panels in the fused C++ layers, and torch's int8 library, each
  timed beside the float32 pass of 1 token.

``--json`` prints one object, among others ``{"verify_ms": {"1": ..., "2":
..., ...}, "tree_ms": {"1": ..., "4": ..., "8": ...}, "draft_int8_ms": ...}``
for the products ``--specdec-backend auto`` uses.
"""
import argparse
import json
import sys
import time
from typing import Callable, Dict, List, Optional, Tuple

from .machine import describe, header

#: random-weight verifier shapes: the demo's (configs/multi30k-cpu.sh) and
#: the papers' transformer-base and transformer-big (WMT, 32k vocabulary)
SHAPES = {
    "demo": dict(layers=3, dim=256, ffn=1024, heads=4, vocab=7976),
    "base": dict(layers=6, dim=512, ffn=2048, heads=8, vocab=32000),
    "big": dict(layers=6, dim=1024, ffn=4096, heads=16, vocab=32000),
}


#: the tree sizes (nodes, the root included) whose pass the roofline times
TREE_SIZES = (1, 2, 4, 8, 16)


def binary_tree(nodes: int, tokens):
    """A draft tree of ``nodes`` slots (the root included) over ``tokens``'s
    first ``nodes - 1`` columns: slot i's parent is slot (i - 1) // 2."""
    import torch

    from ..generation.tree import DraftTree

    parents = torch.tensor([[-1] + [(i - 1) // 2 for i in range(1, nodes)]])
    return DraftTree(tokens[:, 1:nodes], parents)


def best_ms(fn: Callable[[], object], min_seconds: float = 0.2, rounds: int = 5) -> float:
    """The fastest of ``rounds`` mean times of ``fn`` (ms), each round long
    enough to last ``min_seconds / rounds``."""
    fn()
    t0 = time.perf_counter()
    fn()
    once = max(time.perf_counter() - t0, 1e-6)
    reps = max(1, int(min_seconds / rounds / once))
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best * 1e3


def interleaved_best_ms(fns: Dict[str, Callable[[], object]], seconds: float = 1.0, rounds: int = 10) -> Dict[str, float]:
    """:func:`best_ms` of several callables measured in turn, round by round,
    so that a machine whose speed drifts slows them all alike: each gets
    about ``seconds`` in all, and its fastest round counts."""
    reps = {}
    for name, fn in fns.items():
        fn()
        t0 = time.perf_counter()
        fn()
        reps[name] = max(1, int(seconds / rounds / max(time.perf_counter() - t0, 1e-6)))
    best = {name: float("inf") for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(reps[name]):
                fn()
            best[name] = min(best[name], (time.perf_counter() - t0) / reps[name] * 1e3)
    return best


#: floating-point operations of the peak probe, a 1024-cube product
PEAK_FLOP = 2 * 1024 ** 3


def peak_probe() -> Callable[[], object]:
    """A float32 1024 x 1024 x 1024 product on the current threads (its
    :data:`PEAK_FLOP` over its time: the product peak)."""
    import torch

    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    return lambda: torch.mm(a, b)


#: rounds of the register-only probe (:func:`fma_probe`): 16 fused
#: multiply-adds each, a few milliseconds on one core
FMA_ROUNDS = 2_000_000


def fma_probe() -> Optional[Tuple[str, Callable[[], object], int]]:
    """(instruction set, call, its floating-point operations): fused
    multiply-adds on registers only, no memory read, on the widest vectors
    the plugin's kernels have here (AVX-512 where the CPU has it, else
    AVX2); None where the kernels cannot run.  What the arithmetic units
    reach, which a library's 1024-cube product (:func:`peak_probe`) may not:
    on a CPU where the library takes its AVX2 path, the AVX-512 products of
    a pass of 8 rows ran faster than that product."""
    from .. import kernels

    if kernels.unavailable_reason() is not None:
        return None
    name = "avx512" if kernels.has_avx512() else "avx2"
    lanes = 16 if name == "avx512" else 8
    return name, (lambda: kernels._ext.fma_rounds(name, FMA_ROUNDS)), FMA_ROUNDS * 16 * lanes * 2


def read_probe(nbytes: int) -> Callable[[], object]:
    """A sum over a float32 buffer of ``nbytes`` (warm: read again at each call)."""
    import torch

    buf = torch.ones(max(1, nbytes // 4))
    return lambda: buf.sum()


def op_overhead_ms() -> float:
    """The cost of one tensor operation that does almost nothing (ms)."""
    import torch

    x = torch.zeros(1, 4)
    return best_ms(lambda: x.add(1.0), min_seconds=0.1)


def random_verifier(shape: Dict, seed: int = 1):
    """A fairseq Transformer (post-norm, ReLU, shared embeddings, as the
    recipes train) with random weights of ``shape``, in eval mode."""
    import torch
    from argparse import Namespace

    from fairseq.data import Dictionary
    from fairseq.models.transformer import TransformerModel, base_architecture

    dictionary = Dictionary()
    for i in range(shape["vocab"] - len(dictionary)):
        dictionary.add_symbol(f"w{i}")
    args = Namespace(
        encoder_layers=shape["layers"], decoder_layers=shape["layers"],
        encoder_embed_dim=shape["dim"], decoder_embed_dim=shape["dim"],
        encoder_ffn_embed_dim=shape["ffn"], decoder_ffn_embed_dim=shape["ffn"],
        encoder_attention_heads=shape["heads"], decoder_attention_heads=shape["heads"],
        share_all_embeddings=True, dropout=0.0, max_source_positions=1024, max_target_positions=1024,
    )
    base_architecture(args)

    class _Task:
        source_dictionary = target_dictionary = dictionary

    torch.manual_seed(seed)
    return TransformerModel.build_model(args, _Task()).eval()


class _PassBench:
    """A lean verifier at batch 1 over a fixed prefix, ready to run passes of m tokens."""

    def __init__(self, model, gemm: str, prefix: int, src_len: int, precision: str = "float32"):
        import torch

        from ..generation.lean_verifier import LeanVerifier
        from ..generation.state import DecodingState

        self.model = model
        self.verifier = LeanVerifier(model, gemm=gemm, precision=precision)
        vocab = len(model.decoder.dictionary)
        g = torch.Generator().manual_seed(0)
        src = torch.randint(4, vocab, (1, src_len), generator=g)
        src[0, -1] = model.decoder.dictionary.eos()
        sample = {"net_input": {"src_tokens": src, "src_lengths": torch.tensor([src_len])}}
        self.verifier.start()
        self.state = DecodingState(
            sample, self.verifier.encode(sample["net_input"]), width=prefix + 64,
            pad=model.decoder.dictionary.pad(), bos=model.decoder.dictionary.eos(), draft_k=1,
        )
        # fill the cache with the prefix: positions [0, prefix) hold it from now on
        self.verifier.forward(torch.randint(4, vocab, (1, prefix), generator=g), self.state)
        self.state.lengths = torch.tensor([prefix])
        self.state.lengths_host = [prefix]
        self.tokens = torch.randint(4, vocab, (1, 64), generator=g)

    def run(self, m: int, tree=None):
        # the state never moves: every pass writes scratch past the prefix
        return self.verifier.forward(self.tokens[:, :m], self.state, tree=tree)

    def run_tree(self, nodes: int):
        """A pass over a :func:`binary_tree` of ``nodes`` slots (made anew
        each time, as the loop makes each iteration's tree)."""
        return self.run(nodes, binary_tree(nodes, self.tokens))

    def products(self, m: int) -> List[Callable[[], object]]:
        """The pass's matrix products with inputs of m rows, as callables."""
        import torch

        x = torch.randn(1, m, self.model.decoder.embed_dim)
        calls = []
        for lw in self.verifier.layers:
            hidden = torch.randn(1, m, lw.fc1(x).size(-1))
            calls += [lambda lw=lw: lw.qkv(x), lambda lw=lw: lw.sa_out(x), lambda lw=lw: lw.ca_q(x),
                      lambda lw=lw: lw.ca_out(x), lambda lw=lw: lw.fc1(x), lambda lw=lw, h=hidden: lw.fc2(h)]
        calls.append(lambda: self.verifier.logits(x))
        return calls

    def count_ops(self, m: int) -> int:
        """ATen operations one pass of m tokens dispatches."""
        from torch.utils._python_dispatch import TorchDispatchMode

        class Counter(TorchDispatchMode):
            n = 0

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                Counter.n += 1
                return func(*args, **(kwargs or {}))

        with Counter():
            self.run(m)
        return Counter.n


def decoder_weights(model) -> Dict[str, int]:
    """Parameters a verify pass reads per token: the decoder's layer matrices
    except the encoder-attention keys/values (computed once per sentence),
    plus the vocabulary projection."""
    params = 0
    for layer in model.decoder.layers:
        for name, p in layer.named_parameters():
            if p.dim() == 2 and not name.startswith(("encoder_attn.k_proj", "encoder_attn.v_proj")):
                params += p.numel()
    params += model.decoder.output_projection.weight.numel()
    return {"params": params, "bytes": params * 4}


def roofline(model, max_m: int = 8, prefix: int = 12, src_len: int = 14, gemms: Optional[List[str]] = None,
             seconds: float = 1.0) -> Dict:
    import torch

    from ..generation.lean_verifier import resolve_gemm
    from ..kernels import rowgemm

    weight = next(model.parameters())
    default = resolve_gemm("auto", weight)
    if gemms is None:
        gemms = ["torch"] + (["rowgemm"] if rowgemm.applies_to(weight) else [])
    sizes = decoder_weights(model)
    overhead = op_overhead_ms()
    ms_range = range(1, max_m + 1)
    machine = describe()
    result = {
        "threads": torch.get_num_threads(),
        "machine": {**machine, "op_overhead_us": round(overhead * 1e3, 2)},
        "isa": machine["plugin_isa"],
        "weights": {"params": sizes["params"], "mbytes": round(sizes["bytes"] / 2 ** 20, 1)},
        "prefix": prefix,
        "default_gemm": default,
        "by_gemm": {},
    }
    # the machine's peak and read speed are timed in the same rounds as the
    # passes (their fastest over all rounds), so that a machine whose speed
    # or cache share drifts judges the products by what it did meanwhile
    probes = {("peak",): peak_probe(), ("read",): read_probe(sizes["bytes"])}
    fma = fma_probe()
    if fma is not None:
        probes[("fma",)] = fma[1]
    fastest = {name: float("inf") for name in probes}
    with torch.no_grad():
        for gemm in gemms:
            bench = _PassBench(model, gemm, prefix, src_len)
            rows = {"verify_ms": {}, "products_ms": {}, "rest_ms": {}, "ops": {}, "tree_ms": {}}
            fns = dict(probes)
            for m in ms_range:
                calls = bench.products(m)
                fns[("pass", m)] = lambda m=m: bench.run(m)
                fns[("products", m)] = lambda calls=calls: [c() for c in calls]
            for n in TREE_SIZES:
                fns[("tree", n)] = lambda n=n: bench.run_tree(n)
            timed = interleaved_best_ms(fns, seconds)
            for name in probes:
                fastest[name] = min(fastest[name], timed[name])
            for n in TREE_SIZES:
                rows["tree_ms"][str(n)] = round(timed[("tree", n)], 4)
            rows["tree_ratio_to_1"] = {k: round(v / rows["tree_ms"]["1"], 3) for k, v in rows["tree_ms"].items()}
            for m in ms_range:
                total, products = timed[("pass", m)], timed[("products", m)]
                rows["verify_ms"][str(m)] = round(total, 4)
                rows["products_ms"][str(m)] = round(products, 4)
                rows["rest_ms"][str(m)] = round(total - products, 4)
                rows["ops"][str(m)] = bench.count_ops(m)
            one = rows["verify_ms"]["1"]
            rows["ratio_to_m1"] = {k: round(v / one, 3) for k, v in rows["verify_ms"].items()}
            rows["op_overhead_ms"] = {k: round(n * overhead, 4) for k, n in rows["ops"].items()}
            # a draft of k tokens verifies k + 1: it must add this many tokens per iteration
            rows["break_even_tok"] = {str(k): round(rows["verify_ms"][str(k + 1)] / one, 3) for k in range(1, max_m)}
            result["by_gemm"][gemm] = rows
    library = PEAK_FLOP / (fastest[("peak",)] * 1e-3) / 1e9
    registers = fma[2] / (fastest[("fma",)] * 1e-3) / 1e9 if fma is not None else None
    # the register probe runs on one core: it bounds a pass on one thread only
    peak = max(library, registers or 0.0) if result["threads"] == 1 else library
    bandwidth = sizes["bytes"] / (fastest[("read",)] * 1e-3) / 1e9
    result["machine"].update(peak_gflops=round(peak, 1), read_gbs=round(bandwidth, 1),
                             peak_library_gflops=round(library, 1),
                             peak_registers_gflops=None if registers is None else round(registers, 1),
                             peak_registers_isa=None if fma is None else fma[0])
    ideal = {}
    for m in ms_range:
        read = sizes["bytes"] / (bandwidth * 1e9)
        arithmetic = 2 * m * sizes["params"] / (peak * 1e9)
        ideal[str(m)] = max(read, arithmetic) * 1e3
    result["ideal_products_ms"] = {k: round(v, 4) for k, v in ideal.items()}
    chosen = result["by_gemm"][default] if default in result["by_gemm"] else next(iter(result["by_gemm"].values()))
    result["verify_ms"] = chosen["verify_ms"]
    result["tree_ms"] = chosen["tree_ms"]
    result.update(int8_draft_step(model, default, prefix, src_len, seconds))
    return result


def int8_draft_step(model, gemm: str, prefix: int, src_len: int, seconds: float = 1.0) -> Dict:
    """One step of ``--decoding self-draft``'s int8 copy (a pass of 1
    token), timed interleaved with the float32 verify pass of 1 token on
    ``gemm``: ``draft_int8_ms`` (the products the decoding uses here:
    ``draft_int8_products``), ``draft_int8_verify_ms``, their ratio, and
    each kind of int8 products that runs here in ``draft_int8_by_products``
    (``native``: int8 panels in the fused C++ layers; ``library``: torch's
    quantized dynamic linears)."""
    import torch

    from ..generation.self_draft import native_int8
    from ..utils.int8 import int8_unavailable_reason

    benches = {}
    with torch.no_grad():
        if native_int8(True, model):
            benches["native"] = _PassBench(model, "rowgemm", prefix, src_len, precision="int8")
        if int8_unavailable_reason() is None:
            benches["library"] = _PassBench(model, "torch-int8", prefix, src_len)
        if not benches:
            return {"draft_int8_ms": None, "draft_int8_reason": int8_unavailable_reason()}
        verify = _PassBench(model, gemm, prefix, src_len)
        fns = {name: (lambda b=b: b.run(1)) for name, b in benches.items()}
        fns["verify"] = lambda: verify.run(1)
        timed = interleaved_best_ms(fns, seconds)
    used = "native" if "native" in benches else "library"
    return {"draft_int8_ms": round(timed[used], 4), "draft_int8_products": used,
            "draft_int8_verify_ms": round(timed["verify"], 4),
            "draft_int8_ratio_to_verify": round(timed[used] / timed["verify"], 3),
            "draft_int8_by_products": {name: round(timed[name], 4) for name in benches}}


def _peak_sources(mach: Dict) -> str:
    """The peak's two measurements in words (a machine dict of an older
    run, without them, as "1024-cube product")."""
    library = mach.get("peak_library_gflops", mach["peak_gflops"])
    text = f"1024-cube product {library}"
    if mach.get("peak_registers_gflops") is not None:
        text += f", {mach['peak_registers_isa']} register FMAs {mach['peak_registers_gflops']}"
    return text


def format_report(name: str, result: Dict) -> str:
    mach = result["machine"]
    lines = [
        f"# Verify-pass roofline: {name}, {result['threads']} thread(s), batch 1, prefix {result['prefix']}",
        "",
        f"Machine: {header(mach)}",
        "",
        f"machine: {mach['peak_gflops']} GFLOP/s float32 peak ({_peak_sources(mach)}); {mach['read_gbs']} GB/s reading "
        f"{result['weights']['mbytes']} MB (the weights a pass reads: {result['weights']['params']:,} parameters); "
        f"{mach['op_overhead_us']} us per tensor operation",
        f"default products (--specdec-backend auto): {result['default_gemm']}",
        "",
        "| products | m | verify ms | x m=1 | products ms | ideal products ms | rest ms | ops | ops x overhead ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for gemm, rows in result["by_gemm"].items():
        for m in rows["verify_ms"]:
            lines.append(
                f"| {gemm} | {m} | {rows['verify_ms'][m]:.3f} | {rows['ratio_to_m1'][m]:.2f}x | "
                f"{rows['products_ms'][m]:.3f} | {result['ideal_products_ms'][m]:.3f} | {rows['rest_ms'][m]:.3f} | "
                f"{rows['ops'][m]} | {rows['op_overhead_ms'][m]:.3f} |"
            )
    lines.append("")
    for gemm, rows in result["by_gemm"].items():
        tok = ", ".join(f"k={k}: {v:.2f}" for k, v in rows["break_even_tok"].items())
        lines.append(f"break-even Tok. ({gemm}; verify cost only, drafter and loop not counted): {tok}")
    lines.append("")
    for gemm, rows in result["by_gemm"].items():
        tree = ", ".join(f"{n} nodes: {rows['tree_ms'][n]:.3f} ms ({rows['tree_ratio_to_1'][n]:.2f}x)"
                         for n in rows["tree_ms"])
        lines.append(f"draft-tree pass ({gemm}; binary tree, the root included): {tree}")
    lines.append("")
    if result.get("draft_int8_ms") is None:
        lines.append(f"int8 draft step (--decoding self-draft): not available: {result.get('draft_int8_reason')}")
    else:
        kinds = ", ".join(f"{k} {v:.3f} ms" for k, v in result["draft_int8_by_products"].items())
        lines.append(f"int8 draft step (--decoding self-draft, 1 token, {result['draft_int8_products']} products): "
                     f"{result['draft_int8_ms']:.3f} ms, {result['draft_int8_ratio_to_verify']:.2f}x of the float32 "
                     f"verify pass of 1 token ({result['draft_int8_verify_ms']:.3f} ms, timed beside it); by products: "
                     f"{kinds}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="scripts/roofline.py",
        description="Roofline of the verify pass: measured and ideal cost of a pass of m tokens, per component.",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--shape", choices=sorted(SHAPES), default=None,
                     help="a random-weight verifier of this shape (default demo, when --path is not given)")
    src.add_argument("--path", default=None, help="a verifier checkpoint (fairseq Transformer)")
    p.add_argument("--data", default=None, help="with --path: the binarized data directory its dictionaries are in "
                   "(default: the checkpoint's own)")
    p.add_argument("--max-m", type=int, default=8, help="verify passes of m = 1 ... this many tokens (default 8)")
    p.add_argument("--prefix", type=int, default=12, help="tokens already in the cache (default 12)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--seconds", type=float, default=1.0,
                   help="time spent on each measurement, in 5 rounds whose fastest counts (default 1.0)")
    p.add_argument("--gemm", default=None, help="comma-separated product implementations to measure "
                   "(default: torch, and rowgemm where it runs)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--json-out", default=None, help="also write the JSON object to this file")
    return p


def load_checkpoint(path: str, data: Optional[str]):
    import os

    import fairseq_specdec  # noqa: F401  (registers the plugin's task and models)
    from fairseq import checkpoint_utils

    if not os.path.isfile(path):
        raise FileNotFoundError(f"--path {path}: no such checkpoint")
    overrides = {"data": data} if data else None
    models, _, _ = checkpoint_utils.load_model_ensemble_and_task([path], arg_overrides=overrides)
    return models[0].float().cpu().eval()


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.max_m < 1:
        parser.error(f"--max-m must be >= 1, got {args.max_m}")
    if args.prefix < 1:
        parser.error(f"--prefix must be >= 1, got {args.prefix}")
    if args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    if args.seconds <= 0:
        parser.error(f"--seconds must be > 0, got {args.seconds}")
    import torch

    torch.set_num_threads(args.threads)
    gemms = None
    if args.gemm:
        from ..generation.lean_verifier import VERIFY_GEMMS

        gemms = [g.strip() for g in args.gemm.split(",") if g.strip()]
        bad = [g for g in gemms if g not in VERIFY_GEMMS or g == "auto"]
        if bad:
            parser.error(f"--gemm: unknown {', '.join(bad)} (choose from rowgemm, torch)")
    if args.path:
        try:
            model = load_checkpoint(args.path, args.data)
        except FileNotFoundError as error:
            parser.error(str(error))
        name = args.path
    else:
        shape = args.shape or "demo"
        model = random_verifier(SHAPES[shape])
        name = f"{shape} shape ({SHAPES[shape]['layers']}+{SHAPES[shape]['layers']} layers, d{SHAPES[shape]['dim']}, " \
               f"FFN {SHAPES[shape]['ffn']}, vocabulary {SHAPES[shape]['vocab']}), random weights"
    try:
        result = roofline(model, args.max_m, args.prefix, gemms=gemms, seconds=args.seconds)
    except ValueError as error:
        parser.error(str(error))
    result["verifier"] = name
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=1)
    if args.json:
        print(json.dumps(result))
    else:
        print(format_report(name, result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
