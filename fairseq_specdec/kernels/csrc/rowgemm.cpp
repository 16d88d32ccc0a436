// Row-blocked float32 products for the verify pass: y = x W^T + b for a few
// rows x (m x K) against a large weight W (N x K).
//
// BLAS libraries choose their kernel by the shape: a one-row product takes a
// matrix-vector path, a few rows a matrix-matrix path whose packing and
// blocking are sized for many rows, so on a CPU a product of 4 rows costs
// 2-5x one of 1 row even where reading the weight dominates.  This kernel
// streams the weight once for all rows: the weight is packed once into
// panels of 8 columns ([ceil(N/8)][K][8], zero padded), and each block of 3
// panels (24 columns) is swept over K with 4 rows x 3 vectors of accumulators
// held in AVX2 registers (calls of more rows use blocks of fewer panels:
// layout_for); further row groups reuse the block from cache.
// While a block computes, the next one can be prefetched into the L2 cache,
// so that streaming the weight from memory and computing on it overlap;
// whether it is depends on the class of row counts (g_prefetch: measured per
// CPU, since on some the prefetch slows the products of few rows).
//
// Arithmetic contract: every output element is
//     y[i][n] = (sum over k = 0..K-1, in order, of x[i][k] * W[n][k]) + b[n]
// accumulated in float32 with fused multiply-adds from 0, the bias added
// last.  It depends on neither the number of rows nor the other rows, so a
// row's result is the same in a pass of 1, 4 or 128 rows (unlike a BLAS,
// whose summation order follows its shape-dependent kernel).  It is not
// bitwise the BLAS result: the plugin measures what that changes.
//
// Panels may also be packed in bfloat16 (pack_bf16: each weight rounded to
// the nearest bfloat16, ties to even), half the bytes to stream; a block then
// widens each loaded element exactly to float32 and the contract above holds
// with W replaced by its rounded copy.  For drafters only: a draft that
// rounds differently is at most rejected, while the verifier's products
// always read float32 panels.
//
// Or in int8 (pack_i8, the int8 copy of --decoding self-draft): each weight
// row n quantized symmetrically, q = round(W[n][k] / s[n]) with s[n] =
// max_k |W[n][k]| / 127, a quarter of the bytes to stream.  A panel holds
// its K k-rows of 8 int8 with each pair of k-rows interleaved column by
// column (q[n][2j], q[n][2j+1] side by side; an odd last k-row as it is),
// then its 8 scales as float32 (4 more k-rows of bytes: [P][K + 4][8] int8).
// Each row of x is quantized too, symmetrically to 16-bit integers:
//     xq[i][k] = round_half_even(x[i][k] * (Q / a_i)),  sx_i = a_i / Q,
// a_i = max_k |x[i][k]| (xq = 0, sx = 0 for a row of zeros), Q = the
// largest integer up to 32767 with 127 * K * Q < 2^31, so that the sum
//     d[i][n] = sum over k of xq[i][k] * q[n][k]
// is exact in 32-bit integers (pairs of k multiplied and added by one
// vpmaddwd: twice the products of a float32 fused multiply-add per
// instruction, no widening to float).  Then, in float32,
//     y[i][n] = fma(float(d[i][n]) * s[n], sx_i, b[n])
// (one rounding for the last multiply and the bias; ReLU after).  An
// integer sum has no order, so a row's result depends on nothing but the
// row.  Drafting only, like bfloat16; every instruction set runs these AVX2
// blocks.
//
// On a CPU with AVX-512F the blocks can be AVX-512 ones instead
// (rowgemm_avx512.cpp: 16-lane vectors over pairs of panels, blocks of up to
// 8 rows x 48 columns), bitwise the same products; the instruction set is
// set once per process, for each class of row counts (FAIRSEQ_SPECDEC_ISA,
// or measured on a CPU with AVX-512F: fairseq_specdec/kernels/__init__.py).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "rowgemm_avx512.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <tuple>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define ROWGEMM_X86 1
#endif

namespace {

constexpr int64_t kLanes = 8;    // floats per AVX2 register (and per panel)
// The register block a call sweeps its weight with, by its number of rows m
// (at most 12 accumulators of the 16 AVX2 registers): up to 4 rows x 3
// panels (24 columns), 5-6 rows x 2 panels, 7-8 rows x 1 panel, so that a
// call of up to 8 rows reads each weight once; larger calls sweep blocks of
// 2 panels with groups of 6 rows, the further groups from cache.
struct Layout {
  int64_t group_rows, block_panels;
};
// The AVX-512 blocks (wide): up to 4 rows x 8 panels (4 vectors of 16
// columns), else groups of 8 rows x 6 panels (3 vectors), 16 or 24 of the 32
// registers as accumulators; a call of up to 8 rows reads each weight once.
inline Layout layout_for(int64_t m, bool wide) {
  if (wide) return m <= 4 ? Layout{4, 8} : Layout{8, 6};
  if (m <= 4) return {4, 3};
  if (m <= 6) return {6, 2};
  if (m <= 8) return {8, 1};
  return {6, 2};
}

bool cpu_supported() {
#ifdef ROWGEMM_X86
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

bool cpu_has_avx512() {
#ifdef ROWGEMM_X86
  // __builtin_cpu_supports also checks that the OS saves the AVX-512 registers
  return cpu_supported() && __builtin_cpu_supports("avx512f");
#else
  return false;
#endif
}

// The instruction set of the products' register blocks, one for each class
// of row counts (kIsaClassFirstRows: calls of 1 row, 2-4, 5-8, 9 or more,
// the classes whose register blocks differ): set once per process
// (select_isa for all classes, set_isa_for_rows for one; what "auto" means
// is decided in fairseq_specdec/kernels/__init__.py), read by every product.
// avx512_emulated computes the AVX-512 blocks with AVX2 instructions, for
// the tests.  Every choice gives bitwise the same products.
enum class Isa { none, avx2, avx512, avx512_emulated };
constexpr int kIsaClasses = 4;
constexpr int64_t kIsaClassFirstRows[kIsaClasses] = {1, 2, 5, 9};
Isa g_isa[kIsaClasses] = {cpu_supported() ? Isa::avx2 : Isa::none, cpu_supported() ? Isa::avx2 : Isa::none,
                          cpu_supported() ? Isa::avx2 : Isa::none, cpu_supported() ? Isa::avx2 : Isa::none};

// the class of a call of m rows (m >= 1)
inline int isa_class(int64_t m) {
  int c = 0;
  while (c + 1 < kIsaClasses && m >= kIsaClassFirstRows[c + 1]) ++c;
  return c;
}

// Whether the float32 and bfloat16 products of each class of row counts
// (the classes of g_isa) prefetch the next block of panels into L2 while a
// block computes (see the prefetch note above): on by default; set per
// class where the plugin measured the products without it faster on this
// CPU (fairseq_specdec/kernels/__init__.py).  The int8 products always
// prefetch.  A prefetch changes no arithmetic: either setting gives bitwise
// the same products.
bool g_prefetch[kIsaClasses] = {true, true, true, true};

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::avx2: return "avx2";
    case Isa::avx512: return "avx512";
    case Isa::avx512_emulated: return "avx512-emulated";
    default: return "none";
  }
}

#ifdef ROWGEMM_X86
// R rows (xt: K x R, row-interleaved) against NV consecutive panels.
// ``next`` (or null): the next block's panels, fetched into the L2 cache
// while this block computes (NV * 32 bytes per k, the rate this block reads
// its own), so that a weight streamed from memory arrives before it is
// needed: in a decoding loop the weights do not stay in the caches between
// passes, and without it a pass of 4 rows waited for memory and computed in
// turn.  (Into L1 instead, a block of large K evicts the lines in use.)  A
// prefetch never faults and changes no result.
// one k-step of a panel: 8 weights widened to float32
__attribute__((target("avx2,fma"), always_inline)) inline __m256 load_lanes(const float* w) {
  return _mm256_loadu_ps(w);
}
__attribute__((target("avx2,fma"), always_inline)) inline __m256 load_lanes(const uint16_t* w) {
  // a bfloat16 is the high half of the float32 with the same bits: exact
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

template <int R, int NV, typename WT>
__attribute__((target("avx2,fma"), always_inline)) inline void block_impl(
    const float* xt, int64_t K, const WT* w, int64_t panel_stride, const float* bias, int activation,
    float* y, int64_t ldy, int64_t ncols, const WT* next) {
  // k-steps per 64-byte line of a panel, and elements per line
  constexpr int64_t kStepsPerLine = 64 / (kLanes * sizeof(WT));
  constexpr int64_t kLineElems = 64 / sizeof(WT);
  __m256 acc[R * NV];
#pragma GCC unroll 16
  for (int a = 0; a < R * NV; ++a) acc[a] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    if (next != nullptr && (k % kStepsPerLine) == 0) {
      // kStepsPerLine k-steps of NV panels = NV cache lines of the next block
      const char* line = reinterpret_cast<const char*>(next + (k / kStepsPerLine) * NV * kLineElems);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) _mm_prefetch(line + v * 64, _MM_HINT_T1);
    }
    __m256 wv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) wv[v] = load_lanes(w + v * panel_stride + k * kLanes);
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const __m256 xb = _mm256_broadcast_ss(xt + k * R + i);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[i * NV + v] = _mm256_fmadd_ps(xb, wv[v], acc[i * NV + v]);
    }
  }
  alignas(32) float out[R * NV * kLanes];
  const __m256 zero = _mm256_setzero_ps();
#pragma GCC unroll 16
  for (int a = 0; a < R * NV; ++a) {
    __m256 r = acc[a];
    if (bias != nullptr) r = _mm256_add_ps(r, _mm256_loadu_ps(bias + (a % NV) * kLanes));
    if (activation == 1) r = _mm256_max_ps(r, zero);
    _mm256_store_ps(out + a * kLanes, r);
  }
  const int64_t n = ncols < NV * kLanes ? ncols : NV * kLanes;
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) std::memcpy(y + i * ldy, out + i * NV * kLanes, n * sizeof(float));
}

template <int R, int NV, typename WT>
__attribute__((target("avx2,fma"))) void block(
    const float* xt, int64_t K, const WT* w, int64_t panel_stride, const float* bias, int activation,
    float* y, int64_t ldy, int64_t ncols, const WT* next) {
  block_impl<R, NV, WT>(xt, K, w, panel_stride, bias, activation, y, ldy, ncols, next);
}

template <int NV, typename WT>
void rows_block(int rows, const float* xt, int64_t K, const WT* w, int64_t panel_stride, const float* bias,
                int activation, float* y, int64_t ldy, int64_t ncols, const WT* next) {
  switch (rows) {
    case 1: block<1, NV, WT>(xt, K, w, panel_stride, bias, activation, y, ldy, ncols, next); break;
    case 2: block<2, NV, WT>(xt, K, w, panel_stride, bias, activation, y, ldy, ncols, next); break;
    case 3: block<3, NV, WT>(xt, K, w, panel_stride, bias, activation, y, ldy, ncols, next); break;
    case 4: block<4, NV, WT>(xt, K, w, panel_stride, bias, activation, y, ldy, ncols, next); break;
    default:
      // more rows only in blocks of fewer panels (layout_for): 6 x 3 would spill registers
      if constexpr (NV <= 2) {
        if (rows == 5) { block<5, NV, WT>(xt, K, w, panel_stride, bias, activation, y, ldy, ncols, next); break; }
        if (rows == 6) { block<6, NV, WT>(xt, K, w, panel_stride, bias, activation, y, ldy, ncols, next); break; }
      }
      if constexpr (NV == 1) {
        if (rows == 7) { block<7, NV, WT>(xt, K, w, panel_stride, bias, activation, y, ldy, ncols, next); break; }
        if (rows == 8) { block<8, NV, WT>(xt, K, w, panel_stride, bias, activation, y, ldy, ncols, next); break; }
      }
      TORCH_CHECK(false, "rowgemm: no register block of ", rows, " rows x ", NV, " panels");
  }
}

// acc[i][v] += the products of row i's pair of k (xpair[i]: two 16-bit
// values in an int32) and panel v's 8 columns x 2 k (wv[v]), in 32-bit sums
template <int R, int NV>
__attribute__((target("avx2,fma"), always_inline)) inline void madd_pairs(__m256i* acc, const __m256i* wv,
                                                                           const int32_t* xpair) {
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) {
    const __m256i xb = _mm256_set1_epi32(xpair[i]);
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[i * NV + v] = _mm256_add_epi32(acc[i * NV + v], _mm256_madd_epi16(xb, wv[v]));
  }
}

