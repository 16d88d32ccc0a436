// The row-blocked products' register blocks in AVX-512 (rowgemm.cpp picks
// them at run time where the CPU has AVX-512F: rowgemm_avx512.h).
//
// The weight keeps the packing of rowgemm.cpp, panels of 8 columns
// ([P][K][8], float32 or bfloat16 bits; int8 panels always take rowgemm.cpp's
// integer blocks).  A 16-lane vector holds one k-step of two neighbouring
// panels (its low half the first, its high half the second), so the 32
// registers of AVX-512 hold blocks of up to 4 rows x 4 vectors (64 columns)
// or 8 rows x 3 vectors (48 columns): a call of up to 8 rows sweeps 48 or
// 64 columns of the weight at once, with one 16-lane fused multiply-add per
// row and vector at every k-step.
//
// Arithmetic: each lane computes what rowgemm.cpp's AVX2 blocks compute for
// its column (the in-order float32 sum over k of x[i][k] * W[n][k] by fused
// multiply-adds from 0, plus the bias, then the ReLU), so a product here is
// bitwise the AVX2 product (tests/test_rowgemm.py).
//
// This file is compiled twice: as itself (namespace rowgemm_avx512, AVX-512F
// instructions) and by rowgemm_avx512_emulated.cpp with
// ROWGEMM_AVX512_EMULATED defined (namespace rowgemm_avx512_emulated), where
// a 16-lane vector is two AVX2 registers: the same blocks, computed with
// AVX2 instructions, so that the tests check this code's logic on a CPU
// without AVX-512 (FAIRSEQ_SPECDEC_ISA=avx512-emulated).  Everything but the
// entry points has internal linkage, so the two builds never share a symbol.
// GCC 12's AVX-512 intrinsics warn, under -Wall, of the placeholder they
// initialize from itself (GCC bug 105593): a false alarm, silenced here only
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include "rowgemm_avx512.h"

#include <cstdint>
#include <cstring>
#include <type_traits>

#ifdef ROWGEMM_AVX512_EMULATED
#define ROWGEMM_NS rowgemm_avx512_emulated
#define ROWGEMM_TARGET __attribute__((target("avx2,fma")))
#else
#define ROWGEMM_NS rowgemm_avx512
#define ROWGEMM_TARGET __attribute__((target("avx512f,avx2,fma")))
#endif

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

#define ROWGEMM_INLINE ROWGEMM_TARGET __attribute__((always_inline)) inline

namespace ROWGEMM_NS {
namespace {

constexpr int64_t kLanes = 8;  // columns per panel (as in rowgemm.cpp)

// 8 weights of one panel's k-step widened exactly to float32 (as rowgemm.cpp)
ROWGEMM_INLINE __m256 load8(const float* w) { return _mm256_loadu_ps(w); }
ROWGEMM_INLINE __m256 load8(const uint16_t* w) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

#ifdef ROWGEMM_AVX512_EMULATED
// a 16-lane vector as two 8-lane AVX2 registers, lane for lane
struct Vec {
  __m256 lo, hi;
};
ROWGEMM_INLINE Vec zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
ROWGEMM_INLINE Vec broadcast(const float* x) {
  const __m256 b = _mm256_broadcast_ss(x);
  return {b, b};
}
ROWGEMM_INLINE Vec fmadd(Vec a, Vec b, Vec c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
ROWGEMM_INLINE Vec add(Vec a, Vec b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
ROWGEMM_INLINE Vec relu(Vec a) {
  const __m256 z = _mm256_setzero_ps();
  return {_mm256_max_ps(a.lo, z), _mm256_max_ps(a.hi, z)};
}
ROWGEMM_INLINE Vec load16(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + kLanes)}; }
ROWGEMM_INLINE void store16(float* p, Vec v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + kLanes, v.hi);
}
// one k-step of two panels: lanes 0-7 from lo, 8-15 from hi
template <typename WT>
ROWGEMM_INLINE Vec pair(const WT* lo, const WT* hi) { return {load8(lo), load8(hi)}; }
#else
using Vec = __m512;
ROWGEMM_INLINE Vec zero() { return _mm512_setzero_ps(); }
ROWGEMM_INLINE Vec broadcast(const float* x) { return _mm512_set1_ps(*x); }
ROWGEMM_INLINE Vec fmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
ROWGEMM_INLINE Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
ROWGEMM_INLINE Vec relu(Vec a) { return _mm512_max_ps(a, _mm512_setzero_ps()); }
ROWGEMM_INLINE Vec load16(const float* p) { return _mm512_loadu_ps(p); }
ROWGEMM_INLINE void store16(float* p, Vec v) { _mm512_storeu_ps(p, v); }
ROWGEMM_INLINE Vec join(__m256 lo, __m256 hi) {
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(lo)), _mm256_castps_pd(hi), 1));
}
ROWGEMM_INLINE Vec pair(const float* lo, const float* hi) { return join(_mm256_loadu_ps(lo), _mm256_loadu_ps(hi)); }
ROWGEMM_INLINE Vec pair(const uint16_t* lo, const uint16_t* hi) {
  // a bfloat16 is the high half of the float32 with the same bits: exact
  const __m256i h = _mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lo))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(hi)), 1);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

