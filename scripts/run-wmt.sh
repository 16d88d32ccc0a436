#!/usr/bin/env bash
# WMT reproduction recipe for the papers' main setting (one GPU node):
#   download -> prepare -> teacher -> distill -> verifier -> drafter -> average -> evaluate
#
#   download  raw parallel text: the training archives (statmt.org; SETIMES2 from
#             OPUS), concatenated; valid/test through sacrebleu (statmt.org archives)
#   prepare   Moses tokenization (scripts/moses.py), joint BPE (subword-nmt),
#             length/ratio cleaning of train, fairseq-preprocess --joined-dictionary
#   teacher   fairseq-train on the raw data, then average its last checkpoints
#   distill   sequence-level KD: teacher beam search over train and valid, one
#             fairseq-generate --distributed-world-size/--distributed-rank shard per GPU
#             (CUDA_VISIBLE_DEVICES), merged in sentence order by
#             scripts/merge-hypotheses.py, binarized with the teacher's dictionary
#   verifier  transformer-base on the distilled data, then averaged
#   drafter   specdec_nat_base + glat_block, initialized from the averaged verifier
#   average   the drafter's last AVERAGE_LAST update checkpoints ("avg10")
#   evaluate  test set: beam 5, beam 1, draft-verify strict and relaxed. Each is
#             scored with sacreBLEU on detokenized text (signature printed) and
#             with tokenized BLEU (sacrebleu --tokenize none; for EN-DE also with
#             compound splitting). Results are in $OUT/eval/results.txt.
# Teacher and verifier are averaged at the end of their own stages, because
# the next stage needs the averaged model.
#
# Usage: scripts/run-wmt.sh CONFIG [--dry-run] [STAGE ...]   (default: all stages, in order)
#   CONFIG     configs/wmt14-en-de-base.sh or configs/wmt16-en-ro-base.sh
#   --dry-run  print every command of the selected stages (one per line,
#              shell-quoted; "#" lines are comments) and run nothing. No data
#              or checkpoint has to exist.
# Environment: DATA (data/NAME), OUT (runs/NAME), PYTHON (python), WORKERS (8),
#   CUDA_VISIBLE_DEVICES (GPUs for the distillation shards; default 0..NUM_GPUS-1),
#   plus every variable of the config (NUM_GPUS, MAX_TOKENS, ...).
# A real run is idempotent: a step whose output exists is skipped, fairseq-train
# resumes from checkpoint_last.pt, and every stage is logged with its time.
# Multi-node training is out of scope: use torchrun with the same arguments.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
ALL_STAGES=(download prepare teacher distill verifier drafter average evaluate)

usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; }

CONFIG="" DRY=0 STAGES=()
for arg in "$@"; do
  case "$arg" in
    --dry-run|-n) DRY=1 ;;
    -h|--help) usage; exit 0 ;;
    -*) echo "run-wmt.sh: unknown option '$arg'" >&2; exit 2 ;;
    *) if [ -z "$CONFIG" ]; then CONFIG=$arg; else STAGES+=("$arg"); fi ;;
  esac
done
if [ -z "$CONFIG" ]; then
  echo "usage: scripts/run-wmt.sh CONFIG [--dry-run] [STAGE ...]   (stages: ${ALL_STAGES[*]})" >&2
  exit 2
fi
[ -f "$CONFIG" ] || { echo "run-wmt.sh: no such config: $CONFIG" >&2; exit 2; }
[ ${#STAGES[@]} -gt 0 ] || STAGES=("${ALL_STAGES[@]}")
for stage in "${STAGES[@]}"; do
  case " ${ALL_STAGES[*]} " in
    *" $stage "*) ;;
    *) echo "run-wmt.sh: unknown stage '$stage' (stages: ${ALL_STAGES[*]})" >&2; exit 2 ;;
  esac
done