// int8 panels (see the top of the file): R rows (xp: the rows' 16-bit
// values in pairs of k, [ceil(K/2)][R] int32, an odd K's last pair
// (x[K-1], 0); sx: the rows' scales) against NV panels, summed exactly in
// 32-bit integers, then scaled, biased and ReLU'd in float32.  ``next``:
// the next block, prefetched at the rate this one reads (as block_impl).
template <int R, int NV>
__attribute__((target("avx2,fma"))) void block_i8(const int32_t* xp, const float* sx, int64_t K, const int8_t* w,
                                                  int64_t panel_stride, const float* bias, int activation, float* y,
                                                  int64_t ldy, int64_t ncols, const int8_t* next) {
  const int64_t pairs = K / 2;
  __m256i acc[R * NV];
#pragma GCC unroll 16
  for (int a = 0; a < R * NV; ++a) acc[a] = _mm256_setzero_si256();
  for (int64_t j = 0; j < pairs; ++j) {
    if (next != nullptr && (j % 4) == 0) {  // 4 pairs of k-rows of a panel: one 64-byte line
      const char* line = reinterpret_cast<const char*>(next) + (j / 4) * NV * 64;
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) _mm_prefetch(line + v * 64, _MM_HINT_T1);
    }
    __m256i wv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v)  // 8 columns x 2 k, widened to 16 bits
      wv[v] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + v * panel_stride + j * 16)));
    madd_pairs<R, NV>(acc, wv, xp + j * R);
  }
  if (K % 2 == 1) {  // the last k-row alone, paired with zeros
    const __m128i zero = _mm_setzero_si128();
    __m256i wv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v)
      wv[v] = _mm256_cvtepi8_epi16(
          _mm_unpacklo_epi8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + v * panel_stride + (K - 1) * kLanes)), zero));
    madd_pairs<R, NV>(acc, wv, xp + pairs * R);
  }
  alignas(32) float out[R * NV * kLanes];
  const __m256 zero = _mm256_setzero_ps();
#pragma GCC unroll 16
  for (int a = 0; a < R * NV; ++a) {
    const __m256 scales = _mm256_loadu_ps(reinterpret_cast<const float*>(w + (a % NV) * panel_stride + K * kLanes));
    // the bias in one fused multiply-add: explicit, so no compiler contracts (or not) a multiply and an add
    const __m256 ds = _mm256_mul_ps(_mm256_cvtepi32_ps(acc[a]), scales), row = _mm256_set1_ps(sx[a / NV]);
    __m256 r = bias != nullptr ? _mm256_fmadd_ps(ds, row, _mm256_loadu_ps(bias + (a % NV) * kLanes))
                               : _mm256_mul_ps(ds, row);
    if (activation == 1) r = _mm256_max_ps(r, zero);
    _mm256_store_ps(out + a * kLanes, r);
  }
  const int64_t n = ncols < NV * kLanes ? ncols : NV * kLanes;
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) std::memcpy(y + i * ldy, out + i * NV * kLanes, n * sizeof(float));
}

template <int NV>
void rows_block_i8(int rows, const int32_t* xp, const float* sx, int64_t K, const int8_t* w, int64_t panel_stride,
                   const float* bias, int activation, float* y, int64_t ldy, int64_t ncols, const int8_t* next) {
#define ROWGEMM_I8(r) block_i8<r, NV>(xp, sx, K, w, panel_stride, bias, activation, y, ldy, ncols, next)
  switch (rows) {
    case 1: ROWGEMM_I8(1); return;
    case 2: ROWGEMM_I8(2); return;
    case 3: ROWGEMM_I8(3); return;
    default:
      // the layouts of layout_i8: 12 accumulators, the widened weights, the broadcast and a product in 16 registers
      if constexpr (NV <= 2) {
        if (rows == 4) { ROWGEMM_I8(4); return; }
        if (rows == 5) { ROWGEMM_I8(5); return; }
        if (rows == 6) { ROWGEMM_I8(6); return; }
      }
      if constexpr (NV == 1) {
        if (rows == 7) { ROWGEMM_I8(7); return; }
        if (rows == 8) { ROWGEMM_I8(8); return; }
      }
      TORCH_CHECK(false, "rowgemm: no int8 register block of ", rows, " rows x ", NV, " panels");
  }
#undef ROWGEMM_I8
}
#endif

// k-rows of a panel after its K weights: an int8 panel's 8 float32 scales
constexpr int64_t kScaleRows = 4;

// the input features K of a packed weight (an int8 one holds its scales too)
int64_t in_features(const torch::Tensor& packed) {
  return packed.size(1) - (packed.scalar_type() == torch::kChar ? kScaleRows : 0);
}

void check_packed(const torch::Tensor& packed, int64_t out_features) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kLanes, "rowgemm: packed weight must be [panels][K][8]");
  TORCH_CHECK((packed.scalar_type() == torch::kFloat || packed.scalar_type() == torch::kBFloat16 ||
               packed.scalar_type() == torch::kChar) &&
                  packed.is_contiguous() && packed.device().is_cpu(),
              "rowgemm: packed weight must be a contiguous float32, bfloat16 or int8 CPU tensor");
  TORCH_CHECK(in_features(packed) >= 0, "rowgemm: an int8 packed weight lacks its scales");
  TORCH_CHECK(packed.size(0) == (out_features + kLanes - 1) / kLanes, "rowgemm: packed weight has the wrong panel count");
}

}  // namespace

bool supported() { return cpu_supported(); }

// the instruction set the products run on here: "avx512" (AVX-512F blocks),
// "avx2" (AVX2 with FMA), "avx512-emulated" (the AVX-512 blocks on AVX2
// instructions), or "none" where the CPU lacks AVX2/FMA; the fused layers'
// other loops are AVX2 on all of them
std::string isa() {
  for (int c = 1; c < kIsaClasses; ++c)
    if (g_isa[c] != g_isa[0]) return "mixed";
  return isa_name(g_isa[0]);
}

// the instruction set of a call of m rows
std::string isa_for_rows(int64_t m) {
  TORCH_CHECK(m >= 1, "isa_for_rows: a call has at least 1 row, got ", m);
  return isa_name(g_isa[isa_class(m)]);
}

// whether the float32 and bfloat16 products of a call of m rows prefetch
bool prefetch_for_rows(int64_t m) {
  TORCH_CHECK(m >= 1, "prefetch_for_rows: a call has at least 1 row, got ", m);
  return g_prefetch[isa_class(m)];
}

namespace {
// the class whose first row count is ``first_rows`` (one of isa_classes()),
// refused otherwise in the name of ``caller``
int class_starting_at(int64_t first_rows, const char* caller) {
  int c = 0;
  while (c < kIsaClasses && kIsaClassFirstRows[c] != first_rows) ++c;
  TORCH_CHECK(c < kIsaClasses, caller, ": ", first_rows, " rows does not start a class (1, 2, 5 or 9)");
  return c;
}
}  // namespace

// whether the float32 and bfloat16 calls of the class whose first row count
// is ``first_rows`` (one of isa_classes()) prefetch
void set_prefetch_for_rows(int64_t first_rows, bool on) {
  g_prefetch[class_starting_at(first_rows, "set_prefetch_for_rows")] = on;
}

// the first row count of each class (1, 2, 5, 9)
std::vector<int64_t> isa_classes() {
  return std::vector<int64_t>(kIsaClassFirstRows, kIsaClassFirstRows + kIsaClasses);
}

namespace {
Isa parse_isa(const std::string& name) {
  TORCH_CHECK(cpu_supported(), "this CPU has no AVX2/FMA, so no instruction set can be chosen");
  if (name == "avx2") return Isa::avx2;
  if (name == "avx512-emulated") return Isa::avx512_emulated;
  if (name == "avx512") {
    TORCH_CHECK(cpu_has_avx512(), "this CPU has no AVX-512F instructions (use avx2, or avx512-emulated to test)");
    return Isa::avx512;
  }
  TORCH_CHECK(false, "no instruction set '", name, "'; the choices are avx2, avx512, avx512-emulated");
  return Isa::none;
}
}  // namespace

// The instruction set of the calls of the class whose first row count is
// ``first_rows`` (one of isa_classes()); returns the one set.
std::string set_isa_for_rows(int64_t first_rows, const std::string& name) {
  const int c = class_starting_at(first_rows, "set_isa_for_rows");
  const Isa isa = parse_isa(name);
  g_isa[c] = isa;
  return isa_name(isa);
}

// The instruction set of every call: one of "avx2", "avx512",
// "avx512-emulated", refused where the CPU lacks it ("auto" is resolved by
// the plugin, in Python).  Returns the one chosen.
std::string select_isa(const std::string& name) {
  const Isa isa = parse_isa(name);
  for (int c = 0; c < kIsaClasses; ++c) g_isa[c] = isa;
  return isa_name(isa);
}

// The arithmetic peak of one core: ``iters`` rounds of fused multiply-adds
// on registers only, no memory read, with 16 independent accumulators (more
// than two FMA units of latency 4 need to stay busy) of 8 lanes (avx2) or 16
// (avx512); a round is 16 * lanes * 2 floating-point operations.  Returns the
// accumulators' sum, so that the loop is not optimized away (each converges
// to 1: no overflow and no subnormal slows it).  For the roofline's peak
// (fairseq_specdec/bench/roofline.py), which a library's large product may
// not reach on every CPU.
#ifdef ROWGEMM_X86
// one definition for both widths: VEC registers of LANES floats, under TARGET
#define ROWGEMM_FMA_ROUNDS(NAME, TARGET, VEC, LANES, SET1, FMADD, STOREU)      \
  __attribute__((target(TARGET))) double NAME(int64_t iters, float a, float b) { \
    VEC acc[16];                                                                \
    const VEC va = SET1(a), vb = SET1(b);                                       \
    for (int j = 0; j < 16; ++j) acc[j] = SET1(static_cast<float>(j) * 1e-3f); \
    for (int64_t i = 0; i < iters; ++i) {                                       \
      _Pragma("GCC unroll 16") for (int j = 0; j < 16; ++j) acc[j] = FMADD(acc[j], va, vb); \
    }                                                                           \
    float lanes[LANES];                                                         \
    double sum = 0.0;                                                           \
    for (int j = 0; j < 16; ++j) {                                              \
      STOREU(lanes, acc[j]);                                                    \
      for (float v : lanes) sum += v;                                           \
    }                                                                           \
    return sum;                                                                 \
  }
ROWGEMM_FMA_ROUNDS(fma_rounds_avx2, "avx2,fma", __m256, 8, _mm256_set1_ps, _mm256_fmadd_ps, _mm256_storeu_ps)
ROWGEMM_FMA_ROUNDS(fma_rounds_avx512, "avx512f", __m512, 16, _mm512_set1_ps, _mm512_fmadd_ps, _mm512_storeu_ps)
#undef ROWGEMM_FMA_ROUNDS
#endif

double fma_rounds(const std::string& name, int64_t iters) {
  TORCH_CHECK(iters >= 0, "fma_rounds: iters must be >= 0, got ", iters);
#ifdef ROWGEMM_X86
  // a and b come from the caller's side of the call, so the compiler cannot fold the loop
  volatile float a = 0.999f, b = 0.001f;
  if (name == "avx2") {
    TORCH_CHECK(cpu_supported(), "fma_rounds: this CPU has no AVX2/FMA instructions");
    return fma_rounds_avx2(iters, a, b);
  }
  if (name == "avx512") {
    TORCH_CHECK(cpu_has_avx512(), "fma_rounds: this CPU has no AVX-512F instructions");
    return fma_rounds_avx512(iters, a, b);
  }
  TORCH_CHECK(false, "fma_rounds: no instruction set ", name, " (avx2, avx512)");
#else
  TORCH_CHECK(false, "fma_rounds: not built for this CPU (x86-64 only)");
#endif
  return 0.0;
}

// weight: N x K (an nn.Linear's weight) -> [ceil(N/8)][K][8], zero padded
torch::Tensor pack(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kFloat && weight.device().is_cpu(),
              "rowgemm.pack: weight must be a 2-D float32 CPU tensor");
  const int64_t N = weight.size(0), K = weight.size(1);
  const int64_t P = (N + kLanes - 1) / kLanes;
  auto padded = torch::zeros({P * kLanes, K}, weight.options());
  padded.narrow(0, 0, N).copy_(weight);
  // [P*8][K] -> [P][8][K] -> [P][K][8]
  return padded.view({P, kLanes, K}).permute({0, 2, 1}).contiguous();
}

// the same panels in bfloat16: each weight rounded to nearest, ties to even
torch::Tensor pack_bf16(const torch::Tensor& weight) {
  return pack(weight).to(torch::kBFloat16);
}

// int8 panels with their scales: [P][K + 4][8] int8 (see the top of the file)
torch::Tensor pack_i8(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kFloat && weight.device().is_cpu(),
              "rowgemm.pack_i8: weight must be a 2-D float32 CPU tensor");
  const int64_t N = weight.size(0);
  const int64_t P = (N + kLanes - 1) / kLanes;
  auto scales = std::get<0>(weight.abs().max(1)).div(127.0f).clamp_min(1e-12f);
  auto q = weight.div(scales.unsqueeze(1)).round().clamp(-127.0f, 127.0f);
  auto panels = pack(q).to(torch::kChar);  // [P][K][8], exact: integers within int8
  const int64_t K = weight.size(1), even = K / 2 * 2;
  if (even > 0) {  // each pair of k-rows interleaved column by column: [P][K/2][8][2]
    auto pairs = panels.narrow(1, 0, even).reshape({P, even / 2, 2, kLanes}).transpose(2, 3).reshape({P, even, kLanes});
    panels = torch::cat({pairs, panels.narrow(1, even, K - even)}, 1);
  }
  auto padded = torch::ones({P * kLanes}, weight.options());
  padded.narrow(0, 0, N).copy_(scales);
  auto scale_rows = padded.view({P, kLanes}).view(torch::kChar).view({P, kScaleRows, kLanes});
  return torch::cat({panels, scale_rows}, 1).contiguous();
}

