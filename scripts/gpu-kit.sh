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
#   run/      with --models only: models trained before (a finished run
#             folder of the Multi30k recipe, e.g. make demo's), so that the
#             GPU run benchmarks them and trains nothing
#   MANIFEST.txt  what is in the kit, its size, the commit it was made from
#   kit.tar.xz    with --xz only: all of the above in one archive, which
#             scripts/gpu-run.sh unpacks where it finds no data/ beside it
#             (carry .gpu-kit/kit.tar.xz alone: a kit with CTranslate2 fits
#             in what travels only so)
# The run script and the configs are in the checkout, which travels with the kit.
#
# Usage: scripts/gpu-kit.sh [--out DIR] [--no-wheels] [--ct2] [--xz] [--models RUN_DIR [--half-weights]]
#   --out DIR        the kit folder (default .gpu-kit, ignored by git)
#   --no-wheels      skip the wheel download (a kit for a machine that has fairseq)
#   --ct2            also the ctranslate2 wheel (the version installed here,
#                    else 4.8.5; 43 MB), for the CTranslate2 rows of
#                    scripts/gpu-run.sh's host phase
#   --xz             also pack the kit into DIR/kit.tar.xz, the wheels stored
#                    uncompressed inside so that xz shrinks their libraries
#                    (with --ct2: 44 MiB against 80 loose); KIT_MAX_MB then
#                    bounds the archive
#   --models RUN_DIR pack the models KIT_MODELS names from RUN_DIR (verifier/
#                    checkpoint_best.pt, vsd/checkpoint_last.pt, blockwise/
#                    checkpoint_best.pt, drafter/checkpoint_selected.pt) into
#                    run/, without optimizer state (scripts/pack-checkpoint.py),
#                    with the data they were trained on (RUN_DIR/distill/bin:
#                    dictionaries, test split, train split for ngram); the
#                    kit's data then holds only the test references
#   --half-weights   store the packed models' float weights in float16 (half the
#                    size; they decode in float32, rounded to float16 values)
# Environment: PYTHON (python), PIP (default "$PYTHON -m pip"), DATA (the
#   prepared data, default data/multi30k.en-de, made when missing),
#   MULTI30K_RAW (see prepare-multi30k.sh), KIT_MAX_MB (48: the kit travels
#   with the checkout, at most 64 MiB together; with --models or --xz 60),
#   KIT_MODELS (with --models: "verifier vsd blockwise", any of those and
#   drafter).
# Idempotent: wheels already downloaded and data already prepared are kept.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; }

KIT=$HERE/.gpu-kit WHEELS=1 MODELS="" HALF="" CT2=0 XZ=0
while [ $# -gt 0 ]; do
  case "$1" in
    --out) [ $# -ge 2 ] || { echo "gpu-kit.sh: --out needs a folder" >&2; exit 2; }; KIT=$2; shift ;;
    --no-wheels) WHEELS=0 ;;
    --ct2) CT2=1 ;;
    --xz) XZ=1 ;;
    --models) [ $# -ge 2 ] || { echo "gpu-kit.sh: --models needs a run folder" >&2; exit 2; }; MODELS=$2; shift ;;
    --half-weights) HALF=--half-weights ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu-kit.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
PY=${PYTHON:-python}
read -r -a PIP <<< "${PIP:-$PY -m pip}"
DATA=${DATA:-$HERE/data/multi30k.en-de}
MAX_MB=${KIT_MAX_MB:-48}
if [ -n "$HALF" ] && [ -z "$MODELS" ]; then echo "gpu-kit.sh: --half-weights packs the models of --models RUN_DIR; give one" >&2; exit 2; fi
if [ -n "$MODELS" ]; then
  MAX_MB=${KIT_MAX_MB:-60}
  [ -f "$MODELS/verifier/checkpoint_best.pt" ] || { echo "gpu-kit.sh: --models $MODELS: no verifier/checkpoint_best.pt (a finished run of scripts/run-multi30k.sh)" >&2; exit 2; }
  [ -f "$MODELS/distill/bin/dict.en.txt" ] || { echo "gpu-kit.sh: --models $MODELS: no distill/bin/dict.en.txt (the data its models were trained on)" >&2; exit 2; }
  # model -> its checkpoint in a run folder (the files scripts/run-multi30k.sh benchmarks)
  declare -A CKPT=([verifier]=verifier/checkpoint_best.pt [vsd]=vsd/checkpoint_last.pt
                   [blockwise]=blockwise/checkpoint_best.pt [drafter]=drafter/checkpoint_selected.pt)
  read -r -a PACK <<< "${KIT_MODELS:-verifier vsd blockwise}"
  for m in "${PACK[@]}"; do
    [ -n "${CKPT[$m]:-}" ] || { echo "gpu-kit.sh: KIT_MODELS: unknown model '$m' (verifier vsd blockwise drafter)" >&2; exit 2; }
    [ -f "$MODELS/${CKPT[$m]}" ] || { echo "gpu-kit.sh: --models $MODELS: no ${CKPT[$m]} (KIT_MODELS names $m)" >&2; exit 2; }
  done
fi
WHEEL_LIST=$HERE/configs/gpu-kit-wheels.txt
if [ "$CT2" = 1 ]; then
  [ "$WHEELS" = 1 ] || { echo "gpu-kit.sh: --ct2 adds a wheel; it cannot go with --no-wheels" >&2; exit 2; }
  CT2_VERSION=$("$PY" -c "import ctranslate2; print(ctranslate2.__version__)" 2>/dev/null || echo 4.8.5)
