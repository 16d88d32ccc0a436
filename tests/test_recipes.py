"""The WMT recipes (scripts/run-wmt.sh + configs/wmt*-base.sh), checked through
their --dry-run output: every stage is there, and every fairseq-train and
fairseq-generate command parses with fairseq's own parsers, with the plugin
registered. Fast: nothing is trained, decoded or downloaded."""
import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import fairseq_specdec  # noqa: E402,F401  (registers draft_verify, specdec_nat, glat_block)
from fairseq import options  # noqa: E402

SCRIPT = os.path.join(ROOT, "scripts", "run-wmt.sh")
PLUGIN = os.path.join(ROOT, "fairseq_specdec")
STAGES = ["download", "prepare", "teacher", "distill", "verifier", "drafter", "average", "evaluate"]
# config -> the papers' tokens per update (reference notes section 1)
CONFIGS = {
    "configs/wmt14-en-de-base.sh": 128 * 1024,
    "configs/wmt16-en-ro-base.sh": 64 * 1024,
}
# shell syntax that ends the command's own arguments on a printed line
SHELL_TOKENS = {">", ">>", "<", "2>", "2>>", "&", "|", "&&", ";"}


def run_recipe(*args, **env_overrides):
    # a clean environment: no CUDA_VISIBLE_DEVICES, NUM_GPUS, ... from the caller
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), "LANG": "C.UTF-8"}
    env.update(env_overrides)
    return subprocess.run(
        ["bash", SCRIPT, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


def commands(stdout):
    """Each printed command as (env assignments, argv), shell syntax removed."""
    result = []
    for line in stdout.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        tokens = shlex.split(line)
        for i, tok in enumerate(tokens):
            if tok in SHELL_TOKENS:
                tokens = tokens[:i]
                break
        env = {}
        if tokens and tokens[0] == "env":
            tokens = tokens[1:]
            while tokens and "=" in tokens[0] and not tokens[0].startswith("-"):
                key, value = tokens.pop(0).split("=", 1)
                env[key] = value
        result.append((env, tokens))
    return result


def parse(parser_fn, argv):
    return options.parse_args_and_arch(parser_fn(), argv)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def dry_run(request):
    config = request.param
    proc = run_recipe(config, "--dry-run")
    assert proc.returncode == 0, proc.stderr
    return config, proc.stdout


def test_every_stage_is_printed_in_order(dry_run):
    _, out = dry_run
    printed = [line.split()[2] for line in out.splitlines() if line.startswith("# stage ")]
    assert printed == STAGES
    # every stage prints at least one command
    blocks = out.split("# stage ")[1:]
    for block in blocks:
        assert any(line and not line.startswith("#") for line in block.splitlines()[1:]), block[:80]


def test_train_commands_parse_and_batch_size(dry_run):
    config, out = dry_run
    target = CONFIGS[config]
    trains = [argv for _, argv in commands(out) if argv and argv[0] == "fairseq-train"]
    assert len(trains) == 3  # teacher, verifier, drafter
    for argv in trains:
        assert argv[argv.index("--user-dir") + 1] == PLUGIN
        args = parse(options.get_training_parser, argv[1:])
        assert args.fp16
        assert args.max_update > 0
        tokens = args.distributed_world_size * args.max_tokens * args.update_freq[0]
        print(f"{config} {args.arch}: {args.distributed_world_size} x {args.max_tokens} x "
              f"{args.update_freq[0]} = {tokens} tokens per update")
        assert abs(tokens - target) <= 0.1 * target, (args.arch, tokens, target)
        # update checkpoints, so that the last 10 can be averaged
        assert args.save_interval_updates > 0 and args.keep_interval_updates >= 10
    teacher, verifier, drafter = (parse(options.get_training_parser, a[1:]) for a in trains)
    assert teacher.arch == ("transformer_vaswani_wmt_en_de_big" if "en-de" in config else "transformer_wmt_en_de")
    assert verifier.arch == "transformer_wmt_en_de"
    assert verifier.criterion == teacher.criterion == "label_smoothed_cross_entropy"


def test_drafter_command(dry_run):
    config, out = dry_run
    drafters = [(line, argv) for line, (_, argv) in zip(
        [l for l in out.splitlines() if l.strip() and not l.startswith("#")], commands(out))
        if argv and argv[0] == "fairseq-train" and "specdec_nat_base" in argv]
    assert len(drafters) == 1
    line, argv = drafters[0]
    assert "--arch specdec_nat_base --criterion glat_block --block-size 25" in line
    args = parse(options.get_training_parser, argv[1:])
    assert (args.task, args.arch, args.criterion, args.block_size) == ("draft_verify", "specdec_nat_base", "glat_block", 25)
    assert args.init_from_verifier.endswith("verifier/checkpoint_avg10.pt")
    assert args.encoder_layers == 12 and args.decoder_layers == 2
    assert args.adam_betas == "(0.9, 0.999)" and args.adam_eps == 1e-6
    assert args.weight_decay == 0.01 and args.clip_norm == 5 and args.label_smoothing == 0.1
    assert args.warmup_init_lr == 1e-7 and args.lr_scheduler == "inverse_sqrt"
    if "en-de" in config:
        assert (args.lr, args.dropout, args.warmup_updates, args.max_update) == ([5e-4], 0.1, 10000, 300000)
    else:
        assert (args.lr, args.dropout, args.warmup_updates, args.max_update) == ([1e-3], 0.2, 4000, 50000)


def test_generate_commands_parse(dry_run):
    _, out = dry_run
    gens = [(env, argv) for env, argv in commands(out) if argv and argv[0] == "fairseq-generate"]
    assert gens
    for env, argv in gens:
        assert argv[argv.index("--user-dir") + 1] == PLUGIN
        assert "CUDA_VISIBLE_DEVICES" in env
        args = parse(options.get_generation_parser, argv[1:])
        assert args.task == "draft_verify"


def test_distillation_is_sharded_over_the_gpus(dry_run):
    _, out = dry_run
    cmds = commands(out)
    for split in ("train", "valid"):
        shards = [(i, env, parse(options.get_generation_parser, argv[1:]))
                  for i, (env, argv) in enumerate(cmds)
                  if argv and argv[0] == "fairseq-generate" and argv[argv.index("--gen-subset") + 1] == split]
        assert len(shards) == 8
        # fairseq-generate shards its input by world size and rank (it ignores --num-shards)
        assert sorted(a.distributed_rank for _, _, a in shards) == list(range(8))
        assert {a.distributed_world_size for _, _, a in shards} == {8}
        assert sorted(env["CUDA_VISIBLE_DEVICES"] for _, env, _ in shards) == [str(i) for i in range(8)]
        assert {a.beam for _, _, a in shards} == {5}
        assert all(a.decoding == "autoregressive" and a.path.endswith("teacher/checkpoint_avg10.pt")
                   for _, _, a in shards)
        # then the shards are merged, in sentence order, with a sentence count
        after = [argv for _, argv in cmds[shards[-1][0] + 1:]]
        assert after[0] == ["wait"]
        merge = after[1]
        assert merge[1].endswith("scripts/merge-hypotheses.py") and "--expected" in merge
        assert [os.path.basename(p) for p in merge[merge.index("--expected") + 2:]] == [
            f"{split}.shard{i}.txt" for i in range(8)]
    binarize = [argv for _, argv in cmds if argv and argv[0] == "fairseq-preprocess" and "--srcdict" in argv]
    assert len(binarize) == 1


def test_evaluation(dry_run):
    config, out = dry_run
    cmds = commands(out)
    runs = {}
    for env, argv in cmds:
        if argv and argv[0] == "fairseq-generate" and argv[argv.index("--gen-subset") + 1] == "test":
            a = parse(options.get_generation_parser, argv[1:])
            assert a.post_process == "subword_nmt"
            assert a.path.endswith("verifier/checkpoint_avg10.pt")
            runs[(a.decoding, a.beam, a.verify_beta, a.verify_tau)] = a
    assert ("autoregressive", 5, 1, 0.0) in runs
    assert ("autoregressive", 1, 1, 0.0) in runs
    assert ("draft-verify", 1, 1, 0.0) in runs
    assert ("draft-verify", 1, 5, 3.0) in runs
    for key, a in runs.items():
        if key[0] == "draft-verify":
            assert a.drafter_path.endswith("drafter/checkpoint_avg10.pt")
    # the drafter that is evaluated is the average of its last 10 update checkpoints
    avg = [argv for _, argv in cmds if len(argv) > 1 and argv[1].endswith("average-checkpoints.py")]
    drafter_avg = [a for a in avg if a[a.index("--output") + 1].endswith("drafter/checkpoint_avg10.pt")]
    assert len(drafter_avg) == 1 and drafter_avg[0][drafter_avg[0].index("--num-update-checkpoints") + 1] == "10"
    # scoring: detokenized sacreBLEU and tokenized BLEU for every decoder
    detok = [argv for _, argv in cmds if len(argv) > 2 and argv[1].endswith("moses.py") and argv[2] == "detokenize"]
    sacre = [argv for _, argv in cmds if argv and argv[0] == "sacrebleu" and "-i" in argv]
    tokenized = [argv for argv in sacre if "--tokenize" in argv and argv[argv.index("--tokenize") + 1] == "none"]
    n = len(runs)
    assert len(detok) == n
    assert len(sacre) - len(tokenized) == n
    assert len(tokenized) == (2 * n if "en-de" in config else n)  # EN-DE: also compound-split


def test_fewer_gpus_keep_the_tokens_per_update():
    proc = run_recipe("configs/wmt14-en-de-base.sh", "--dry-run", "teacher", "verifier", "drafter", NUM_GPUS="3")
    assert proc.returncode == 0, proc.stderr
    trains = [argv for _, argv in commands(proc.stdout) if argv and argv[0] == "fairseq-train"]
    assert len(trains) == 3
    for argv in trains:
        args = parse(options.get_training_parser, argv[1:])
        assert args.distributed_world_size == 3
        tokens = 3 * args.max_tokens * args.update_freq[0]
        assert abs(tokens - 131072) <= 0.1 * 131072


def test_selected_stages_only():
    proc = run_recipe("configs/wmt16-en-ro-base.sh", "--dry-run", "average")
    assert proc.returncode == 0, proc.stderr
    assert [l for l in proc.stdout.splitlines() if l.startswith("# stage")] == ["# stage average"]
    (_, argv), = commands(proc.stdout)
    assert argv[1].endswith("average-checkpoints.py")


def test_unknown_stage_fails_with_a_message():
    proc = run_recipe("configs/wmt14-en-de-base.sh", "--dry-run", "prepare", "train-everything")
    assert proc.returncode != 0
    assert "unknown stage 'train-everything'" in proc.stderr
    assert proc.stdout == ""  # nothing printed (or run) before the check


def test_missing_config_fails():
    proc = run_recipe("configs/no-such-config.sh", "--dry-run")
    assert proc.returncode != 0
    assert "no such config" in proc.stderr


def test_multi30k_recipe_checks_every_stage_of_a_group_first(tmp_path):
    """`drafter+blockwise` runs two stages side by side; a bad name anywhere
    stops the recipe before any stage runs."""
    out = tmp_path / "run"
    proc = subprocess.run(
        ["bash", os.path.join(ROOT, "scripts", "run-multi30k.sh"), "average", "drafter+train-everything"],
        cwd=ROOT, env={"PATH": os.environ["PATH"], "HOME": str(tmp_path), "OUT": str(out), "LANG": "C.UTF-8"},
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode != 0
    assert "unknown stage 'train-everything'" in proc.stderr
    assert "stage" not in proc.stdout  # not even `average` started
    assert not (out / "drafter").exists()


# ---------------------------------------------------------------- Multi30k recipe: CPU and GPU configs
FAKE_TOOL = r'''#!/usr/bin/env bash
# records its command line, creates the directories and files the recipe expects
name=$(basename "$0")
# one line per command, under a lock: stages run side by side, and a long
# line written in several chunks would interleave with another tool's
line=$(printf '%q ' "$name" "$@")
exec 9>>"$RECORD"
if command -v flock > /dev/null; then flock 9; fi
printf '%s\n' "$line" >&9
printf '%s %s\n' "${OMP_NUM_THREADS:-unset}" "$line" >> "$RECORD.threads"
exec 9>&-
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  case "${args[i]}" in
    --save-dir) mkdir -p "${args[i+1]}"; touch "${args[i+1]}/checkpoint_best.pt" "${args[i+1]}/checkpoint_last.pt";;
    --destdir|--out) mkdir -p "${args[i+1]}";;
    --output) touch "${args[i+1]}";;
  esac
done
case "$name" in
  fairseq-train) echo "epoch 001 | valid on 'valid' subset | loss 1.0 | num_updates 999999 | best_loss 1.0";;
  fairseq-validate) echo "epoch 001 | valid on 'valid' subset | loss 1.0 | block_acc 50.0 | num_updates 1";;
  python) if [ "${1:-}" = -c ] && [[ "${2:-}" == *ctranslate2* ]]; then exit "${FAKE_CT2_MISSING:-0}"; fi;;
esac
'''
MULTI30K_STAGES = ["verifier", "distill", "vsd+blockwise", "drafter", "average", "benchmark"]


def run_multi30k(tmp_path, config=None, stages=MULTI30K_STAGES, **env_overrides):
    """scripts/run-multi30k.sh with every tool it calls replaced by a recorder;
    returns (process, [argv of each recorded command])."""
    bin_dir, data, out = tmp_path / "bin", tmp_path / "data", tmp_path / "run"
    bin_dir.mkdir(parents=True)
    for tool in ("fairseq-train", "fairseq-validate", "fairseq-generate", "fairseq-preprocess", "python"):
        (bin_dir / tool).write_text(FAKE_TOOL)
        (bin_dir / tool).chmod(0o755)
    (data / "bpe").mkdir(parents=True)
    (data / "bin").mkdir()
    for name in ("train.en", "val.en"):
        (data / "bpe" / name).write_text("a b\nc d\n")
    (data / "bin" / "test.en-de.en.bin").write_text("")
    drafter = out / "drafter"  # epoch checkpoints for the average stage
    drafter.mkdir(parents=True)
    for name in ("checkpoint1.pt", "checkpoint2.pt", "checkpoint_last.pt"):
        (drafter / name).write_text("")
    record = tmp_path / "commands.txt"
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(tmp_path), "LANG": "C.UTF-8", "RECORD": str(record),
           "OUT": str(out), "DATA": str(data), "PYTHON": str(bin_dir / "python"), "MULTI30K_RAW": str(tmp_path / "raw")}
    if config:
        env["CONFIG"] = os.path.join(ROOT, config)
    env.update(env_overrides)
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "run-multi30k.sh"), *stages], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    recorded = [shlex.split(line) for line in record.read_text().splitlines()] if record.exists() else []
    return proc, recorded


