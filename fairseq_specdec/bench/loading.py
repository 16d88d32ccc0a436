"""Build one row's decoder exactly as ``fairseq-generate`` builds it."""
import os
from typing import Dict

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
    return argv + list(spec.get("extra", []))


def load_decoder(spec: Dict):
    """Models, task and generator of one configuration, exactly as
    ``fairseq-generate`` builds them, with threads pinned.  Returns
    ``(task, models, generator, batches)``; ``batches()`` yields the test set
    (its first ``spec["limit"]`` sentences) in fairseq's batch order, on the
    spec's device (``"cpu"`` unless ``spec["device"]`` says ``"cuda"``)."""
    import torch

    torch.set_num_threads(spec["threads"])
    import fairseq_specdec  # noqa: F401
    from fairseq import checkpoint_utils, options, tasks, utils
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    parser = options.get_generation_parser()
    args = options.parse_args_and_arch(parser, generate_argv(spec))
    cfg = convert_namespace_to_omegaconf(args)
    task = tasks.setup_task(cfg.task)
    models, saved_cfg = checkpoint_utils.load_model_ensemble(
        utils.split_paths(cfg.common_eval.path), task=task
    )
    use_cuda = spec.get("device", "cpu") == "cuda"
    for model in models:
        if use_cuda:
            model.cuda()
        model.eval()
        model.prepare_for_inference_(cfg)
    task.load_dataset(cfg.dataset.gen_subset, task_cfg=saved_cfg.task)
    dataset = task.dataset(cfg.dataset.gen_subset)
    generator = task.build_generator(models, cfg.generation)
    max_positions = utils.resolve_max_positions(task.max_positions(), *[m.max_positions() for m in models])
    limit = spec.get("limit")

    def batches():
        itr = task.get_batch_iterator(
            dataset=dataset, max_sentences=spec["batch_size"], max_positions=max_positions,
            ignore_invalid_inputs=False, num_workers=0,
        ).next_epoch_itr(shuffle=False)
        seen = 0
        for sample in itr:
            if limit is not None and seen >= limit:
                break
            seen += len(sample["id"])
            yield utils.move_to_cuda(sample) if use_cuda else sample

    return task, models, generator, batches

