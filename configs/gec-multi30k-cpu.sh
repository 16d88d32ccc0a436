# GEC-style demo for input-guided aggressive decoding (Ge et al. 2022), CPU-sized
# (NOT a paper setting): Multi30k English sentences corrupted with the noise
# model of scripts/make-gec-noise.py (source) -> the original sentences
# (target).  A 3+3-layer d256 transformer corrector, one joined dictionary
# (input-guided decoding copies source tokens into the output).

: "${THREADS:=1}"
: "${CORRECTOR_UPDATES:=1000}"     # training budget (about 20 minutes on 1 thread)
: "${CORRECTOR_MAX_MINUTES:=40}"  # safety cap only: the log says when it cut training short
: "${BPE_MERGES:=8000}"

# the corrector is the Multi30k verifier's transformer (same arguments)
# shellcheck source=multi30k-cpu.sh
source "$(dirname "${BASH_SOURCE[0]}")/multi30k-cpu.sh"
CORRECTOR_ARGS=("${VERIFIER_ARGS[@]}")