// R rows (xt: K x R, row-interleaved) against 2 * NV consecutive panels (NV
// vectors of 16 columns); ``next``: the next block's panels, fetched into the
// L2 cache at the rate this block reads its own (as in rowgemm.cpp).
template <int R, int NV, typename WT>
ROWGEMM_TARGET void block(const float* xt, int64_t K, const WT* w, int64_t panel_stride, const float* bias,
                          int activation, float* y, int64_t ldy, int64_t ncols, const WT* next) {
  constexpr int64_t kStepsPerLine = 64 / (kLanes * sizeof(WT));
  constexpr int64_t kLineElems = 64 / sizeof(WT);
  Vec acc[R * NV];
#pragma GCC unroll 32
  for (int a = 0; a < R * NV; ++a) acc[a] = zero();
  for (int64_t k = 0; k < K; ++k) {
    if (next != nullptr && (k % kStepsPerLine) == 0) {
      const char* line = reinterpret_cast<const char*>(next + (k / kStepsPerLine) * 2 * NV * kLineElems);
#pragma GCC unroll 8
      for (int v = 0; v < 2 * NV; ++v) _mm_prefetch(line + v * 64, _MM_HINT_T1);
    }
    Vec wv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      const WT* lo = w + 2 * v * panel_stride + k * kLanes;
      wv[v] = pair(lo, lo + panel_stride);
    }
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const Vec xb = broadcast(xt + k * R + i);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[i * NV + v] = fmadd(xb, wv[v], acc[i * NV + v]);
    }
  }
  float out[R * NV * 2 * kLanes];
#pragma GCC unroll 32
  for (int a = 0; a < R * NV; ++a) {
    Vec r = acc[a];
    if (bias != nullptr) r = add(r, load16(bias + (a % NV) * 2 * kLanes));
    if (activation == 1) r = relu(r);
    store16(out + a * 2 * kLanes, r);
  }
  const int64_t n = ncols < NV * 2 * kLanes ? ncols : NV * 2 * kLanes;
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) std::memcpy(y + i * ldy, out + i * NV * 2 * kLanes, n * sizeof(float));
}

template <int R, typename WT>
bool rows_block(int pairs, const float* xt, int64_t K, const WT* w, int64_t panel_stride, const float* bias,
                int activation, float* y, int64_t ldy, int64_t ncols, const WT* next) {
  switch (pairs) {
    case 1: block<R, 1, WT>(xt, K, w, panel_stride, bias, activation, y, ldy, ncols, next); return true;
    case 2: block<R, 2, WT>(xt, K, w, panel_stride, bias, activation, y, ldy, ncols, next); return true;
    case 3: block<R, 3, WT>(xt, K, w, panel_stride, bias, activation, y, ldy, ncols, next); return true;
    case 4:
      // 4 vectors only up to 4 rows (16 accumulators); 8 x 4 would spill
      if constexpr (R <= 4) {
        block<R, 4, WT>(xt, K, w, panel_stride, bias, activation, y, ldy, ncols, next);
        return true;
      }
      return false;
    default: return false;
  }
}

template <typename WT>
bool sweep_impl(int rows, int pairs, const float* xt, int64_t K, const WT* w, int64_t panel_stride,
                const float* bias, int activation, float* y, int64_t ldy, int64_t ncols, const WT* next) {
  switch (rows) {
    case 1: return rows_block<1, WT>(pairs, xt, K, w, panel_stride, bias, activation, y, ldy, ncols, next);
    case 2: return rows_block<2, WT>(pairs, xt, K, w, panel_stride, bias, activation, y, ldy, ncols, next);
    case 3: return rows_block<3, WT>(pairs, xt, K, w, panel_stride, bias, activation, y, ldy, ncols, next);
    case 4: return rows_block<4, WT>(pairs, xt, K, w, panel_stride, bias, activation, y, ldy, ncols, next);
    case 5: return rows_block<5, WT>(pairs, xt, K, w, panel_stride, bias, activation, y, ldy, ncols, next);
    case 6: return rows_block<6, WT>(pairs, xt, K, w, panel_stride, bias, activation, y, ldy, ncols, next);
    case 7: return rows_block<7, WT>(pairs, xt, K, w, panel_stride, bias, activation, y, ldy, ncols, next);
    case 8: return rows_block<8, WT>(pairs, xt, K, w, panel_stride, bias, activation, y, ldy, ncols, next);
    default: return false;
  }
}

}  // namespace

bool sweep(int rows, int pairs, const float* xt, int64_t K, const float* w, int64_t panel_stride, const float* bias,
           int activation, float* y, int64_t ldy, int64_t ncols, const float* next) {
  return sweep_impl(rows, pairs, xt, K, w, panel_stride, bias, activation, y, ldy, ncols, next);
}
bool sweep(int rows, int pairs, const float* xt, int64_t K, const uint16_t* w, int64_t panel_stride, const float* bias,
           int activation, float* y, int64_t ldy, int64_t ncols, const uint16_t* next) {
  return sweep_impl(rows, pairs, xt, K, w, panel_stride, bias, activation, y, ldy, ncols, next);
}

}  // namespace ROWGEMM_NS

#else  // not x86-64: no entry point computes

namespace ROWGEMM_NS {
bool sweep(int, int, const float*, int64_t, const float*, int64_t, const float*, int, float*, int64_t, int64_t,
           const float*) { return false; }
bool sweep(int, int, const float*, int64_t, const uint16_t*, int64_t, const float*, int, float*, int64_t, int64_t,
           const uint16_t*) { return false; }
}  // namespace ROWGEMM_NS

#endif
