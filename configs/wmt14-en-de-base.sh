# Xia et al. 2023, Table 1, WMT14 EN-DE: Spec-Drafter 12+2 (k=25) with a
# Transformer-base verifier. Both are trained on the distillation of a
# Transformer-big teacher (the SpecDec papers).
# Sourced by scripts/run-wmt.sh. Override any `: "${VAR:=...}"` variable from the environment,
# e.g. NUM_GPUS=4 scripts/run-wmt.sh configs/wmt14-en-de-base.sh
#
# Where the settings come from:
#  - data: WMT14 EN-DE (europarl v7 + commoncrawl + news-commentary v9, 4.5M
#    pairs), newstest2013 valid, newstest2014 (full, 3003 sentences) test, as
#    in fairseq's examples/translation/prepare-wmt14en2de.sh. The papers use
#    Mask-Predict's copy of this data, which has 32K joint BPE (the SpecDec papers:
#    "32K BPE"). So BPE_MERGES is 32000 here, not fairseq's 40000.
#  - drafter: reference notes section 1 and the SpecDec ICLR 2023 submission's Table 7 (right) / the
#    SpecDec README: Adam (0.9, 0.999) eps 1e-6, weight decay 0.01, clip-norm 5,
#    lr 5e-4, inverse_sqrt with 10k warmup from 1e-7, label smoothing 0.1,
#    dropout 0.1, fp16, k=25, 300k updates of ~128K tokens (8 GPUs x 4096 x 4),
#    last 10 checkpoints averaged ("avg10").
#  - verifier: the SpecDec ICLR 2023 submission's Table 7 (left) and the SpecDec README: transformer-base,
#    lr 1e-3, 4k warmup from 1e-7, Adam (0.9, 0.98) (the README; the paper's
#    table says 0.99), weight decay 1e-5, clip-norm 3, label smoothing 0.1,
#    100k updates, averaged over the last 10 checkpoints. The table's batch is
#    20000 tokens x 4 x 8 GPUs (640K per update). We use the same 128K as the
#    drafter; set VERIFIER_TOKENS_PER_UPDATE=655360 to follow the table.
#  - teacher: the papers give no settings, only that it is a Transformer-big
#    trained on the raw data (29.31 BLEU). We use fairseq's scaling-NMT recipe
#    (Ott et al. 2018): lr 5e-4, Adam (0.9, 0.98), dropout 0.3, 4k warmup,
#    no clipping. We train it for 100k updates of 128K tokens, about 90 epochs
#    of the 4.5M pairs.

# the arrays and variables below are read by scripts/run-wmt.sh
# shellcheck shell=bash disable=SC2034
: "${SRC:=en}" "${TGT:=de}"
: "${NAME:=wmt14.$SRC-$TGT}"
: "${BPE_MERGES:=32000}"
: "${CLEAN_MAX_LEN:=250}" "${CLEAN_RATIO:=1.5}"   # train pairs kept: 1..250 BPE tokens, length ratio <= 1.5
: "${RO_STRIP_DIACRITICS:=0}"
: "${COMPOUND_SPLIT_BLEU:=1}"   # also report tokenized BLEU with ##AT## compound splitting (the papers' EN-DE number)

# --- per-setting values (the rest is configs/wmt-common.sh) ---------------------
: "${TOKENS_PER_UPDATE:=131072}"      # the papers' 128K tokens per update (8 GPUs x 4096 x 4)
: "${DRAFTER_MAX_UPDATE:=300000}"
: "${SAVE_INTERVAL_UPDATES:=2000}"    # update checkpoints; the last AVERAGE_LAST are averaged
TEACHER_ARCH=transformer_vaswani_wmt_en_de_big
TEACHER_DROPOUT=0.3 TEACHER_WEIGHT_DECAY=0.0 TEACHER_CLIP_NORM=0.0 TEACHER_LR=5e-4
VERIFIER_DROPOUT=0.1
DRAFTER_DROPOUT=0.1 DRAFTER_LR=5e-4 DRAFTER_WARMUP=10000
# shellcheck source=wmt-common.sh
source "$(dirname "${BASH_SOURCE[0]}")/wmt-common.sh"

# --- data sources (stage download) ----------------------------------------------------
# training archives: fairseq's prepare-wmt14en2de.sh
TRAIN_URLS=(
  http://statmt.org/wmt13/training-parallel-europarl-v7.tgz
  http://statmt.org/wmt13/training-parallel-commoncrawl.tgz
  http://statmt.org/wmt14/training-parallel-nc-v9.tgz
)
# corpus file prefixes inside the extracted archives (+ ".$SRC" / ".$TGT")
TRAIN_CORPORA=(
  training/europarl-v7.de-en
  commoncrawl.de-en
  training/news-commentary-v9.de-en
)
# valid/test through sacrebleu, which fetches the statmt.org archives
# (https://statmt.org/wmt13/test.tgz, https://statmt.org/wmt14/test-full.tgz)
# and extracts the SGML
VALID_TESTSET=wmt13        # newstest2013
TEST_TESTSET=wmt14/full    # newstest2014, 3003 sentences
