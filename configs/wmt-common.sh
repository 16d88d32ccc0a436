# Shared by configs/wmt14-en-de-base.sh and configs/wmt16-en-ro-base.sh, which set
# the per-setting values (TOKENS_PER_UPDATE, *_MAX_UPDATE, SAVE_INTERVAL_UPDATES,
# TEACHER_*, VERIFIER_DROPOUT, DRAFTER_LR/_WARMUP/_DROPOUT) and then source this file.

# --- GPUs ------------------------------------------------------------------------
: "${NUM_GPUS:=8}"                    # one node; --distributed-world-size, distillation shards
: "${MAX_TOKENS:=4096}"               # per GPU per forward pass
: "${TEACHER_MAX_TOKENS:=$MAX_TOKENS}" "${VERIFIER_MAX_TOKENS:=$MAX_TOKENS}" "${DRAFTER_MAX_TOKENS:=$MAX_TOKENS}"
: "${TEACHER_TOKENS_PER_UPDATE:=$TOKENS_PER_UPDATE}"
: "${VERIFIER_TOKENS_PER_UPDATE:=$TOKENS_PER_UPDATE}"
: "${DRAFTER_TOKENS_PER_UPDATE:=$TOKENS_PER_UPDATE}"

# --update-freq such that NUM_GPUS x max-tokens x update-freq ~= the target (at least 1)
update_freq_for() {  # TOKENS_PER_UPDATE MAX_TOKENS
  local per_step=$((NUM_GPUS * $2))
  local f=$(( ($1 + per_step / 2) / per_step ))
  [ "$f" -ge 1 ] || f=1
  echo "$f"
}
TEACHER_UPDATE_FREQ=$(update_freq_for "$TEACHER_TOKENS_PER_UPDATE" "$TEACHER_MAX_TOKENS")
VERIFIER_UPDATE_FREQ=$(update_freq_for "$VERIFIER_TOKENS_PER_UPDATE" "$VERIFIER_MAX_TOKENS")
DRAFTER_UPDATE_FREQ=$(update_freq_for "$DRAFTER_TOKENS_PER_UPDATE" "$DRAFTER_MAX_TOKENS")

# --- schedule and checkpoints ----------------------------------------------------------
: "${TEACHER_MAX_UPDATE:=100000}"
: "${VERIFIER_MAX_UPDATE:=100000}"
: "${AVERAGE_LAST:=10}"
: "${BLOCK_SIZE:=25}"

# --- distillation and evaluation -------------------------------------------------------
: "${DISTILL_BEAM:=5}"
: "${DISTILL_MAX_TOKENS:=8192}"
: "${EVAL_BATCH_SIZE:=1}"             # the papers time decoding at batch 1
# relaxed verification settings evaluated besides strict (beta tau): Xia et al. 2023's
# choice (3, 1) and the high-speed one (5, 3)
RELAXED_SETTINGS=("3 1" "5 3")

CHECKPOINT_ARGS=(
  --save-interval-updates "$SAVE_INTERVAL_UPDATES" --keep-interval-updates "$AVERAGE_LAST"
  --no-epoch-checkpoints
)

TEACHER_ARGS=(
  --task translation --arch "$TEACHER_ARCH" --share-all-embeddings
  --dropout "$TEACHER_DROPOUT" --weight-decay "$TEACHER_WEIGHT_DECAY"
  --criterion label_smoothed_cross_entropy --label-smoothing 0.1
  --optimizer adam --adam-betas '(0.9, 0.98)' --clip-norm "$TEACHER_CLIP_NORM"
  --lr "$TEACHER_LR" --lr-scheduler inverse_sqrt --warmup-updates 4000 --warmup-init-lr 1e-7
  --max-tokens "$TEACHER_MAX_TOKENS" --update-freq "$TEACHER_UPDATE_FREQ"
  --distributed-world-size "$NUM_GPUS" --fp16
  --max-update "$TEACHER_MAX_UPDATE" "${CHECKPOINT_ARGS[@]}"
)

VERIFIER_ARGS=(
  --task translation --arch transformer_wmt_en_de --share-all-embeddings
  --dropout "$VERIFIER_DROPOUT" --weight-decay 0.00001
  --criterion label_smoothed_cross_entropy --label-smoothing 0.1
  --optimizer adam --adam-betas '(0.9, 0.98)' --clip-norm 3.0
  --lr 1e-3 --lr-scheduler inverse_sqrt --warmup-updates 4000 --warmup-init-lr 1e-7
  --max-tokens "$VERIFIER_MAX_TOKENS" --update-freq "$VERIFIER_UPDATE_FREQ"
  --distributed-world-size "$NUM_GPUS" --fp16
  --max-update "$VERIFIER_MAX_UPDATE" "${CHECKPOINT_ARGS[@]}"
)

DRAFTER_ARGS=(
  --task draft_verify --arch specdec_nat_base --criterion glat_block
  --block-size "$BLOCK_SIZE" --share-all-embeddings
  --dropout "$DRAFTER_DROPOUT" --label-smoothing 0.1
  --glance-ratio-start 0.5 --glance-ratio-end 0.3 --glance-anneal-updates "$DRAFTER_MAX_UPDATE"
  --optimizer adam --adam-betas '(0.9, 0.999)' --adam-eps 1e-6 --weight-decay 0.01 --clip-norm 5
  --lr "$DRAFTER_LR" --lr-scheduler inverse_sqrt --warmup-updates "$DRAFTER_WARMUP" --warmup-init-lr 1e-7
  --max-tokens "$DRAFTER_MAX_TOKENS" --update-freq "$DRAFTER_UPDATE_FREQ"
  --distributed-world-size "$NUM_GPUS" --ddp-backend legacy_ddp --fp16
  --max-update "$DRAFTER_MAX_UPDATE" "${CHECKPOINT_ARGS[@]}"
)