# shellcheck source=/dev/null
source "$CONFIG"
DATA=${DATA:-$HERE/data/$NAME}
RAW=$DATA/raw
OUT=${OUT:-$HERE/runs/$NAME}
PLUGIN=$HERE/fairseq_specdec
PY=${PYTHON:-python}
WORKERS=${WORKERS:-8}
AVG=checkpoint_avg$AVERAGE_LAST.pt
if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
  IFS=, read -r -a GPU_LIST <<< "$CUDA_VISIBLE_DEVICES"
else
  GPU_LIST=(); for ((i = 0; i < NUM_GPUS; i++)); do GPU_LIST+=("$i"); done
fi
T0=$(date +%s)
LOG_TAG=$NAME
# log MESSAGE: the log line of every recipe ("[NAME HH:MM:SS +Nm] MESSAGE").
# recipe-lib.sh's train() is the CPU recipes' (--cpu, a wall-clock cap, budget
# in updates given to it); the WMT runs train on GPUs for the --max-update of
# their configs and can be printed as a dry run, so they keep train_model below.
# shellcheck source=recipe-lib.sh
source "$HERE/scripts/recipe-lib.sh"

# ----------------------------------------------------------------------------- helpers
# q ARG...: the arguments shell-quoted (like Python's shlex.quote), space-separated
q() {
  local out="" a
  for a in "$@"; do
    if [[ $a =~ ^[A-Za-z0-9_@%+=:,./-]+$ ]]; then out+="$a "; else out+="'${a//\'/\'\\\'\'}' "; fi
  done
  printf '%s' "${out% }"
}
# a dry run prints its log lines as comments
if [ "$DRY" = 1 ]; then log() { echo "# $*"; }; fi
# have FILE: the output exists (never true in a dry run, which prints everything)
have() { [ "$DRY" = 0 ] && [ -e "$1" ]; }
# run CMD...: print it (dry run) or run it
run() { if [ "$DRY" = 1 ]; then q "$@"; echo; else "$@"; fi; }
# run_out OUT CMD...: stdout to OUT, written atomically
run_out() {
  local out=$1; shift
  if [ "$DRY" = 1 ]; then echo "$(q "$@") > $(q "$out")"; return; fi
  "$@" > "$out.part"; mv "$out.part" "$out"
}
# run_io IN OUT CMD...: stdin from IN, stdout to OUT (atomically)
run_io() {
  local in=$1 out=$2; shift 2
  if [ "$DRY" = 1 ]; then echo "$(q "$@") < $(q "$in") > $(q "$out")"; return; fi
  "$@" < "$in" > "$out.part"; mv "$out.part" "$out"
}
# run_pipe OUT PIPELINE: a shell pipeline (built with q) to OUT, atomically
run_pipe() {
  local out=$1 pipeline=$2
  if [ "$DRY" = 1 ]; then echo "$pipeline > $(q "$out")"; return; fi
  eval "$pipeline" > "$out.part"; mv "$out.part" "$out"
}
# background jobs (distillation shards): run_bg OUT CMD... then wait_bg
BG_PIDS=() BG_LOGS=()
run_bg() {
  local out=$1; shift
  if [ "$DRY" = 1 ]; then echo "$(q "$@") > $(q "$out") 2> $(q "$out.log") &"; return; fi
  ( "$@" > "$out" 2> "$out.log" && echo ok > "$out.done" ) &
  BG_PIDS+=($!) BG_LOGS+=("$out.log")
}
wait_bg() {
  if [ "$DRY" = 1 ]; then echo wait; return; fi
  local i failed=0
  for i in "${!BG_PIDS[@]}"; do
    wait "${BG_PIDS[$i]}" || { echo "failed; see ${BG_LOGS[$i]}" >&2; failed=1; }
  done
  BG_PIDS=() BG_LOGS=()
  [ "$failed" = 0 ] || exit 1
}
# run_log OUT CMD...: stdout to OUT, stderr to OUT.log, then OUT.done
run_log() {
  local out=$1; shift
  if [ "$DRY" = 1 ]; then echo "$(q "$@") > $(q "$out") 2> $(q "$out.log")"; return; fi
  "$@" > "$out" 2> "$out.log" || { echo "failed; see $out.log" >&2; exit 1; }
  echo ok > "$out.done"
}
# run_merge OUT LINES_FILE GEN...: hypotheses of fairseq-generate outputs, in sentence order
run_merge() {
  local out=$1 count=$2; shift 2
  local cmd=("$PY" "$HERE/scripts/merge-hypotheses.py")
  if [ "$DRY" = 1 ]; then
    local n
    if [ -f "$count" ]; then n=$(wc -l < "$count"); else n="\"\$(wc -l < $(q "$count"))\""; fi
    echo "$(q "${cmd[@]}") --expected $n $(q "$@") > $(q "$out")"
    return
  fi
  "${cmd[@]}" --expected "$(wc -l < "$count")" "$@" > "$out.part"; mv "$out.part" "$out"
}
# the raw text of SPLIT in LANG (Romanian without diacritics when RO_STRIP_DIACRITICS=1)
text_file() {
  if [ "$2" = ro ] && [ "$RO_STRIP_DIACRITICS" = 1 ]; then echo "$DATA/norm/$1.$2"; else echo "$RAW/$1.$2"; fi
}
RO_SED='s/Ș/S/g; s/ș/s/g; s/Ş/S/g; s/ş/s/g; s/Ț/T/g; s/ț/t/g; s/Ţ/T/g; s/ţ/t/g; s/Ă/A/g; s/ă/a/g; s/Â/A/g; s/â/a/g; s/Î/I/g; s/î/i/g'

