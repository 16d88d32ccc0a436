#!/usr/bin/env bash
# The GPU table in one command: run on a GPU machine from the checkout's root,
# with the kit of scripts/gpu-kit.sh (make gpu-kit) in .gpu-kit beside it.
#   setup  install the kit's wheels into SITE (--no-index --no-deps: nothing
#          is downloaded; the machine's own torch stays), put fairseq's
#          commands and the plugin on the paths, record the machine (env.txt)
#   train  the Multi30k recipe's training stages with the GPU kit's budgets
#          (configs/multi30k-gpu-kit.sh): verifier -> greedy distillation ->
#          specdec_vsd and the blockwise heads side by side on the GPU (with
#          BENCH_DRAFTERS="paper vsd" also the paper's drafter, then its
#          checkpoint averaging)
#   bench  scripts/benchmark.py on the GPU at batch 1: fairseq beam 5 and
#          beam 1, loop-greedy, n-gram drafting from the distillation, strict and relaxed draft-verify with the
#          specdec_vsd drafter, blockwise (the plugin's rows with the
#          default --specdec-backend auto, and the rows it captures whole
#          iterations of again with FAIRSEQ_SPECDEC_OFF=iteration, the verify pass alone);
#          Tok., ms/sentence, sacreBLEU, peak GPU memory, identity with
#          --beam 1 in the same precision
#   batched  the same at batch 8 and 64 (KIT_BATCHED), without relaxed rows,
#          every row of the plugin again with FAIRSEQ_SPECDEC_OFF=graphs
#   host   the CPU rows at the kit's model size, on the machine's own cores:
#          scripts/interleave.py, 1 thread, batch 1, the first HOST_LIMIT
#          (300) test sentences, HOST_ROUNDS (1) rounds taken batch by batch:
#          loop-greedy, ngram (drafting from the distillation), self-draft,
#          loop-greedy with the products' prefetch on for every class
#          (FAIRSEQ_SPECDEC_PREFETCH=on, a process of its own) beside the
#          default's measured choice, where the CPU has AVX-512F loop-greedy
#          forced to AVX2 and to AVX-512 products (FAIRSEQ_SPECDEC_ISA=avx2,
#          =avx512, each a process of its own), and CTranslate2
#          float32 and int8 where the kit has ctranslate2 (gpu-kit.sh --ct2);
#          every row's output compared with loop-greedy's. It first builds the
#          plugin's C++ extension in place (the kit carries none), then waits
#          for the verifier and the distillation, so that it can run beside
#          phase train once that phase's setup is done (HOST_CPUS: the cores
#          it is pinned to, e.g. 12-15); its table comes back as host-cpu.md,
#          its JSON and build log in benchmark.tar.gz (RUN/host)
# Everything it reports goes to OUT_DIR, at most 8 files: gpu-run.log (this
# run's log), env.txt, summary.md (machine, stage times, what each training
# reached, the tables and the ratios of the GPU targets), results.md and
# results-batched.md (the benchmarks' tables), host-cpu.md (phase host's
# table), train-logs.tar.gz and benchmark.tar.gz (training logs; results.json,
# hypotheses, plots and worker logs; phase host's JSON).  Models stay in RUN, so that a second call on the same warm
# machine goes on where the first stopped: every stage is skipped when its
# output exists.
#
# Usage: scripts/gpu-run.sh [--dry-run] [--phase all|train|bench|batched|host] [--kit DIR] OUT_DIR
#   --dry-run  print every command with its budget and run nothing (no kit or
#              GPU needed)
#   --phase    all (default: the four above), train, bench, batched or host: where
#              a command may run only minutes, one phase per command, in order
#   --kit DIR  the kit folder (default .gpu-kit); a kit made with --models
#              (scripts/gpu-kit.sh) carries trained models in DIR/run: RUN is
#              DIR/run, phase all is bench and batched, and nothing is trained
# Environment: CONFIG (configs/multi30k-gpu-kit.sh), KIT_MODEL (small|base,
#   see the config), RUN (runs/gpu-kit.KIT_MODEL), SITE (/tmp/gpu-kit-site),
#   PYTHON (python3), KIT_BATCHED (8,64), PHASE_SECONDS (540: each phase's
#   stages are stopped after this many seconds, so
#   that the report is written inside a 10-minute call; a benchmark cut short
#   keeps the rows it finished in rows.partial.jsonl), ALLOW_CPU (1: go on
#   without a GPU, for a smoke run on a CPU with KIT_SMOKE=1), plus every
#   variable of the config.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; }

