# Multi30k EN-DE on one GPU (NOT a paper setting, and NOT RUN ON A GPU YET:
# the budgets and batch sizes below are a starting point, not measured).
#
#   CONFIG=configs/multi30k-gpu.sh scripts/run-multi30k.sh
#
# The CPU recipe's models and stages (configs/multi30k-cpu.sh, sourced below
# for everything this file does not set), trained for far more updates than
# the CPU hour allows, since on a GPU Multi30k trains in minutes: this is where
# the drafters' accuracy with real training shows.  Differences from the CPU
# config:
#  - DEVICE=gpu: fairseq-train, fairseq-validate and distillation run without
#    --cpu (on every visible GPU: with more than one, fairseq-train trains
#    data-parallel and multiplies the tokens per update; set
#    CUDA_VISIBLE_DEVICES to one GPU to keep the settings below);
#    distillation runs in one shard (DISTILL_SHARDS=1: shard i would run on GPU i);
#  - budgets: verifier 20k updates, both drafters 20k, blockwise heads 10k
#    (CPU: 1000, 400, 400, 100); safety caps of two hours per stage;
#  - training in float16 (--fp16, fairseq's mixed precision), 8192 tokens per
#    update (CPU: 2048-4096), no epoch limit (--max-epoch 0: the update budget
#    ends training), validation and epoch checkpoints every 5 epochs (an epoch
#    is about 55 updates at 8192 tokens);
#  - the verifier: dropout 0.3, lr 5e-4 with 4000 warm-up updates (the usual
#    Multi30k transformer setting over many epochs; the CPU config uses
#    dropout 0.1 and warm-up 400 for its four epochs); the drafters: lr 5e-4,
#    4000 warm-up updates, glancing annealed over the whole budget,
#    specdec_vsd with 4 cuts per sentence (CPU: 2);
#  - update-numbered checkpoints every 1000 updates, all 20 kept, for
#    scripts/learning-curve.py;
#  - the benchmark: --device auto (cuda when torch sees a GPU), one decoder at
#    a time (BENCH_JOBS=1: two decoders on one GPU would time each other),
#    batch sizes 1, 8 and 64, the relaxed grid at batch 1.  Decoding
#    stays in float32; BENCH_ARGS=--fp16 decodes every fairseq row in float16
#    (strict draft-verify is then compared with --beam 1 in float16; see
#    docs/gpu.md on half precision).
# Every variable can still be overridden from the environment.

: "${DEVICE:=gpu}"
: "${BENCH_DEVICE:=auto}"
: "${THREADS:=1}"
: "${VERIFIER_THREADS:=4}"           # CPU threads of the data pipeline and the host side
: "${VERIFIER_UPDATES:=20000}"
: "${VERIFIER_MAX_MINUTES:=120}"
: "${DRAFTER_UPDATES:=20000}"
: "${DRAFTER_MAX_MINUTES:=120}"
: "${VSD_UPDATES:=20000}"
: "${VSD_MAX_MINUTES:=120}"
: "${VSD_CUTS:=4}"
: "${BLOCKWISE_UPDATES:=10000}"
: "${BLOCKWISE_MAX_MINUTES:=120}"
: "${DISTILL_SHARDS:=1}"
: "${BENCH_JOBS:=1}"
: "${BENCH_BATCH_SIZES:=1,8,64}"
: "${BENCH_RELAXED_BATCH_SIZES:=1}"

# shellcheck source=multi30k-cpu.sh
source "$(dirname "${BASH_SOURCE[0]}")/multi30k-cpu.sh"

# fairseq's parser keeps the last value of a repeated option: these override
# the CPU arguments above.
GPU_TRAIN_ARGS=(--fp16 --max-tokens 8192 --max-epoch 0 --validate-interval 5 --save-interval 5)
VERIFIER_ARGS+=("${GPU_TRAIN_ARGS[@]}" --dropout 0.3 --lr 5e-4 --warmup-updates 4000)
DRAFTER_ARGS+=("${GPU_TRAIN_ARGS[@]}" --lr 5e-4 --warmup-updates 4000 --glance-anneal-updates "$DRAFTER_UPDATES"
               --save-interval-updates 1000 --keep-interval-updates 20)
VSD_ARGS+=("${GPU_TRAIN_ARGS[@]}" --lr 5e-4 --warmup-updates 4000
           --save-interval-updates 1000 --keep-interval-updates 20)
BLOCKWISE_ARGS+=("${GPU_TRAIN_ARGS[@]}" --warmup-updates 1000)