# ----------------------------------------------------------------------------- stages
stage_download() {
  run mkdir -p "$RAW/orig"
  local url f prefix alt l i
  for url in "${TRAIN_URLS[@]}"; do
    f=$RAW/orig/$(basename "$url")
    if have "$f.extracted"; then log "have $(basename "$url")"; continue; fi
    if ! have "$f"; then
      log "downloading $url"
      run curl -fL --retry 3 -o "$f.part" "$url"
      run mv "$f.part" "$f"
    fi
    case "$f" in
      *.zip) run "$PY" -m zipfile -e "$f" "$RAW/orig" ;;
      *) run tar -xzf "$f" -C "$RAW/orig" ;;
    esac
    run touch "$f.extracted"
  done
  for l in "$SRC" "$TGT"; do
    if have "$RAW/train.$l"; then continue; fi
    local files=()
    for prefix in "${TRAIN_CORPORA[@]}"; do
      # OPUS has renamed files between releases: NAME.xx-yy may be NAME2.xx-yy
      for alt in "$prefix" "${prefix/./2.}"; do
        if [ -f "$RAW/orig/$alt.$l" ]; then prefix=$alt; break; fi
      done
      files+=("$RAW/orig/$prefix.$l")
    done
    if [ "$DRY" = 0 ]; then
      for i in "${files[@]}"; do [ -f "$i" ] || { echo "missing $i (extracted: $(ls "$RAW/orig"))" >&2; exit 1; }; done
    fi
    log "training corpus $l: ${#files[@]} files"
    run_out "$RAW/train.$l" cat "${files[@]}"
  done
  local split set side
  for split in valid test; do
    if [ "$split" = valid ]; then set=$VALID_TESTSET; else set=$TEST_TESTSET; fi
    for side in src ref; do
      if [ "$side" = src ]; then l=$SRC; else l=$TGT; fi
      if have "$RAW/$split.$l"; then continue; fi
      log "$split.$l: sacrebleu test set $set ($side)"
      run_out "$RAW/$split.$l" sacrebleu -t "$set" -l "$SRC-$TGT" --echo "$side"
    done
  done
}