DRY=0 PHASE=all KIT=$HERE/.gpu-kit RESULTS=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run|-n) DRY=1 ;;
    --phase) [ $# -ge 2 ] || { echo "gpu-run.sh: --phase needs all, train, bench, batched or host" >&2; exit 2; }; PHASE=$2; shift ;;
    --kit) [ $# -ge 2 ] || { echo "gpu-run.sh: --kit needs a folder" >&2; exit 2; }; KIT=$2; shift ;;
    -h|--help) usage; exit 0 ;;
    -*) echo "gpu-run.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
    *) [ -z "$RESULTS" ] || { echo "gpu-run.sh: one OUT_DIR only ('$RESULTS', '$1')" >&2; exit 2; }; RESULTS=$1 ;;
  esac
  shift
done
case "$PHASE" in
  all) PHASES=(train bench batched host) ;;
  train|bench|batched|host) PHASES=("$PHASE") ;;
  *) echo "gpu-run.sh: --phase must be all, train, bench, batched or host, got '$PHASE'" >&2; exit 2 ;;
esac
[ -n "$RESULTS" ] || { echo "usage: scripts/gpu-run.sh [--dry-run] [--phase all|train|bench|batched|host] [--kit DIR] OUT_DIR" >&2; exit 2; }
KIT=$(cd "$(dirname "$KIT")" && pwd)/$(basename "$KIT")
# a kit packed with --xz (scripts/gpu-kit.sh) travels as KIT/kit.tar.xz alone
if [ "$DRY" = 0 ] && [ -f "$KIT/kit.tar.xz" ] && [ ! -d "$KIT/data/raw" ]; then
  echo "gpu-run.sh: unpacking $KIT/kit.tar.xz"
  tar -xJf "$KIT/kit.tar.xz" -C "$KIT"
fi

export CONFIG=${CONFIG:-$HERE/configs/multi30k-gpu-kit.sh}
[ -f "$CONFIG" ] || { echo "gpu-run.sh: no such config: $CONFIG" >&2; exit 2; }
export KIT_MODEL=${KIT_MODEL:-small}
# a kit made with --models carries trained models in KIT/run: they are
# benchmarked, nothing is trained (MODELS_GIVEN: scripts/run-multi30k.sh then
# has rows only for the models there, also in a dry run)
export MODELS_GIVEN=0
if [ -d "$KIT/run" ]; then
  MODELS_GIVEN=1
  export RUN=${RUN:-$KIT/run}
  [ "$PHASE" = all ] && PHASES=(bench batched host)
fi
export RUN=${RUN:-$HERE/runs/gpu-kit.$KIT_MODEL}
export SITE=${SITE:-/tmp/gpu-kit-site}
export PYTHON=${PYTHON:-python3}
BATCHED=${KIT_BATCHED:-8,64}
PHASE_SECONDS=${PHASE_SECONDS:-540}

# the paper's Spec-Drafter is trained (and averaged) only when the benchmark
# has its rows (BENCH_DRAFTERS="paper vsd"; the config's default is vsd)
TRAIN_STAGES="verifier distill vsd+blockwise"
case " ${BENCH_DRAFTERS:-vsd} " in
  *" paper "*) TRAIN_STAGES="verifier distill vsd+blockwise+drafter average" ;;
esac
TRAIN_STAGES=${KIT_TRAIN_STAGES:-$TRAIN_STAGES}

