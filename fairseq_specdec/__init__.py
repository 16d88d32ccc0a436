"""fairseq-specdec: lossless speculative (draft-then-verify) decoding for fairseq.

Load it with ``--user-dir path/to/fairseq_specdec``.  Importing the package,
in this order: installs the compatibility layer (:mod:`fairseq_specdec.compat`);
registers the models (``specdec_nat``, ``specdec_vsd``,
``blockwise_transformer``) and the criteria (``glat_block``,
``blockwise_heads``) with fairseq; registers the built-in decodings
(:data:`fairseq_specdec.generation.build.BUILTIN_DECODINGS`: ``draft-verify``,
``input-guided``, ``blockwise``, ``ngram``, ``loop-greedy``), before the task, whose
``--decoding`` help lists them; and registers the task ``draft_verify``.

The layers import downwards only (``tests/test_imports.py`` checks it):
``utils`` <- ``models`` <- ``criterions``, ``generation`` <- ``tasks`` <-
``hub``, ``bench``; ``compat`` stands apart.
"""
from . import compat

compat.install_safe_checkpoint_loading()
compat.install_cli_refusals()

# These imports load fairseq.models, whose import runs a stray logging.basicConfig.
from . import criterions, models  # noqa: E402,F401
from .generation.build import register_builtin_decodings  # noqa: E402

register_builtin_decodings()

from . import tasks  # noqa: E402,F401

compat.restore_fairseq_logging()

from .version import __version__  # noqa: E402,F401
