"""Reading fairseq's encoder output dictionary, and fairseq's output length
limit: the few facts of fairseq's generation contract that models, the loop
and the benchmark's CTranslate2 rows all need."""
from typing import Optional, Tuple

import torch
from torch import Tensor


def encoder_states(encoder_out) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """``(encoder output S x B x C or None, padding mask B x S or None)``."""
    enc = encoder_out["encoder_out"][0] if len(encoder_out["encoder_out"]) > 0 else None
    pad = encoder_out["encoder_padding_mask"]
    return enc, (pad[0] if len(pad) > 0 else None)


def source_padding(encoder_out) -> Tensor:
    """B x S bool padding mask of the source (all false when fairseq left it
    out because no row is padded)."""
    enc, pad = encoder_states(encoder_out)
    if pad is not None:
        return pad
    enc = enc if enc is not None else encoder_out["encoder_embedding"][0].transpose(0, 1)
    return torch.zeros((enc.size(1), enc.size(0)), dtype=torch.bool, device=enc.device)


def max_output_length(max_len_a: float, max_len_b: int, src_len: int, max_positions: int) -> int:
    """fairseq ``SequenceGenerator``'s output length limit (EOS excluded) for
    a batch whose padded source, EOS included, has ``src_len`` tokens:
    ``--max-len-a`` x src_len + ``--max-len-b``, within the decoder's positions."""
    return min(int(max_len_a * src_len + max_len_b), max_positions - 1)
