"""The GPU kit (scripts/gpu-kit.sh, make gpu-kit) and its run script
(scripts/gpu-run.sh), checked on the CPU: the kit holds the data and one
wheel of every listed package (the download faked: CI may not reach the
registry), stays under its size limit, and says what is in it; the run
script's dry run prints every command with its budget, each fairseq-train
and fairseq-generate command parses with fairseq's own parsers, on the GPU
(no --cpu), in the kit's budgets; the report reads a run folder."""
import gzip
import json
import os
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import fairseq_specdec  # noqa: E402,F401  (registers the plugin's task, models and criteria)
from fairseq import options  # noqa: E402
from fairseq_specdec.bench import kit_summary  # noqa: E402
import specdec_helpers as H  # noqa: E402

KIT = os.path.join(ROOT, "scripts", "gpu-kit.sh")
RUN = os.path.join(ROOT, "scripts", "gpu-run.sh")
WHEELS = [line.split()[0] for line in open(os.path.join(ROOT, "configs", "gpu-kit-wheels.txt"))
          if line.strip() and not line.startswith("#")]

FAKE_PIP = r'''#!/usr/bin/env bash
# pip download/wheel -d|-w DIR ... NAME==VERSION: writes an empty wheel of that name
echo "$*" >> "$RECORD"
dir="" spec="${@: -1}"
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  case "${args[i]}" in -d|-w) dir=${args[i+1]};; esac
done
name=$(echo "${spec%%==*}" | tr '-' '_') version=${spec#*==}
touch "$dir/$name-$version-py3-none-any.whl"
'''


def clean_env(tmp_path, **extra):
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "LANG": "C.UTF-8"}
    env.update({k: str(v) for k, v in extra.items()})
    return env


@pytest.fixture
def prepared(tmp_path):
    """What prepare-multi30k.sh leaves (the files the kit copies), and the raw test reference."""
    data, raw = tmp_path / "data", tmp_path / "raw"
    for sub in ("bin", "bpe", "tok"):
        (data / sub).mkdir(parents=True)
    for name in ("dict.en.txt", "dict.de.txt", "train.en-de.en.bin", "test.en-de.de.bin"):
        (data / "bin" / name).write_text("x\n")
    for split in ("train", "val", "test_2016_flickr"):
        for lang in ("en", "de"):
            (data / "bpe" / f"{split}.{lang}").write_text("a b\n")
    (data / "tok" / "test_2016_flickr.de").write_text("ein Hund .\n")
    raw.mkdir()
    with gzip.open(raw / "test_2016_flickr.de.gz", "wt") as f:
        f.write("Ein Hund.\n")
    pip = tmp_path / "pip"
    pip.write_text(FAKE_PIP)
    pip.chmod(0o755)
    return data, raw, pip


def build_kit(tmp_path, prepared, *args, **env):
    data, raw, pip = prepared
    return subprocess.run(
        ["bash", KIT, "--out", str(tmp_path / "kit"), *args], cwd=ROOT, capture_output=True, text=True, timeout=120,
        env=clean_env(tmp_path, DATA=data, MULTI30K_RAW=raw, PIP=pip, RECORD=tmp_path / "pip.txt", **env),
    )


def test_kit_holds_the_data_and_a_cp312_wheel_of_every_package(tmp_path, prepared):
    proc = build_kit(tmp_path, prepared)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    kit = tmp_path / "kit"
    for path in ("data/bin/dict.de.txt", "data/bin/test.en-de.de.bin", "data/bpe/train.en", "data/bpe/val.de",
                 "data/tok/test_2016_flickr.de", "data/raw/test_2016_flickr.de.gz"):
        assert (kit / path).is_file(), path
    assert not (kit / "data" / "bpe" / "test_2016_flickr.en").exists()  # only what the GPU run reads
    wheels = sorted(os.listdir(kit / "wheels"))
    assert len(wheels) == len(WHEELS)
    for spec in WHEELS:
        name, version = spec.split("==")
        assert any(w.startswith(f"{name.replace('-', '_')}-{version}-") for w in wheels), spec
    assert not any(w.startswith("torch") for w in wheels)  # never carried
    calls = (tmp_path / "pip.txt").read_text().splitlines()
    downloads = [c for c in calls if c.startswith("download")]
    assert all("--python-version 3.12" in c and "--only-binary=:all:" in c and "--no-deps" in c for c in downloads)
    assert [c for c in calls if c.startswith("wheel")] == [
        f"wheel -q --no-deps -w {kit}/wheels antlr4-python3-runtime==4.9.3"]  # the source-only package
    manifest = (kit / "MANIFEST.txt").read_text()
    assert manifest.startswith("GPU kit for scripts/gpu-run.sh, made ")
    assert "data/raw/test_2016_flickr.de.gz" in manifest and f"wheels/{wheels[0]}" in manifest
    # idempotent: nothing downloaded again
    proc = build_kit(tmp_path, prepared)
    assert proc.returncode == 0 and (tmp_path / "pip.txt").read_text().splitlines() == calls


