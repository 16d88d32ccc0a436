"""Build one row's decoder exactly as ``fairseq-generate`` builds it."""
import os
import re
from contextlib import contextmanager
from typing import Dict, FrozenSet, List, Tuple

#: a row option that is an environment assignment (NAME=value, the name upper-case)
ASSIGNMENT = re.compile(r"^([A-Z_][A-Z0-9_]*)=(.*)$")

#: a row's assignment of this name switches native parts off for that row
#: (comma-separated names of :data:`fairseq_specdec.kernels.PARTS`), to
#: measure what each gains; the benchmark's only, never read by decoding
OFF_ENV = "FAIRSEQ_SPECDEC_OFF"


def parts_off(text: str) -> FrozenSet[str]:
    """The native parts of a row's ``FAIRSEQ_SPECDEC_OFF=text``; an unknown
    name is refused, naming the variable."""
    from fairseq_specdec.kernels import check_parts

    return check_parts((n.strip() for n in text.split(",") if n.strip()), where=f"{OFF_ENV}={text}: ")


def split_environment(extra: List[str]) -> Tuple[Dict[str, str], List[str]]:
    """A row's options as ``(environment, fairseq-generate options)``: the
    ``NAME=value`` words (environment assignments with an upper-case name,
    e.g. ``FAIRSEQ_SPECDEC_OFF=accept``; no fairseq option or value looks
    like one) are set while the row's generator is built; the rest are
    fairseq-generate's options, in their order.  ``FAIRSEQ_SPECDEC_ISA``
    and ``FAIRSEQ_SPECDEC_PREFETCH`` are refused: they are read once, at
    import, so a row's assignment would change nothing."""
    from fairseq_specdec.kernels import ISA_ENV, PREFETCH_ENV

    env, rest = {}, []
    for word in extra:
        match = ASSIGNMENT.match(word)
        if match is None:
            rest.append(word)
        elif match.group(1) in (ISA_ENV, PREFETCH_ENV):
            raise ValueError(f"{word}: {match.group(1)} is read once, when the plugin is imported, so one row cannot "
                             f"set it; set it for the whole command, and compare settings in two processes "
                             f"(docs/benchmarking.md)")
        else:
            env[match.group(1)] = match.group(2)
    return env, rest


@contextmanager
def environment(env: Dict[str, str]):
    """``os.environ`` with ``env`` set inside, as it was after."""
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

#: the plugin directory, fairseq's ``--user-dir`` when the row names no other plugin
PLUGIN = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def generate_argv(spec: Dict) -> list:
    """fairseq-generate's command line (after the program name) for ``spec``."""
    argv = [
        spec["data"], "--user-dir", spec.get("user_dir") or PLUGIN, "--task", "draft_verify",
        "--gen-subset", spec.get("subset", "test"), "--path", spec["path"],
        "--batch-size", str(spec["batch_size"]), "--beam", str(spec["beam"]),
        "--source-lang", spec["src"], "--target-lang", spec["tgt"],
    ]
    if spec.get("device", "cpu") == "cpu":
        argv.append("--cpu")
    if spec.get("fp16"):  # fairseq-generate --fp16: every model cast to float16
        argv.append("--fp16")
    return argv + split_environment(list(spec.get("extra", [])))[1]


def setup_task(spec: Dict):
    """fairseq-generate's parsed options and task for ``spec``, threads pinned:
    ``(cfg, task)``, nothing loaded yet."""
    import torch

    torch.set_num_threads(spec["threads"])
    import fairseq_specdec  # noqa: F401
    from fairseq import options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    parser = options.get_generation_parser()
    args = options.parse_args_and_arch(parser, generate_argv(spec))
    cfg = convert_namespace_to_omegaconf(args)
    return cfg, tasks.setup_task(cfg.task)


def first_sentences(dataset, limit: int):
    """``dataset`` cut to the first ``limit`` sentences of its batch order
    (``ordered_indices``, which does not depend on the batch size), so that
    every batch size decodes the same sentences; ids stay the dataset's."""
    from fairseq.data import BaseWrapperDataset

    class FirstSentences(BaseWrapperDataset):
        def ordered_indices(self):
            return self.dataset.ordered_indices()[:limit]

    return FirstSentences(dataset)


def batch_source(spec: Dict, task, cfg, max_positions, task_cfg=None):
    """``batches()``: the test set (its first ``spec["limit"]`` sentences in
    fairseq's batch order, the same sentences at every batch size) in
    batches of ``spec["batch_size"]``, on the spec's device.  Every row of
    one batch size, whatever decodes it, sees these batches."""
    from fairseq import utils

    task.load_dataset(cfg.dataset.gen_subset, task_cfg=task_cfg)
    dataset = task.dataset(cfg.dataset.gen_subset)
    if spec.get("limit") is not None:
        dataset = first_sentences(dataset, spec["limit"])
    use_cuda = spec.get("device", "cpu") == "cuda"

    def batches():
        itr = task.get_batch_iterator(
            dataset=dataset, max_sentences=spec["batch_size"], max_positions=max_positions,
            ignore_invalid_inputs=False, num_workers=0,
        ).next_epoch_itr(shuffle=False)
        for sample in itr:
            yield utils.move_to_cuda(sample) if use_cuda else sample

    return batches


def load_decoder(spec: Dict):
    """Models, task and generator of one configuration, exactly as
    ``fairseq-generate`` builds them, with threads pinned (and the row's
    environment assignments set while its generator is built:
    :func:`split_environment`; ``FAIRSEQ_SPECDEC_OFF=PARTS`` switches those
    native parts off for this row's generator, :func:`parts_off`).  Returns
    ``(task, models, generator, batches)``; ``batches()`` yields the test set
    (its first ``spec["limit"]`` sentences) in fairseq's batch order, on the
    spec's device (``"cpu"`` unless ``spec["device"]`` says ``"cuda"``)."""
    from fairseq import checkpoint_utils, utils

    cfg, task = setup_task(spec)
    models, saved_cfg = checkpoint_utils.load_model_ensemble(
        utils.split_paths(cfg.common_eval.path), task=task
    )
    use_cuda = spec.get("device", "cpu") == "cuda"
    for model in models:
        if cfg.common.fp16:  # as fairseq-generate: --fp16 casts every model to float16
            model.half()
        if use_cuda:
            model.cuda()
        model.eval()
        model.prepare_for_inference_(cfg)
    # the dataset is loaded after the checkpoint, with its task config, as fairseq-generate does
    max_positions = utils.resolve_max_positions(task.max_positions(), *[m.max_positions() for m in models])
    batches = batch_source(spec, task, cfg, max_positions, task_cfg=saved_cfg.task)
    env = split_environment(list(spec.get("extra", [])))[0]
    task.generation_services.parts_off = parts_off(env.pop(OFF_ENV, ""))
    with environment(env):
        generator = task.build_generator(models, cfg.generation)
    return task, models, generator, batches
