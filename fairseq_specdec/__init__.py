"""fairseq-specdec: lossless speculative (draft-then-verify) decoding for fairseq.

Load it with ``--user-dir /path/to/fairseq_specdec``: importing the package
installs the compatibility layer (:mod:`fairseq_specdec.compat`) and registers
the task ``draft_verify``, the model ``specdec_nat`` and the criterion
``glat_block``.
"""
from . import compat

compat.install_safe_checkpoint_loading()

# These imports load fairseq.models, whose import runs a stray logging.basicConfig.
from . import criterions, models, tasks  # noqa: E402,F401

compat.restore_fairseq_logging()

__version__ = "0.1.0"
