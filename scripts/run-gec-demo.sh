#!/usr/bin/env bash
# GEC-style demo of input-guided aggressive decoding (Ge et al. 2022) on Multi30k:
#   noise -> BPE -> binarize -> train a corrector -> benchmark input-guided
#   decoding against fairseq's greedy and beam 5 (identical to greedy?)
# The held-out split is Multi30k test_2016_flickr, corrupted with its own seed.
#
# Usage: scripts/run-gec-demo.sh [STAGE ...]   (default: data train benchmark)
# Environment: CONFIG (configs/gec-multi30k-cpu.sh), OUT (runs/gec-multi30k),
#   DATA (data/multi30k.en-de: the tokenized English comes from there; it is
#   prepared first when missing), BENCH_ARGS (extra scripts/benchmark.py args).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CONFIG=${CONFIG:-$HERE/configs/gec-multi30k-cpu.sh}
# shellcheck source=/dev/null
source "$CONFIG"
OUT=${OUT:-$HERE/runs/gec-multi30k}
DATA=${DATA:-$HERE/data/multi30k.en-de}
PY=${PYTHON:-python}
export OMP_NUM_THREADS=$THREADS MKL_NUM_THREADS=$THREADS
STAGES=("$@")
[ ${#STAGES[@]} -gt 0 ] || STAGES=(data train benchmark)
T0=$(date +%s)
LOG_TAG=gec-demo
# shellcheck source=recipe-lib.sh
source "$HERE/scripts/recipe-lib.sh"
mkdir -p "$OUT/text"

stage_data() {
  [ -s "$DATA/tok/test_2016_flickr.en" ] || OUT_DIR=$DATA bash "$HERE/scripts/prepare-multi30k.sh" en de
  local seed=1
  for split in train val test_2016_flickr; do
    if [ ! -s "$OUT/text/$split.err" ]; then
      log "corrupting $split (seed $seed)"
      "$PY" "$HERE/scripts/make-gec-noise.py" --seed "$seed" < "$DATA/tok/$split.en" > "$OUT/text/$split.err"
      cp "$DATA/tok/$split.en" "$OUT/text/$split.cor"
    fi
    seed=$((seed + 1))
  done
  if [ ! -s "$OUT/text/codes" ]; then
    log "learning BPE ($BPE_MERGES merges) on the noisy and clean training text"
    cat "$OUT/text/train.err" "$OUT/text/train.cor" | "$PY" -m subword_nmt.learn_bpe -s "$BPE_MERGES" > "$OUT/text/codes"
  fi
  for split in train val test_2016_flickr; do
    for side in err cor; do
      [ -s "$OUT/text/$split.bpe.$side" ] || "$PY" -m subword_nmt.apply_bpe -c "$OUT/text/codes" \
        < "$OUT/text/$split.$side" > "$OUT/text/$split.bpe.$side"
    done
  done
  if [ ! -s "$OUT/bin/test.err-cor.cor.bin" ]; then
    log "binarizing (one joined dictionary)"
    rm -rf "$OUT/bin.part"
    fairseq-preprocess --source-lang err --target-lang cor --joined-dictionary --workers 2 \
      --trainpref "$OUT/text/train.bpe" --validpref "$OUT/text/val.bpe" --testpref "$OUT/text/test_2016_flickr.bpe" \
      --destdir "$OUT/bin.part" > "$OUT/preprocess.log"
    mv "$OUT/bin.part" "$OUT/bin"
  fi
}

stage_train() {
  train corrector "$CORRECTOR_UPDATES" "$CORRECTOR_MAX_MINUTES" "$OUT/bin" "${CORRECTOR_ARGS[@]}"
}

stage_benchmark() {
  local raw; raw=$(raw_multi30k)
  log "benchmark: input-guided vs greedy and beam 5 on the corrupted test_2016_flickr"
  "$PY" "$HERE/scripts/benchmark.py" --data "$OUT/bin" --src err --tgt cor \
    --verifier "$OUT/corrector/checkpoint_best.pt" --rows beam5,beam1,input-guided \
    --raw-ref "$raw/test_2016_flickr.en.gz" --tok-ref "$DATA/tok/test_2016_flickr.en" --detok-lang en \
    --out "$OUT/benchmark" ${BENCH_ARGS:-}
}

for stage in "${STAGES[@]}"; do
  case "$stage" in data|train|benchmark) ;; *) echo "unknown stage '$stage' (data train benchmark)" >&2; exit 2;; esac
  log "stage $stage"
  "stage_$stage"
done
log "all done in $(( ($(date +%s) - T0) / 60 )) minutes"