// the N row scales an int8 packed weight holds (pack_i8: the 4 k-rows of
// bytes after each panel's K, 8 float32), as an N float32 tensor
torch::Tensor pack_i8_scales(const torch::Tensor& packed, int64_t out_features) {
  TORCH_CHECK(packed.scalar_type() == torch::kChar, "rowgemm.pack_i8_scales: not int8 panels");
  check_packed(packed, out_features);
  const int64_t K = in_features(packed);
  return packed.narrow(1, K, kScaleRows).contiguous().view(torch::kFloat).reshape({-1}).narrow(0, 0, out_features)
      .clone();
}

// bias: N -> P*8 zero padded (or an empty tensor for none)
torch::Tensor pack_bias(const torch::Tensor& bias) {
  TORCH_CHECK(bias.dim() == 1 && bias.scalar_type() == torch::kFloat && bias.device().is_cpu(),
              "rowgemm.pack_bias: bias must be a 1-D float32 CPU tensor");
  const int64_t N = bias.size(0);
  auto out = torch::zeros({(N + kLanes - 1) / kLanes * kLanes}, bias.options());
  out.narrow(0, 0, N).copy_(bias);
  return out;
}

namespace {

// The sweep every product makes over its packed weight: the blocks of
// ``lay.block_panels`` panels (in parallel over blocks where torch has
// threads), each with every group of ``lay.group_rows`` of the m rows in turn,
// the next block of a thread's range prefetched during the first group
// where ``prefetch``.
// block(g, rows, nv, wb, bb, yg, ncols, pf): group g's ``rows`` rows against
// the ``nv`` panels at wb (bias bb or null), written to yg (at most ncols
// columns), pf the block to prefetch or null.
template <typename WT, typename Block>
void sweep_blocks(int64_t m, int64_t P, int64_t N, Layout lay, const WT* w, int64_t panel_stride, const float* b,
                  float* yd, int64_t ldy, bool prefetch, const Block& block) {
  const int64_t group_rows = lay.group_rows, block_panels = lay.block_panels;
  const int64_t groups = (m + group_rows - 1) / group_rows;
  const int64_t nblocks = (P + block_panels - 1) / block_panels;
  at::parallel_for(0, nblocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t p = blk * block_panels;
      const int64_t nv = std::min<int64_t>(block_panels, P - p);
      const int64_t col = p * kLanes;
      const WT* wb = w + p * panel_stride;
      const float* bb = b != nullptr ? b + col : nullptr;
      const WT* next = prefetch && blk + 1 < b1 && nv == block_panels ? wb + block_panels * panel_stride : nullptr;
      for (int64_t g = 0; g < groups; ++g)
        block(g, static_cast<int>(std::min<int64_t>(group_rows, m - g * group_rows)), nv, wb, bb,
              yd + g * group_rows * ldy + col, N - col, g == 0 ? next : nullptr);
    }
  });
}

// y (m x N, row stride ldy) = x (m x K, contiguous rows) W^T + b through the
// packed panels w ([P][K][8], float32 or bfloat16 bits); b: P*8 floats or
// null; act 0 = none, 1 = relu.
template <typename WT>
void linear_raw(const float* xs, int64_t m, int64_t K, const WT* w, int64_t P, const float* b, int act,
                float* yd, int64_t N, int64_t ldy) {
#ifdef ROWGEMM_X86
  if (m == 0 || N == 0) return;
  if (K == 0) {
    for (int64_t i = 0; i < m; ++i)
      for (int64_t n = 0; n < N; ++n) {
        float v = b != nullptr ? b[n] : 0.0f;
        yd[i * ldy + n] = (act == 1 && v < 0.0f) ? 0.0f : v;
      }
    return;
  }
  // rows interleaved per group: xt[g][k][r]
  const Isa isa = g_isa[isa_class(m)];
  const bool wide = isa == Isa::avx512 || isa == Isa::avx512_emulated;
  const Layout lay = layout_for(m, wide);
  const int64_t group_rows = lay.group_rows;
  const int64_t groups = (m + group_rows - 1) / group_rows;
  std::vector<float> xt(static_cast<size_t>(groups * K * group_rows));
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t rows = std::min<int64_t>(group_rows, m - g * group_rows);
    float* dst = xt.data() + g * K * group_rows;
    for (int64_t r = 0; r < rows; ++r) {
      const float* src = xs + (g * group_rows + r) * K;
      for (int64_t k = 0; k < K; ++k) dst[k * rows + r] = src[k];
    }
  }
  const float* xd = xt.data();
  const int64_t panel_stride = K * kLanes;
  sweep_blocks(m, P, N, lay, w, panel_stride, b, yd, ldy, g_prefetch[isa_class(m)],
               [&](int64_t g, int rows, int64_t nv, const WT* wb, const float* bb, float* yg, int64_t ncols,
                   const WT* pf) {
    const float* xg = xd + g * K * group_rows;
    if (wide) {
      // pairs of panels in AVX-512 blocks, an odd last panel in an AVX2 one (bitwise the same sums)
      const int pairs = static_cast<int>(nv / 2);
      if (pairs > 0) {
        const bool done = isa == Isa::avx512
            ? rowgemm_avx512::sweep(rows, pairs, xg, K, wb, panel_stride, bb, act, yg, ldy, ncols, pf)
            : rowgemm_avx512_emulated::sweep(rows, pairs, xg, K, wb, panel_stride, bb, act, yg, ldy, ncols, pf);
        TORCH_CHECK(done, "rowgemm: no AVX-512 block of ", rows, " rows x ", pairs, " panel pairs");
      }
      if (nv % 2 == 1) {
        const int64_t c = 2 * pairs * kLanes;
        rows_block<1, WT>(rows, xg, K, wb + 2 * pairs * panel_stride, panel_stride, bb != nullptr ? bb + c : nullptr,
                          act, yg + c, ldy, ncols - c, nullptr);
      }
    } else if (nv == 3) rows_block<3, WT>(rows, xg, K, wb, panel_stride, bb, act, yg, ldy, ncols, pf);
    else if (nv == 2) rows_block<2, WT>(rows, xg, K, wb, panel_stride, bb, act, yg, ldy, ncols, pf);
    else rows_block<1, WT>(rows, xg, K, wb, panel_stride, bb, act, yg, ldy, ncols, pf);
  });
#else
  TORCH_CHECK(false, "rowgemm: built without x86-64 support");
#endif
}

// The register block of an int8 call of m rows: up to 3 rows x 3 panels,
// 4-6 rows x 2, 7-8 rows x 1 (a call of up to 8 rows reads each weight
// once), larger calls in groups of 6 rows x 2 panels, the further groups
// from cache.  One layout on every instruction set.
inline Layout layout_i8(int64_t m) {
  if (m <= 3) return {3, 3};
  if (m <= 6) return {6, 2};
  if (m <= 8) return {8, 1};
  return {6, 2};
}

// Q of the int8 products' 16-bit inputs: the largest integer up to 32767
// with 127 * K * Q < 2^31, so that a sum of K products is exact in 32 bits
inline int64_t int16_scale_max(int64_t K) {
  return std::min<int64_t>(32767, (int64_t{2147483647}) / (127 * std::max<int64_t>(K, 1)));
}

// linear_raw for int8 panels (w: [P][K + 4][8], see the top of the file):
// each row of x quantized to 16 bits, its pairs of k interleaved per row
// group, then the integer blocks
void linear_raw_i8(const float* xs, int64_t m, int64_t K, const int8_t* w, int64_t P, const float* b, int act,
                   float* yd, int64_t N, int64_t ldy) {
#ifdef ROWGEMM_X86
  if (m == 0 || N == 0) return;
  const Layout lay = layout_i8(m);
  const int64_t group_rows = lay.group_rows;
  const int64_t groups = (m + group_rows - 1) / group_rows;
  const int64_t kpairs = (K + 1) / 2;
  const float fq = static_cast<float>(int16_scale_max(K));
  std::vector<int32_t> xp(static_cast<size_t>(groups * kpairs * group_rows));
  std::vector<float> sx(static_cast<size_t>(groups * group_rows), 0.0f);
  std::vector<int32_t> q(static_cast<size_t>(kpairs * 2));
  for (int64_t i = 0; i < m; ++i) {
    const float* x = xs + i * K;
    float amax = 0.0f;
    for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(x[k]));
    const int64_t g = i / group_rows, r = i % group_rows;
    const int64_t rows = std::min<int64_t>(group_rows, m - g * group_rows);
    std::fill(q.begin(), q.end(), 0);
    if (amax > 0.0f) {
      const float inv = fq / amax;
      sx[g * group_rows + r] = amax / fq;
      for (int64_t k = 0; k < K; ++k) {
        // round half to even (nearbyint in the default rounding mode), within [-Q, Q]
        const float v = std::nearbyint(x[k] * inv);
        q[k] = static_cast<int32_t>(v != v ? 0.0f : std::min(fq, std::max(-fq, v)));
      }
    }
    int32_t* dst = xp.data() + g * kpairs * group_rows;
    for (int64_t j = 0; j < kpairs; ++j)
      dst[j * rows + r] = static_cast<int32_t>(static_cast<uint32_t>(static_cast<uint16_t>(q[2 * j])) |
                                               (static_cast<uint32_t>(static_cast<uint16_t>(q[2 * j + 1])) << 16));
  }
  const int64_t panel_stride = (K + kScaleRows) * kLanes;
  sweep_blocks(m, P, N, lay, w, panel_stride, b, yd, ldy, /*prefetch=*/true,
               [&](int64_t g, int rows, int64_t nv, const int8_t* wb, const float* bb, float* yg, int64_t ncols,
                   const int8_t* pf) {
    const int32_t* xg = xp.data() + g * kpairs * group_rows;
    const float* sg = sx.data() + g * group_rows;
    if (nv == 3) rows_block_i8<3>(rows, xg, sg, K, wb, panel_stride, bb, act, yg, ldy, ncols, pf);
    else if (nv == 2) rows_block_i8<2>(rows, xg, sg, K, wb, panel_stride, bb, act, yg, ldy, ncols, pf);
    else rows_block_i8<1>(rows, xg, sg, K, wb, panel_stride, bb, act, yg, ldy, ncols, pf);
  });
#else
  TORCH_CHECK(false, "rowgemm: built without x86-64 support");
#endif
}

// linear_raw through a packed weight tensor of either element type
void linear_packed(const float* xs, int64_t m, int64_t K, const torch::Tensor& packed, const float* b, int act,
                   float* yd, int64_t N, int64_t ldy) {
  if (packed.scalar_type() == torch::kBFloat16)
    linear_raw(xs, m, K, reinterpret_cast<const uint16_t*>(packed.data_ptr()), packed.size(0), b, act, yd, N, ldy);
  else if (packed.scalar_type() == torch::kChar)
    linear_raw_i8(xs, m, K, packed.data_ptr<int8_t>(), packed.size(0), b, act, yd, N, ldy);
  else
    linear_raw(xs, m, K, packed.data_ptr<float>(), packed.size(0), b, act, yd, N, ldy);
}

const float* bias_ptr(const c10::optional<torch::Tensor>& bias, const torch::Tensor& packed) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->numel() == packed.size(0) * kLanes && bias->is_contiguous() &&
                  bias->scalar_type() == torch::kFloat,
              "rowgemm: bias must come from pack_bias");
  return bias->data_ptr<float>();
}

}  // namespace

// x: ... x K (float32, CPU); packed from pack(); bias from pack_bias() or
// undefined; activation 0 = none, 1 = relu.  Returns ... x N.
torch::Tensor linear(const torch::Tensor& x_in, const torch::Tensor& packed, int64_t out_features,
                     const c10::optional<torch::Tensor>& bias, int64_t activation) {
  TORCH_CHECK(cpu_supported(), "rowgemm: this CPU has no AVX2/FMA");
  check_packed(packed, out_features);
  TORCH_CHECK(x_in.scalar_type() == torch::kFloat && x_in.device().is_cpu(), "rowgemm: x must be float32 on the CPU");
  const int64_t K = in_features(packed);
  TORCH_CHECK(x_in.size(-1) == K, "rowgemm: x has ", x_in.size(-1), " features, the weight ", K);
  TORCH_CHECK(activation == 0 || activation == 1, "rowgemm: activation must be 0 (none) or 1 (relu)");
  const float* b = bias_ptr(bias, packed);
  auto out_shape = x_in.sizes().vec();
  out_shape.back() = out_features;
  int64_t mm = 1;  // rows: the product of the leading dimensions
  for (int64_t dim = 0; dim + 1 < x_in.dim(); ++dim) mm *= x_in.size(dim);
  auto y = torch::empty({mm, out_features}, x_in.options());
  const auto xc = x_in.reshape({mm, K}).contiguous();
  linear_packed(xc.data_ptr<float>(), mm, K, packed, b, static_cast<int>(activation), y.data_ptr<float>(), out_features,
                out_features);
  return y.view(out_shape);
}

