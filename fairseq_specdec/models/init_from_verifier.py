"""Initialize a Spec-Drafter from its verifier (Xia et al. 2023; the authors' README).

The drafter's encoder is fairseq's own ``TransformerEncoderBase``, so the
verifier's encoder copies in tensor for tensor under the same names.  The copy
is explicit: every drafter tensor is either copied from a named verifier
tensor with the same shape, or reported as kept at its initialization.  There
is no ``strict=False`` anywhere: a shape mismatch in a mapped tensor is an
error.

Mapping (verifier -> drafter):

* ``encoder.embed_tokens.weight`` (V rows) -> the first V rows of the drafter's
  (V + 1 rows: the extra row is the mask symbol, kept at its initialization);
  with joined dictionaries this is also the drafter decoder's embedding and
  output projection; otherwise ``decoder.embed_tokens.weight`` is copied
  into the drafter decoder's embedding the same way;
* ``encoder.layers.{i}.*`` for the first min(layers) layers, and the
  encoder's final ``layer_norm`` / ``layernorm_embedding`` / learned
  positions when both have them.
"""
import logging
import os
from typing import Dict, List

import torch

from fairseq import checkpoint_utils
from fairseq.data import Dictionary

from ..utils.dictionary import dictionary_fingerprint

logger = logging.getLogger(__name__)

# settings that change what a copied encoder tensor means
_ENCODER_SEMANTICS = [
    "encoder_embed_dim",
    "encoder_ffn_embed_dim",
    "encoder_attention_heads",
    "encoder_normalize_before",
    "activation_fn",
    "no_scale_embedding",
    "encoder_learned_pos",
    "layernorm_embedding",
]


def _cfg_value(cfg, name):
    if cfg is None:
        return None
    value = cfg.get(name) if hasattr(cfg, "get") else getattr(cfg, name, None)
    return value


def _verifier_dictionary(state, side: str):
    """The verifier's dictionary file, when its training data dir is still there."""
    task_cfg = (state.get("cfg") or {}).get("task") if state.get("cfg") is not None else None
    data = _cfg_value(task_cfg, "data")
    lang = _cfg_value(task_cfg, f"{side}_lang")
    if not data or not lang:
        return None
    path = os.path.join(str(data).split(os.pathsep)[0], f"dict.{lang}.txt")
    return Dictionary.load(path) if os.path.isfile(path) else None