def test_kit_over_its_size_limit_fails_by_name(tmp_path, prepared):
    proc = build_kit(tmp_path, prepared, "--no-wheels", KIT_MAX_MB=0)
    assert proc.returncode == 1
    assert "more than KIT_MAX_MB=0" in proc.stderr
    assert not (tmp_path / "pip.txt").exists()  # --no-wheels downloads nothing


def test_kit_refuses_unknown_arguments(tmp_path, prepared):
    proc = build_kit(tmp_path, prepared, "--wheels-only")
    assert proc.returncode == 2 and "unknown argument '--wheels-only'" in proc.stderr


# ---------------------------------------------------------------- the run script
def dry_run(tmp_path, *args, **env):
    """The dry run's output; the kit is one of tmp_path (none: a dry run needs
    none), not the checkout's .gpu-kit, unless ``args`` name another."""
    proc = subprocess.run(["bash", RUN, "--dry-run", "--kit", str(tmp_path / ".gpu-kit"), *args, str(tmp_path / "out")],
                          cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env=clean_env(tmp_path, **env))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not (tmp_path / "out").exists()  # a dry run writes nothing
    return proc.stdout


def commands(stdout):
    """(budget comment or None, argv) of every printed command."""
    out, budget = [], None
    for line in stdout.splitlines():
        if line.startswith("#"):
            budget = line if "updates, at most" in line else budget
            continue
        argv = shlex.split(line)
        for i, tok in enumerate(argv):
            if tok in (">", ">>", "2>&1"):
                argv = argv[:i]
                break
        if argv and argv[0] == "env":
            argv = argv[1:]
            while argv and "=" in argv[0] and not argv[0].startswith("-"):
                argv.pop(0)
        out.append((budget, argv))
        budget = None
    return out


def trainings(stdout):
    got = {}
    for budget, argv in commands(stdout):
        if argv and argv[0] == "fairseq-train":
            args = options.parse_args_and_arch(options.get_training_parser(), argv[1:])
            got[os.path.basename(args.save_dir)] = (budget, args)
    return got


