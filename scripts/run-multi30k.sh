#!/usr/bin/env bash
# The Multi30k EN-DE CPU recipe, end to end (what `make demo` runs):
#   prepare -> verifier (teacher) -> distill -> specdec_vsd (reads the
#   verifier's states; the default drafter) and blockwise heads (Stern et al. 2018)
#   side by side, one core each -> the paper's Spec-Drafter (init from
#   verifier, glat_block) alone on both cores -> average -> benchmark (its
#   ngram row drafts from the distillation's train split, no model)
# Every stage logs its progress and time, is skipped when its output exists,
# and fairseq-train resumes from checkpoint_last.pt after an interruption.
#
# Usage: scripts/run-multi30k.sh [--dry-run] [STAGE ...]   (default: all stages
#   in order; STAGE1+STAGE2 runs stages at the same time with THREADS each,
#   default vsd+blockwise; a training stage run alone gets SOLO_THREADS; the
#   benchmark adds a blockwise row when that stage has run)
#   --dry-run  print every command of the stages, each training with its
#              budget, shell-quoted ("#" lines are comments), and run nothing
# Environment: CONFIG (configs/multi30k-cpu.sh; configs/multi30k-gpu.sh trains
#   on a GPU for far more updates: --cpu only when the config says DEVICE=cpu,
#   the benchmark on BENCH_DEVICE), OUT (runs/multi30k.SRC-TGT),
#   MULTI30K_RAW (raw corpus dir, see prepare-multi30k.sh), BENCH_ARGS (extra
#   arguments for scripts/benchmark.py), BENCH_DIR (its results, default
#   OUT/benchmark), BENCH_DRAFTERS (the drafters with rows: "paper vsd"),
#   BENCH_RELAXED_BATCH_SIZES=none (no relaxed rows), BENCH_RELAXED_DRAFTERS
#   (the drafter labels with relaxed rows, e.g. "vsd"; default all), ROOFLINE (1: the verify pass's CPU
#   roofline after the benchmark; 0: none), plus every variable of the config.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CONFIG=${CONFIG:-$HERE/configs/multi30k-cpu.sh}
# shellcheck source=/dev/null
source "$CONFIG"
case "${DEVICE:-cpu}" in
  cpu|gpu) ;;
  *) echo "DEVICE must be cpu or gpu, got '$DEVICE' (set by $CONFIG or the environment)" >&2; exit 2;;
esac
OUT=${OUT:-$HERE/runs/multi30k.$SRC-$TGT}
DATA=${DATA:-$HERE/data/multi30k.$SRC-$TGT}
PY=${PYTHON:-python}
export OMP_NUM_THREADS=$THREADS MKL_NUM_THREADS=$THREADS
STAGES=()
DRY_RUN=0
for arg in "$@"; do
  case "$arg" in
    --dry-run|-n) DRY_RUN=1 ;;
    *) STAGES+=("$arg") ;;
  esac