fi
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
# with --models, the packed models' own data (their dictionaries) goes into
# run/distill/bin below, and the kit's data is only the test references
if [ -n "$MODELS" ] || [ ! -s "$KIT/data/bin/test.$SRC-$TGT.$TGT.bin" ]; then
  rm -rf "$KIT/data.part" && mkdir -p "$KIT/data.part"/{tok,raw}
  if [ -n "$MODELS" ]; then
    log "copying the test references into $KIT/data"
  else
    log "copying the prepared data into $KIT/data"
    cp -r "$DATA/bin" "$KIT/data.part/bin"
    mkdir -p "$KIT/data.part/bpe"
    for split in train val; do
      for l in $SRC $TGT; do cp "$DATA/bpe/$split.$l" "$KIT/data.part/bpe/"; done
    done
  fi
  cp "$DATA/tok/test_2016_flickr.$TGT" "$KIT/data.part/tok/"
  cp "$(raw_multi30k)/test_2016_flickr.$TGT.gz" "$KIT/data.part/raw/"
  rm -rf "$KIT/data" && mv "$KIT/data.part" "$KIT/data"
fi

# 1b. models trained before (--models): packed, each stage marked done
rm -rf "$KIT/run"
if [ -n "$MODELS" ]; then
  rm -rf "$KIT/run.part" && mkdir -p "$KIT/run.part/distill/bin"
  for f in "$MODELS"/distill/bin/dict.*.txt "$MODELS"/distill/bin/{test,train}.*; do
    [ -f "$f" ] && cp "$f" "$KIT/run.part/distill/bin/"
  done
  touch "$KIT/run.part/distill/DONE"
  for m in "${PACK[@]}"; do
    log "packing $m: $MODELS/${CKPT[$m]}${HALF:+ (float weights in float16)}"
    "$PY" "$HERE/scripts/pack-checkpoint.py" "$MODELS/${CKPT[$m]}" "$KIT/run.part/${CKPT[$m]}" $HALF
    touch "$KIT/run.part/$m/DONE"
  done
  echo "models packed from $MODELS (${PACK[*]})${HALF:+, float weights stored in float16}" > "$KIT/run.part/ORIGIN.txt"
  mv "$KIT/run.part" "$KIT/run"
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
  done < <(cat "$WHEEL_LIST"; [ "$CT2" = 0 ] || echo "ctranslate2==$CT2_VERSION")
fi

# 3. the manifest, the archive (--xz), and the size check
rm -f "$KIT/kit.tar.xz"
kb=$(du -sk "$KIT" --exclude=MANIFEST.txt | cut -f1)
{
  echo "GPU kit for scripts/gpu-run.sh, made $(date -u +%Y-%m-%d) from commit $(git -C "$HERE" rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo "size: $((kb / 1024)) MiB ($kb KiB)"
  echo
  (cd "$KIT" && find . -type f ! -name MANIFEST.txt | sort | while read -r f; do
    printf '%10d  %s\n' "$(stat -c %s "$f")" "${f#./}"
  done)
} > "$KIT/MANIFEST.txt"
if [ "$XZ" = 1 ]; then
  MAX_MB=${KIT_MAX_MB:-60}  # the archive travels alone
  # wheels are zip files of deflated members, which xz cannot shrink further:
  # each is re-stored uncompressed (the same files; pip reads either) first
  log "packing the kit into $KIT/kit.tar.xz"
  stage=$(mktemp -d)
  trap 'rm -rf "$stage"' EXIT
  (cd "$KIT" && find . -mindepth 1 -maxdepth 1 ! -name wheels ! -name kit.tar.xz -exec cp -r {} "$stage/" \;)
  if [ -d "$KIT/wheels" ]; then
    mkdir -p "$stage/wheels"
    for w in "$KIT"/wheels/*.whl; do
      "$PY" - "$w" "$stage/wheels/$(basename "$w")" <<'PYEOF'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as src, zipfile.ZipFile(sys.argv[2], "w", zipfile.ZIP_STORED) as dst:
    for info in src.infolist():
        data = src.read(info)
        info.compress_type = zipfile.ZIP_STORED
        dst.writestr(info, data)
PYEOF
    done
  fi
  tar -C "$stage" -cf - . | xz -T0 -6 > "$KIT/kit.tar.xz.part"
  mv "$KIT/kit.tar.xz.part" "$KIT/kit.tar.xz"
  kb=$(du -sk "$KIT/kit.tar.xz" | cut -f1)
  log "kit.tar.xz: $((kb / 1024)) MiB (carry .gpu-kit/kit.tar.xz alone; scripts/gpu-run.sh unpacks it)"
fi
if [ "$kb" -gt $((MAX_MB * 1024)) ]; then
  echo "gpu-kit.sh: the kit$([ "$XZ" = 1 ] && echo " (kit.tar.xz)") is $((kb / 1024)) MiB, more than KIT_MAX_MB=$MAX_MB (it travels with the checkout, 64 MiB at most)" >&2
  exit 1
fi
[ "$WHEELS" = 1 ] || log "no wheels (--no-wheels): the GPU machine must have fairseq-fixed and its needs"
[ -z "$MODELS" ] || log "models: $KIT/run (${PACK[*]}): scripts/gpu-run.sh benchmarks them and trains nothing"
log "kit ready: $KIT ($((kb / 1024)) MiB, contents in $KIT/MANIFEST.txt)"
log "on the GPU machine, from the checkout's root: bash scripts/gpu-run.sh OUT_DIR   (the kit folder travels with it)"