namespace {

// rows of x (m x C) normalized in place: (x - mean) / sqrt(var + eps) * w + b,
// mean and biased variance over C accumulated in double
void layer_norm_rows(float* x, int64_t m, int64_t C, const float* w, const float* b, double eps) {
  for (int64_t i = 0; i < m; ++i) {
    float* r = x + i * C;
    double sum = 0.0;
    for (int64_t c = 0; c < C; ++c) sum += r[c];
    const double mean = sum / C;
    double sq = 0.0;
    for (int64_t c = 0; c < C; ++c) {
      const double d = r[c] - mean;
      sq += d * d;
    }
    const float rstd = static_cast<float>(1.0 / std::sqrt(sq / C + eps));
    const float fmean = static_cast<float>(mean);
    for (int64_t c = 0; c < C; ++c) r[c] = (r[c] - fmean) * rstd * w[c] + b[c];
  }
}

#ifdef ROWGEMM_X86
__attribute__((target("avx2,fma"))) float dot_avx2(const float* a, const float* b, int64_t d) {
  __m256 acc = _mm256_setzero_ps();
  int64_t t = 0;
  for (; t + kLanes <= d; t += kLanes) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + t), _mm256_loadu_ps(b + t), acc);
  alignas(32) float lanes[kLanes];
  _mm256_store_ps(lanes, acc);
  float s = 0.0f;
  for (int l = 0; l < kLanes; ++l) s += lanes[l];
  for (; t < d; ++t) s = std::fma(a[t], b[t], s);
  return s;
}
#endif

float dot(const float* a, const float* b, int64_t d) {
#ifdef ROWGEMM_X86
  return dot_avx2(a, b, d);
#else
  float s = 0.0f;
  for (int64_t t = 0; t < d; ++t) s += a[t] * b[t];
  return s;
#endif
}

// softmax over scores[0, L) in place (max subtracted, float32)
void softmax_inplace(float* scores, int64_t L) {
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < L; ++j) mx = std::max(mx, scores[j]);
  float sum = 0.0f;
  for (int64_t j = 0; j < L; ++j) {
    const float e = scores[j] == -std::numeric_limits<float>::infinity() ? 0.0f : std::exp(scores[j] - mx);
    scores[j] = e;
    sum += e;
  }
  const float inv = 1.0f / sum;
  for (int64_t j = 0; j < L; ++j) scores[j] *= inv;
}

// out[t] = sum_j p[j] * v[j * stride + t], j in order, fused multiply-adds
#ifdef ROWGEMM_X86
__attribute__((target("avx2,fma"))) void weighted_values(const float* p, const float* v, int64_t L, int64_t stride,
                                                         int64_t d, float* out) {
  int64_t t = 0;
  for (; t + kLanes <= d; t += kLanes) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t j = 0; j < L; ++j) acc = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), _mm256_loadu_ps(v + j * stride + t), acc);
    _mm256_storeu_ps(out + t, acc);
  }
  for (; t < d; ++t) {
    float acc = 0.0f;
    for (int64_t j = 0; j < L; ++j) acc = std::fma(p[j], v[j * stride + t], acc);
    out[t] = acc;
  }
}
#else
void weighted_values(const float* p, const float* v, int64_t L, int64_t stride, int64_t d, float* out) {
  for (int64_t t = 0; t < d; ++t) {
    float acc = 0.0f;
    for (int64_t j = 0; j < L; ++j) acc += p[j] * v[j * stride + t];
    out[t] = acc;
  }
}
#endif

struct Packed {
  const torch::Tensor* w;  // float32, bfloat16 or int8 panels
  const float* b;
  int64_t N;
};

// y = x W^T + b (then act) through one of a layer's packed weights
void linear_raw(const float* xs, int64_t m, int64_t K, const Packed& p, int act, float* yd, int64_t ldy) {
  linear_packed(xs, m, K, *p.w, p.b, act, yd, p.N, ldy);
}

Packed packed_of(const torch::Tensor& packed, const torch::Tensor& bias, int64_t out_features, int64_t K) {
  check_packed(packed, out_features);
  TORCH_CHECK(in_features(packed) == K, "decoder_layer: a packed weight has ", in_features(packed), " input features, expected ", K);
  TORCH_CHECK(bias.numel() == packed.size(0) * kLanes && bias.is_contiguous() && bias.scalar_type() == torch::kFloat,
              "decoder_layer: every bias must come from pack_bias");
  return {&packed, bias.data_ptr<float>(), out_features};
}

void check_vector(const torch::Tensor& t, int64_t n, const char* what) {
  TORCH_CHECK(t.dim() == 1 && t.size(0) == n && t.is_contiguous() && t.scalar_type() == torch::kFloat && t.device().is_cpu(),
              "decoder_layer: ", what, " must be a contiguous float32 CPU vector of ", n);
}

// The residual stream of one fused layer (rows x C, in place) and its
// scratch buffers; a sublayer reads input(), writes its output into tmp and
// calls finish(): the residual added, then the post-norm.
struct Stream {
  float* x;
  int64_t rows, C;
  bool normalize_before;
  double eps;
  std::vector<float> h, tmp, attn;

  Stream(float* x_, int64_t rows_, int64_t C_, int64_t widest, bool normalize_before_, double eps_)
      : x(x_), rows(rows_), C(C_), normalize_before(normalize_before_), eps(eps_),
        h(static_cast<size_t>(rows_ * C_)), tmp(static_cast<size_t>(rows_ * widest)),
        attn(static_cast<size_t>(rows_ * C_)) {}

  const float* input(const torch::Tensor& ln_w, const torch::Tensor& ln_b) {
    if (!normalize_before) return x;
    std::memcpy(h.data(), x, sizeof(float) * rows * C);
    layer_norm_rows(h.data(), rows, C, ln_w.data_ptr<float>(), ln_b.data_ptr<float>(), eps);
    return h.data();
  }

  void finish(const torch::Tensor& ln_w, const torch::Tensor& ln_b) {
    for (int64_t i = 0; i < rows * C; ++i) x[i] += tmp[i];
    if (!normalize_before) layer_norm_rows(x, rows, C, ln_w.data_ptr<float>(), ln_b.data_ptr<float>(), eps);
  }
};

// The self-attention sublayer over B groups of m rows.  With a cache (kc/vc:
// B x H x cap x d), the m keys and values of group b are written at
// [starts[b], starts[b] + m) and row i attends to positions 0 .. starts[b] + i,
// or, with ``tree`` (B x m x m, [b][i][j] true where input j is input i or
// one of its ancestors in a draft tree), to 0 .. starts[b] - 1 and the
// inputs j that tree marks for i; without a cache, every row of a group
// attends to the group's m rows, except those key_pad (B x m, true =
// padding; may be null) marks.
void self_attention(Stream& s, int64_t B, int64_t m, const Packed& qkv, const Packed& out,
                    const torch::Tensor& ln_w, const torch::Tensor& ln_b, int64_t H, double scaling, float* kc,
                    float* vc, int64_t cap, const std::vector<int64_t>& starts, const bool* key_pad,
                    const bool* tree = nullptr) {
  const int64_t C = s.C, d = C / H;
  const bool cached = kc != nullptr;
  float* tmp = s.tmp.data();
  linear_raw(s.input(ln_w, ln_b), s.rows, C, qkv, 0, tmp, 3 * C);
  int64_t longest = m;
  if (cached)
    for (int64_t b = 0; b < B; ++b) {
      longest = std::max(longest, starts[b] + m);
      for (int64_t i = 0; i < m; ++i) {
        const float* r = tmp + (b * m + i) * 3 * C;
        for (int64_t hh = 0; hh < H; ++hh) {
          const int64_t at = ((b * H + hh) * cap + starts[b] + i) * d;
          std::memcpy(kc + at, r + C + hh * d, sizeof(float) * d);
          std::memcpy(vc + at, r + 2 * C + hh * d, sizeof(float) * d);
        }
      }
    }
  std::vector<float> q(static_cast<size_t>(d)), scores(static_cast<size_t>(longest));
  const float fscaling = static_cast<float>(scaling);
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t hh = 0; hh < H; ++hh) {
      const float* kh = cached ? kc + (b * H + hh) * cap * d : tmp + b * m * 3 * C + C + hh * d;
      const float* vh = cached ? vc + (b * H + hh) * cap * d : tmp + b * m * 3 * C + 2 * C + hh * d;
      const int64_t stride = cached ? d : 3 * C;
      const bool* pad = cached || key_pad == nullptr ? nullptr : key_pad + b * m;
      for (int64_t i = 0; i < m; ++i) {
        const float* r = tmp + (b * m + i) * 3 * C + hh * d;
        for (int64_t t = 0; t < d; ++t) q[t] = r[t] * fscaling;
        const int64_t L = cached ? starts[b] + i + 1 : m;
        const bool* seen = tree != nullptr && cached ? tree + (b * m + i) * m - starts[b] : nullptr;
        for (int64_t j = 0; j < L; ++j)
          scores[j] = (pad != nullptr && pad[j]) || (seen != nullptr && j >= starts[b] && !seen[j])
                          ? ninf
                          : dot(q.data(), kh + j * stride, d);
        softmax_inplace(scores.data(), L);
        weighted_values(scores.data(), vh, L, stride, d, s.attn.data() + (b * m + i) * C + hh * d);
      }
    }
  linear_raw(s.attn.data(), s.rows, C, out, 0, tmp, C);
  s.finish(ln_w, ln_b);
}

// The feed-forward sublayer, ReLU fused into the first product.
void feed_forward(Stream& s, const Packed& fc1, const Packed& fc2, int64_t F, const torch::Tensor& ln_w,
                  const torch::Tensor& ln_b) {
  std::vector<float> hidden(static_cast<size_t>(s.rows * F));
  linear_raw(s.input(ln_w, ln_b), s.rows, s.C, fc1, 1, hidden.data(), F);
  linear_raw(hidden.data(), s.rows, F, fc2, 0, s.tmp.data(), s.C);
  s.finish(ln_w, ln_b);
}

int64_t checked_heads(int64_t heads, int64_t C, const char* what) {
  TORCH_CHECK(heads > 0 && (C / heads) * heads == C, what, ": ", heads, " heads do not divide the model dimension ", C);
  return heads;
}

}  // namespace

