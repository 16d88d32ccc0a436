#!/usr/bin/env bash
# Prepare Multi30k for fairseq: Moses tokenization (sacremoses, no XML escaping),
# joint BPE (subword-nmt), fairseq-preprocess --joined-dictionary.
#
# Usage: scripts/prepare-multi30k.sh [SRC] [TGT]            (default: en de)
# Environment:
#   MULTI30K_RAW  directory with {train,val,test_2016_flickr}.{lang}.gz
#                 (default: ../shared/data/multi30k when it exists, otherwise
#                 the files are downloaded from the public Multi30k repository)
#   OUT_DIR       output root (default: data/multi30k.SRC-TGT)
#   BPE_MERGES    number of BPE merges (default: 8000)
#   WORKERS       fairseq-preprocess workers (default: 2)
# Outputs: OUT_DIR/tok (tokenized), OUT_DIR/bpe (BPE text + codes), OUT_DIR/bin
# (binarized; train / valid / test splits). Every stage is skipped when its
# output already exists, so the script is idempotent and resumable.
set -euo pipefail

SRC=${1:-en}
TGT=${2:-de}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SHARED_RAW="$(cd "$HERE/.." && pwd)/shared/data/multi30k"
RAW=${MULTI30K_RAW:-}
if [ -z "$RAW" ]; then
  if [ -d "$SHARED_RAW" ]; then RAW=$SHARED_RAW; else RAW="$HERE/data/multi30k-raw"; fi
fi
OUT=${OUT_DIR:-$HERE/data/multi30k.$SRC-$TGT}
MERGES=${BPE_MERGES:-8000}
WORKERS=${WORKERS:-2}
PY=${PYTHON:-python}
URL=https://raw.githubusercontent.com/multi30k/dataset/master/data/task1/raw
SPLITS="train val test_2016_flickr"

log() { echo "[prepare-multi30k $(date +%H:%M:%S)] $*"; }
case "$SRC$TGT" in *[!a-z]*|"") echo "bad language pair '$SRC' '$TGT'" >&2; exit 2;; esac
for l in "$SRC" "$TGT"; do
  case "$l" in en|de|fr|cs) ;; *) echo "Multi30k has en, de, fr, cs; not '$l'" >&2; exit 2;; esac
done

log "raw data: $RAW; output: $OUT; pair $SRC-$TGT; $MERGES BPE merges"
mkdir -p "$RAW" "$OUT/tok" "$OUT/bpe"

# 1. raw files (download only what is missing)
for split in $SPLITS; do
  for l in "$SRC" "$TGT"; do
    f="$RAW/$split.$l.gz"
    if [ ! -s "$f" ]; then
      log "downloading $split.$l.gz"
      curl -fsSL --retry 3 -o "$f.part" "$URL/$split.$l.gz" && mv "$f.part" "$f"
    fi
  done
done

# 2. tokenize
for split in $SPLITS; do
  for l in "$SRC" "$TGT"; do
    out="$OUT/tok/$split.$l"
    if [ ! -s "$out" ]; then
      log "tokenizing $split.$l"
      gzip -dc "$RAW/$split.$l.gz" | "$PY" "$HERE/scripts/moses.py" tokenize -l "$l" > "$out.part"
      mv "$out.part" "$out"
    fi
  done
done

# 3. joint BPE learned on the training set
CODES="$OUT/bpe/codes"
if [ ! -s "$CODES" ]; then
  log "learning joint BPE ($MERGES merges)"
  cat "$OUT/tok/train.$SRC" "$OUT/tok/train.$TGT" | "$PY" -m subword_nmt.learn_bpe -s "$MERGES" > "$CODES.part"
  mv "$CODES.part" "$CODES"
fi
for split in $SPLITS; do
  for l in "$SRC" "$TGT"; do
    out="$OUT/bpe/$split.$l"
    if [ ! -s "$out" ]; then
      log "applying BPE to $split.$l"
      "$PY" -m subword_nmt.apply_bpe -c "$CODES" < "$OUT/tok/$split.$l" > "$out.part"
      mv "$out.part" "$out"
    fi
  done
done

# 4. binarize with one joined dictionary
if [ ! -s "$OUT/bin/test.$SRC-$TGT.$TGT.bin" ]; then
  log "binarizing (fairseq-preprocess --joined-dictionary)"
  rm -rf "$OUT/bin.part"
  fairseq-preprocess --source-lang "$SRC" --target-lang "$TGT" \
    --trainpref "$OUT/bpe/train" --validpref "$OUT/bpe/val" --testpref "$OUT/bpe/test_2016_flickr" \
    --destdir "$OUT/bin.part" --joined-dictionary --workers "$WORKERS"
  rm -rf "$OUT/bin" && mv "$OUT/bin.part" "$OUT/bin"
fi
log "done: $(wc -l < "$OUT/bin/dict.$SRC.txt") dictionary types; binarized data in $OUT/bin"
