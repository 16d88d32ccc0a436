// The AVX-512 register blocks of the row-blocked products
// (rowgemm_avx512.cpp), called by rowgemm.cpp where the chosen instruction
// set is AVX-512 (or its emulation on AVX2, for the tests).
//
// sweep(rows, pairs, xt, K, w, panel_stride, bias, activation, y, ldy, ncols,
// next): y[i][c] for rows i < ``rows`` (1-8) and the 16 * ``pairs`` columns
// of the 2 * ``pairs`` panels from w (each ``panel_stride`` elements after
// the previous; at most ``ncols`` columns written, row stride ``ldy``), from
// xt (K x rows, row-interleaved); bias: the block's 16 * pairs padded
// biases or null; activation 0 = none, 1 = relu; next: the next block's
// panels to prefetch, or null.  ``pairs`` is 1-4, and at most 3 above 4
// rows.  Returns false (and computes nothing) for any other block or where
// the code is not built (not x86-64).  Every element is bitwise what the
// AVX2 blocks of rowgemm.cpp give.
#pragma once
#include <cstdint>

#define ROWGEMM_AVX512_DECLARE(ns)                                                                                   \
  namespace ns {                                                                                                     \
  bool sweep(int rows, int pairs, const float* xt, int64_t K, const float* w, int64_t panel_stride,                 \
             const float* bias, int activation, float* y, int64_t ldy, int64_t ncols, const float* next);          \
  bool sweep(int rows, int pairs, const float* xt, int64_t K, const uint16_t* w, int64_t panel_stride,              \
             const float* bias, int activation, float* y, int64_t ldy, int64_t ncols, const uint16_t* next);       \
  }

ROWGEMM_AVX512_DECLARE(rowgemm_avx512)
ROWGEMM_AVX512_DECLARE(rowgemm_avx512_emulated)
#undef ROWGEMM_AVX512_DECLARE