// One Transformer decoder layer (ReLU FFN) over the m new tokens of every
// row, in place of its PyTorch operations: a fairseq TransformerDecoderLayer
// in the lean verify pass, or a drafter's block layer.  x: B x m x C.  With
// keys/values (B x heads x capacity x d), self-attention writes the m keys
// and values at positions [starts[b], starts[b] + m) and row b's input i
// attends to positions 0 .. starts[b] + i (with ``tree``, B x m x m bool, the
// positions before starts[b] and the inputs tree[b][i] marks: a draft tree's
// ancestors); without them it is bidirectional over the m rows of each b
// (no cache).  Encoder
// attention reads cross_keys/cross_values ((B * Hc) x S x dc) with enc_pad
// (B x S, true = padding; may be undefined).  Post-norm unless
// normalize_before.  starts: host ints (one per row with a cache, else
// none).  Returns the layer's output, B x m x C.
torch::Tensor decoder_layer(
    const torch::Tensor& x_in, const std::vector<int64_t>& starts_in,
    const torch::Tensor& qkv_w, const torch::Tensor& qkv_b, const torch::Tensor& sa_out_w, const torch::Tensor& sa_out_b,
    const torch::Tensor& sa_ln_w, const torch::Tensor& sa_ln_b, const c10::optional<torch::Tensor>& keys_opt,
    const c10::optional<torch::Tensor>& values_opt, int64_t heads, double scaling,
    const torch::Tensor& ca_q_w, const torch::Tensor& ca_q_b, const torch::Tensor& ca_out_w, const torch::Tensor& ca_out_b,
    const torch::Tensor& ca_ln_w, const torch::Tensor& ca_ln_b, const torch::Tensor& cross_keys,
    const torch::Tensor& cross_values, const c10::optional<torch::Tensor>& enc_pad, int64_t c_heads, double c_scaling,
    const torch::Tensor& fc1_w, const torch::Tensor& fc1_b, const torch::Tensor& fc2_w, const torch::Tensor& fc2_b,
    const torch::Tensor& final_ln_w, const torch::Tensor& final_ln_b, bool normalize_before, double eps,
    const c10::optional<torch::Tensor>& tree_opt) {
  TORCH_CHECK(cpu_supported(), "rowgemm: this CPU has no AVX2/FMA");
  TORCH_CHECK(x_in.dim() == 3 && x_in.scalar_type() == torch::kFloat && x_in.device().is_cpu(),
              "decoder_layer: x must be a B x m x C float32 CPU tensor");
  const int64_t B = x_in.size(0), m = x_in.size(1), C = x_in.size(2);
  const bool cached = keys_opt.has_value() && keys_opt->defined();
  const int64_t H = checked_heads(heads, C, "decoder_layer"), d = C / H;
  int64_t cap = 0;
  float* kc = nullptr;
  float* vc = nullptr;
  std::vector<int64_t> starts(static_cast<size_t>(B), 0);
  if (cached) {
    TORCH_CHECK(static_cast<int64_t>(starts_in.size()) == B, "decoder_layer: starts must hold one position per row (",
                B, "), not ", starts_in.size());
    const auto& keys = *keys_opt;
    TORCH_CHECK(values_opt.has_value() && values_opt->defined(), "decoder_layer: keys given without values");
    const auto& values = *values_opt;
    TORCH_CHECK(keys.dim() == 4 && keys.size(0) == B && keys.size(1) == H && keys.size(3) == d && keys.is_contiguous() &&
                    values.sizes() == keys.sizes() && values.is_contiguous() && keys.scalar_type() == torch::kFloat &&
                    values.scalar_type() == torch::kFloat,
                "decoder_layer: keys and values must be contiguous float32 B x heads x capacity x head_dim caches");
    cap = keys.size(2);
    kc = keys.data_ptr<float>();
    vc = values.data_ptr<float>();
    for (int64_t b = 0; b < B; ++b) {
      starts[b] = starts_in[b];
      TORCH_CHECK(starts[b] >= 0 && starts[b] + m <= cap, "decoder_layer: row ", b, " needs cache positions up to ",
                  starts[b] + m, ", capacity ", cap);
    }
  }
  TORCH_CHECK(cross_keys.dim() == 3 && cross_keys.size(0) == B * c_heads && cross_keys.is_contiguous() &&
                  cross_values.sizes() == cross_keys.sizes() && cross_values.is_contiguous(),
              "decoder_layer: cross keys/values must be contiguous (B * heads) x S x d");
  const int64_t S = cross_keys.size(1), dc = cross_keys.size(2);
  TORCH_CHECK(c_heads * dc == C, "decoder_layer: encoder attention heads x head_dim is not ", C);
  const bool* pad = nullptr;
  if (enc_pad.has_value() && enc_pad->defined()) {
    TORCH_CHECK(enc_pad->dim() == 2 && enc_pad->size(0) == B && enc_pad->size(1) == S && enc_pad->is_contiguous() &&
                    enc_pad->scalar_type() == torch::kBool,
                "decoder_layer: enc_pad must be a contiguous bool B x S tensor");
    pad = enc_pad->data_ptr<bool>();
  }
  const Packed qkv = packed_of(qkv_w, qkv_b, 3 * C, C), sa_out = packed_of(sa_out_w, sa_out_b, C, C);
  const Packed ca_q = packed_of(ca_q_w, ca_q_b, C, C), ca_out = packed_of(ca_out_w, ca_out_b, C, C);
  const int64_t F = in_features(fc2_w);
  const Packed fc1 = packed_of(fc1_w, fc1_b, F, C), fc2 = packed_of(fc2_w, fc2_b, C, F);
  check_vector(sa_ln_w, C, "sa_ln_w"); check_vector(sa_ln_b, C, "sa_ln_b");
  check_vector(ca_ln_w, C, "ca_ln_w"); check_vector(ca_ln_b, C, "ca_ln_b");
  check_vector(final_ln_w, C, "final_ln_w"); check_vector(final_ln_b, C, "final_ln_b");

  auto out = x_in.contiguous().clone();  // the residual stream, B*m x C
  Stream s(out.data_ptr<float>(), B * m, C, std::max<int64_t>(3 * C, F), normalize_before, eps);
  const bool* tree = nullptr;
  if (tree_opt.has_value() && tree_opt->defined()) {
    const auto& t = *tree_opt;
    TORCH_CHECK(cached, "decoder_layer: a draft tree needs the cache (keys and values)");
    TORCH_CHECK(t.dim() == 3 && t.size(0) == B && t.size(1) == m && t.size(2) == m && t.is_contiguous() &&
                    t.scalar_type() == torch::kBool && t.device().is_cpu(),
                "decoder_layer: tree must be a contiguous bool B x m x m CPU tensor");
    tree = t.data_ptr<bool>();
  }
  self_attention(s, B, m, qkv, sa_out, sa_ln_w, sa_ln_b, H, scaling, kc, vc, cap, starts, nullptr, tree);

  // encoder attention
  const float* in = s.input(ca_ln_w, ca_ln_b);
  linear_raw(in, s.rows, C, ca_q, 0, s.tmp.data(), C);
  std::vector<float> q(static_cast<size_t>(dc)), scores(static_cast<size_t>(S));
  const float fc_scaling = static_cast<float>(c_scaling);
  const float ninf = -std::numeric_limits<float>::infinity();
  const float* ck = cross_keys.data_ptr<float>();
  const float* cv = cross_values.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t hh = 0; hh < c_heads; ++hh) {
      const float* kh = ck + (b * c_heads + hh) * S * dc;
      const float* vh = cv + (b * c_heads + hh) * S * dc;
      for (int64_t i = 0; i < m; ++i) {
        const float* r = s.tmp.data() + (b * m + i) * C + hh * dc;
        for (int64_t t = 0; t < dc; ++t) q[t] = r[t] * fc_scaling;
        for (int64_t j = 0; j < S; ++j)
          scores[j] = (pad != nullptr && pad[b * S + j]) ? ninf : dot(q.data(), kh + j * dc, dc);
        softmax_inplace(scores.data(), S);
        weighted_values(scores.data(), vh, S, dc, dc, s.attn.data() + (b * m + i) * C + hh * dc);
      }
    }
  linear_raw(s.attn.data(), s.rows, C, ca_out, 0, s.tmp.data(), C);
  s.finish(ca_ln_w, ca_ln_b);

  feed_forward(s, fc1, fc2, F, final_ln_w, final_ln_b);
  return out.view({B, m, C});
}

// One Transformer encoder layer (ReLU FFN), in place of a fairseq
// TransformerEncoderLayer's operations: self-attention of each of the B
// sentences' S rows (x: B x S x C) over its own rows, except those key_pad
// (B x S, true = padding; may be undefined) marks, then the feed-forward.
// Post-norm unless normalize_before.  Returns B x S x C.
torch::Tensor encoder_layer(
    const torch::Tensor& x_in, const c10::optional<torch::Tensor>& key_pad,
    const torch::Tensor& qkv_w, const torch::Tensor& qkv_b, const torch::Tensor& sa_out_w, const torch::Tensor& sa_out_b,
    const torch::Tensor& sa_ln_w, const torch::Tensor& sa_ln_b, int64_t heads, double scaling,
    const torch::Tensor& fc1_w, const torch::Tensor& fc1_b, const torch::Tensor& fc2_w, const torch::Tensor& fc2_b,
    const torch::Tensor& final_ln_w, const torch::Tensor& final_ln_b, bool normalize_before, double eps) {
  TORCH_CHECK(cpu_supported(), "rowgemm: this CPU has no AVX2/FMA");
  TORCH_CHECK(x_in.dim() == 3 && x_in.scalar_type() == torch::kFloat && x_in.device().is_cpu(),
              "encoder_layer: x must be a B x S x C float32 CPU tensor");
  const int64_t B = x_in.size(0), S = x_in.size(1), C = x_in.size(2);
  const int64_t H = checked_heads(heads, C, "encoder_layer");
  const bool* pad = nullptr;
  if (key_pad.has_value() && key_pad->defined()) {
    TORCH_CHECK(key_pad->dim() == 2 && key_pad->size(0) == B && key_pad->size(1) == S && key_pad->is_contiguous() &&
                    key_pad->scalar_type() == torch::kBool,
                "encoder_layer: key_pad must be a contiguous bool B x S tensor");
    pad = key_pad->data_ptr<bool>();
  }
  const Packed qkv = packed_of(qkv_w, qkv_b, 3 * C, C), sa_out = packed_of(sa_out_w, sa_out_b, C, C);
  const int64_t F = in_features(fc2_w);
  const Packed fc1 = packed_of(fc1_w, fc1_b, F, C), fc2 = packed_of(fc2_w, fc2_b, C, F);
  check_vector(sa_ln_w, C, "sa_ln_w"); check_vector(sa_ln_b, C, "sa_ln_b");
  check_vector(final_ln_w, C, "final_ln_w"); check_vector(final_ln_b, C, "final_ln_b");

  auto out = x_in.contiguous().clone();
  Stream s(out.data_ptr<float>(), B * S, C, std::max<int64_t>(3 * C, F), normalize_before, eps);
  self_attention(s, B, S, qkv, sa_out, sa_ln_w, sa_ln_b, H, scaling, nullptr, nullptr, 0, {}, pad);
  feed_forward(s, fc1, fc2, F, final_ln_w, final_ln_b);
  return out.view({B, S, C});
}

// The input rows of a specdec_vsd drafting pass (decoding), in place of a
// dozen tensor operations: for each of the N rows, the context row
//     ctx = fuse([states[n]; scale * embed[tokens[n]]])   (a packed 2C -> C product)
// then its k slot rows base[n][min(cuts[n] + j, P - 1)] + offsets[j] + ctx,
// added in that order.  states: N x C; tokens, cuts: N (int64); embed: V x C;
// base: N x P x C; offsets: >= k x C.  Returns N x (1 + k) x C.
torch::Tensor block_input(const torch::Tensor& states, const torch::Tensor& tokens, const torch::Tensor& embed,
                          double scale, const torch::Tensor& fuse_w, const torch::Tensor& fuse_b,
                          const torch::Tensor& base, const torch::Tensor& cuts, const torch::Tensor& offsets, int64_t k) {
  TORCH_CHECK(cpu_supported(), "rowgemm: this CPU has no AVX2/FMA");
  auto is_f32 = [](const torch::Tensor& t, int64_t dims) {
    return t.dim() == dims && t.scalar_type() == torch::kFloat && t.device().is_cpu() && t.is_contiguous();
  };
  auto is_i64 = [](const torch::Tensor& t, int64_t n) {
    return t.dim() == 1 && t.size(0) == n && t.scalar_type() == torch::kLong && t.is_contiguous();
  };
  TORCH_CHECK(is_f32(states, 2) && is_f32(embed, 2) && is_f32(base, 3) && is_f32(offsets, 2),
              "block_input: states, embed, base and offsets must be contiguous float32 CPU tensors");
  const int64_t N = states.size(0), C = states.size(1), V = embed.size(0), P = base.size(1);
  TORCH_CHECK(embed.size(1) == C && base.size(0) == N && base.size(2) == C && P > 0 && offsets.size(1) == C &&
                  k >= 0 && offsets.size(0) >= k,
              "block_input: shapes do not agree (states N x C, embed V x C, base N x P x C, offsets >= k x C)");
  TORCH_CHECK(is_i64(tokens, N) && is_i64(cuts, N), "block_input: tokens and cuts must be contiguous int64 vectors of N");
  const Packed fuse = packed_of(fuse_w, fuse_b, C, 2 * C);
  const int64_t* tok = tokens.data_ptr<int64_t>();
  const int64_t* cut = cuts.data_ptr<int64_t>();
  std::vector<float> in(static_cast<size_t>(N * 2 * C)), ctx(static_cast<size_t>(N * C));
  const float* st = states.data_ptr<float>();
  const float* em = embed.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  for (int64_t n = 0; n < N; ++n) {
    TORCH_CHECK(tok[n] >= 0 && tok[n] < V, "block_input: token ", tok[n], " is outside the embedding of ", V);
    std::memcpy(in.data() + n * 2 * C, st + n * C, sizeof(float) * C);
    for (int64_t c = 0; c < C; ++c) in[n * 2 * C + C + c] = fscale * em[tok[n] * C + c];
  }
  linear_raw(in.data(), N, 2 * C, fuse, 0, ctx.data(), C);
  auto out = torch::empty({N, 1 + k, C}, states.options());
  float* o = out.data_ptr<float>();
  const float* bs = base.data_ptr<float>();
  const float* off = offsets.data_ptr<float>();
  for (int64_t n = 0; n < N; ++n) {
    const float* cn = ctx.data() + n * C;
    float* row = o + n * (1 + k) * C;
    std::memcpy(row, cn, sizeof(float) * C);
    for (int64_t j = 0; j < k; ++j) {
      const int64_t at = std::min<int64_t>(std::max<int64_t>(cut[n] + j, 0), P - 1);
      const float* b = bs + (n * P + at) * C;
      float* r = row + (1 + j) * C;
      for (int64_t c = 0; c < C; ++c) r[c] = (b[c] + off[j * C + c]) + cn[c];
    }
  }
  return out;
}

