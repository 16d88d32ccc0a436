"""The Python API: fairseq's hub interface with speculative decoding.

::

    from fairseq_specdec.hub import from_pretrained

    translator = from_pretrained(
        "runs/multi30k.en-de/verifier", checkpoint_file="checkpoint_best.pt",
        data_name_or_path="data/multi30k.en-de/bin",
        decoding="draft-verify", drafter_path="runs/multi30k.en-de/drafter/checkpoint_selected.pt",
    )
    translator.translate("two dogs play in the snow .")

Why a helper: fairseq's ``TransformerModel.from_pretrained(..., **kwargs)``
hands its keywords to ``checkpoint_utils.load_model_ensemble_and_task`` as
``arg_overrides``, and ``overwrite_args_by_name`` sets only the options the
checkpoint's configuration already has.  For a verifier trained with ``--task
translation`` (the recommended one) a flat ``task='draft_verify'`` cannot
replace the stored task, and ``decoding=``/``drafter_path=`` exist in no
section of it: they would be dropped without a word (the plugin now refuses
that call, see :func:`fairseq_specdec.compat._check_task_override`).  fairseq
does switch the task when it is given as a dict, ``task={'_name':
'draft_verify', ...}``, but then the flat ``data`` override no longer reaches
the task.  :func:`from_pretrained` takes flat keywords and builds that dict
(data directory included).

Under a speculative decoding, ``translate()``, ``sample()`` and
``generate()`` of the returned :class:`SpecDecHubInterface` decode greedily
(beam 1) unless given another beam, which the decoding then refuses; fairseq's
own hub defaults ``translate()`` to beam 5.  Every ``translate()`` logs its
statistics line, and the drafter checkpoint is read once.

The translator builds its generator once when it is made, so that every
option the decoding refuses (a missing drafter file, ``ngram_order=0``,
``draft-verify`` without a drafter, ...) raises from :func:`from_pretrained`,
not from the first request; only the keywords given to ``translate()``
itself are checked there.
"""
import copy
import logging
import os
from typing import Optional

from omegaconf import open_dict

from fairseq import file_utils, hub_utils
from fairseq.hub_utils import GeneratorHubInterface

from .generation.registry import AUTOREGRESSIVE
from .generation.speculative import SpeculativeGenerator
from .tasks.draft_verify import DraftVerifyConfig, DraftVerifyTask

logger = logging.getLogger(__name__)

TASK = "draft_verify"
#: the options of the draft_verify task (translation's included)
TASK_OPTIONS = frozenset(DraftVerifyConfig.__dataclass_fields__) - {"_name"}


def _fairseq_options() -> frozenset:
    """Every option name of fairseq's configuration sections (common,
    dataset, generation, ...): the keywords fairseq's ``from_pretrained``
    may override."""
    from fairseq.dataclass.configs import FairseqConfig

    names = set()
    for section in FairseqConfig.__dataclass_fields__.values():
        fields = getattr(section.type, "__dataclass_fields__", None) if isinstance(section.type, type) else None
        names.update(fields or ())
    return frozenset(names)


def check_keywords(keywords) -> None:
    """Refuse a keyword that is no option but nearly one (a typo such as
    ``draft_treee=5``): fairseq drops overrides that match nothing, so the
    option would silently keep its default.  Other unknown keywords pass on
    to fairseq (model options, a bpe's settings)."""
    import difflib

    known = TASK_OPTIONS | _fairseq_options()
    for name in keywords:
        if name in known:
            continue
        close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.8)
        if close:
            raise ValueError(f"from_pretrained: unknown keyword argument {name!r}; did you mean {close[0]!r}?")


def _data_dir(model_name_or_path: str, data_name_or_path: str) -> Optional[str]:
    """The data directory, resolved as fairseq's ``hub_utils.from_pretrained`` does."""
    if data_name_or_path.startswith("."):
        model_path = file_utils.load_archive_file(model_name_or_path)
        return os.path.abspath(os.path.join(model_path, data_name_or_path))
    return file_utils.load_archive_file(data_name_or_path)


def from_pretrained(
    model_name_or_path: str,
    checkpoint_file: str = "model.pt",
    data_name_or_path: str = ".",
    decoding: str = "draft-verify",
    **kwargs,
) -> "SpecDecHubInterface":
    """Load a verifier (any fairseq Transformer checkpoint, whatever task it
    was trained with) under the ``draft_verify`` task.

    Takes the arguments of fairseq's ``from_pretrained`` (model directory,
    ``checkpoint_file``, ``data_name_or_path``, ``tokenizer=``, ``bpe=``,
    ``bpe_codes=``, ...) plus every option of the task as a flat keyword:
    ``decoding`` (default ``draft-verify``), ``drafter_path``, ``block_size``,
    ``verify_beta``, ``verify_tau``, ``adaptive_draft``, ...  ``user_dir`` is
    not needed: this package is the plugin.
    """
    task = kwargs.pop("task", TASK)
    if task != TASK:
        raise ValueError(f"fairseq_specdec.hub.from_pretrained loads the {TASK} task, got task={task!r}")
    kwargs.pop("user_dir", None)
    check_keywords(kwargs)
    task_options = {name: kwargs.pop(name) for name in list(kwargs) if name in TASK_OPTIONS}
    task_options.setdefault("data", _data_dir(model_name_or_path, data_name_or_path))
    loaded = hub_utils.from_pretrained(
        model_name_or_path,
        checkpoint_file,
        data_name_or_path,
        task={"_name": TASK, "decoding": decoding, **task_options},
        **kwargs,
    )
    return SpecDecHubInterface(loaded["args"], loaded["task"], loaded["models"])


class SpecDecHubInterface(GeneratorHubInterface):
    """fairseq's ``GeneratorHubInterface`` whose beam defaults to 1 under a
    speculative decoding (fairseq's defaults otherwise)."""

    _noted = False

    def __init__(self, cfg, task, models):
        super().__init__(cfg, task, models)
        if self.decoding != AUTOREGRESSIVE:
            self._check_generator()

    def _check_generator(self) -> None:
        """Build the generator ``translate()`` will build (its default
        options, beam 1), so that what it refuses is refused now."""
        gen_args = copy.deepcopy(self.cfg.generation)
        with open_dict(gen_args):
            gen_args.beam = 1
        generator = self.task.build_generator(self.models, gen_args)
        if isinstance(generator, SpeculativeGenerator):
            generator.stats.close()

    @property
    def decoding(self) -> str:
        return self.task.cfg.decoding if isinstance(self.task, DraftVerifyTask) else AUTOREGRESSIVE

    def _beam(self, beam: Optional[int], fairseq_default: int) -> int:
        if beam is not None:
            return beam
        if self.decoding == AUTOREGRESSIVE:
            return fairseq_default
        if not self._noted:
            logger.info(f"--decoding {self.decoding} is greedy: decoding with beam 1")
            self._noted = True
        return 1

    def translate(self, sentences, beam: Optional[int] = None, verbose: bool = False, **kwargs):
        return super().translate(sentences, self._beam(beam, 5), verbose, **kwargs)

    def sample(self, sentences, beam: Optional[int] = None, verbose: bool = False, **kwargs):
        return super().sample(sentences, self._beam(beam, 1), verbose, **kwargs)

    def generate(self, tokenized_sentences, beam: Optional[int] = None, verbose: bool = False, **kwargs):
        return super().generate(tokenized_sentences, self._beam(beam, 5), verbose, **kwargs)
