"""Session fixtures: the toy corpus and the tiny models, each built once per run.

Fixtures are lazy: the fast tests only binarize the toy corpus; the models are
trained the first time a (slow) test asks for them.  ``make test`` runs the
suite on two processes (pytest-xdist); a corpus or model that a fixture
writes to disk is built once for the whole run, by whichever process asks
first, under a file lock (:func:`shared`), and the other process reads it.
"""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import specdec_helpers as H  # noqa: E402

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)


def shared(tmp_path_factory, name, build):
    """``build(directory)`` (a JSON value: paths, logs) run once per test run
    for ``name``: under pytest-xdist the workers share the directory above
    their own temporary roots, and a file lock makes the first one build and
    the others wait and read its result."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    root = base / "shared" / name
    root.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root) + ".lock"):
        done = root / ".built.json"
        if done.is_file():
            return json.loads(done.read_text())
        root.mkdir(exist_ok=True)
        value = build(root)
        done.write_text(json.dumps(value))
        return value


def write_toy_bin(root, splits, make):
    """Write the ``splits`` of a toy corpus under root/raw and binarize them
    (one joined dictionary) into root/bin; every split but train/valid is a test split."""
    import toy_corpus

    raw, dest = root / "raw", root / "bin"
    toy_corpus.write_corpus(str(raw), splits, make=make)
    toy_corpus.binarize(str(raw), str(dest), tests=tuple(s for s in splits if s not in ("train", "valid")))
    return str(dest)


@pytest.fixture(scope="session")
def toy_bin(tmp_path_factory):
    """Binarized toy corpus: train/valid and test splits test (50), test1 (57), test2 (1000)."""
    import toy_corpus

    return shared(tmp_path_factory, "toy", lambda root: write_toy_bin(root, H.SPLITS, toy_corpus.make_lines))


def train_tiny_transformer(data, save_dir):
    """checkpoint_best.pt of the tiny Transformer trained on ``data`` by stock
    fairseq-train (no --user-dir)."""
    H.run([
        H.cli("fairseq-train"), data, "--task", "translation", *H.AR_ARCH_ARGS, *H.OPTIM_ARGS,
        "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
        "--max-update", "400", "--save-dir", save_dir,
    ])
    path = save_dir / "checkpoint_best.pt"
    assert path.is_file()
    return str(path)


@pytest.fixture(scope="session")
def ar_checkpoint(toy_bin, tmp_path_factory):
    """A tiny Transformer translation model."""
    return shared(tmp_path_factory, "ckpt_ar", lambda root: train_tiny_transformer(toy_bin, root))


@pytest.fixture(scope="session")
def vsd_training(toy_bin, ar_checkpoint, tmp_path_factory):
    """(checkpoint, training log) of the tiny specdec_vsd drafter on the
    ar_checkpoint verifier (200 updates)."""
    def build(save_dir):
        proc = H.run([
            H.cli("fairseq-train"), toy_bin, "--user-dir", H.USER_DIR, *H.VSD_ARGS, "--block-size", "4",
            "--init-from-verifier", ar_checkpoint, *H.OPTIM_ARGS, "--max-update", "200", "--save-dir", save_dir,
        ])
        return [str(save_dir / "checkpoint_last.pt"), proc.stdout + proc.stderr]

    return tuple(shared(tmp_path_factory, "ckpt_vsd", build))


@pytest.fixture(scope="session")
def vsd_checkpoint(vsd_training):
    return vsd_training[0]


@pytest.fixture(scope="session")
def nat_training(toy_bin, tmp_path_factory):
    """(checkpoint path, training log) of a tiny specdec_nat drafter, k = 4."""
    def build(save_dir):
        proc = H.run([
            H.cli("fairseq-train"), toy_bin, "--user-dir", H.USER_DIR, *H.NAT_ARGS, "--block-size", "4",
            *H.OPTIM_ARGS, "--max-update", "200", "--save-dir", save_dir,
        ])
        path = save_dir / "checkpoint_best.pt"
        assert path.is_file()
        return [str(path), proc.stdout + proc.stderr]

    return tuple(shared(tmp_path_factory, "ckpt_nat", build))


@pytest.fixture(scope="session")
def nat_checkpoint(nat_training):
    return nat_training[0]


@pytest.fixture(scope="session")
def random_drafter_checkpoint(toy_bin, tmp_path_factory):
    """An untrained specdec_nat_tiny (k = 4) saved in-process as a checkpoint."""
    model, _, cfg = H.build_untrained_drafter(toy_bin, seed=7, block_size=4)
    path = tmp_path_factory.mktemp("ckpt_rand") / "random_drafter.pt"
    return H.save_model_checkpoint(model, cfg, path)


@pytest.fixture(scope="session")
def stock_beam1(toy_bin, tmp_path_factory):
    """``get(path, *extra, batch_size=1, task="draft_verify", split="test")``:
    the hypotheses (:func:`specdec_helpers.parse_generate`) of
    ``fairseq-generate --beam 1`` with a checkpoint on the toy corpus, the
    reference many test files compare with; each set of arguments is run
    once per test run (:func:`shared`) and handed out as a new dict."""
    import hashlib
    from pathlib import Path

    cache = {}

    def get(path, *extra, batch_size=1, task="draft_verify", split="test"):
        key = (str(path), tuple(str(e) for e in extra), batch_size, task, split)
        if key not in cache:
            def build(root):
                proc = H.generate(toy_bin, path, *extra, task=task, batch_size=batch_size, split=split)
                (root / "stdout.txt").write_text(proc.stdout)
                return str(root / "stdout.txt")

            name = "beam1_" + hashlib.sha1(repr(key).encode()).hexdigest()[:16]
            cache[key] = H.parse_generate(Path(shared(tmp_path_factory, name, build)).read_text())
        return dict(cache[key])

    return get


@pytest.fixture(scope="session")
def baseline(ar_checkpoint, stock_beam1):
    """``get(bsz, split="test")``: fairseq's own ``--beam 1`` with the toy
    Transformer (the stock translation task, nothing dropped: every
    sentence of the split)."""

    def get(bsz, split="test"):
        hyps = stock_beam1(ar_checkpoint, "--required-batch-size-multiple", "1", task="translation", batch_size=bsz,
                           split=split)
        assert sorted(hyps) == list(range(H.SPLIT_SIZES[split]))
        return hyps

    return get


@pytest.fixture(scope="session")
def verifier(ar_checkpoint, toy_bin):
    """(model, task) of the trained tiny Transformer, loaded in-process."""
    return H.load_model(ar_checkpoint, toy_bin)


@pytest.fixture(scope="session")
def beam1_reference(verifier):
    """``get(option set, batch size) -> {id: hypothesis}``: fairseq's own
    ``--beam 1`` SequenceGenerator on the ``verifier`` fixture's test split,
    each (option set, batch size) decoded once per session."""
    model, task = verifier
    cache = {}

    def get(opts, bsz):
        if (opts, bsz) not in cache:
            gen = H.seq_gen(model, task.target_dictionary, H.OPTION_SETS[opts])
            cache[(opts, bsz)] = H.run_generator(gen, model, H.batches(task, "test", bsz))
        return cache[(opts, bsz)]

    return get


@pytest.fixture(scope="session")
def tiny_drafter(toy_bin):
    """(model, task, cfg): an untrained in-process specdec_nat_tiny, eval mode."""
    model, task, cfg = H.build_untrained_drafter(toy_bin, seed=3, block_size=4)
    return model.eval(), task, cfg


@pytest.fixture(scope="session")
def correction_bin(tmp_path_factory):
    """Binarized toy correction corpus (one joined dictionary): train/valid/test (50)."""
    import toy_corpus

    splits = {name: H.SPLITS[name] for name in ("train", "valid", "test")}
    return shared(tmp_path_factory, "toy_correction",
                  lambda root: write_toy_bin(root, splits, toy_corpus.make_correction_lines))


@pytest.fixture(scope="session")
def corrector_checkpoint(correction_bin, tmp_path_factory):
    """A tiny Transformer corrector (same model and training as ar_checkpoint)."""
    return shared(tmp_path_factory, "ckpt_corrector", lambda root: train_tiny_transformer(correction_bin, root))


@pytest.fixture(scope="session")
def blockwise_checkpoint(toy_bin, ar_checkpoint, tmp_path_factory):
    """A blockwise_transformer (k = 3): the trained tiny Transformer plus two
    heads trained on its frozen states with the blockwise_heads criterion."""
    arch = [a if a != "transformer" else "blockwise_transformer" for a in H.AR_ARCH_ARGS]

    def build(save_dir):
        H.run([
            H.cli("fairseq-train"), toy_bin, "--user-dir", H.USER_DIR, "--task", "draft_verify", *arch,
            "--blockwise-k", "3", "--criterion", "blockwise_heads", "--init-from-verifier", ar_checkpoint,
            *H.OPTIM_ARGS, "--max-update", "300", "--save-dir", save_dir,
        ])
        path = save_dir / "checkpoint_best.pt"
        assert path.is_file()
        return str(path)

    return shared(tmp_path_factory, "ckpt_blockwise", build)


def pytest_configure(config):
    # fairseq/hydra deprecation noise
    config.addinivalue_line("filterwarnings", "ignore::UserWarning")


#: the test files that take longest, in that order, run first: ``make test``
#: hands whole files to its two processes (``--dist loadfile``) in
#: collection order (``--no-loadscope-reorder``; pytest-xdist would order
#: them by their number of tests), so that no long file starts when the
#: other process is nearly done
LONGEST_FIRST = ("test_verifier_variants.py", "test_cli.py", "test_bench_package.py", "test_draft_trees.py",
                 "test_family.py", "test_cli_errors.py", "test_half_precision.py", "test_specdec_vsd.py",
                 "test_benchmark.py", "test_self_draft.py", "test_distill_shards.py")


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    # a stable sort: the other files keep their order after these, and the tests of a file theirs
    items.sort(key=lambda item: rank.get(os.path.basename(str(item.fspath)), len(rank)))