def trainings(recorded):
    """{save dir name: parsed fairseq-train arguments}"""
    out = {}
    for argv in recorded:
        if argv[0] == "fairseq-train":
            args = parse(options.get_training_parser, argv[1:])
            out[os.path.basename(args.save_dir)] = args
    return out


def fairseq_commands(recorded):
    return [argv for argv in recorded if argv[0] in ("fairseq-train", "fairseq-validate", "fairseq-generate")]


def benchmark_command(recorded):
    (argv,) = [a for a in recorded if len(a) > 1 and a[1].endswith("scripts/benchmark.py")]
    return argv


def option(argv, name):
    return argv[argv.index(name) + 1]


def test_multi30k_cpu_config_passes_cpu_everywhere(tmp_path):
    proc, recorded = run_multi30k(tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    trains = trainings(recorded)
    assert set(trains) == {"verifier", "drafter", "vsd", "blockwise"}
    assert all(args.cpu and not args.fp16 for args in trains.values())
    assert trains["verifier"].max_update == 1000 and trains["vsd"].arch == "specdec_vsd"
    kinds = {argv[0] for argv in fairseq_commands(recorded)}
    assert kinds == {"fairseq-train", "fairseq-validate", "fairseq-generate"}  # distillation and block_acc too
    assert all("--cpu" in argv for argv in fairseq_commands(recorded))
    bench = benchmark_command(recorded)
    assert option(bench, "--device") == "cpu" and option(bench, "--batch-sizes") == "1,32"
    assert option(bench, "--jobs") == "2"
    # both drafters and the blockwise heads are benchmarked
    drafters = [option(bench[i:], "--drafter") for i, a in enumerate(bench) if a == "--drafter"]
    assert f"paper={tmp_path}/run/drafter/checkpoint_selected.pt" in drafters
    assert f"vsd={tmp_path}/run/vsd/checkpoint_last.pt" in drafters
    assert "blockwise" in option(bench, "--rows").split(",")
    # the roofline of the verifier's pass comes with the benchmark
    (roofline,) = [a for a in recorded if len(a) > 1 and a[1].endswith("scripts/roofline.py")]
    assert option(roofline, "--path") == f"{tmp_path}/run/verifier/checkpoint_best.pt"
    assert option(roofline, "--json-out") == f"{tmp_path}/run/benchmark/roofline.json"


def test_multi30k_gpu_config_trains_longer_without_cpu(tmp_path):
    proc, recorded = run_multi30k(tmp_path, "configs/multi30k-gpu.sh")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert not any("--cpu" in argv for argv in fairseq_commands(recorded))
    trains = trainings(recorded)
    assert set(trains) == {"verifier", "drafter", "vsd", "blockwise"}  # the vsd stage is kept
    for name, args in trains.items():
        assert not args.cpu and args.fp16, name
        assert args.max_tokens == 8192 and args.max_epoch == 0, name
    assert {name: args.max_update for name, args in trains.items()} == {
        "verifier": 20000, "drafter": 20000, "vsd": 20000, "blockwise": 10000}
    # the CPU settings are overridden, not duplicated into a contradiction
    assert trains["verifier"].dropout == 0.3 and trains["verifier"].warmup_updates == 4000
    assert trains["drafter"].glance_anneal_updates == 20000 and trains["vsd"].cuts_per_sentence == 4
    assert trains["drafter"].save_interval_updates == 1000 and trains["drafter"].keep_interval_updates == 20
    # distillation in one shard, on the GPU
    gens = [parse(options.get_generation_parser, a[1:]) for a in recorded if a[0] == "fairseq-generate"]
    assert gens and all(not g.cpu and g.distributed_world_size == 1 for g in gens)
    bench = benchmark_command(recorded)
    assert option(bench, "--device") == "auto" and option(bench, "--batch-sizes") == "1,8,64"
    assert option(bench, "--jobs") == "1"


def test_multi30k_device_must_be_cpu_or_gpu(tmp_path):
    proc, recorded = run_multi30k(tmp_path, stages=["verifier"], DEVICE="tpu")
    assert proc.returncode != 0
    assert "DEVICE must be cpu or gpu, got 'tpu'" in proc.stderr
    assert recorded == []


def test_multi30k_default_stages_train_two_at_a_time(tmp_path):
    """Three trainings side by side on two cores ran 0.25-0.67 updates/s and
    the time caps cut two short: by default specdec_vsd and the blockwise
    heads share the machine (one thread each), then the paper's drafter
    trains alone on SOLO_THREADS; the caps are a safety net well above a
    stage's measured time."""
    script = open(os.path.join(ROOT, "scripts", "run-multi30k.sh")).read()
    default = re.search(r"STAGES=\(prepare ([^)]*)\)", script).group(1).split()
    assert default == MULTI30K_STAGES
    proc, _ = run_multi30k(tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    threads = {}
    for line in (tmp_path / "commands.txt.threads").read_text().splitlines():
        omp, argv = line.split(" ", 1)
        argv = shlex.split(argv)
        if argv[0] == "fairseq-train":
            threads[os.path.basename(option(argv, "--save-dir"))] = omp
    assert threads == {"verifier": "2", "vsd": "1", "blockwise": "1", "drafter": "2"}
    config = open(os.path.join(ROOT, "configs", "multi30k-cpu.sh")).read()
    caps = dict(re.findall(r'\$\{(\w+_MAX_MINUTES):=(\d+)\}', config))
    assert all(int(minutes) >= 60 for minutes in caps.values()), caps


def test_multi30k_benchmark_rows_ctranslate2_and_diagnostics(tmp_path):
    """The vsd-fixed diagnostic row only with BENCH_DIAGNOSTIC=1; without the
    ctranslate2 package the log says why there is no CTranslate2 row."""
    proc, recorded = run_multi30k(tmp_path)
    bench = benchmark_command(recorded)
    assert not any(a.startswith("vsd-fixed=") for a in bench)
    # on a CPU: the int8 self-draft row and CTranslate2's float32 and int8 rows
    assert {"ct2", "ct2-int8", "self-draft"} <= set(option(bench, "--rows").split(","))
    proc, recorded = run_multi30k(tmp_path / "no-ct2", FAKE_CT2_MISSING="1")
    assert not {"ct2", "ct2-int8"} & set(option(benchmark_command(recorded), "--rows").split(","))
    assert "no CTranslate2 row: the ctranslate2 package is not installed" in proc.stdout
    proc, recorded = run_multi30k(tmp_path / "diag", BENCH_DIAGNOSTIC="1")
    assert any(a.startswith("vsd-fixed=") for a in benchmark_command(recorded))


def test_multi30k_benchmark_has_draft_tree_rows(tmp_path):
    """The specdec_vsd drafter's tree rows (a drafter entry with --draft-tree),
    the combined decoding with that drafter only, and the ngram tree variant;
    TREE_NODES sets the trees' size."""
    proc, recorded = run_multi30k(tmp_path, TREE_NODES="4")
    bench = benchmark_command(recorded)
    assert any(a.startswith("vsd-tree=") for a in bench)
    assert "vsd-tree=--draft-tree 4 --draft-min-confidence 0" in bench
    assert "ngram+draft-verify:vsd" in option(bench, "--rows").split(",")
    assert "tree:ngram=--draft-tree 4 --ngram-min-confidence 0.15" in bench
    # several sizes: the first keeps the plain labels, the others carry their size
    proc, recorded = run_multi30k(tmp_path / "two", TREE_NODES="16 32")
    bench = benchmark_command(recorded)
    assert "vsd-tree=--draft-tree 16 --draft-min-confidence 0" in bench
    assert "vsd-tree32=--draft-tree 32 --draft-min-confidence 0" in bench
    assert "tree:ngram=--draft-tree 16 --ngram-min-confidence 0.15" in bench
    assert "tree32:ngram=--draft-tree 32 --ngram-min-confidence 0.15" in bench
    assert "relaxed" in option(bench, "--rows").split(",")  # every drafter's, unless named
    proc, recorded = run_multi30k(tmp_path / "chain", TREE_NODES="16 32", BENCH_RELAXED_DRAFTERS="vsd")
    rows = option(benchmark_command(recorded), "--rows").split(",")
    assert "relaxed:vsd" in rows and "relaxed" not in rows