# host_rows [--dry-run]: phase host (see the usage above)
host_rows() {
  local dry=0; [ "${1:-}" = --dry-run ] && dry=1
  local rows=(--row "loop-greedy=--decoding loop-greedy" --row "ngram=--decoding ngram"
              --row "self-draft=--decoding self-draft")
  # the default row runs the prefetch (and instruction sets) measured at its first products; forced beside it
  rows+=(--process-row "loop-greedy-prefetch-on=--decoding loop-greedy FAIRSEQ_SPECDEC_PREFETCH=on")
  if grep -qw avx512f /proc/cpuinfo 2>/dev/null; then
    rows+=(--process-row "loop-greedy-avx2=--decoding loop-greedy FAIRSEQ_SPECDEC_ISA=avx2"
           --process-row "loop-greedy-avx512=--decoding loop-greedy FAIRSEQ_SPECDEC_ISA=avx512")
  fi
  local ct2=()
  if [ "$dry" = 1 ] || "$PYTHON" -c "import ctranslate2" 2>/dev/null; then ct2=(--ct2 --ct2-int8); fi
  local pin=()
  if [ -n "${HOST_CPUS:-}" ]; then
    if [ "$dry" = 1 ] || command -v taskset > /dev/null; then pin=(taskset -c "$HOST_CPUS")
    else log "host: no taskset here: the rows run on any core (HOST_CPUS=$HOST_CPUS not applied)"; fi
  fi
  local build=("$PYTHON" setup.py build_ext --inplace)
  local cmd=("${pin[@]}" env OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 "$PYTHON" "$HERE/scripts/interleave.py"
             --data "$RUN/distill/bin" --verifier "$RUN/verifier/checkpoint_best.pt" --src en --tgt de
             --subset test --limit "${HOST_LIMIT:-300}" --batch-size 1 --rounds "${HOST_ROUNDS:-1}" --by-batch
             "${rows[@]}" "${ct2[@]}" --json "$RUN/host/host-cpu.json")
  if [ "$dry" = 1 ]; then
    echo "(cd $(quote "$HERE") && $(quote "${build[@]}"))   # unless the extension is built"
    echo "# wait for $RUN/verifier/DONE and $RUN/distill/bin"
    echo "$(quote "${cmd[@]}") > $(quote "$RUN/host/host-cpu.md")"
    return
  fi
  mkdir -p "$RUN/host"
  if ! "$PYTHON" -c "import sys, fairseq_specdec.kernels as k; sys.exit(k.unavailable_reason() is not None)" 2>/dev/null; then
    log "host: building the plugin's C++ extension in place (log: $RUN/host/build.log)"
    (cd "$HERE" && "${build[@]}") > "$RUN/host/build.log" 2>&1 || true
    "$PYTHON" -c "import sys, fairseq_specdec.kernels as k; r = k.unavailable_reason(); print(r or 'the native kernels run here: ' + k.isa()); sys.exit(r is not None)" \
      || log "host: WARNING: the rows run on torch's products (see $RUN/host/build.log)"
  fi
  if [ ! -f "$RUN/verifier/DONE" ] || [ ! -d "$RUN/distill/bin" ]; then
    log "host: waiting for the verifier and the distillation ($RUN)"
    while [ ! -f "$RUN/verifier/DONE" ] || [ ! -d "$RUN/distill/bin" ]; do sleep 5; done
  fi
  log "host: the CPU rows, ${HOST_LIMIT:-300} test sentences at batch 1, 1 thread${HOST_CPUS:+, on cores $HOST_CPUS}"
  "${cmd[@]}" | tee "$RUN/host/host-cpu.md"
}

# phase NAME [--dry-run]: the recipe's stages of one phase, with its benchmark's settings
phase() {
  local name=$1; shift
  if [ "$name" = train ] && [ "$MODELS_GIVEN" = 1 ]; then
    echo "# phase train: the kit carries trained models ($(cat "$KIT/run/ORIGIN.txt" 2>/dev/null)); nothing to train"
    return 0
  fi
  case "$name" in
    # shellcheck disable=SC2086  # TRAIN_STAGES: one word per stage
    train) bash "$HERE/scripts/run-multi30k.sh" "$@" $TRAIN_STAGES ;;
    bench) KIT_PHASE=bench BENCH_DIR=$RUN/benchmark bash "$HERE/scripts/run-multi30k.sh" "$@" benchmark ;;
    host) host_rows "$@" ;;
    batched) KIT_PHASE=batched BENCH_DIR=$RUN/benchmark-batched BENCH_BATCH_SIZES=$BATCHED BENCH_RELAXED_BATCH_SIZES=none \
               bash "$HERE/scripts/run-multi30k.sh" "$@" benchmark ;;
  esac
}
# what scripts/run-multi30k.sh reads: the kit's data, the run folder
export DATA=$KIT/data OUT=$RUN MULTI30K_RAW=$KIT/data/raw

T0=$(date +%s) LOG_TAG=gpu-run
# shellcheck source=recipe-lib.sh
source "$HERE/scripts/recipe-lib.sh"

if [ "$DRY" = 1 ]; then
  echo "# scripts/gpu-run.sh --dry-run --phase $PHASE (KIT_MODEL=$KIT_MODEL, config $CONFIG)"
  echo "# setup: install the kit's wheels, nothing downloaded"
  echo "$PYTHON -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $SITE $KIT/wheels/*.whl"
  echo "$PYTHON -m compileall -q -j 0 $SITE"
  echo "export PYTHONPATH=$SITE:$HERE PATH=$SITE/bin:\$PATH"
  for p in "${PHASES[@]}"; do echo "# phase $p, at most $PHASE_SECONDS s"; phase "$p" --dry-run; done
  echo "# results: $RESULTS/{gpu-run.log,env.txt,summary.md,results.md,results-batched.md,host-cpu.md,train-logs.tar.gz,benchmark.tar.gz}"
  exit 0
fi

mkdir -p "$RESULTS" "$RUN"
RESULTS=$(cd "$RESULTS" && pwd)
exec > >(tee -a "$RESULTS/gpu-run.log") 2>&1
log "phase $PHASE, KIT_MODEL=$KIT_MODEL, kit $KIT, models in $RUN, results in $RESULTS"
[ -d "$KIT/data/raw" ] || { log "no kit at $KIT (make gpu-kit builds it on the CPU machine; it must travel with the checkout)"; exit 2; }