stage_prepare() {
  local split l in out
  run mkdir -p "$DATA/tok" "$DATA/bpe"
  if [ "$RO_STRIP_DIACRITICS" = 1 ]; then run mkdir -p "$DATA/norm"; fi
  for split in train valid test; do
    for l in "$SRC" "$TGT"; do
      in=$(text_file "$split" "$l")
      if [ "$in" != "$RAW/$split.$l" ] && ! have "$in"; then
        log "$split.$l: removing Romanian diacritics"
        run_io "$RAW/$split.$l" "$in" sed -e "$RO_SED"
      fi
      out=$DATA/tok/$split.$l
      if have "$out"; then continue; fi
      log "tokenizing $split.$l"
      run_io "$in" "$out" "$PY" "$HERE/scripts/moses.py" tokenize -l "$l"
    done
  done
  local codes=$DATA/bpe/codes
  if ! have "$codes"; then
    log "learning joint BPE ($BPE_MERGES merges)"
    run_pipe "$codes" "$(q cat "$DATA/tok/train.$SRC" "$DATA/tok/train.$TGT") | $(q "$PY" -m subword_nmt.learn_bpe -s "$BPE_MERGES")"
  fi
  for split in train valid test; do
    for l in "$SRC" "$TGT"; do
      out=$DATA/bpe/$split.$l
      [ "$split" = train ] && out=$DATA/bpe/train.all.$l
      if have "$out"; then continue; fi
      log "applying BPE to $split.$l"
      run_io "$DATA/tok/$split.$l" "$out" "$PY" -m subword_nmt.apply_bpe -c "$codes"
    done
  done
  if ! have "$DATA/bpe/train.$TGT"; then
    log "cleaning train: 1..$CLEAN_MAX_LEN BPE tokens, length ratio <= $CLEAN_RATIO (as clean-corpus-n.perl)"
    # shellcheck disable=SC2016  # an awk program, not shell
    local awk_prog='{ n = split($1, a, " "); m = split($2, b, " "); if (n >= 1 && m >= 1 && n <= max && m <= max && n <= ratio * m && m <= ratio * n) print }'
    run_pipe "$DATA/bpe/train.pairs" "$(q paste "$DATA/bpe/train.all.$SRC" "$DATA/bpe/train.all.$TGT") | $(q awk -F '\t' -v max="$CLEAN_MAX_LEN" -v ratio="$CLEAN_RATIO" "$awk_prog")"
    run_out "$DATA/bpe/train.$SRC" cut -f1 "$DATA/bpe/train.pairs"
    run_out "$DATA/bpe/train.$TGT" cut -f2 "$DATA/bpe/train.pairs"
  fi
  if ! have "$DATA/bin/test.$SRC-$TGT.$TGT.bin"; then
    log "binarizing (fairseq-preprocess --joined-dictionary)"
    run rm -rf "$DATA/bin.part" "$DATA/bin"
    run fairseq-preprocess --source-lang "$SRC" --target-lang "$TGT" \
      --trainpref "$DATA/bpe/train" --validpref "$DATA/bpe/valid" --testpref "$DATA/bpe/test" \
      --destdir "$DATA/bin.part" --joined-dictionary --workers "$WORKERS"
    run mv "$DATA/bin.part" "$DATA/bin"
  fi
}

# train_model NAME BIN ARRAY AVERAGE [EXTRA ARG...]: fairseq-train, then (AVERAGE=1)
# average the last AVERAGE_LAST update checkpoints into NAME/checkpoint_avgN.pt
train_model() {
  local name=$1 bin=$2 average=$4
  local -n model_args=$3
  shift 4
  local dir=$OUT/$name
  if have "$dir/DONE"; then
    log "$name: trained before ($dir)"
  else
    log "$name: fairseq-train (log: $dir/train.log)"
    run mkdir -p "$dir"
    run fairseq-train "$bin" --user-dir "$PLUGIN" "${model_args[@]}" "$@" \
      --source-lang "$SRC" --target-lang "$TGT" --save-dir "$dir" \
      --log-file "$dir/train.log" --log-format simple --log-interval 100 --seed 1
    run touch "$dir/DONE"
  fi
  if [ "$average" = 1 ]; then average_model "$name"; fi
}

average_model() {
  local dir=$OUT/$1
  if have "$dir/$AVG"; then log "$1: averaged before ($dir/$AVG)"; return; fi
  log "$1: averaging the last $AVERAGE_LAST update checkpoints"
  run "$PY" "$HERE/scripts/average-checkpoints.py" --inputs "$dir" \
    --num-update-checkpoints "$AVERAGE_LAST" --output "$dir/$AVG"
}

