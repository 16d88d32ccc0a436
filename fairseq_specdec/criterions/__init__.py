from .blockwise_heads import BlockwiseHeadsCriterion  # noqa: F401
from .glat_block import GlatBlockCriterion  # noqa: F401
