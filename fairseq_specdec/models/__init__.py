from .specdec_nat import SpecDecNATModel, mask_index  # noqa: F401