def test_dry_run_prints_every_command_with_its_budget(tmp_path):
    out = dry_run(tmp_path)
    cmds = commands(out)
    install = [argv for _, argv in cmds if argv[:4] == ["python3", "-m", "pip", "install"]]
    assert install and {"--no-index", "--no-deps"} <= set(install[0])
    # then compiled once (every later process imports fairseq without compiling it)
    target = install[0][install[0].index("--target") + 1]
    assert ["python3", "-m", "compileall", "-q", "-j", "0", target] in [argv for _, argv in cmds]
    trains = trainings(out)
    # the paper's drafter has no rows by default (BENCH_DRAFTERS=vsd), so it is not trained
    assert set(trains) == {"verifier", "vsd", "blockwise"} and "average-checkpoints.py" not in out
    with_paper = dry_run(tmp_path, BENCH_DRAFTERS="paper vsd")
    trains.update(drafter=trainings(with_paper)["drafter"])
    assert "average-checkpoints.py" in with_paper and "paper=" in with_paper
    budgets = {"verifier": (2500, "3"), "vsd": (1500, "2.5"), "blockwise": (1500, "2.5"), "drafter": (1500, "2.5")}
    for name, (budget, args) in trains.items():
        updates, minutes = budgets[name]
        assert budget == f"# {name}: {updates} updates, at most {minutes} minutes", name
        assert args.max_update == updates and args.stop_time_hours == pytest.approx(float(minutes) / 60, abs=1e-4)
        assert not args.cpu and args.fp16 and args.max_tokens == 8192, name
        assert args.data.endswith(".gpu-kit/data/bin" if name == "verifier" else "runs/gpu-kit.small/distill/bin")
    assert trains["verifier"][1].warmup_updates == 500 and trains["verifier"][1].encoder_embed_dim == 256
    # distillation on the GPU from the kit's data, then the benchmark on the GPU at batch 1, then 8 and 64
    (distill,) = [argv for _, argv in cmds if argv[-6:-4] and argv[1:2] and argv[1].endswith("scripts/distill.sh")]
    assert distill[3].endswith(".gpu-kit/data/bin") and distill[4].endswith(".gpu-kit/data/bpe")
    assert "CPU=0" in out and "MAX_TOKENS=16000" in out
    bench1, batched = [argv for _, argv in cmds if len(argv) > 1 and argv[1].endswith("scripts/benchmark.py")]
    # without what the default adds: at batch 1 the verify pass's graphs alone where auto captures whole
    # iterations, at 8 and 64 no graphs, for every row
    variants = {"benchmark": "no-iteration:loop-greedy,strict,relaxed=FAIRSEQ_SPECDEC_OFF=iteration",
                "benchmark-batched": "no-graphs=FAIRSEQ_SPECDEC_OFF=graphs"}
    for bench, sizes, out_dir in ((bench1, "1", "benchmark"), (batched, "8,64", "benchmark-batched")):
        opt = lambda name: bench[bench.index(name) + 1]  # noqa: E731
        assert opt("--device") == "auto" and opt("--batch-sizes") == sizes and opt("--jobs") == "1"
        assert opt("--out").endswith(f"runs/gpu-kit.small/{out_dir}")
        assert opt("--raw-ref").endswith(".gpu-kit/data/raw/test_2016_flickr.de.gz")
        given = [bench[i + 1] for i, a in enumerate(bench) if a == "--variant"]
        # the ngram tree variant, with the kit's trees of 16 nodes
        assert given == ["tree:ngram=--draft-tree 16 --ngram-min-confidence 0.15", variants[out_dir]]
        assert "--keep-going" in bench
        assert [a for a in bench if a.startswith(("paper=", "vsd="))] == [f"vsd={os.path.dirname(opt('--out'))}/vsd/checkpoint_last.pt"]
        assert "vsd-tree=--draft-tree 16 --draft-min-confidence 0" in bench
    # ct2 joins the rows wherever the ctranslate2 package imports (here, for the dry run; on the GPU machine, if carried)
    rows = lambda bench: set(bench[bench.index("--rows") + 1].split(",")) - {"ct2"}  # noqa: E731
    assert rows(bench1) == {"beam5", "beam1", "loop-greedy", "ngram", "strict", "relaxed", "blockwise", "ngram+draft-verify:vsd"}
    assert rows(batched) == {"beam5", "beam1", "loop-greedy", "ngram", "strict", "blockwise", "ngram+draft-verify:vsd"}
    assert "--relaxed" not in batched
    assert not any(len(argv) > 1 and argv[1].endswith("roofline.py") for _, argv in cmds)  # a CPU figure


def test_base_model_switch_and_phases(tmp_path):
    trains = trainings(dry_run(tmp_path, KIT_MODEL="base", BENCH_DRAFTERS="paper vsd"))
    verifier = trains["verifier"][1]
    assert (verifier.encoder_layers, verifier.decoder_layers, verifier.encoder_embed_dim) == (6, 6, 512)
    assert trains["blockwise"][1].decoder_embed_dim == 512 and trains["blockwise"][1].decoder_layers == 6
    assert trains["vsd"][1].embed_dim == 512 and trains["drafter"][1].encoder_layers == 6
    assert verifier.save_dir.endswith("runs/gpu-kit.base/verifier")
    train = dry_run(tmp_path, "--phase", "train")
    assert "benchmark.py" not in train and "fairseq-train" in train
    bench = dry_run(tmp_path, "--phase", "bench")
    assert "fairseq-train" not in bench and bench.count("benchmark.py") == 1 and "--batch-sizes 1 " in bench
    batched = dry_run(tmp_path, "--phase", "batched", KIT_BATCHED="4")
    assert "fairseq-train" not in batched and "--batch-sizes 4 " in batched