namespace {

// A verify pass's inputs, B x m x C float32: row b's slot j is
// scale * embed[tokens[b][j]] + pos_table[min(starts[b] + depth, P - 1)]
// (depth: depths[b][j], or j for a chain; no position term without a
// table), each as one float32 multiplication and one addition, the values
// of VerifyPass._embed's ATen operations (embedding, mul by the scale as a
// float, add).  Float32 contiguous tables are read directly, the product
// and the sum in separate loops so that no compiler contracts them into one
// rounding; other tables take the ATen operations themselves.
torch::Tensor pass_inputs(const torch::Tensor& tokens, const c10::optional<torch::Tensor>& depths,
                          const std::vector<int64_t>& starts, const torch::Tensor& embed_w, double embed_scale,
                          const c10::optional<torch::Tensor>& pos_table) {
  const int64_t B = tokens.size(0), m = tokens.size(1);
  const bool has_pos = pos_table.has_value() && pos_table->defined();
  const bool has_depths = depths.has_value() && depths->defined();
  const bool direct = tokens.device().is_cpu() && embed_w.device().is_cpu() && embed_w.dim() == 2 &&
                      embed_w.scalar_type() == torch::kFloat && embed_w.is_contiguous() &&
                      (!has_pos || (pos_table->dim() == 2 && pos_table->scalar_type() == torch::kFloat &&
                                    pos_table->is_contiguous() && pos_table->device().is_cpu() &&
                                    pos_table->size(1) == embed_w.size(1) && pos_table->size(0) > 0)) &&
                      (!has_depths || (depths->scalar_type() == torch::kLong && depths->dim() == 2 &&
                                       depths->size(0) == B && depths->size(1) == m && depths->device().is_cpu()));
  if (!direct) {
    torch::Tensor x = at::embedding(embed_w, tokens).mul(embed_scale);
    if (has_pos) {
      const torch::Tensor offsets = has_depths ? *depths : torch::arange(m, tokens.options());
      torch::Tensor index = torch::tensor(starts, tokens.options()).unsqueeze(1) + offsets;
      index = index.clamp_(c10::nullopt, pos_table->size(0) - 1);
      x = x + pos_table->index({index});
    }
    return x.to(torch::kFloat).contiguous();
  }
  const int64_t V = embed_w.size(0), C = embed_w.size(1);
  const torch::Tensor tk = tokens.contiguous();
  const torch::Tensor dp = has_depths ? depths->contiguous() : torch::Tensor();
  const int64_t* tp = tk.data_ptr<int64_t>();
  const int64_t* dd = has_depths ? dp.data_ptr<int64_t>() : nullptr;
  const float* ew = embed_w.data_ptr<float>();
  const float* pw = has_pos ? pos_table->data_ptr<float>() : nullptr;
  const int64_t P = has_pos ? pos_table->size(0) : 0;
  const float scale = static_cast<float>(embed_scale);
  torch::Tensor x = torch::empty({B, m, C}, embed_w.options());
  float* xp = x.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 0; j < m; ++j) {
      const int64_t token = tp[b * m + j];
      TORCH_CHECK(token >= 0 && token < V, "decoder_pass: token ", token, " is not in the embedding of ", V, " rows");
      const float* e = ew + token * C;
      float* out = xp + (b * m + j) * C;
      for (int64_t c = 0; c < C; ++c) out[c] = e[c] * scale;
      if (pw == nullptr) continue;
      const int64_t at = starts[b] + (dd != nullptr ? dd[b * m + j] : j);
      TORCH_CHECK(at >= 0, "decoder_pass: row ", b, " has a negative position");
      const float* p = pw + std::min(at, P - 1) * C;
      for (int64_t c = 0; c < C; ++c) out[c] += p[c];  // a second loop: never contracted into one FMA
    }
  return x;
}

}  // namespace

// The end of a pass from its final states x (... x C): the vocabulary
// projection, the temperature and the float32 log-softmax.  A row's values
// depend on that row alone, so states of several passes projected together
// give bitwise each pass's log-probs (screened greedy steps settle so).
torch::Tensor pass_log_probs(const torch::Tensor& x, const torch::Tensor& out_packed, int64_t vocab,
                             const c10::optional<torch::Tensor>& out_bias, double temperature) {
  torch::Tensor logits = linear(x, out_packed, vocab, out_bias, 0);
  if (temperature != 1.0) logits = logits.div_(temperature);
  return at::log_softmax(logits, -1, torch::kFloat);
}

// A whole verify pass of the decoder in one call, for the fused path of
// LeanVerifier.forward (lean_verifier.py), which decides when it applies: the
// new tokens' inputs, every layer (decoder_layer), the optional final layer
// norm, the vocabulary projection (linear) and the log-softmax.  The same
// computation as that path's Python, operation for operation: the inputs
// through the same ATen operations (embedding, the scale, the position rows
// added), the final norm through at::layer_norm and the log-probs through
// at::log_softmax in float32 as fairseq's get_normalized_probs, so the
// result is bitwise that of the Python path; only the Python between the
// calls is gone.
//
// tokens, depths: B x m int64 (depths: a draft tree's node depths, or
// undefined for a chain: slot j at depth j); starts: B int64, each row's
// first new position (its length) on the host; layers: per layer its 18
// tensors in decoder_layer's order (qkv w/b, sa_out w/b, sa_ln w/b, ca_q w/b,
// ca_out w/b, ca_ln w/b, fc1 w/b, fc2 w/b, final_ln w/b) and its 6 scalars
// (heads, scaling, c_heads, c_scaling, normalize_before, eps); keys, values,
// cross_keys, cross_values: per layer.  Returns (log-probs B x m x V float32,
// the last layer's output after the final norm, B x m x C).
std::tuple<torch::Tensor, torch::Tensor> decoder_pass(
    const torch::Tensor& tokens, const c10::optional<torch::Tensor>& depths, const std::vector<int64_t>& starts,
    const torch::Tensor& embed_w, double embed_scale, const c10::optional<torch::Tensor>& pos_table,
    const std::vector<torch::Tensor>& layers, const std::vector<double>& scalars,
    const std::vector<torch::Tensor>& keys, const std::vector<torch::Tensor>& values,
    const std::vector<torch::Tensor>& cross_keys, const std::vector<torch::Tensor>& cross_values,
    const c10::optional<torch::Tensor>& enc_pad, const c10::optional<torch::Tensor>& tree,
    const c10::optional<torch::Tensor>& final_ln_w, const c10::optional<torch::Tensor>& final_ln_b, double final_eps,
    const torch::Tensor& out_packed, int64_t vocab, const c10::optional<torch::Tensor>& out_bias, double temperature,
    bool project) {
  constexpr size_t kTensors = 18, kScalars = 6;
  const size_t L = keys.size();
  TORCH_CHECK(layers.size() == L * kTensors && scalars.size() == L * kScalars && values.size() == L &&
                  cross_keys.size() == L && cross_values.size() == L,
              "decoder_pass: ", L, " layers need ", kTensors, " tensors, ", kScalars,
              " scalars, keys, values and encoder keys and values each");
  TORCH_CHECK(tokens.dim() == 2 && tokens.scalar_type() == torch::kLong, "decoder_pass: tokens must be B x m int64");
  const int64_t B = tokens.size(0);
  TORCH_CHECK(static_cast<int64_t>(starts.size()) == B, "decoder_pass: starts must hold one position per row (", B,
              "), not ", starts.size());
  torch::Tensor x = pass_inputs(tokens, depths, starts, embed_w, embed_scale, pos_table);
  for (size_t l = 0; l < L; ++l) {
    const torch::Tensor* t = layers.data() + l * kTensors;
    const double* s = scalars.data() + l * kScalars;
    x = decoder_layer(x, starts, t[0], t[1], t[2], t[3], t[4], t[5], keys[l], values[l],
                      static_cast<int64_t>(s[0]), s[1], t[6], t[7], t[8], t[9], t[10], t[11], cross_keys[l],
                      cross_values[l], enc_pad, static_cast<int64_t>(s[2]), s[3], t[12], t[13], t[14], t[15],
                      t[16], t[17], s[4] != 0.0, s[5], tree);
  }
  if (final_ln_w.has_value() && final_ln_w->defined())
    x = at::layer_norm(x, {x.size(-1)}, *final_ln_w, *final_ln_b, final_eps);
  if (!project) return {torch::Tensor(), x};
  return {pass_log_probs(x, out_packed, vocab, out_bias, temperature), x};
}

// screen_greedy's first sweep: e[n] = alpha s[n] + beta l1[n] + rel (|a[n]| + |b[n]|) for every
// column, tau = max(a - e), top = max(a + e), 8 columns a vector (the float32 operations of the
// scalar tail, lane by lane)
#ifdef ROWGEMM_X86
__attribute__((target("avx2,fma"))) static void screen_bounds(const float* a, const float* sc, const float* l1,
                                                       const float* b, int64_t V, float alpha, float beta, float rel,
                                                       float* e, float* tau_out, float* top_out) {
  const __m256 va = _mm256_set1_ps(alpha), vb = _mm256_set1_ps(beta), vr = _mm256_set1_ps(rel);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 tau = _mm256_set1_ps(-std::numeric_limits<float>::infinity()), top = tau;
  int64_t n = 0;
  for (; n + kLanes <= V; n += kLanes) {
    const __m256 an = _mm256_loadu_ps(a + n);
    __m256 mag = _mm256_andnot_ps(sign, an);
    if (b != nullptr) mag = _mm256_add_ps(mag, _mm256_andnot_ps(sign, _mm256_loadu_ps(b + n)));
    const __m256 en = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(va, _mm256_loadu_ps(sc + n)),
                                                  _mm256_mul_ps(vb, _mm256_loadu_ps(l1 + n))),
                                    _mm256_mul_ps(vr, mag));
    _mm256_storeu_ps(e + n, en);
    tau = _mm256_max_ps(_mm256_sub_ps(an, en), tau);
    top = _mm256_max_ps(_mm256_add_ps(an, en), top);
  }
  alignas(32) float lanes[2][kLanes];
  _mm256_store_ps(lanes[0], tau);
  _mm256_store_ps(lanes[1], top);
  float t = lanes[0][0], u = lanes[1][0];
  for (int i = 1; i < kLanes; ++i) t = std::max(t, lanes[0][i]), u = std::max(u, lanes[1][i]);
  for (; n < V; ++n) {
    const float mag = std::fabs(a[n]) + (b != nullptr ? std::fabs(b[n]) : 0.0f);
    e[n] = (alpha * sc[n] + beta * l1[n]) + rel * mag;
    t = std::max(t, a[n] - e[n]);
    u = std::max(u, a[n] + e[n]);
  }
  *tau_out = t;
  *top_out = u;
}

// screen_greedy's second sweep: the columns with a[n] + e[n] >= tau (in order) into ``out``, and
// the largest a[n] + e[n] of the others (NaN, pad's, is neither)
__attribute__((target("avx2,fma"))) static float screen_candidates(const float* a, const float* e, int64_t V,
                                                                   float tau, std::vector<int64_t>* out) {
  const __m256 vt = _mm256_set1_ps(tau);
  __m256 rest = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  float r = -std::numeric_limits<float>::infinity();
  int64_t n = 0;
  for (; n + kLanes <= V; n += kLanes) {
    const __m256 hi = _mm256_add_ps(_mm256_loadu_ps(a + n), _mm256_loadu_ps(e + n));
    const int mask = _mm256_movemask_ps(_mm256_cmp_ps(hi, vt, _CMP_GE_OQ));
    if (mask == 0) {
      rest = _mm256_max_ps(hi, rest);
      continue;
    }
    for (int i = 0; i < kLanes; ++i) {
      const float h = a[n + i] + e[n + i];
      if (mask & (1 << i)) out->push_back(n + i);
      else r = std::max(r, h);
    }
  }
  for (; n < V; ++n) {
    const float h = a[n] + e[n];
    if (h >= tau) out->push_back(n);
    else r = std::max(r, h);
  }
  alignas(32) float lanes[kLanes];
  _mm256_store_ps(lanes, rest);
  for (int i = 0; i < kLanes; ++i) r = std::max(r, lanes[i]);
  return r;
}
#endif

#ifdef ROWGEMM_X86
namespace {

// screen_greedy for one row: x (K floats), a (its int8 estimates, V + padding), the rest as screen_greedy.
// Returns (the column or -1, lp_bound).
std::tuple<int64_t, double> screen_row(const float* xs, int64_t K, float* a, int64_t V, const float* w,
                                       const float* b, const float* sc, const float* l1p, int64_t pad, int64_t ban,
                                       double temperature, double cum_bound, std::vector<float>& e,
                                       std::vector<int64_t>& candidates) {
  float amax = 0.0f;
  double xl1 = 0.0;
  for (int64_t k = 0; k < K; ++k) {
    if (!std::isfinite(xs[k])) return {-1, 0.0};
    amax = std::max(amax, std::fabs(xs[k]));
    xl1 += std::fabs(xs[k]);
  }
  const double sx = static_cast<double>(amax) / static_cast<double>(int16_scale_max(K));
  // e[n] = alpha s[n] + beta l1[n] + rel (|a[n]| + |b[n]|), the formula above regrouped, its float32
  // evaluation covered by the factor (1 + 2^-10)
  const double grow = 1.0 + std::ldexp(1.0, -10), rel = static_cast<double>(K + 8) * std::ldexp(1.0, -23);
  const float alpha = static_cast<float>((xl1 / 2 + sx * K / 4) * grow * grow);
  const float beta = static_cast<float>((sx / 2 * grow + rel * amax) * grow);
  const float relf = static_cast<float>(rel * grow);
  // pad is never a candidate: a[pad] = -inf makes e[pad] = inf, a - e = -inf and a + e = NaN, which
  // _mm256_max_ps(x, acc) and std::max(acc, x) pass over (they return acc when x is NaN) and no
  // comparison admits; nor is ``ban`` (a column the length rules forbid at this step), the same way
  a[pad] = -std::numeric_limits<float>::infinity();
  if (ban >= 0) a[ban] = -std::numeric_limits<float>::infinity();
  float tau, top;
  screen_bounds(a, sc, l1p, b, V, alpha, beta, relf, e.data(), &tau, &top);
  if (!std::isfinite(tau) || !std::isfinite(top)) return {-1, 0.0};
  // the candidates' exact values: each candidate's panel through the kernel's own one-row block
  // (its 8 columns, bitwise the products' values); ``rest``: the largest bound of the others
  candidates.clear();
  const float rest = screen_candidates(a, e.data(), V, tau, &candidates);
  int64_t best = -1, done_panel = -1;
  float tbest = 0.0f, tsecond = -std::numeric_limits<float>::infinity();
  alignas(32) float panel_out[kLanes];
  for (const int64_t n : candidates) {
    const int64_t p = n / kLanes;
    if (p != done_panel) {
      rows_block<1, float>(1, xs, K, w + p * K * kLanes, K * kLanes, b != nullptr ? b + p * kLanes : nullptr, 0,
                           panel_out, kLanes, kLanes, nullptr);
      done_panel = p;
    }
    const float t = panel_out[n % kLanes];
    if (!std::isfinite(t)) return {-1, 0.0};
    if (best < 0 || t > tbest) {
      if (best >= 0) tsecond = tbest;
      best = n;
      tbest = t;
    } else {
      tsecond = std::max(tsecond, t);
    }
  }
  if (best < 0) return {-1, 0.0};
  const double T = temperature, lp_bound = top / T + std::log(static_cast<double>(V)) - tbest / T;
  const double margin = std::ldexp(1.0, -14) * (16.0 + std::fabs(tbest) / T + std::fabs(lp_bound) + std::fabs(top) / T +
                                                 cum_bound) * T;
  const double gap = static_cast<double>(tbest) - std::max<double>(tsecond, rest);
  if (!(gap > margin)) return {-1, 0.0};
  return {best, lp_bound};
}

}  // namespace
#endif