stage_teacher() { train_model teacher "$DATA/bin" TEACHER_ARGS 1; }

stage_distill() {
  local teacher=$OUT/teacher/$AVG dist=$OUT/distill split shard gen gens
  local shards=$NUM_GPUS
  run mkdir -p "$dist/gen" "$dist/text"
  for split in train valid; do
    if have "$dist/text/$split.$TGT"; then log "distill: $split done before"; continue; fi
    log "distill: $split, beam $DISTILL_BEAM, $shards shards on GPUs ${GPU_LIST[*]}"
    gens=()
    for ((shard = 0; shard < shards; shard++)); do
      gen=$dist/gen/$split.shard$shard.txt
      gens+=("$gen")
      if have "$gen.done"; then continue; fi
      run_bg "$gen" env CUDA_VISIBLE_DEVICES="${GPU_LIST[shard % ${#GPU_LIST[@]}]}" \
        fairseq-generate "$DATA/bin" --user-dir "$PLUGIN" --task draft_verify \
        --decoding autoregressive --gen-subset "$split" --path "$teacher" \
        --beam "$DISTILL_BEAM" --max-tokens "$DISTILL_MAX_TOKENS" --fp16 \
        --distributed-world-size "$shards" --distributed-rank "$shard" --source-lang "$SRC" --target-lang "$TGT"
    done
    wait_bg
    run_merge "$dist/text/$split.$TGT" "$DATA/bpe/$split.$SRC" "${gens[@]}"
    run cp "$DATA/bpe/$split.$SRC" "$dist/text/$split.$SRC"
  done
  if ! have "$dist/bin/test.$SRC-$TGT.$TGT.bin"; then
    log "distill: binarizing with the teacher's dictionary (test set: the original one)"
    run rm -rf "$dist/bin.part" "$dist/bin"
    run fairseq-preprocess --source-lang "$SRC" --target-lang "$TGT" \
      --trainpref "$dist/text/train" --validpref "$dist/text/valid" --testpref "$DATA/bpe/test" \
      --srcdict "$DATA/bin/dict.$SRC.txt" --tgtdict "$DATA/bin/dict.$TGT.txt" \
      --destdir "$dist/bin.part" --workers "$WORKERS"
    run mv "$dist/bin.part" "$dist/bin"
  fi
}

stage_verifier() { train_model verifier "$OUT/distill/bin" VERIFIER_ARGS 1; }

stage_drafter() {
  train_model drafter "$OUT/distill/bin" DRAFTER_ARGS 0 --init-from-verifier "$OUT/verifier/$AVG"
}

stage_average() { average_model drafter; }