@pytest.mark.parametrize("args, message", [
    (["--phase", "deploy", "out"], "--phase must be all, train, bench, batched or host, got 'deploy'"),
    ([], "usage: scripts/gpu-run.sh"),
    (["--kit"], "--kit needs a folder"),
    (["a", "b"], "one OUT_DIR only"),
])
def test_run_script_refuses_bad_arguments(tmp_path, args, message):
    proc = subprocess.run(["bash", RUN, *args], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env=clean_env(tmp_path))
    assert proc.returncode == 2 and message in proc.stderr


def test_run_without_a_kit_says_how_to_build_one(tmp_path):
    proc = subprocess.run(["bash", RUN, "--kit", str(tmp_path / "nokit"), str(tmp_path / "out")], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, env=clean_env(tmp_path, RUN=tmp_path / "run"))
    assert proc.returncode == 2
    assert "no kit at" in proc.stdout and "make gpu-kit" in proc.stdout


# ---------------------------------------------------------------- the report
def test_report_reads_stage_times_trainings_and_the_table(tmp_path):
    run = tmp_path / "run"
    (run / "benchmark").mkdir(parents=True)
    (run / "verifier.log").write_text(
        "2026 | INFO | train_inner | epoch 010:  3 / 69 loss=4.1, ups=2.5, num_updates=2900\n"
        "2026 | INFO | train_inner | epoch 010:  53 / 69 loss=4, ups=21.5, num_updates=2950\n"
        "2026 | INFO | valid | epoch 011 | valid on 'valid' subset | loss 3.9 | nll_loss 2.4 | num_updates 3000\n")
    (run / "vsd.log").write_text("2026 | INFO | train_inner | epoch 001:  3 / 69 ups=9.0, num_updates=1234\n")
    log = tmp_path / "gpu-run.log"
    log.write_text("\n".join([
        "[multi30k 10:00:00 +0m] stage verifier",
        "[multi30k 10:03:30 +3m] stage distill",
        "[multi30k 10:04:00 +4m] stages vsd blockwise drafter, side by side",
        "[multi30k 10:07:00 +7m] WARNING: vsd stopped by the 3-minute safety cap at 1234 of 3000 updates: weaker",
        "[multi30k 10:07:00 +7m] stage average",
        "[multi30k 10:07:30 +7m] all done in 7 minutes",
    ]))
    rows = []
    for name, label, bs, s, b1, b5, tok, bleu in [
        ("beam5@bs1", "fairseq beam 5", 1, 10.0, 0.8, 1.0, 1.0, 40.0),
        ("beam1@bs1", "fairseq beam 1", 1, 8.0, 1.0, 1.25, 1.0, 39.5),
        ("loop-greedy@bs1", "greedy", 1, 4.0, 2.0, 2.5, 1.0, 39.5),
        ("strict-vsd@bs1", "draft-verify strict (vsd)", 1, 2.0, 4.0, 5.0, 3.1, 39.5),
        ("b5t3-vsd@bs1", "draft-verify beta=5 tau=3 (vsd)", 1, 1.5, 5.33, 6.67, 4.0, 39.3),
    ]:
        rows.append(dict(name=name, label=label, batch_size=bs, seconds=s, speedup_vs_beam1=b1,
                         speedup_vs_beam5=b5, tok=tok, sacrebleu=bleu, identical_to_beam1=name != "b5t3-vsd@bs1"))
    (run / "benchmark" / "results.json").write_text(json.dumps({"rows": rows}))
    (run / "benchmark" / "results.md").write_text("| decoder | batch |\n|---|---|\n| x | 1 |\n")
    env = tmp_path / "env.txt"
    env.write_text("gpu: NVIDIA H100 80GB HBM3, 81559 MiB, 580\n")
    text = kit_summary.summary(str(run), str(log), str(env))
    assert "gpu: NVIDIA H100 80GB HBM3" in text
    assert "| verifier | 3.5 |" in text and "| vsd blockwise drafter | 3.0 |" in text and "| average | 0.5 |" in text
    assert "| verifier | 3000 | 21.5 | no | loss 3.9, nll_loss 2.4, num_updates 3000 |" in text
    assert "| vsd | 1234 | 9.0 | yes, at 1234 of 3000 | none |" in text
    assert "| blockwise | not trained |" in text
    assert "batch 1: greedy 2.00x of fairseq --beam 1 (identical: True)" in text
    assert "batch 1: best strict draft-verify (draft-verify strict (vsd)) 4.00x of --beam 1, Tok. 3.10" in text
    assert "best relaxed (draft-verify beta=5 tau=3 (vsd)) 6.67x of beam 5, sacreBLEU 39.30 against beam 5's 40.00 (-0.70)" in text
    assert "| x | 1 |" in text