done
export DRY_RUN
[ ${#STAGES[@]} -gt 0 ] || STAGES=(prepare verifier distill vsd+blockwise drafter average benchmark)
T0=$(date +%s)
LOG_TAG=multi30k
# shellcheck source=recipe-lib.sh
source "$HERE/scripts/recipe-lib.sh"
# a dry run prints its log lines as comments, and each command instead of running it
if [ "$DRY_RUN" = 1 ]; then log() { echo "# $*"; }; else mkdir -p "$OUT"; fi
run() { if [ "$DRY_RUN" = 1 ]; then quote "$@"; echo; else "$@"; fi; }
# have FILE: FILE exists (always true in a dry run, which prints every stage as if the earlier ones had run)
# a dry run counts a file a stage would make as made, unless no stage trains
# here (MODELS_GIVEN=1: scripts/gpu-run.sh with a kit's packed models)
have() { [ -f "$1" ] || { [ "$DRY_RUN" = 1 ] && [ "${MODELS_GIVEN:-0}" != 1 ]; }; }

stage_prepare() {
  run env OUT_DIR="$DATA" bash "$HERE/scripts/prepare-multi30k.sh" "$SRC" "$TGT"
}

stage_verifier() {
  OMP_NUM_THREADS=$VERIFIER_THREADS MKL_NUM_THREADS=$VERIFIER_THREADS \
    train verifier "$VERIFIER_UPDATES" "$VERIFIER_MAX_MINUTES" "$DATA/bin" "${VERIFIER_ARGS[@]}"
}

stage_distill() {
  log "distill: beam $DISTILL_BEAM ${DISTILL_GEN_ARGS} over train and valid, ${DISTILL_SHARDS:-2} shards in parallel"
  local cpu=1; [ "${DEVICE:-cpu}" = cpu ] || cpu=0
  run env BEAM="$DISTILL_BEAM" SHARDS="${DISTILL_SHARDS:-2}" PARALLEL=1 THREADS=1 EXTRA_GEN_ARGS="$DISTILL_GEN_ARGS" \
    CPU=$cpu MAX_TOKENS="${DISTILL_MAX_TOKENS:-6000}" \
    bash "$HERE/scripts/distill.sh" "$OUT/verifier/checkpoint_best.pt" "$DATA/bin" "$DATA/bpe" "$OUT/distill" "$SRC" "$TGT"
}

stage_drafter() {
  train drafter "$DRAFTER_UPDATES" "$DRAFTER_MAX_MINUTES" "$OUT/distill/bin" "${DRAFTER_ARGS[@]}" \
    --init-from-verifier "$OUT/verifier/checkpoint_best.pt"
}

stage_vsd() {
  train vsd "$VSD_UPDATES" "$VSD_MAX_MINUTES" "$OUT/distill/bin" "${VSD_ARGS[@]}" \
    --init-from-verifier "$OUT/verifier/checkpoint_best.pt"
}

stage_blockwise() {
  train blockwise "$BLOCKWISE_UPDATES" "$BLOCKWISE_MAX_MINUTES" "$OUT/distill/bin" "${BLOCKWISE_ARGS[@]}" \
    --init-from-verifier "$OUT/verifier/checkpoint_best.pt"
}

# block_acc of a drafter checkpoint on the distilled validation set (the
# fairseq-validate log is kept next to the checkpoint); fails with the log's
# name when no block_acc can be read from it
validate_cmd() {
  VALIDATE=(fairseq-validate "$OUT/distill/bin" --user-dir "$HERE/fairseq_specdec" --task draft_verify --path "$1"
            $(device_flag) --max-tokens 4096 --num-workers 0)
}
block_acc() {
  local log=${1%.pt}.validate.log acc
  validate_cmd "$1"
  "${VALIDATE[@]}" > "$log" 2>&1 || true
  acc=$(sed -n 's/.*valid on .*| block_acc \([0-9.]*\) .*/\1/p' "$log" | tail -1)
  if [ -z "$acc" ]; then echo "no validation block_acc for $1: see $log" >&2; return 1; fi
  echo "$acc"
}

# Average the last epoch checkpoints, then keep whichever of the average and
# the last checkpoint has the higher validation block_acc: after a short run
# the early epochs are much weaker and their average can lose to the last one
# (measured: 30.49 vs 32.58 after 20 minutes).  -> drafter/checkpoint_selected.pt
stage_average() {
  local n=${AVERAGE_LAST:-5} selected=$OUT/drafter/checkpoint_last.pt
  if [ "$DRY_RUN" = 1 ]; then
    log "average: the drafter's last (up to) $n epoch checkpoints, kept if its validation block_acc is at least the last checkpoint's"
    run "$PY" "$HERE/scripts/average-checkpoints.py" --inputs "$OUT/drafter" --num-epoch-checkpoints "$n" \
      --output "$OUT/drafter/checkpoint_avg.pt"
    for c in avg last; do validate_cmd "$OUT/drafter/checkpoint_$c.pt"; run "${VALIDATE[@]}"; done
    run cp "$OUT/drafter/checkpoint_avg.pt" "$OUT/drafter/checkpoint_selected.pt"
    return
  fi
  local have; have=$(ls "$OUT/drafter" | grep -cE '^checkpoint[0-9]+\.pt$' || true)
  [ "$have" -lt "$n" ] && n=$have
  if [ "$n" -ge 2 ]; then
    log "average: last $n epoch checkpoints of the drafter"
    "$PY" "$HERE/scripts/average-checkpoints.py" --inputs "$OUT/drafter" --num-epoch-checkpoints "$n" \
      --output "$OUT/drafter/checkpoint_avg.pt"
    local acc_avg acc_last
    acc_avg=$(block_acc "$OUT/drafter/checkpoint_avg.pt")
    acc_last=$(block_acc "$OUT/drafter/checkpoint_last.pt")
    log "validation block_acc: average $acc_avg, last checkpoint $acc_last"
    if awk -v a="$acc_avg" -v b="$acc_last" 'BEGIN { exit !(a >= b) }'; then
      selected=$OUT/drafter/checkpoint_avg.pt
    fi
  fi
  log "drafter for decoding: $selected"
  cp "$selected" "$OUT/drafter/checkpoint_selected.pt"
}

stage_benchmark() {
  local raw; raw=$(raw_multi30k)
  local BENCH_DIR=${BENCH_DIR:-$OUT/benchmark}
  local rows=beam5,beam1,loop-greedy,ngram,strict drafters=() relaxed=()
  # draft trees: nodes per tree of the specdec_vsd drafter's tree rows, and the
  # ngram tree rows; several sizes ("16 32"): the first's rows are labelled
  # tree and vsd-tree, the others' treeN and vsd-treeN
  local TREE_NODES=${TREE_NODES:-5} trees=() sizes=() suffixes=() i
  read -r -a sizes <<< "$TREE_NODES"
  for i in "${!sizes[@]}"; do
    suffixes[i]=${sizes[i]}; [ "$i" -gt 0 ] || suffixes[i]=""
    trees+=(--variant "tree${suffixes[i]}:ngram=--draft-tree ${sizes[i]} --ngram-min-confidence 0.15")
  done
  # BENCH_RELAXED_BATCH_SIZES=none: no relaxed rows
  if [ "$BENCH_RELAXED_BATCH_SIZES" != none ]; then
    # BENCH_RELAXED_DRAFTERS: the --drafter labels with relaxed rows (default every drafter), e.g. "vsd"
    local relaxed_rows=relaxed
    [ -z "${BENCH_RELAXED_DRAFTERS:-}" ] || relaxed_rows="relaxed:$(echo "$BENCH_RELAXED_DRAFTERS" | tr ' ' '+')"
    rows=$rows,$relaxed_rows relaxed=(--relaxed "$BENCH_RELAXED" --relaxed-batch-sizes "$BENCH_RELAXED_BATCH_SIZES")
  fi
  # BENCH_DRAFTERS: which drafters have rows (paper: the Spec-Drafter, vsd: specdec_vsd)
  case " ${BENCH_DRAFTERS:-paper vsd} " in
    *" paper "*) drafters+=(--drafter "paper=$OUT/drafter/checkpoint_selected.pt") ;;
  esac
  if [[ " ${BENCH_DRAFTERS:-paper vsd} " == *" vsd "* ]] && have "$OUT/vsd/checkpoint_last.pt"; then
    drafters+=(--drafter "vsd=$OUT/vsd/checkpoint_last.pt")  # the default drafter
    # the same drafter's draft trees (docs/trees.md), and the corpus and the drafter in one tree
    for i in "${!sizes[@]}"; do
      drafters+=(--drafter "vsd-tree${suffixes[i]}=$OUT/vsd/checkpoint_last.pt"
                 --drafter-options "vsd-tree${suffixes[i]}=--draft-tree ${sizes[i]} --draft-min-confidence 0")
    done
    rows=$rows,ngram+draft-verify:vsd
    if [ "${BENCH_DIAGNOSTIC:-0}" = 1 ]; then
      # diagnostic: the same drafter with a fixed k and no confidence cut
      drafters+=(--drafter "vsd-fixed=$OUT/vsd/checkpoint_last.pt" --drafter-options "vsd-fixed=--draft-min-confidence 0")
    fi
  fi
  if [ ${#drafters[@]} = 0 ]; then rows=beam5,beam1,loop-greedy,ngram; fi
  # the verifier's own int8 copy drafting (a CPU decoding), and CTranslate2's int8 row below
  local cpu=0; [ "${BENCH_DEVICE:-cpu}" = cpu ] && cpu=1
  if [ $cpu = 1 ]; then rows=$rows,self-draft; fi
  local extra=()
  if have "$OUT/blockwise/checkpoint_best.pt"; then
    extra=(--blockwise "$OUT/blockwise/checkpoint_best.pt"); rows=$rows,blockwise
  fi
  # CTranslate2's greedy decoder on the same verifier (make demo installs the
  # package; the plugin does not depend on it)
  if "$PY" -c "import ctranslate2" 2>/dev/null; then
    rows=$rows,ct2
    if [ $cpu = 1 ]; then rows=$rows,ct2-int8; fi
  else
    log "no CTranslate2 row: the ctranslate2 package is not installed (pip install -e '.[ct2]', or make demo)"
  fi
  log "benchmark: 1,000 test sentences, every decoder, $BENCH_JOBS at a time (results in $BENCH_DIR)"
  run "$PY" "$HERE/scripts/benchmark.py" --data "$OUT/distill/bin" --src "$SRC" --tgt "$TGT" "${extra[@]}" \
    --verifier "$OUT/verifier/checkpoint_best.pt" "${drafters[@]}" --rows "$rows" --device "${BENCH_DEVICE:-cpu}" \
    --raw-ref "$raw/test_2016_flickr.$TGT.gz" --tok-ref "$DATA/tok/test_2016_flickr.$TGT" \
    --out "$BENCH_DIR" --jobs "$BENCH_JOBS" --batch-sizes "${BENCH_BATCH_SIZES:-1,32}" \
    "${relaxed[@]}" "${trees[@]}" ${BENCH_ARGS:-}
  # what a verify pass of m tokens costs on this CPU, against its ideal: the
  # answer to "when does speculation pay here" (docs/verify-kernels.md)
  local roofline=1; [ "${BENCH_DEVICE:-cpu}" = cpu ] || roofline=0
  [ "${ROOFLINE:-$roofline}" = 1 ] || return 0
  log "roofline of the verify pass, 1 thread ($BENCH_DIR/roofline.md, roofline.json)"
  if [ "$DRY_RUN" = 1 ]; then
    echo "$(quote "$PY" "$HERE/scripts/roofline.py" --path "$OUT/verifier/checkpoint_best.pt" --data "$OUT/distill/bin" \
      --json-out "$BENCH_DIR/roofline.json") > $(quote "$BENCH_DIR/roofline.md")"
    return
  fi
  mkdir -p "$BENCH_DIR"
  "$PY" "$HERE/scripts/roofline.py" --path "$OUT/verifier/checkpoint_best.pt" --data "$OUT/distill/bin" \
    --json-out "$BENCH_DIR/roofline.json" > "$BENCH_DIR/roofline.md"
}

for group in "${STAGES[@]}"; do
  IFS=+ read -r -a parts <<< "$group"
  for stage in "${parts[@]}"; do
    case "$stage" in
      prepare|verifier|distill|drafter|vsd|blockwise|average|benchmark) ;;
      *) echo "unknown stage '$stage' (prepare verifier distill drafter vsd blockwise average benchmark)" >&2; exit 2;;
    esac
  done
done
for group in "${STAGES[@]}"; do
  IFS=+ read -r -a parts <<< "$group"
  if [ ${#parts[@]} -eq 1 ]; then
    log "stage $group"
    case "$group" in
      drafter|vsd|blockwise)  # a training stage alone: SOLO_THREADS
        OMP_NUM_THREADS=${SOLO_THREADS:-$THREADS} MKL_NUM_THREADS=${SOLO_THREADS:-$THREADS} "stage_$group";;
      *) "stage_$group";;
    esac
    continue
  fi
  log "stages ${parts[*]}, side by side"
  if [ "$DRY_RUN" = 1 ]; then
    for stage in "${parts[@]}"; do "stage_$stage"; done
    continue
  fi
  pids=()
  for stage in "${parts[@]}"; do "stage_$stage" & pids+=($!); done
  failed=0
  for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
  [ $failed = 0 ] || { log "a stage of $group failed"; exit 1; }
done
[ "$DRY_RUN" = 1 ] || log "all done in $(( ($(date +%s) - T0) / 60 )) minutes"
