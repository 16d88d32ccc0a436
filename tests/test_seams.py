"""Capabilities are declared, not probed.

The project's own classes declare what they can do (a base class, an
abstract capability such as ``PathDrafter``, a field that is always set), so
no code asks them with ``hasattr(obj, "name")`` or ``getattr(obj, "name",
default)``.  The scan below finds every such call in the package whose
attribute name is one the project's classes define (a method, a class
attribute, a ``self.name =`` assignment); each left must be listed in
:data:`FOREIGN` with why its receiver is not the project's own object (a
fairseq module, a checkpoint's saved arguments).  A listed probe that is gone
fails too, so the list stays the list of today's probes.
"""
import ast

import specdec_helpers as H

PACKAGE = H.ROOT / "fairseq_specdec"

#: (file under fairseq_specdec/, attribute name) -> why the probed object is not the project's own
FOREIGN = {
    ("compat.py", "name"): "a file object of any kind (compat reads fairseq's and torch's objects)",
    ("compat.py", "task"): "a checkpoint's saved argparse Namespace",
    ("compat.py", "get"): "a checkpoint's saved config: an omegaconf DictConfig or a dict",
    ("generation/backend.py", "decoder"): "any fairseq model handed over as the verifier",
    ("generation/lean_verifier.py", "encoder"): "any fairseq model handed over as the verifier",
    ("generation/drafters/nat.py", "embed_scale"): "fairseq encoders (drafter's and verifier's) compared",
    ("generation/drafters/nat.py", "normalize_before"): "fairseq encoder layers compared",
    ("generation/ngram.py", "is_training_dataset"): "the fairseq task generation runs under, of any class",
    ("generation/verify_pass.py", "padding_idx"): "fairseq's positional embedding modules",
    ("generation/verify_pass.py", "output_projection"): "fairseq's decoder (none with an adaptive softmax)",
    ("generation/verify_pass.py", "adaptive_softmax"): "fairseq's decoder",
    ("models/specdec_vsd.py", "output_projection"): "the verifier's fairseq decoder",
    ("models/blockwise_transformer.py", "blockwise_k"): "arguments of checkpoints saved before the option",
    ("models/blockwise_transformer.py", "blockwise_shortlist"): "arguments of checkpoints saved before the option",
    ("models/specdec_nat.py", "src_embedding_copy"): "arguments of checkpoints saved before the option",
    ("models/init_from_verifier.py", "get"): "a checkpoint's saved config: an omegaconf DictConfig or a Namespace",
}


def project_names():
    """Every attribute name the package's classes define."""
    names = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ClassDef):
                continue
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(item.name)
                elif isinstance(item, ast.Assign):
                    names.update(t.id for t in item.targets if isinstance(t, ast.Name))
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    names.add(item.target.id)
            for sub in ast.walk(node):
                if (isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store)
                        and isinstance(sub.value, ast.Name) and sub.value.id == "self"):
                    names.add(sub.attr)
    return names


def probes(names, root=PACKAGE):
    """``{(file, name): [line, ...]}`` of every ``hasattr(x, "name")`` and
    ``getattr(x, "name", default)`` under ``root`` whose name is in ``names``."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
                continue
            kind = node.func.id
            if kind not in ("hasattr", "getattr") or len(node.args) < 2 or (kind == "getattr" and len(node.args) < 3):
                continue
            name = node.args[1]
            if isinstance(name, ast.Constant) and isinstance(name.value, str) and name.value in names:
                key = (path.relative_to(root).as_posix(), name.value)
                found.setdefault(key, []).append(node.lineno)
    return found


def test_no_capability_probe_on_the_projects_own_classes():
    found = probes(project_names())
    unlisted = {key: lines for key, lines in found.items() if key not in FOREIGN}
    assert not unlisted, f"probes of names the project's classes define (declare the capability instead): {unlisted}"
    gone = set(FOREIGN) - set(found)
    assert not gone, f"listed in FOREIGN but no longer probed (remove them): {sorted(gone)}"


def test_the_scan_finds_a_probe(tmp_path):
    """The scan is not blind: probes of a drafter's capability and of the
    generator's statistics are found; a getattr without a default (a plain
    read) and a name no class of the project defines are not."""
    names = project_names()
    assert {"tree_paths", "propose_tree", "stats", "freeze_encoder"} <= names
    (tmp_path / "mod.py").write_text('if hasattr(first, "tree_paths"):\n    pass\nx = getattr(g, "stats", None)\n'
                                     'y = getattr(g, "stats")\nz = hasattr(g, "no_such_name_anywhere")\n')
    assert probes(names, tmp_path) == {("mod.py", "tree_paths"): [1], ("mod.py", "stats"): [3]}


def test_generation_writes_nothing_to_the_task(toy_bin, ar_checkpoint, random_drafter_checkpoint):
    """Building generators (twice each: the second finds the drafter and the
    corpus in the task's GenerationServices) and decoding with them leaves
    the task object's attributes as they were: what generation keeps lives
    in the services the task hands over."""
    from fairseq import checkpoint_utils, tasks

    for argv in (["--decoding", "draft-verify", "--drafter-path", random_drafter_checkpoint],
                 ["--decoding", "ngram"]):
        cfg = H.generation_cfg(toy_bin, "--task", "draft_verify", "--path", ar_checkpoint, "--beam", "1", *argv)
        task = tasks.setup_task(cfg.task)
        models, _ = checkpoint_utils.load_model_ensemble([ar_checkpoint], task=task)
        samples = H.batches(task, "test", 4)[:2]  # fairseq loads the split into task.datasets: before the snapshot
        before = dict(vars(task))
        for _ in range(2):
            generator = task.build_generator(models, cfg.generation)
            for sample in samples:
                task.inference_step(generator, models, sample)
        after = vars(task)
        assert set(after) == set(before), sorted(set(after) ^ set(before))
        assert [k for k in before if after[k] is not before[k]] == []
        services = task.generation_services
        assert len(services.drafters if "draft-verify" in argv else services.ngram_corpora) == 1
