#!/usr/bin/env bash
# Sequence-level knowledge distillation (Kim & Rush 2016), as the SpecDec papers use:
# decode the training (and validation) source with the teacher through
# fairseq-generate, then binarize the (source, teacher output) pairs with the
# teacher's dictionary.
#
# Usage: scripts/distill.sh TEACHER_CKPT BIN_DIR BPE_DIR OUT_DIR [SRC] [TGT]
#   BIN_DIR  binarized data the teacher was trained on (dict.*.txt, train, valid)
#   BPE_DIR  the BPE text of that data: train.SRC and valid.SRC (fairseq's split
#            name; val.SRC, as scripts/prepare-multi30k.sh names it, also works)
#   OUT_DIR  receives the distilled text (OUT_DIR/text) and binarized data (OUT_DIR/bin)
# Environment:
#   BEAM (5)  MAX_TOKENS (6000)  THREADS (1)
#   SHARDS (1)     split decoding into shards (fairseq-generate shards its
#                  input by --distributed-world-size/--distributed-rank; its
#                  --num-shards/--shard-id options are ignored in fairseq 0.12)
#   PARALLEL (0)   1: run the shards at the same time (one per core; with CPU=0,
#                  shard i on GPU i)
#   EXTRA_GEN_ARGS extra fairseq-generate options (e.g. --fp16 on a GPU; omit --cpu via CPU=0)
#   CPU (1)        pass --cpu to fairseq-generate
# Idempotent: a finished shard or split is not decoded again.
set -euo pipefail
CKPT=$1; BIN=$2; BPE=$3; OUT=$4; SRC=${5:-en}; TGT=${6:-de}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BEAM=${BEAM:-5}; MAX_TOKENS=${MAX_TOKENS:-6000}; THREADS=${THREADS:-1}
SHARDS=${SHARDS:-1}; PARALLEL=${PARALLEL:-0}; CPU=${CPU:-1}
PY=${PYTHON:-python}
CPU_FLAG=""; [ "$CPU" = 1 ] && CPU_FLAG="--cpu"
export OMP_NUM_THREADS=$THREADS MKL_NUM_THREADS=$THREADS
log() { echo "[distill $(date +%H:%M:%S)] $*"; }
[ -f "$CKPT" ] || { echo "no teacher checkpoint: $CKPT" >&2; exit 2; }
# the text inputs are found before anything is decoded
[ -f "$BPE/train.$SRC" ] || { echo "distill.sh: no $BPE/train.$SRC (BPE_DIR holds the BPE text train.$SRC and valid.$SRC)" >&2; exit 2; }
VALID=""
for name in valid val; do if [ -f "$BPE/$name.$SRC" ]; then VALID=$name; break; fi; done
[ -n "$VALID" ] || { echo "distill.sh: no $BPE/valid.$SRC (nor val.$SRC): BPE_DIR holds the BPE text train.$SRC and valid.$SRC" >&2; exit 2; }
mkdir -p "$OUT/text" "$OUT/gen"

decode_split() {  # fairseq split name, BPE file prefix
  local split=$1 prefix=$2
  local n; n=$(wc -l < "$BPE/$prefix.$SRC")
  local out="$OUT/text/$prefix.$TGT"
  if [ -s "$out" ]; then log "$split: already distilled ($out)"; return; fi
  local pids=()
  for ((shard = 0; shard < SHARDS; shard++)); do
    local gen="$OUT/gen/$split.shard$shard.txt"
    if [ -s "$gen.done" ]; then continue; fi
    log "$split: decoding shard $((shard + 1))/$SHARDS of $n sentences (beam $BEAM)"
    cmd=(fairseq-generate "$BIN" --user-dir "$HERE/fairseq_specdec" --task draft_verify
         --decoding autoregressive --gen-subset "$split" --path "$CKPT" --beam "$BEAM"
         --max-tokens "$MAX_TOKENS" --distributed-world-size "$SHARDS" --distributed-rank "$shard"
         --source-lang "$SRC" --target-lang "$TGT" $CPU_FLAG ${EXTRA_GEN_ARGS:-})
    if [ "$PARALLEL" = 1 ]; then
      # on GPUs (CPU=0) shard i runs on GPU i
      local devices=${CUDA_VISIBLE_DEVICES:-}
      [ "$CPU" = 1 ] || devices=$shard
      ( CUDA_VISIBLE_DEVICES=$devices "${cmd[@]}" > "$gen" 2> "$gen.log" && echo ok > "$gen.done" ) &
      pids+=($!)
    else
      "${cmd[@]}" > "$gen" 2> "$gen.log"
      echo ok > "$gen.done"
      tail -1 "$gen" | sed "s/^/[distill]   /"
    fi
  done
  for pid in "${pids[@]}"; do wait "$pid"; done
  "$PY" "$HERE/scripts/merge-hypotheses.py" --expected "$n" "$OUT/gen/$split".shard*.txt > "$out.part"
  mv "$out.part" "$out"
  cp "$BPE/$prefix.$SRC" "$OUT/text/$prefix.$SRC"
  log "$split: $n sentences distilled into $out"
}

decode_split train train
decode_split valid "$VALID"

if [ ! -s "$OUT/bin/train.$SRC-$TGT.$TGT.bin" ]; then
  log "binarizing with the teacher's dictionary"
  rm -rf "$OUT/bin.part"
  fairseq-preprocess --source-lang "$SRC" --target-lang "$TGT" \
    --trainpref "$OUT/text/train" --validpref "$OUT/text/$VALID" \
    --srcdict "$BIN/dict.$SRC.txt" --tgtdict "$BIN/dict.$TGT.txt" \
    --destdir "$OUT/bin.part" --workers "${WORKERS:-2}"
  # the test split stays the original one
  for f in "$BIN"/test.*; do cp "$f" "$OUT/bin.part/"; done
  rm -rf "$OUT/bin" && mv "$OUT/bin.part" "$OUT/bin"
fi
log "done: $OUT/bin"
