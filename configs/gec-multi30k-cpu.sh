# GEC-style demo for input-guided aggressive decoding (paper 003), CPU-sized
# (NOT a paper setting): Multi30k English sentences corrupted with the noise
# model of scripts/make-gec-noise.py (source) -> the original sentences
# (target).  A 3+3-layer d256 transformer corrector, one joined dictionary
# (input-guided decoding copies source tokens into the output).

: "${THREADS:=1}"
: "${CORRECTOR_MINUTES:=20}"
: "${BPE_MERGES:=8000}"

CORRECTOR_ARGS=(
  --task translation --arch transformer
  --encoder-layers 3 --decoder-layers 3 --encoder-embed-dim 256 --decoder-embed-dim 256
  --encoder-ffn-embed-dim 1024 --decoder-ffn-embed-dim 1024
  --encoder-attention-heads 4 --decoder-attention-heads 4 --share-all-embeddings
  --dropout 0.3 --weight-decay 0.0001
  --criterion label_smoothed_cross_entropy --label-smoothing 0.1
  --optimizer adam --adam-betas '(0.9, 0.98)' --lr 1e-3
  --lr-scheduler inverse_sqrt --warmup-updates 400 --warmup-init-lr 1e-7
  --max-tokens 2048 --max-epoch 30 --keep-last-epochs 3
  --required-batch-size-multiple 1
)