def init_drafter_from_verifier(drafter, verifier_path: str, src_dict, tgt_dict) -> Dict[str, List[str]]:
    """Copy the verifier's encoder and embeddings into ``drafter`` in place.

    Returns ``{"copied": [...], "not_copied": [...]}`` (drafter tensor names);
    raises ``ValueError`` when the dictionaries differ or a mapped tensor has
    another shape.
    """
    if not os.path.isfile(verifier_path):
        raise FileNotFoundError(f"--init-from-verifier {verifier_path}: no such file")
    state = checkpoint_utils.load_checkpoint_to_cpu(verifier_path)
    source = state["model"]
    model_cfg = (state.get("cfg") or {}).get("model") if state.get("cfg") is not None else None

    for side, dictionary, key in (
        ("source", src_dict, "encoder.embed_tokens.weight"),
        ("target", tgt_dict, "decoder.embed_tokens.weight"),
    ):
        rows = source[key].size(0) if key in source else None
        if rows is not None and rows != len(dictionary):
            raise ValueError(
                f"--init-from-verifier: the verifier's {side} embedding has {rows} rows but the "
                f"{side} dictionary has {len(dictionary)} types: the dictionaries differ"
            )
        verifier_dict = _verifier_dictionary(state, side)
        if verifier_dict is not None and dictionary_fingerprint(verifier_dict) != dictionary_fingerprint(dictionary):
            raise ValueError(
                f"--init-from-verifier: the verifier's {side} dictionary differs from this task's"
            )

    drafter_args = getattr(drafter, "args", None)
    for name in _ENCODER_SEMANTICS:
        v, d = _cfg_value(model_cfg, name), getattr(drafter_args, name, None)
        if v is not None and d is not None and v != d:
            logger.warning(
                f"--init-from-verifier: {name} is {v!r} in the verifier but {d!r} in the "
                "drafter; the copied tensors will not compute the same function"
            )

    target = drafter.state_dict()
    copied: List[str] = []
    mapping: Dict[str, str] = {}
    for name in target:
        if name.startswith("encoder.") and name in source and name != "encoder.embed_tokens.weight":
            if name.startswith("encoder.embed_positions") and "_float_tensor" in name:
                continue
            mapping[name] = name
    embedding_pairs = [("encoder.embed_tokens.weight", "encoder.embed_tokens.weight")]
    shared = drafter.decoder.embed_tokens is drafter.encoder.embed_tokens
    if not shared and "decoder.embed_tokens.weight" in source:
        embedding_pairs.append(("decoder.embed_tokens.weight", "decoder.embed_tokens.weight"))

    params = dict(drafter.named_parameters())
    params.update(dict(drafter.named_buffers()))
    with torch.no_grad():
        for dst, src in mapping.items():
            if params[dst].shape != source[src].shape:
                raise ValueError(
                    f"--init-from-verifier: {src} has shape {tuple(source[src].shape)} in the "
                    f"verifier but {tuple(params[dst].shape)} in the drafter"
                )
            params[dst].copy_(source[src])
            copied.append(dst)
        for dst, src in embedding_pairs:
            rows = source[src].size(0)
            if params[dst].size(0) != rows + 1 or params[dst].size(1) != source[src].size(1):
                raise ValueError(
                    f"--init-from-verifier: {src} has shape {tuple(source[src].shape)}; the "
                    f"drafter's {dst} must be {rows + 1} x {source[src].size(1)} "
                    f"(one extra mask row), got {tuple(params[dst].shape)}"
                )
            params[dst][:rows].copy_(source[src])
            copied.append(f"{dst}[:{rows}]")
    copied_names = {c.split("[")[0] for c in copied}
    if shared:
        copied_names.add("decoder.embed_tokens.weight")
    not_copied = [n for n in target if n not in copied_names]
    logger.info(
        f"initialized the drafter from verifier {verifier_path}: copied {len(copied)} tensors: "
        + ", ".join(copied)
    )
    if shared:
        logger.info("decoder.embed_tokens.weight is the encoder embedding (shared), copied with it")
    logger.info(
        f"kept at initialization ({len(not_copied)} tensors, incl. the mask row of the embedding): "
        + ", ".join(not_copied)
    )
    used = set(mapping.values()) | {src for _, src in embedding_pairs}
    unused = sorted({".".join(k.split(".")[:2]) for k in source if k not in used})
    logger.info("verifier tensors not used (by group): " + ", ".join(unused))
    return {"copied": copied, "not_copied": not_copied}


def init_blockwise_from_verifier(model, verifier_path: str) -> Dict[str, List[str]]:
    """Load a trained ``transformer`` into the base of a ``blockwise_transformer``:
    every verifier tensor must exist in the model with the same shape; only
    the heads (``heads.*``) keep their initialization."""
    if not os.path.isfile(verifier_path):
        raise FileNotFoundError(f"--init-from-verifier {verifier_path}: no such file")
    source = checkpoint_utils.load_checkpoint_to_cpu(verifier_path)["model"]
    target = model.state_dict()
    unexpected = sorted(k for k in source if k not in target)
    if unexpected:
        raise ValueError(f"--init-from-verifier: the blockwise model has no tensor named {unexpected[:5]}")
    for name, tensor in source.items():
        if target[name].shape != tensor.shape:
            raise ValueError(
                f"--init-from-verifier: {name} has shape {tuple(tensor.shape)} in the verifier "
                f"but {tuple(target[name].shape)} in the blockwise model"
            )
    not_copied = [k for k in target if k not in source]
    model.load_state_dict({**target, **source}, strict=True)
    logger.info(
        f"initialized the blockwise model from {verifier_path}: copied all {len(source)} verifier "
        f"tensors; kept at initialization: {', '.join(not_copied)}"
    )
    return {"copied": list(source), "not_copied": not_copied}
