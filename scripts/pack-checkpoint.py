#!/usr/bin/env python
"""Pack a fairseq checkpoint for decoding elsewhere: the same checkpoint
without its optimizer state (a third to two thirds of a trained checkpoint),
optionally with its float weights stored in float16.

    python scripts/pack-checkpoint.py SRC DST [--half-weights]

The output loads wherever SRC loads (fairseq's checkpoint_utils, the plugin's
safe loader: its config is stored as plain containers, as fairseq-train
stores it).  With --half-weights every floating-point tensor of the model is
rounded to float16 (tied weights stay one tensor); fairseq copies them into
the model's float32 parameters when it loads them, so the packed model
decodes in float32 with weights that differ from SRC's by that rounding.
scripts/gpu-kit.sh --models uses it to carry trained models to a GPU
machine (docs/gpu.md).  DST is written whole or not at all.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pack(state: dict, half: bool) -> dict:
    """``state`` without ``last_optimizer_state``; with ``half``, the model's
    float tensors in float16, each storage converted once."""
    state = dict(state)
    state.pop("last_optimizer_state", None)
    if half:
        halves = {}

        def to_half(v):
            if not torch.is_tensor(v) or not v.is_floating_point():
                return v
            key = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape), tuple(v.stride()))
            if key not in halves:
                halves[key] = v.half()
            return halves[key]

        state["model"] = type(state["model"])((k, to_half(v)) for k, v in state["model"].items())
    return state


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src", help="a fairseq checkpoint (.pt)")
    parser.add_argument("dst", help="where the packed checkpoint goes")
    parser.add_argument("--half-weights", action="store_true",
                        help="store the model's float weights in float16 (about half the size)")
    args = parser.parse_args(argv)
    if not os.path.isfile(args.src):
        parser.error(f"SRC: no such checkpoint: {args.src}")
    if os.path.isdir(args.dst):
        parser.error(f"DST {args.dst} is a directory: give the packed checkpoint's file name "
                     f"(e.g. {os.path.join(args.dst, os.path.basename(args.src))})")
    import fairseq_specdec  # noqa: F401  (allowlists fairseq's globals for torch's safe loader)
    from fairseq import checkpoint_utils
    from fairseq_specdec.compat import CheckpointLoadError, UntrustedCheckpointError, save_checkpoint

    not_a_checkpoint = f"SRC {args.src} is not a fairseq checkpoint (fairseq-train writes checkpoint_*.pt)"
    try:
        state = checkpoint_utils.load_checkpoint_to_cpu(args.src)
    except (CheckpointLoadError, UntrustedCheckpointError) as e:
        parser.error(f"SRC: {e}")
    except (KeyError, TypeError, AttributeError) as e:  # a torch.save file fairseq's loader cannot read
        parser.error(f"{not_a_checkpoint}: {type(e).__name__}: {e}")
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
        parser.error(f"{not_a_checkpoint}: it holds no model weights")
    save_checkpoint(pack(state, args.half_weights), args.dst)
    print(f"{args.dst}: {os.path.getsize(args.dst) / 2**20:.1f} MiB (from {os.path.getsize(args.src) / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
