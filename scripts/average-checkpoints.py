#!/usr/bin/env python
"""Average the parameters of several fairseq checkpoints (fairseq's own
``scripts/average_checkpoints.py`` is not in the installed package).

Checkpoints are read through fairseq-specdec's safe loader (no arbitrary
pickled code runs).  Floating-point tensors are averaged; other tensors (for
example a drafter's ``train_block_size`` buffer) must be equal in every input
and are copied.  Everything else (config, optimizer history) comes from the
last input, as in fairseq's script.  The output is saved the way fairseq's
trainer saves (config as plain containers), so the safe loader reads it back.

Examples:
    scripts/average-checkpoints.py --inputs ckpt/checkpoint9.pt ckpt/checkpoint10.pt --output avg.pt
    scripts/average-checkpoints.py --inputs ckpt --num-epoch-checkpoints 5 --output avg.pt
    scripts/average-checkpoints.py --inputs ckpt --num-update-checkpoints 5 --output avg.pt
"""
import argparse
import collections
import logging
import os
import re
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import fairseq_specdec  # noqa: E402,F401  (safe checkpoint loading)
from fairseq import checkpoint_utils  # noqa: E402
from fairseq_specdec.compat import save_checkpoint  # noqa: E402

logger = logging.getLogger("average-checkpoints")


def last_n_checkpoints(directory, n, by_update):
    pattern = re.compile(r"checkpoint_\d+_(\d+)\.pt$" if by_update else r"checkpoint(\d+)\.pt$")
    found = []
    for name in os.listdir(directory):
        m = pattern.fullmatch(name)
        if m:
            found.append((int(m.group(1)), os.path.join(directory, name)))
    if len(found) < n:
        raise SystemExit(f"found {len(found)} {'update' if by_update else 'epoch'} checkpoints in {directory}, need {n}")
    return [path for _, path in sorted(found, reverse=True)[:n]]


def average(paths):
    summed = None
    last_state = None
    for i, path in enumerate(paths):
        logger.info(f"reading {path} ({i + 1}/{len(paths)})")
        state = checkpoint_utils.load_checkpoint_to_cpu(path)
        params = state["model"]
        if summed is None:
            summed = collections.OrderedDict((k, v.clone().double() if v.is_floating_point() else v.clone()) for k, v in params.items())
        else:
            if set(params) != set(summed):
                missing = sorted(set(summed) ^ set(params))[:5]
                raise SystemExit(f"{path} has other parameters than {paths[0]}: {missing} ...")
            for k, v in params.items():
                if v.shape != summed[k].shape:
                    raise SystemExit(f"{k} has shape {tuple(v.shape)} in {path} but {tuple(summed[k].shape)} in {paths[0]}")
                if v.is_floating_point():
                    summed[k] += v.double()
                elif not torch.equal(v, summed[k]):
                    raise SystemExit(f"non-float tensor {k} differs between {paths[0]} and {path}")
        last_state = state
    averaged = collections.OrderedDict()
    for k, v in summed.items():
        ref = last_state["model"][k]
        averaged[k] = (v / len(paths)).to(ref.dtype) if ref.is_floating_point() else v
    last_state["model"] = averaged
    return last_state


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--inputs", nargs="+", required=True, help="checkpoint files, or one directory with --num-*-checkpoints")
    parser.add_argument("--output", required=True, help="where to write the averaged checkpoint")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--num-epoch-checkpoints", type=int, help="average the last N checkpointEPOCH.pt of the directory")
    group.add_argument("--num-update-checkpoints", type=int, help="average the last N checkpoint_EPOCH_UPDATE.pt of the directory")
    args = parser.parse_args(argv)
    logging.basicConfig(format="%(asctime)s | %(levelname)s | %(name)s | %(message)s", datefmt="%Y-%m-%d %H:%M:%S", level=logging.INFO, stream=sys.stdout, force=True)

    n = args.num_epoch_checkpoints or args.num_update_checkpoints
    if n is not None:
        if len(args.inputs) != 1 or not os.path.isdir(args.inputs[0]):
            parser.error("--num-*-checkpoints needs exactly one directory in --inputs")
        paths = last_n_checkpoints(args.inputs[0], n, by_update=args.num_update_checkpoints is not None)
    else:
        paths = args.inputs
        for p in paths:
            if not os.path.isfile(p):
                parser.error(f"no such checkpoint: {p}")
    save_checkpoint(average(paths), args.output)  # config as plain containers, whole or absent
    logger.info(f"averaged {len(paths)} checkpoints into {args.output}: {', '.join(paths)}")


if __name__ == "__main__":
    main()
