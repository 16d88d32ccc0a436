#!/usr/bin/env python
"""What a chain of drafts costs the acceptance step when it is handed over as
a plain draft tree rather than as a ChainTree (whose cheaper forms the steps
take): both steps, one sentence, on the CPU, one thread.

    python scripts/chain-as-tree.py --path CHECKPOINT --data DATA-BIN [--drafts 8]

Prints the machine and, per step, the microseconds of one call (the best of
5 timed runs) for the chain and for the same chain as a tree, and their ratio.
"""
import argparse
import json
import sys
import time

import torch


def best_microseconds(fn, calls: int, repeats: int = 5) -> float:
    for _ in range(max(1, calls // 10)):
        fn()
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - began) / calls * 1e6)
    return best


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--path", required=True, help="the verifier's checkpoint")
    parser.add_argument("--data", required=True, help="its fairseq-preprocess'ed data directory (the dictionaries)")
    parser.add_argument("--drafts", type=int, default=8, help="drafted tokens in the chain (default: 8)")
    parser.add_argument("--calls", type=int, default=300, help="calls per timed run (default: 300)")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    from fairseq import checkpoint_utils

    import fairseq_specdec  # noqa: F401  (registers the plugin)
    from fairseq_specdec.bench.machine import describe, header
    from fairseq_specdec.generation.accept_step import FairseqRules, NativeStep, TensorStep, native_step_unavailable
    from fairseq_specdec.generation.acceptance import StrictAcceptance
    from fairseq_specdec.generation.tree import DraftTree, chain_tree

    _, _, task = checkpoint_utils.load_model_ensemble_and_task([args.path], arg_overrides={"data": args.data})
    d = task.target_dictionary
    rules = FairseqRules(d.pad(), d.unk(), d.eos(), len(d))
    steps = {"tensor": TensorStep(StrictAcceptance(), rules)}
    if native_step_unavailable(StrictAcceptance(), 0.0) is None:
        steps["native"] = NativeStep(TensorStep(StrictAcceptance(), rules))
    g = torch.Generator().manual_seed(0)
    k = args.drafts
    drafts = torch.randint(d.nspecial, len(d), (1, k), generator=g)
    chain = chain_tree(drafts)
    as_tree = DraftTree(drafts, chain.parents.clone())
    lprobs = torch.log_softmax(torch.randn(1, k + 1, len(d), generator=g), -1)
    lengths = torch.tensor([5])

    class State:  # what a step reads of a decoding state
        lengths_host = lengths.tolist()
        cum = torch.tensor([-3.0])
        size = 1

        def __init__(self):
            self.lengths = lengths

        @staticmethod
        def last_tokens():
            return drafts.new_full((1, 1), d.eos())

    state = State()
    print(header(describe()))
    figures = {"drafts": k, "vocabulary": len(d)}
    for name, step in steps.items():
        a = step(state, lprobs.clone(), chain, [k], 200, True)
        b = step(state, lprobs.clone(), as_tree, None, 200, True)
        if not (torch.equal(a.n_new, b.n_new) and torch.equal(a.cum, b.cum)
                and torch.equal(a.new_tokens[:, : int(a.n_new)], b.new_tokens[:, : int(b.n_new)])):
            print(f"error: the {name} step gives the chain and the same chain as a tree different results",
                  file=sys.stderr)
            return 1
        chain_us = best_microseconds(lambda: step(state, lprobs.clone(), chain, [k], 200, True), args.calls)
        tree_us = best_microseconds(lambda: step(state, lprobs.clone(), as_tree, None, 200, True), args.calls)
        figures[name] = {"chain_us": round(chain_us, 1), "as_tree_us": round(tree_us, 1),
                         "ratio": round(tree_us / chain_us, 2)}
        print(f"{name:6s} acceptance step: chain {chain_us:8.1f} us, as a tree {tree_us:8.1f} us, "
              f"{tree_us / chain_us:.2f}x")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(figures, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