# setup: the wheels, once per machine
if ls "$KIT"/wheels/*.whl > /dev/null 2>&1; then
  if [ ! -f "$SITE/.installed" ]; then
    log "installing $(ls "$KIT"/wheels/*.whl | wc -l) wheels into $SITE"
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$KIT"/wheels/*.whl
    # Byte-compile once, on every core. Where PYTHONDONTWRITEBYTECODE is set
    # (the H100 run's log showed fairseq's compile-time warning in every
    # process), each of the run's 50-odd processes would otherwise compile
    # fairseq anew (docs/gpu.md, "Device time").
    "$PYTHON" -m compileall -q -j 0 "$SITE" > /dev/null 2>&1 || log "compileall: some files of $SITE did not compile (they are compiled when imported)"
    touch "$SITE/.installed"
  fi
  export PYTHONPATH=$SITE:$HERE${PYTHONPATH:+:$PYTHONPATH} PATH=$SITE/bin:$PATH
else
  log "the kit has no wheels: using the fairseq installed here"
  export PYTHONPATH=$HERE${PYTHONPATH:+:$PYTHONPATH}
fi
{
  echo "date: $(date -u '+%Y-%m-%d %H:%M UTC'); checkout's commit: $(git -C "$HERE" rev-parse --short HEAD 2>/dev/null || echo unknown)"
  head -1 "$KIT/MANIFEST.txt" 2>/dev/null || true
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | sed 's/^/gpu: /' || true
  "$PYTHON" - <<'EOF'
import platform, sys
import torch
print(f"python {platform.python_version()}; torch {torch.__version__} (CUDA {torch.version.cuda}); "
      f"cuda available: {torch.cuda.is_available()}")
if torch.cuda.is_available():
    print(f"device: {torch.cuda.get_device_name(0)}; {torch.cuda.device_count()} visible")
import fairseq, numpy
print(f"fairseq {fairseq.__version__}; numpy {numpy.__version__}")
import fairseq_specdec  # noqa: F401  (the plugin imports)
EOF
  echo "cpu: $(nproc) cores; $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')"
} > "$RESULTS/env.txt"
sed 's/^/  /' "$RESULTS/env.txt"
if ! grep -q "cuda available: True" "$RESULTS/env.txt" && [ "${ALLOW_CPU:-0}" != 1 ]; then
  log "torch sees no GPU here; ALLOW_CPU=1 goes on without one (a smoke run: KIT_SMOKE=1)"
  exit 2
fi

collect() {
  # what comes back: at most 8 files, small (phase host's table as host-cpu.md,
  # its JSON and build log in benchmark.tar.gz)
  tar -czf "$RESULTS/train-logs.tar.gz" -C "$RUN" $(cd "$RUN" && ls -d ./*.log distill/gen/*.log distill/*.log \
      drafter/*.validate.log 2>/dev/null) 2>/dev/null || true
  local benches=() b
  for b in benchmark benchmark-batched host; do
    [ -d "$RUN/$b" ] && benches+=("$b")
  done
  if [ ${#benches[@]} -gt 0 ]; then
    # not the converted model; a phase beside this one may still be writing
    tar -czf "$RESULTS/benchmark.tar.gz" --exclude=ct2-verifier -C "$RUN" "${benches[@]}" \
      || log "benchmark.tar.gz: tar said the above (a phase beside this one still writing?)"
  fi
  cp "$RUN/host/host-cpu.md" "$RESULTS/host-cpu.md" 2>/dev/null || true
  cp "$RUN/benchmark/results.md" "$RESULTS/results.md" 2>/dev/null || true
  cp "$RUN/benchmark-batched/results.md" "$RESULTS/results-batched.md" 2>/dev/null || true
  "$PYTHON" "$HERE/scripts/gpu-summary.py" --run "$RUN" --bench "$RUN/benchmark" --bench "$RUN/benchmark-batched" \
    --log "$RESULTS/gpu-run.log" --env "$RESULTS/env.txt" \
    > "$RESULTS/summary.md" || log "no summary (see the error above)"
}
trap collect EXIT

export -f phase host_rows log quote
export HERE RUN BATCHED TRAIN_STAGES KIT RESULTS T0 LOG_TAG
for p in "${PHASES[@]}"; do
  t=$(date +%s) status=0
  timeout "$PHASE_SECONDS" bash -c 'phase "$1"' _ "$p" || status=$?
  if [ "$status" = 124 ]; then
    log "phase $p stopped after PHASE_SECONDS=$PHASE_SECONDS s: what it finished is reported, the rest is missing"
  elif [ "$status" != 0 ]; then
    log "phase $p failed (exit $status): see the log above"
    exit "$status"
  fi
  log "phase $p done in $(( $(date +%s) - t )) s"
done
