"""Dictionary helpers that models, the task and the generator share.

The drafters use their verifier's dictionary files unchanged; these helpers
name the drafter's one extra symbol (the mask) and check that a drafter and
its verifier agree on the dictionary."""
import hashlib


def mask_index(dictionary) -> int:
    """Index of the drafter's mask symbol: one past the dictionary's last type."""
    return len(dictionary)


def dictionary_fingerprint(dictionary) -> int:
    """A 63-bit hash of the dictionary's symbols, in order."""
    digest = hashlib.sha256("\n".join(dictionary.symbols).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def check_same_dictionary(drafter_fingerprint, verifier_fingerprint, drafter: str) -> None:
    """Refuse a drafter whose target dictionary is not the verifier's (same
    symbols in the same order), naming the drafter and the fix."""
    if int(drafter_fingerprint) != int(verifier_fingerprint):
        raise ValueError(
            f"{drafter} was trained with a different target dictionary than the "
            "verifier's: drafter and verifier must share one dictionary (binarize "
            "the drafter's data with the verifier's dict files)"
        )


def joined_dictionaries(model) -> bool:
    """Whether ``model``'s encoder and decoder share one embedding (and so one
    dictionary: source tokens are target types)."""
    return model.encoder.embed_tokens.weight.data_ptr() == model.decoder.embed_tokens.weight.data_ptr()
