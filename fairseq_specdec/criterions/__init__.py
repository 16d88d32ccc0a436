from .glat_block import GlatBlockCriterion  # noqa: F401