// The greedy pick of each row of final states x (B x K) over the
// vocabulary without the float32 product of every column (GreedyScreen in
// rowgemm.py): the int8 copy of the projection (w8, pack_i8) gives every
// column an estimate a[n] and a bound e[n] on |t[n] - a[n]|, t[n] the value
// the float32 panels (w32) give (the products' contract).  With
// Q = the int8 kernel's 16-bit scale, sx = max|x| / Q, s[n] the row's int8
// scale, l1[n] = sum_k |W[n][k]| (rounded up):
//   e[n] = (s[n] / 2 |x|_1 + (sx / 2) (l1[n] + K s[n] / 2)) (1 + 2^-10)
//          + (K + 8) 2^-23 (max|x| l1[n] + |a[n]| + |b[n]|)
// (the int8 weight's and the 16-bit input's rounding, then every float32
// rounding of both products, doubled).  Every column but ``pad`` (and the
// row's ban) with
// a[n] + e[n] >= tau = max over them of a[n] - e[n] gets its exact t[n]
// (its panel through the products' own one-row block: bitwise the value the
// products give); every other column is below tau, and tau is at most the
// best exact value.  The pick is certified when the
// best exact value exceeds every other candidate's and every other
// column's bound a[n] + e[n] by more than 2^-14 (16 + |t| / T + (max(a + e)
// / T + log V) + cum_bound) times the temperature T: then no float32
// rounding of the log-softmax or of a running score up to ``cum_bound`` in
// magnitude can tie it with another column or put one above it.  Returns
// (the column, or -1 where not certified or x is not finite; lp_bound =
// max(a + e) / T + log V - t / T, at least the magnitude of the pick's
// log-prob), per row: two lists of B.  The int8 estimates of all B rows
// come from one product (each weight read once); each row's estimate,
// bound and pick depend on that row alone (its own 16-bit scale), so a
// row's result is the one it gets screened alone.  ``cum_bounds``: one per
// row.  ``bans``: one per row, a column the length rules forbid in this
// step (EOS before --min-len), never picked and no competitor (as ``pad``),
// or -1.  ``scales``: the int8 rows' scales, pack_i8_scales(w8).
std::tuple<std::vector<int64_t>, std::vector<double>> screen_greedy(
    const torch::Tensor& x_in, const torch::Tensor& w8, const torch::Tensor& w32, int64_t vocab,
    const c10::optional<torch::Tensor>& bias, const torch::Tensor& scales, const torch::Tensor& l1, int64_t pad,
    double temperature, const std::vector<double>& cum_bounds, const std::vector<int64_t>& bans) {
#ifdef ROWGEMM_X86
  auto x = x_in.contiguous();
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.dim() == 2, "screen_greedy: x must be B x K float32 rows");
  const int64_t B = x.size(0), K = x.size(1), V = vocab;
  TORCH_CHECK(static_cast<int64_t>(cum_bounds.size()) == B, "screen_greedy: one cum_bound per row (", B,
              "), not ", cum_bounds.size());
  TORCH_CHECK(static_cast<int64_t>(bans.size()) == B, "screen_greedy: one ban per row (", B, "), not ", bans.size());
  for (const int64_t ban : bans) TORCH_CHECK(ban >= -1 && ban < vocab, "screen_greedy: ban ", ban, " is not a column");
  TORCH_CHECK(w8.scalar_type() == torch::kChar && w8.size(1) == K + kScaleRows, "screen_greedy: w8 is not int8 panels of K ", K);
  check_packed(w32, V);
  check_packed(w8, V);
  TORCH_CHECK(w32.scalar_type() == torch::kFloat, "screen_greedy: w32 must be float32 panels");
  TORCH_CHECK(w32.size(1) == K, "screen_greedy: w32 has K ", w32.size(1), ", x has ", K);
  TORCH_CHECK(scales.numel() == V && l1.numel() == V, "screen_greedy: scales and l1 need one value per column");
  TORCH_CHECK(pad >= 0 && pad < V, "screen_greedy: pad ", pad, " is not a column of ", V);
  const float* xs = x.data_ptr<float>();
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() >= V, "screen_greedy: the bias has fewer than ", V, " values");
    b = bias->data_ptr<float>();
  }
  const int64_t lda = w8.size(0) * kLanes;
  std::vector<float> a(static_cast<size_t>(B * lda));
  if (B > 0) linear_raw_i8(xs, B, K, w8.data_ptr<int8_t>(), w8.size(0), b, 0, a.data(), V, lda);
  std::vector<float> e(static_cast<size_t>(V));
  std::vector<int64_t> candidates, columns(static_cast<size_t>(B));
  std::vector<double> bounds(static_cast<size_t>(B));
  for (int64_t r = 0; r < B; ++r)
    std::tie(columns[r], bounds[r]) = screen_row(xs + r * K, K, a.data() + r * lda, V, w32.data_ptr<float>(), b,
                                                 scales.data_ptr<float>(), l1.data_ptr<float>(), pad, bans[r], temperature,
                                                 cum_bounds[r], e, candidates);
  return {columns, bounds};
#else
  TORCH_CHECK(false, "rowgemm: built without x86-64 support");
#endif
}

// A self-drafter's greedy steps in one call (SelfDrafter.propose's native
// path, self_draft.py), in place of its Python loop, which computes the same:
// from each row's log-probs of its newest token (first: B x V), each step
// picks every row's best type other than ``pad`` (torch's max over the row
// with pad at -inf: the first largest, a NaN before any number) and its
// log-prob; a row stays sure while each pick is at least log_min_conf and
// not ``eos``; the steps end after k picks, or once no row is sure, else
// every row's pick is fed as one new token at position starts[r] + s + 1
// (s: the step) through decoder_pass with the remaining arguments, which
// writes the caches (their capacity must hold max(starts) + k positions).
// Returns (picks B x steps int64, their log-probs B x steps float32, the
// features of the last decoder_pass, or an undefined tensor if none ran).
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> decoder_steps(
    const torch::Tensor& first, int64_t k, int64_t pad, int64_t eos, double log_min_conf,
    const std::vector<int64_t>& starts, const torch::Tensor& embed_w, double embed_scale,
    const c10::optional<torch::Tensor>& pos_table, const std::vector<torch::Tensor>& layers,
    const std::vector<double>& scalars, const std::vector<torch::Tensor>& keys,
    const std::vector<torch::Tensor>& values, const std::vector<torch::Tensor>& cross_keys,
    const std::vector<torch::Tensor>& cross_values, const c10::optional<torch::Tensor>& enc_pad,
    const c10::optional<torch::Tensor>& final_ln_w, const c10::optional<torch::Tensor>& final_ln_b,
    double final_eps, const torch::Tensor& out_packed, int64_t vocab, const c10::optional<torch::Tensor>& out_bias,
    double temperature) {
  TORCH_CHECK(k >= 1, "decoder_steps: k must be at least 1, got ", k);
  TORCH_CHECK(first.dim() == 2 && first.scalar_type() == torch::kFloat && first.device().is_cpu(),
              "decoder_steps: first must be B x V float32 log-probs on the CPU");
  const int64_t B = first.size(0), V = first.size(1);
  TORCH_CHECK(static_cast<int64_t>(starts.size()) == B, "decoder_steps: starts must hold one position per row (", B,
              "), not ", starts.size());
  const float lo = static_cast<float>(log_min_conf);
  auto picks = torch::empty({B, k}, first.options().dtype(torch::kLong));
  auto scores = torch::empty({B, k}, first.options());
  int64_t* pk = picks.data_ptr<int64_t>();
  float* sc = scores.data_ptr<float>();
  std::vector<char> sure(static_cast<size_t>(B), 1);
  torch::Tensor lprobs = first.contiguous(), features, token = torch::empty({B, 1}, picks.options());
  std::vector<int64_t> at(starts);
  int64_t steps = 0;
  for (int64_t s = 0; s < k; ++s) {
    const float* lp = lprobs.data_ptr<float>();
    bool any = false;
    for (int64_t b = 0; b < B; ++b) {
      const float* row = lp + b * V;
      int64_t arg = -1;
      float best = 0.0f;
      for (int64_t j = 0; j < V; ++j) {
        const float v = j == pad ? -std::numeric_limits<float>::infinity() : row[j];
        if (arg < 0 || v > best || (std::isnan(v) && !std::isnan(best))) arg = j, best = v;
      }
      pk[b * k + s] = arg;
      sc[b * k + s] = best;
      token.data_ptr<int64_t>()[b] = arg;
      sure[b] = sure[b] && best >= lo && arg != eos;
      any = any || sure[b];
    }
    steps = s + 1;
    if (s == k - 1 || !any) break;
    for (int64_t b = 0; b < B; ++b) at[b] = starts[b] + s + 1;
    auto out = decoder_pass(token, c10::nullopt, at, embed_w, embed_scale, pos_table, layers, scalars, keys, values,
                            cross_keys, cross_values, enc_pad, c10::nullopt, final_ln_w, final_ln_b, final_eps,
                            out_packed, vocab, out_bias, temperature, true);
    TORCH_CHECK(std::get<0>(out).size(2) == V, "decoder_steps: the pass's vocabulary (", std::get<0>(out).size(2),
                ") is not first's (", V, ")");
    lprobs = std::get<0>(out).select(1, 0).contiguous();
    features = std::get<1>(out);
  }
  return {picks.narrow(1, 0, steps).contiguous(), scores.narrow(1, 0, steps).contiguous(), features};
}

// The verifier's greedy steps in one call (ScreenedGreedy's run, screened_greedy.py), in place of one
// loop iteration per step, which computes the same: from each row's newest token (tokens: B x 1, at
// position starts[r]), a step is decoder_pass without its projection (project false: the caches written
// as by it), then screen_greedy's certified pick of every row from its final states (EOS banned while the
// row's length starts[r] + s is below min_len, as fairseq's rule), each pick fed as the row's next token
// at starts[r] + s + 1.  The steps end after n certified steps, after a step in which any row picked eos,
// or at a step in which any row's pick is not certified (that step's states are returned, its picks are
// not, and its cache entries are scratch past the rows' lengths).  The caches' capacity must hold
// max(starts) + n positions.  cum_bounds: each row's bound on the magnitude of its running score, grown
// by each certified pick's lp_bound (screen_greedy's).  Returns (picks B x s int64, the grown cum_bounds,
// the final states of every pass B x t x C: t = s, or s + 1 where the last pass's picks were not
// certified).  A row's picks depend on that row alone, as each call's.
std::tuple<torch::Tensor, std::vector<double>, torch::Tensor> screened_greedy_steps(
    const torch::Tensor& tokens, int64_t n, int64_t pad, int64_t eos, int64_t min_len,
    const std::vector<int64_t>& starts, std::vector<double> cum_bounds, const torch::Tensor& embed_w,
    double embed_scale, const c10::optional<torch::Tensor>& pos_table, const std::vector<torch::Tensor>& layers,
    const std::vector<double>& scalars, const std::vector<torch::Tensor>& keys,
    const std::vector<torch::Tensor>& values, const std::vector<torch::Tensor>& cross_keys,
    const std::vector<torch::Tensor>& cross_values, const c10::optional<torch::Tensor>& enc_pad,
    const c10::optional<torch::Tensor>& final_ln_w, const c10::optional<torch::Tensor>& final_ln_b,
    double final_eps, const torch::Tensor& out_packed, int64_t vocab, const c10::optional<torch::Tensor>& out_bias,
    const torch::Tensor& w8, const torch::Tensor& scales, const torch::Tensor& l1, double temperature) {
  TORCH_CHECK(n >= 1, "screened_greedy_steps: n must be at least 1, got ", n);
  TORCH_CHECK(tokens.dim() == 2 && tokens.size(1) == 1 && tokens.scalar_type() == torch::kLong &&
                  tokens.device().is_cpu(),
              "screened_greedy_steps: tokens must be B x 1 int64 on the CPU");
  const int64_t B = tokens.size(0);
  TORCH_CHECK(B >= 1, "screened_greedy_steps: no rows");
  TORCH_CHECK(static_cast<int64_t>(starts.size()) == B && static_cast<int64_t>(cum_bounds.size()) == B,
              "screened_greedy_steps: starts and cum_bounds must hold one value per row (", B, "), not ", starts.size(),
              " and ", cum_bounds.size());
  TORCH_CHECK(eos >= 0 && eos < vocab, "screened_greedy_steps: eos ", eos, " is not a column of ", vocab);
  auto picks = torch::empty({B, n}, tokens.options());
  int64_t* pk = picks.data_ptr<int64_t>();
  torch::Tensor token = tokens.contiguous().clone();
  int64_t* tp = token.data_ptr<int64_t>();
  std::vector<torch::Tensor> states;
  std::vector<int64_t> at(starts), bans(static_cast<size_t>(B));
  int64_t s = 0;
  for (; s < n; ++s) {
    for (int64_t b = 0; b < B; ++b) {
      at[b] = starts[b] + s;
      bans[b] = at[b] < min_len ? eos : -1;
    }
    auto out = decoder_pass(token, c10::nullopt, at, embed_w, embed_scale, pos_table, layers, scalars, keys, values,
                            cross_keys, cross_values, enc_pad, c10::nullopt, final_ln_w, final_ln_b, final_eps,
                            out_packed, vocab, out_bias, temperature, false);
    const torch::Tensor x = std::get<1>(out);  // B x 1 x C
    states.push_back(x);
    const auto screened = screen_greedy(x.view({B, x.size(2)}), w8, out_packed, vocab, out_bias, scales, l1, pad,
                                        temperature, cum_bounds, bans);
    const std::vector<int64_t>& columns = std::get<0>(screened);
    const std::vector<double>& bounds = std::get<1>(screened);
    if (*std::min_element(columns.begin(), columns.end()) < 0) break;
    bool ended = false;
    for (int64_t b = 0; b < B; ++b) {
      pk[b * n + s] = tp[b] = columns[b];
      cum_bounds[b] += bounds[b];
      ended = ended || columns[b] == eos;
    }
    if (ended) {
      ++s;
      break;
    }
  }
  return {picks.narrow(1, 0, s).contiguous(), cum_bounds, torch::cat(states, 1)};
}

