#!/usr/bin/env bash
# Build the GPU kit: one folder with everything a bare GPU machine with no
# network needs to train and benchmark the Multi30k models through
# scripts/gpu-run.sh (docs/gpu.md, "The GPU kit"):
#   wheels/   CPython 3.12 manylinux wheels of the packages the machine lacks
#             (configs/gpu-kit-wheels.txt: fairseq-fixed and its needs; never
#             torch, whose CUDA build the machine has)
#   data/     Multi30k EN-DE tokenized, BPE-encoded and binarized here
#             (scripts/prepare-multi30k.sh): bin/ (train, valid, test and the
#             joined dictionary), bpe/ train and val text (distillation reads
#             it), tok/ and raw/ test references (tokenized BLEU, sacreBLEU)
#   MANIFEST.txt  what is in the kit, its size, the commit it was made from
# The run script and the configs are in the checkout, which travels with the kit.
#
# Usage: scripts/gpu-kit.sh [--out DIR] [--no-wheels]
#   --out DIR    the kit folder (default .gpu-kit, ignored by git)
#   --no-wheels  skip the wheel download (a kit for a machine that has fairseq)
# Environment: PYTHON (python), PIP (default "$PYTHON -m pip"), DATA (the
#   prepared data, default data/multi30k.en-de, made when missing),
#   MULTI30K_RAW (see prepare-multi30k.sh), KIT_MAX_MB (48: the kit travels
#   with the checkout, at most 64 MiB together).
# Idempotent: wheels already downloaded and data already prepared are kept.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; }

KIT=$HERE/.gpu-kit WHEELS=1
while [ $# -gt 0 ]; do
  case "$1" in
    --out) [ $# -ge 2 ] || { echo "gpu-kit.sh: --out needs a folder" >&2; exit 2; }; KIT=$2; shift ;;
    --no-wheels) WHEELS=0 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu-kit.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
PY=${PYTHON:-python}
read -r -a PIP <<< "${PIP:-$PY -m pip}"
DATA=${DATA:-$HERE/data/multi30k.en-de}
MAX_MB=${KIT_MAX_MB:-48}
WHEEL_LIST=$HERE/configs/gpu-kit-wheels.txt
SRC=en TGT=de
T0=$(date +%s) LOG_TAG=gpu-kit OUT=$KIT
# shellcheck source=recipe-lib.sh
source "$HERE/scripts/recipe-lib.sh"
mkdir -p "$KIT"

# 1. the data, prepared here (BPE learning and binarization need no GPU)
if [ ! -s "$DATA/bin/test.$SRC-$TGT.$TGT.bin" ]; then
  log "preparing Multi30k $SRC-$TGT into $DATA"
  OUT_DIR=$DATA bash "$HERE/scripts/prepare-multi30k.sh" "$SRC" "$TGT"
fi
if [ ! -s "$KIT/data/bin/test.$SRC-$TGT.$TGT.bin" ]; then
  log "copying the prepared data into $KIT/data"
  rm -rf "$KIT/data.part" && mkdir -p "$KIT/data.part"/{bpe,tok,raw}
  cp -r "$DATA/bin" "$KIT/data.part/bin"
  for split in train val; do
    for l in $SRC $TGT; do cp "$DATA/bpe/$split.$l" "$KIT/data.part/bpe/"; done
  done
  cp "$DATA/tok/test_2016_flickr.$TGT" "$KIT/data.part/tok/"
  cp "$(raw_multi30k)/test_2016_flickr.$TGT.gz" "$KIT/data.part/raw/"
  rm -rf "$KIT/data" && mv "$KIT/data.part" "$KIT/data"
fi

# 2. the wheels (CPython 3.12, x86-64 manylinux), one version of each
if [ "$WHEELS" = 1 ]; then
  mkdir -p "$KIT/wheels"
  platforms=()
  for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
  done
  while read -r spec kind; do
    case "$spec" in ''|'#'*) continue ;; esac
    name=${spec%%==*} version=${spec#*==}
    pattern="$(echo "$name" | tr '-' '_')-$version-"
    if ls "$KIT/wheels" | grep -qi "^$pattern"; then continue; fi
    if [ "${kind:-}" = sdist ]; then
      log "building a wheel of $spec (a source distribution only)"
      "${PIP[@]}" wheel -q --no-deps -w "$KIT/wheels" "$spec"
    else
      log "downloading $spec (cp312 wheel)"
      "${PIP[@]}" download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platforms[@]}" -d "$KIT/wheels" "$spec"
    fi
    ls "$KIT/wheels" | grep -qi "^$pattern" || { echo "gpu-kit.sh: no wheel of $spec in $KIT/wheels" >&2; exit 1; }
  done < "$WHEEL_LIST"
fi

# 3. the manifest, and the size check
kb=$(du -sk "$KIT" --exclude=MANIFEST.txt | cut -f1)
{
  echo "GPU kit for scripts/gpu-run.sh, made $(date -u +%Y-%m-%d) from commit $(git -C "$HERE" rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo "size: $((kb / 1024)) MiB ($kb KiB)"
  echo
  (cd "$KIT" && find . -type f ! -name MANIFEST.txt | sort | while read -r f; do
    printf '%10d  %s\n' "$(stat -c %s "$f")" "${f#./}"
  done)
} > "$KIT/MANIFEST.txt"
if [ "$kb" -gt $((MAX_MB * 1024)) ]; then
  echo "gpu-kit.sh: the kit is $((kb / 1024)) MiB, more than KIT_MAX_MB=$MAX_MB (it travels with the checkout, 64 MiB at most)" >&2
  exit 1
fi
[ "$WHEELS" = 1 ] || log "no wheels (--no-wheels): the GPU machine must have fairseq-fixed and its needs"
log "kit ready: $KIT ($((kb / 1024)) MiB, contents in $KIT/MANIFEST.txt)"
log "on the GPU machine, from the checkout's root: bash scripts/gpu-run.sh OUT_DIR   (the kit folder travels with it)"