stage_evaluate() {
  local ev=$OUT/eval bin=$OUT/distill/bin verifier=$OUT/verifier/$AVG drafter=$OUT/drafter/$AVG
  local ref_raw ref_tok=$DATA/tok/test.$TGT
  ref_raw=$(text_file test "$TGT")
  run mkdir -p "$ev"
  local names=(beam5 beam1 dv-strict) setting beta tau
  local -A dec_args=(
    [beam5]="--decoding autoregressive --beam 5"
    [beam1]="--decoding autoregressive --beam 1"
    [dv-strict]="--decoding draft-verify --beam 1 --verify-beta 1"
  )
  for setting in "${RELAXED_SETTINGS[@]}"; do
    read -r beta tau <<< "$setting"
    names+=("dv-beta$beta-tau$tau")
    dec_args[dv-beta$beta-tau$tau]="--decoding draft-verify --beam 1 --verify-beta $beta --verify-tau $tau"
  done
  if [ "$COMPOUND_SPLIT_BLEU" = 1 ] && ! have "$ev/ref.compound"; then
    run_io "$ref_tok" "$ev/ref.compound" sed -E 's/(\S)-(\S)/\1 ##AT##-##AT## \2/g'
  fi
  local name gen extra
  for name in "${names[@]}"; do
    gen=$ev/$name.gen
    read -r -a extra <<< "${dec_args[$name]}"
    if [[ $name == dv-* ]]; then
      extra+=(--drafter-path "$drafter" --block-size "$BLOCK_SIZE" --specdec-stats "$ev/$name.stats.jsonl")
    fi
    if ! have "$gen.done"; then
      log "evaluate: $name (${dec_args[$name]})"
      run_log "$gen" env CUDA_VISIBLE_DEVICES="${GPU_LIST[0]}" \
        fairseq-generate "$bin" --user-dir "$PLUGIN" --task draft_verify --path "$verifier" \
        "${extra[@]}" --gen-subset test --batch-size "$EVAL_BATCH_SIZE" \
        --post-process subword_nmt --source-lang "$SRC" --target-lang "$TGT"
    fi
    # tokenized hypotheses (BPE removed) -> detokenized -> sacreBLEU and tokenized BLEU
    run_merge "$ev/$name.tok" "$DATA/bpe/test.$SRC" "$gen"
    run_io "$ev/$name.tok" "$ev/$name.detok" "$PY" "$HERE/scripts/moses.py" detokenize -l "$TGT"
    run_out "$ev/$name.sacrebleu" sacrebleu "$ref_raw" -i "$ev/$name.detok" -m bleu -f text -w 2
    run_out "$ev/$name.tokbleu" sacrebleu "$ref_tok" -i "$ev/$name.tok" -m bleu -f text -w 2 --tokenize none
    if [ "$COMPOUND_SPLIT_BLEU" = 1 ]; then
      run_io "$ev/$name.tok" "$ev/$name.tok.compound" sed -E 's/(\S)-(\S)/\1 ##AT##-##AT## \2/g'
      run_out "$ev/$name.compoundbleu" sacrebleu "$ev/ref.compound" -i "$ev/$name.tok.compound" \
        -m bleu -f text -w 2 --tokenize none
    fi
  done
  if [ "$DRY" = 1 ]; then log "summary of the files above -> $ev/results.txt"; return; fi
  {
    echo "# $NAME test set: $(wc -l < "$ref_raw") sentences"
    echo "# sacreBLEU: detokenized output vs the raw reference ($ref_raw)"
    echo "# tokenized BLEU: Moses-tokenized output vs $ref_tok (--tokenize none)"
    for name in "${names[@]}"; do
      echo "== $name: ${dec_args[$name]}"
      echo "  sacreBLEU      $(cat "$ev/$name.sacrebleu")"
      echo "  tokenized BLEU $(cat "$ev/$name.tokbleu")"
      [ "$COMPOUND_SPLIT_BLEU" = 1 ] && echo "  compound-split $(cat "$ev/$name.compoundbleu")"
      grep -h -E "Translated |Tok\. " "$ev/$name.gen" | sed 's/^.* | /  /' || true
    done
  } > "$ev/results.txt"
  cat "$ev/results.txt"
}

# ----------------------------------------------------------------------------- main
if [ "$DRY" = 1 ]; then
  echo "# scripts/run-wmt.sh $(q "$CONFIG") --dry-run ${STAGES[*]}"
  echo "# NUM_GPUS=$NUM_GPUS; tokens per update (GPUs x max-tokens x update-freq):" \
    "teacher $((NUM_GPUS * TEACHER_MAX_TOKENS * TEACHER_UPDATE_FREQ))," \
    "verifier $((NUM_GPUS * VERIFIER_MAX_TOKENS * VERIFIER_UPDATE_FREQ))," \
    "drafter $((NUM_GPUS * DRAFTER_MAX_TOKENS * DRAFTER_UPDATE_FREQ))"
fi
for stage in "${STAGES[@]}"; do
  t=$(date +%s)
  if [ "$DRY" = 1 ]; then echo "# stage $stage"; else log "stage $stage: start"; fi
  "stage_$stage"
  [ "$DRY" = 1 ] || log "stage $stage: done in $(( ($(date +%s) - t) / 60 )) minutes"
done
[ "$DRY" = 1 ] || log "all done in $(( ($(date +%s) - T0) / 60 )) minutes"
