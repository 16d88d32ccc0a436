"""From a drafter checkpoint to the loop's drafter."""
from ...models.protocol import DrafterModel, SourceReadingDrafterModel, VerifierStateDrafterModel
from .base import NO_KERNELS, DraftKernels, Drafter
from .nat import NATBlockDrafter
from .vsd import VerifierStateDrafter


def drafter_for_model(model, verifier_model, need_scores: bool, source: str,
                      kernels: DraftKernels = NO_KERNELS) -> Drafter:
    """The loop's drafter for a drafter checkpoint (``source``: where it came
    from, for messages): one drafter class per kind of
    :class:`~fairseq_specdec.models.protocol.DrafterModel`.
    ``need_scores``: the drafts' log-probs are needed (acceptance by drafter
    score, or a confidence cut); ``kernels``: what it may compute with the
    plugin's kernels (the backend's choice)."""
    if isinstance(model, VerifierStateDrafterModel):
        return VerifierStateDrafter(model, verifier_model, model.cfg.shortlist, source, kernels)
    if isinstance(model, SourceReadingDrafterModel):
        return NATBlockDrafter(model, verifier_model, with_scores=need_scores)
    kind = "a drafter of no kind the generator knows" if isinstance(model, DrafterModel) else "not a drafter"
    raise ValueError(f"{source}: a {type(model).__name__} model is {kind} (specdec_nat or specdec_vsd)")
