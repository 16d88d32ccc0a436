// rowgemm_avx512.cpp's blocks computed with AVX2 instructions (a 16-lane
// vector as two 8-lane registers), for the tests on a CPU without AVX-512
// (FAIRSEQ_SPECDEC_ISA=avx512-emulated): see the top of rowgemm_avx512.cpp.
#define ROWGEMM_AVX512_EMULATED 1
#include "rowgemm_avx512.cpp"
