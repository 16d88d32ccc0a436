from .blockwise_transformer import BlockwiseTransformerModel  # noqa: F401
from .specdec_nat import SpecDecNATModel  # noqa: F401
from .specdec_vsd import SpecDecVSDModel  # noqa: F401