def test_report_of_a_benchmark_cut_short_lists_the_rows_it_finished(tmp_path):
    bench = tmp_path / "bench"
    bench.mkdir()
    rows = [dict(label="fairseq beam 5", batch_size=1, ms_per_sent=13.0, tok=1.0, sacrebleu=38.9, peak_gpu_mb=220.0),
            dict(label="fairseq beam 1", batch_size=1, ms_per_sent=12.5, tok=1.0, sacrebleu=38.2, peak_gpu_mb=210.4,
                 speedup_vs_beam1=1.0, identical_to_beam1=True, differs_from_beam1=0),
            dict(label="greedy", batch_size=1, ms_per_sent=5.0, tok=1.0, sacrebleu=38.2, peak_gpu_mb=None,
                 speedup_vs_beam1=2.5, identical_to_beam1=False, differs_from_beam1=3)]
    (bench / "rows.partial.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = kit_summary.summary(str(tmp_path), None, None, [str(bench), str(tmp_path / "batched")])
    assert "cut short" in text
    assert "| fairseq beam 5 | 1 | 13.00 |  | 1.00 | 38.90 | 220 |  |" in text  # ended before beam 1, run killed
    assert "| fairseq beam 1 | 1 | 12.50 | 1.00x | 1.00 | 38.20 | 210 | yes |" in text
    assert "| greedy | 1 | 5.00 | 2.50x | 1.00 | 38.20 |  | no (3 differ) |" in text
    assert "| verifier | not trained |" in text
    assert "## Benchmark: batched: not run" in text
    assert "Models:" not in text
    # a kit's packed models say where they came from
    (tmp_path / "ORIGIN.txt").write_text("models packed from runs/x (verifier vsd)\n")
    text = kit_summary.summary(str(tmp_path), None, None, [str(bench)])
    assert "Models: models packed from runs/x (verifier vsd) (trained before this run, not here)." in text


# ---------------------------------------------------------------- models trained before (--models)
def load_state(path):
    from fairseq import checkpoint_utils

    return checkpoint_utils.load_checkpoint_to_cpu(str(path))


def storage_groups(model_state):
    """The keys of each storage: which tensors are tied."""
    groups = {}
    for k, v in model_state.items():
        groups.setdefault(v.untyped_storage().data_ptr(), []).append(k)
    return sorted(sorted(g) for g in groups.values())


@pytest.mark.slow  # the toy verifier
@pytest.mark.parametrize("half", [False, True])
def test_packed_checkpoint_loads_without_optimizer_state(tmp_path, ar_checkpoint, half):
    import torch

    dst = tmp_path / "sub" / "packed.pt"
    proc = H.run([sys.executable, os.path.join(ROOT, "scripts", "pack-checkpoint.py"), ar_checkpoint, dst]
                 + (["--half-weights"] if half else []), check=False, timeout=300)
    assert proc.returncode == 0, proc.stderr
    src, packed = load_state(ar_checkpoint), load_state(dst)
    assert "last_optimizer_state" in src and "last_optimizer_state" not in packed
    assert os.path.getsize(dst) < os.path.getsize(ar_checkpoint)
    assert storage_groups(packed["model"]) == storage_groups(src["model"])  # tied weights stay tied
    assert packed["model"].keys() == src["model"].keys()
    for k, v in src["model"].items():
        want = v.half() if half and v.is_floating_point() else v
        assert packed["model"][k].dtype == want.dtype and torch.equal(packed["model"][k], want), k
    # it loads as a model in float32, with the rounded weights
    from fairseq import checkpoint_utils

    models, _ = checkpoint_utils.load_model_ensemble([str(dst)])
    weight = models[0].decoder.output_projection.weight
    assert weight.dtype == torch.float32
    assert torch.equal(weight, src["model"]["decoder.output_projection.weight"].half().float() if half
                       else src["model"]["decoder.output_projection.weight"])


def test_pack_refuses_a_missing_checkpoint(tmp_path):
    proc = H.run([sys.executable, os.path.join(ROOT, "scripts", "pack-checkpoint.py"), tmp_path / "no.pt",
                  tmp_path / "out.pt"], check=False, timeout=60)
    assert proc.returncode == 2 and "no such checkpoint" in proc.stderr and not (tmp_path / "out.pt").exists()


def _pack(*argv):
    return H.run([sys.executable, os.path.join(ROOT, "scripts", "pack-checkpoint.py"), *argv], check=False, timeout=300)


def test_pack_refuses_a_directory_as_destination(tmp_path, toy_bin):
    """A folder as DST: a message naming DST, and no stray *.tmp beside it."""
    import specdec_helpers as H
    from fairseq import tasks

    _, cfg = H.train_args_namespace(toy_bin, "--task", "translation", *H.AR_ARCH_ARGS, "--cpu")
    model = tasks.setup_task(cfg.task).build_model(cfg.model)
    src = H.save_model_checkpoint(model, cfg, tmp_path / "checkpoint_best.pt", criterion_name="CrossEntropyCriterion")
    dst = tmp_path / "packed"
    dst.mkdir()
    proc = _pack(src, dst)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"DST {dst} is a directory" in proc.stderr and "Traceback" not in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_best.pt", "packed"]
    assert list(dst.iterdir()) == []


@pytest.mark.parametrize("source", ["text", "dictionary", "tensors", "list"])
def test_pack_refuses_a_source_that_is_no_checkpoint(tmp_path, toy_bin, source):
    """A text file (torch's unpickler used to fail with IndexError or
    KeyError), or a torch.save file that is not fairseq's: a message naming
    SRC, no traceback, nothing written."""
    import shutil

    import torch

    src = tmp_path / "src.pt"
    if source == "text":
        src.write_text("hello\n")
    elif source == "dictionary":
        shutil.copy(os.path.join(toy_bin, "dict.src.txt"), src)
    elif source == "tensors":
        torch.save({"x": torch.ones(2)}, src)
    else:
        torch.save([1, 2], src)
    proc = _pack(src, tmp_path / "out.pt")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "SRC" in proc.stderr and str(src) in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src.pt"]


def test_save_checkpoint_leaves_no_temporary_file_when_it_fails(tmp_path):
    """compat.save_checkpoint (the scripts' one way to write a checkpoint):
    the destination is whole or absent, and its temporary file never stays."""
    from fairseq_specdec.compat import save_checkpoint

    (tmp_path / "folder").mkdir()
    with pytest.raises(IsADirectoryError, match="folder"):
        save_checkpoint({"model": {}}, str(tmp_path / "folder"))
    with pytest.raises(Exception):
        save_checkpoint({"model": {}, "bad": lambda: None}, str(tmp_path / "out.pt"))  # cannot be pickled
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder"]


def trained_run(tmp_path, checkpoint):
    """A finished run folder of the Multi30k recipe, its models the toy verifier."""
    import shutil

    run = tmp_path / "trained"
    for sub in ("verifier", "vsd", "distill/bin"):
        (run / sub).mkdir(parents=True)
    shutil.copy(checkpoint, run / "verifier" / "checkpoint_best.pt")
    shutil.copy(checkpoint, run / "vsd" / "checkpoint_last.pt")
    for name in ("dict.en.txt", "dict.de.txt", "test.en-de.en.bin", "train.en-de.de.idx", "valid.en-de.en.bin"):
        (run / "distill" / "bin" / name).write_text("x\n")
    return run


@pytest.mark.slow  # the toy verifier
def test_kit_with_models_benchmarks_them_and_trains_nothing(tmp_path, prepared, ar_checkpoint):
    run = trained_run(tmp_path, ar_checkpoint)
    proc = build_kit(tmp_path, prepared, "--no-wheels", "--models", str(run), "--half-weights",
                     PYTHON=sys.executable, KIT_MODELS="verifier vsd")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    kit = tmp_path / "kit"
    for path in ("run/verifier/checkpoint_best.pt", "run/vsd/checkpoint_last.pt", "run/verifier/DONE", "run/vsd/DONE",
                 "run/distill/DONE", "run/distill/bin/dict.en.txt", "run/distill/bin/test.en-de.en.bin",
                 "run/distill/bin/train.en-de.de.idx", "data/raw/test_2016_flickr.de.gz", "data/tok/test_2016_flickr.de"):
        assert (kit / path).is_file(), path
    assert not (kit / "run" / "distill" / "bin" / "valid.en-de.en.bin").exists()  # nothing decoding does not read
    assert not (kit / "data" / "bpe").exists() and not (kit / "data" / "bin" / "dict.en.txt").exists()
    assert not (kit / "run" / "blockwise").exists()  # KIT_MODELS leaves it out
    assert "float16" in (kit / "run" / "ORIGIN.txt").read_text()
    assert load_state(kit / "run" / "vsd" / "checkpoint_last.pt")["model"]["decoder.output_projection.weight"].dtype \
        == __import__("torch").float16
    assert "run/verifier/checkpoint_best.pt" in (kit / "MANIFEST.txt").read_text()
    # the run script benchmarks the kit's models at batch 1, then 8 and 64; nothing trained or distilled
    out = dry_run(tmp_path, "--kit", str(kit))
    assert "fairseq-train" not in out and "distill.sh" not in out and "nothing to train" not in out
    benches = [argv for _, argv in commands(out) if len(argv) > 1 and argv[1].endswith("scripts/benchmark.py")]
    assert len(benches) == 2
    for bench in benches:
        opt = lambda name: bench[bench.index(name) + 1]  # noqa: E731
        assert opt("--verifier") == f"{kit}/run/verifier/checkpoint_best.pt"
        assert opt("--data") == f"{kit}/run/distill/bin" and opt("--out").startswith(f"{kit}/run/benchmark")
        assert "blockwise" not in opt("--rows")
    train = dry_run(tmp_path, "--kit", str(kit), "--phase", "train")
    assert "fairseq-train" not in train and "nothing to train" in train
    # a kit built again without --models is a training kit again
    proc = build_kit(tmp_path, prepared, "--no-wheels")
    assert proc.returncode == 0 and not (kit / "run").exists() and (kit / "data" / "bin" / "dict.en.txt").is_file()


@pytest.mark.parametrize("args, env, message", [
    (["--half-weights"], {}, "--half-weights packs the models of --models RUN_DIR"),
    (["--models", "NOWHERE"], {}, "no verifier/checkpoint_best.pt"),
    (["--models", "RUN"], {"KIT_MODELS": "verifier ctc"}, "KIT_MODELS: unknown model 'ctc'"),
    (["--models", "RUN"], {"KIT_MODELS": "verifier blockwise"}, "no blockwise/checkpoint_best.pt (KIT_MODELS names blockwise)"),
])
def test_kit_refuses_bad_models(tmp_path, prepared, args, env, message):
    run = tmp_path / "trained"
    (run / "verifier").mkdir(parents=True)
    (run / "distill" / "bin").mkdir(parents=True)
    (run / "verifier" / "checkpoint_best.pt").write_text("x")
    (run / "distill" / "bin" / "dict.en.txt").write_text("x")
    args = [str(run) if a == "RUN" else str(tmp_path / a) if a == "NOWHERE" else a for a in args]
    proc = build_kit(tmp_path, prepared, "--no-wheels", *args, **env)
    assert proc.returncode == 2 and message in proc.stderr
    assert not (tmp_path / "kit" / "run").exists()


def test_host_phase_times_the_cpu_rows_beside_ctranslate2(tmp_path):
    """Phase host: the extension built in place, then interleave.py on the
    distillation's test split, 1 thread, batch 1, the CPU rows (a row with
    the prefetch on everywhere beside the measured default, and rows forced
    to AVX2 and to AVX-512 exactly where this CPU has AVX-512F), pinned to
    HOST_CPUS."""
    out = dry_run(tmp_path, "--phase", "host", HOST_CPUS="3-4", HOST_LIMIT="40")
    assert "setup.py build_ext --inplace" in out and "wait for" in out
    assert "fairseq-train" not in out and "benchmark.py" not in out
    (cmd,) = [argv for _, argv in commands(out) if any(a.endswith("scripts/interleave.py") for a in argv)]
    assert cmd[:3] == ["taskset", "-c", "3-4"]
    opt = lambda name: cmd[cmd.index(name) + 1]  # noqa: E731
    assert opt("--data").endswith("runs/gpu-kit.small/distill/bin")
    assert opt("--verifier").endswith("runs/gpu-kit.small/verifier/checkpoint_best.pt")
    assert (opt("--limit"), opt("--batch-size"), opt("--rounds"), opt("--subset")) == ("40", "1", "1", "test")
    assert "OMP_NUM_THREADS=1" in cmd and "--by-batch" in cmd and {"--ct2", "--ct2-int8"} <= set(cmd)
    # its JSON stays with the run (it comes back in benchmark.tar.gz), its table as host-cpu.md
    assert opt("--json").endswith("runs/gpu-kit.small/host/host-cpu.json")
    rows = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--row"]
    assert rows == ["loop-greedy=--decoding loop-greedy", "ngram=--decoding ngram", "self-draft=--decoding self-draft"]
    process_rows = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--process-row"]
    has_avx512 = "avx512f" in open("/proc/cpuinfo").read().split()
    assert process_rows == ["loop-greedy-prefetch-on=--decoding loop-greedy FAIRSEQ_SPECDEC_PREFETCH=on"] + (
        ["loop-greedy-avx2=--decoding loop-greedy FAIRSEQ_SPECDEC_ISA=avx2",
         "loop-greedy-avx512=--decoding loop-greedy FAIRSEQ_SPECDEC_ISA=avx512"] if has_avx512 else [])
    # phase all ends with it; KIT_TRAIN_STAGES replaces the training stages
    assert "# phase host" in dry_run(tmp_path)
    assert set(trainings(dry_run(tmp_path, KIT_TRAIN_STAGES="verifier distill vsd"))) == {"verifier", "vsd"}


def test_xz_kit_travels_as_one_archive_that_the_run_unpacks(tmp_path, prepared):
    """--xz: the kit in kit.tar.xz, its wheels re-stored uncompressed with the
    same files; the run script unpacks an archive that travels alone."""
    import io
    import tarfile
    import zipfile
    wheels = tmp_path / "kit" / "wheels"
    wheels.mkdir(parents=True)
    members = {"pkg/__init__.py": "x = 1\n" * 200, "pkg-1.0.dist-info/RECORD": "pkg/__init__.py,,\n"}
    with zipfile.ZipFile(wheels / "pkg-1.0-py3-none-any.whl", "w", zipfile.ZIP_DEFLATED) as whl:
        for name, text in members.items():
            whl.writestr(name, text)
    proc = build_kit(tmp_path, prepared, "--no-wheels", "--xz")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    archive = tmp_path / "kit" / "kit.tar.xz"
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
        assert {"./data/raw/test_2016_flickr.de.gz", "./data/bin/dict.en.txt", "./MANIFEST.txt"} <= names
        packed = zipfile.ZipFile(io.BytesIO(tar.extractfile("./wheels/pkg-1.0-py3-none-any.whl").read()))
    assert {i.filename: i.compress_type for i in packed.infolist()} == dict.fromkeys(members, zipfile.ZIP_STORED)
    assert {n: packed.read(n).decode() for n in members} == members
    # the archive alone, as it travels: the run unpacks it, then stops where torch sees no GPU
    alone = tmp_path / "travelled"
    alone.mkdir()
    (alone / "kit.tar.xz").write_bytes(archive.read_bytes())
    proc = subprocess.run(["bash", RUN, "--kit", str(alone), str(tmp_path / "out")], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env=clean_env(tmp_path, PYTHON=sys.executable, RUN=tmp_path / "run", SITE=tmp_path / "site"))
    assert (alone / "data" / "raw" / "test_2016_flickr.de.gz").is_file(), proc.stdout + proc.stderr
    assert "unpacking" in proc.stdout + proc.stderr
