# Xia et al. 2023, Table 1, WMT16 EN-RO: Spec-Drafter 12+2 (k=25) with a
# Transformer-base verifier. Both are trained on the distillation of a
# Transformer-base teacher (the SpecDec ICLR 2023 submission: "Transformer-base for WMT16 EN-RO").
# Sourced by scripts/run-wmt.sh. Override any `: "${VAR:=...}"` variable from the environment,
# e.g. NUM_GPUS=4 scripts/run-wmt.sh configs/wmt16-en-ro-base.sh
#
# Where the settings come from:
#  - data: WMT16 EN-RO (europarl v8 + SETIMES2, 610K pairs), newsdev2016 valid,
#    newstest2016 test, 40K joint BPE. The papers use Lee et al. (2018)'s copy,
#    which Mask-Predict distributes. Its Romanian side has no diacritics
#    (Sennrich et al.'s WMT16 preprocessing). RO_STRIP_DIACRITICS=1 does the
#    same: it maps s/t-comma and s/t-cedilla to s/t and a-breve, a/i-circumflex
#    to a/i. It does this on the Romanian side of every split, the sacreBLEU
#    reference included, so sacreBLEU is computed against the normalized
#    newstest2016 reference.
#  - drafter: reference notes section 1 / the SpecDec README: Adam (0.9, 0.999)
#    eps 1e-6, weight decay 0.01, clip-norm 5, lr 1e-3, inverse_sqrt with 4k
#    warmup from 1e-7, label smoothing 0.1, dropout 0.2, fp16, k=25, 50k
#    updates of ~64K tokens (8 GPUs x 4096 x 2), last 10 checkpoints averaged.
#  - verifier: the SpecDec ICLR 2023 submission's Table 7 (left) and the SpecDec README: transformer-base,
#    lr 1e-3, 4k warmup, Adam (0.9, 0.98), weight decay 1e-5, clip-norm 3,
#    dropout 0.3 (from the table's grid 0.1/0.2/0.3; EN-RO is small), 100k
#    updates. It uses the drafter's 64K tokens per update (the table's
#    20000 x 4 x 8 is for its WMT14 setting; see VERIFIER_TOKENS_PER_UPDATE).
#  - teacher: the papers do not give its settings. It is a Transformer-base
#    trained on the raw data with the verifier's hyper-parameters.

# the arrays and variables below are read by scripts/run-wmt.sh
# shellcheck shell=bash disable=SC2034
: "${SRC:=en}" "${TGT:=ro}"
: "${NAME:=wmt16.$SRC-$TGT}"
: "${BPE_MERGES:=40000}"
: "${CLEAN_MAX_LEN:=250}" "${CLEAN_RATIO:=1.5}"   # train pairs kept: 1..250 BPE tokens, length ratio <= 1.5
: "${RO_STRIP_DIACRITICS:=1}"
: "${COMPOUND_SPLIT_BLEU:=0}"   # ##AT## compound splitting is an EN-DE convention

# --- per-setting values (the rest is configs/wmt-common.sh) ---------------------
: "${TOKENS_PER_UPDATE:=65536}"       # the papers' 64K tokens per update (8 GPUs x 4096 x 2)
: "${DRAFTER_MAX_UPDATE:=50000}"
: "${SAVE_INTERVAL_UPDATES:=1000}"    # update checkpoints; the last AVERAGE_LAST are averaged
TEACHER_ARCH=transformer_wmt_en_de
TEACHER_DROPOUT=0.3 TEACHER_WEIGHT_DECAY=0.00001 TEACHER_CLIP_NORM=3.0 TEACHER_LR=1e-3
VERIFIER_DROPOUT=0.3
DRAFTER_DROPOUT=0.2 DRAFTER_LR=1e-3 DRAFTER_WARMUP=4000
# shellcheck source=wmt-common.sh
source "$(dirname "${BASH_SOURCE[0]}")/wmt-common.sh"

# --- data sources (stage download) ----------------------------------------------------
TRAIN_URLS=(
  http://data.statmt.org/wmt16/translation-task/training-parallel-ep-v8.tgz
  # SETIMES2 is distributed by OPUS, not statmt.org
  https://object.pouta.csc.fi/OPUS-SETIMES/v2/moses/en-ro.txt.zip
)
# corpus file prefixes inside the extracted archives (+ ".$SRC" / ".$TGT"). OPUS has
# named the SETIMES2 files both SETIMES.en-ro.* and SETIMES2.en-ro.*. The recipe
# takes whichever of the two exists.
TRAIN_CORPORA=(
  training-parallel-ep-v8/europarl-v8.ro-en
  SETIMES.en-ro
)
# valid/test through sacrebleu, which fetches the statmt.org archives
# (https://data.statmt.org/wmt16/translation-task/{dev,test}.tgz) and extracts the SGML
VALID_TESTSET=wmt16/dev    # newsdev2016
TEST_TESTSET=wmt16         # newstest2016