namespace {

#ifdef ROWGEMM_X86
// exp of 8 floats (Cephes' polynomial, as in avx_mathfun): relative error
// about 2e-7 over [-88, 88]; inputs below -88.38 (-inf included) give
// about 0, never a NaN
__attribute__((target("avx2,fma"))) inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f));
  x = _mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f));
  __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
  fx = _mm256_floor_ps(fx);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  const __m256 z = _mm256_mul_ps(x, x);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
  y = _mm256_fmadd_ps(y, z, _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  __m256i n = _mm256_cvttps_epi32(fx);
  n = _mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(0x7f)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(n));
}

// sum over j of exp(v[j] - mx)
__attribute__((target("avx2,fma"))) float sum_exp(const float* v, int64_t n, float mx) {
  const __m256 m8 = _mm256_set1_ps(mx);
  __m256 acc = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) acc = _mm256_add_ps(acc, exp8(_mm256_sub_ps(_mm256_loadu_ps(v + j), m8)));
  alignas(32) float lanes[kLanes];
  _mm256_store_ps(lanes, acc);
  float sum = 0.0f;
  for (int t = 0; t < kLanes; ++t) sum += lanes[t];
  if (j < n) {
    alignas(32) float rest[kLanes];
    for (int t = 0; t < kLanes; ++t) rest[t] = j + t < n ? v[j + t] : -std::numeric_limits<float>::infinity();
    _mm256_store_ps(lanes, exp8(_mm256_sub_ps(_mm256_load_ps(rest), m8)));
    for (int t = 0; t < kLanes && j + t < n; ++t) sum += lanes[t];
  }
  return sum;
}
#endif

}  // namespace

// A drafter's pick per row from its output projection, in place of the
// projection's products, the bias, log_softmax and max: for each of the M
// rows of states (M x C), the logits over the N = n_base + E types
//     logits[j] = (states . W_j) + bias[j]
// (W_j: the packed panels' column j for j < n_base, else column j - n_base
// of extra_t, C x E, a product summed over C in order), then the best type
// (the first largest logit) and its log-probability -log(sum_j exp(logits[j]
// - max)) (a vectorized exp of relative error about 2e-7; a bias of -inf
// never wins).  Returns (best: M int64, log-prob: M float32).
std::tuple<torch::Tensor, torch::Tensor> draft_pick(const torch::Tensor& states, const torch::Tensor& packed,
                                                    int64_t n_base, const c10::optional<torch::Tensor>& extra_t,
                                                    const torch::Tensor& bias) {
  TORCH_CHECK(cpu_supported(), "rowgemm: this CPU has no AVX2/FMA");
  TORCH_CHECK(states.dim() == 2 && states.scalar_type() == torch::kFloat && states.device().is_cpu() &&
                  states.is_contiguous(),
              "draft_pick: states must be a contiguous M x C float32 CPU tensor");
  check_packed(packed, n_base);
  const int64_t M = states.size(0), C = states.size(1);
  TORCH_CHECK(in_features(packed) == C, "draft_pick: the packed weight has ", in_features(packed), " input features, states ", C);
  int64_t E = 0;
  const float* ex = nullptr;
  if (extra_t.has_value() && extra_t->defined()) {
    TORCH_CHECK(extra_t->dim() == 2 && extra_t->size(0) == C && extra_t->scalar_type() == torch::kFloat &&
                    extra_t->is_contiguous() && extra_t->device().is_cpu(),
                "draft_pick: extra_t must be a contiguous C x E float32 CPU tensor");
    E = extra_t->size(1);
    ex = extra_t->data_ptr<float>();
  }
  const int64_t N = n_base + E;
  TORCH_CHECK(N > 0 && bias.dim() == 1 && bias.size(0) == N && bias.scalar_type() == torch::kFloat &&
                  bias.is_contiguous() && bias.device().is_cpu(),
              "draft_pick: bias must be a contiguous float32 CPU vector of n_base + E = ", N);
  auto best = torch::empty({M}, states.options().dtype(torch::kLong));
  auto lprob = torch::empty({M}, states.options());
  if (M == 0) return {best, lprob};
  std::vector<float> logits(static_cast<size_t>(M * N));
  const float* x = states.data_ptr<float>();
  linear_packed(x, M, C, packed, nullptr, 0, logits.data(), n_base, N);
  const float* b = bias.data_ptr<float>();
  int64_t* bo = best.data_ptr<int64_t>();
  float* lo = lprob.data_ptr<float>();
  for (int64_t i = 0; i < M; ++i) {
    float* row = logits.data() + i * N;
    if (E > 0) {
      float* out = row + n_base;
      std::fill(out, out + E, 0.0f);
      for (int64_t c = 0; c < C; ++c) {
        const float xc = x[i * C + c];
        const float* w = ex + c * E;
        for (int64_t e = 0; e < E; ++e) out[e] += xc * w[e];
      }
    }
    int64_t arg = 0;
    for (int64_t j = 0; j < N; ++j) {
      row[j] += b[j];
      if (row[j] > row[arg]) arg = j;
    }
    const float mx = row[arg];
#ifdef ROWGEMM_X86
    const float sum = sum_exp(row, N, mx);
#else
    float sum = 0.0f;
    for (int64_t j = 0; j < N; ++j) sum += std::exp(row[j] - mx);
#endif
    bo[i] = arg;
    lo[i] = -std::log(sum);
  }
  return {best, lprob};
}

// csrc/step.cpp: the tail of a strict speculative iteration in one call
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, bool> strict_step(
    const at::Tensor& lprobs, const at::Tensor& drafts, const at::Tensor& cum, const at::Tensor& lengths,
    const std::vector<int64_t>& drafted, int64_t pad, int64_t eos, int64_t min_len, int64_t max_len,
    const c10::optional<at::Tensor>& parents, bool relaxed, int64_t beta, double tau);

// csrc/step.cpp: a draft tree's accepted cache entries moved into place
void move_cache_entries(const std::vector<at::Tensor>& caches, const at::Tensor& rows, const at::Tensor& src,
                        const at::Tensor& dst);

// csrc/step.cpp: the loop's commit of an iteration's tokens into the decoding state
std::tuple<at::Tensor, at::Tensor> append_rows(at::Tensor& tokens, at::Tensor& pos_scores, const at::Tensor& lengths,
                                               const at::Tensor& new_tokens, const at::Tensor& new_lprobs,
                                               const at::Tensor& n_new);

// csrc/step.cpp: the rows kept after some finished, moved up in place
void compact_rows(const std::vector<at::Tensor>& tensors, const std::vector<int64_t>& order, int64_t width);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Row-blocked float32 products (y = x W^T + b) for few-row verify passes";
  m.def("supported", &supported, "whether this CPU runs the kernel (AVX2 and FMA)");
  m.def("has_avx512", &cpu_has_avx512, "whether this CPU (and its OS) runs the AVX-512 blocks");
  m.def("isa", &isa, "the instruction set the products run on here: avx512, avx2, avx512-emulated, none, or mixed "
        "(it differs by the calls' rows: isa_for_rows)");
  m.def("isa_for_rows", &isa_for_rows, "the instruction set of a product of m rows");
  m.def("isa_classes", &isa_classes, "the first row count of each class of calls with an instruction set of its own");
  m.def("set_isa_for_rows", &set_isa_for_rows,
        "choose the instruction set of the class of calls starting at first_rows (avx2, avx512, avx512-emulated); returns it");
  m.def("prefetch_for_rows", &prefetch_for_rows,
        "whether the float32 and bfloat16 products of m rows prefetch the next block of panels");
  m.def("set_prefetch_for_rows", &set_prefetch_for_rows,
        "whether the float32 and bfloat16 products of the class starting at first_rows prefetch (bitwise the same products)");
  m.def("select_isa", &select_isa,
        "choose the products' instruction set for every call (avx2, avx512, avx512-emulated); returns it");
  m.def("fma_rounds", &fma_rounds,
        "iters rounds of 16 register-only fused multiply-adds of 8 (avx2) or 16 (avx512) lanes: the arithmetic peak");
  m.def("pack", &pack, "pack an N x K weight into [ceil(N/8)][K][8] panels");
  m.def("pack_bf16", &pack_bf16, "pack an N x K weight into [ceil(N/8)][K][8] bfloat16 panels (rounded to nearest even)");
  m.def("pack_i8", &pack_i8, "pack an N x K weight into [ceil(N/8)][K + 4][8] int8 panels, each with its 8 row scales");
  m.def("pack_i8_scales", &pack_i8_scales, "the N float32 row scales of int8 panels (pack_i8)");
  m.def("pack_bias", &pack_bias, "zero-pad a bias to the packed weight's columns");
  m.def("linear", &linear, "x W^T + b through a packed weight", pybind11::arg("x"), pybind11::arg("packed"),
        pybind11::arg("out_features"), pybind11::arg("bias") = c10::nullopt, pybind11::arg("activation") = 0);
  m.def("decoder_layer", &decoder_layer,
        "one fairseq Transformer decoder layer (ReLU FFN) over a pass's new tokens, KV cache written in place");
  m.def("decoder_pass", &decoder_pass,
        "a whole verify pass of the decoder: inputs, every fused layer, final norm, projection, log-softmax");
  m.def("pass_log_probs", &pass_log_probs,
        "the end of decoder_pass from its final states: the projection, the temperature, the float32 log-softmax");
  m.def("screen_greedy", &screen_greedy,
        "each row's certified greedy column from the int8 copy of the projection and exact float32 candidates, or -1");
  m.def("decoder_steps", &decoder_steps,
        "a self-drafter's greedy steps: each row's best non-pad pick and its log-prob, fed through decoder_pass "
        "while any row stays sure");
  m.def("screened_greedy_steps", &screened_greedy_steps,
        "the verifier's greedy steps: decoder_pass to the final states, screen_greedy's certified picks fed back, "
        "until n steps, an EOS pick or a pick not certified");
  m.def("encoder_layer", &encoder_layer, "one fairseq Transformer encoder layer (ReLU FFN) over padded sentences");
  m.def("block_input", &block_input, "the input rows of a specdec_vsd drafting pass: context row, then k slot rows");
  m.def("draft_pick", &draft_pick,
        "a drafter's best type and its log-prob per row: output projection (packed, plus extra columns), bias, "
        "log-softmax, max");
  m.def("strict_step", &strict_step,
        "the tail of a strict speculative iteration (a draft chain or tree): fairseq's rules, running scores, "
        "greedy picks, acceptance");
  m.def("move_cache_entries", &move_cache_entries,
        "after a draft tree's pass: each row's accepted cache entries moved to where a chain would have put them");
  m.def("append_rows", &append_rows,
        "the loop's commit: each row's new tokens and log-probs written after its length, in place; returns the new "
        "lengths and each row's newest token");
  m.def("compact_rows", &compact_rows,
        "the rows kept after some finished, moved up in place in B x H x cap x d caches (their first width positions)");
}
