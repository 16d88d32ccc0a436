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
// held in AVX2 registers; further row groups reuse the block from cache.
//
// Arithmetic contract: every output element is
//     y[i][n] = (sum over k = 0..K-1, in order, of x[i][k] * W[n][k]) + b[n]
// accumulated in float32 with fused multiply-adds from 0, the bias added
// last.  It depends on neither the number of rows nor the other rows, so a
// row's result is the same in a pass of 1, 4 or 128 rows (unlike a BLAS,
// whose summation order follows its shape-dependent kernel).  It is not
// bitwise the BLAS result: the plugin measures what that changes.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define ROWGEMM_X86 1
#endif

namespace {

constexpr int64_t kLanes = 8;    // floats per AVX2 register (and per panel)
constexpr int kGroupRows = 4;    // rows per register block
constexpr int kBlockPanels = 3;  // panels per register block

bool cpu_supported() {
#ifdef ROWGEMM_X86
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

#ifdef ROWGEMM_X86
// R rows (xt: K x R, row-interleaved) against NV consecutive panels.
template <int R, int NV>
__attribute__((target("avx2,fma"), always_inline)) inline void block_impl(
    const float* xt, int64_t K, const float* w, int64_t panel_stride, const float* bias, int activation,
    float* y, int64_t ldy, int64_t ncols) {
  __m256 acc[R * NV];
#pragma GCC unroll 16
  for (int a = 0; a < R * NV; ++a) acc[a] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m256 wv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) wv[v] = _mm256_loadu_ps(w + v * panel_stride + k * kLanes);
#pragma GCC unroll 4
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
  for (int i = 0; i < R; ++i) std::memcpy(y + i * ldy, out + i * NV * kLanes, n * sizeof(float));
}

template <int R, int NV>
__attribute__((target("avx2,fma"))) void block(
    const float* xt, int64_t K, const float* w, int64_t panel_stride, const float* bias, int activation,
    float* y, int64_t ldy, int64_t ncols) {
  block_impl<R, NV>(xt, K, w, panel_stride, bias, activation, y, ldy, ncols);
}

template <int NV>
void rows_block(int rows, const float* xt, int64_t K, const float* w, int64_t panel_stride, const float* bias,
                int activation, float* y, int64_t ldy, int64_t ncols) {
  switch (rows) {
    case 1: block<1, NV>(xt, K, w, panel_stride, bias, activation, y, ldy, ncols); break;
    case 2: block<2, NV>(xt, K, w, panel_stride, bias, activation, y, ldy, ncols); break;
    case 3: block<3, NV>(xt, K, w, panel_stride, bias, activation, y, ldy, ncols); break;
    default: block<4, NV>(xt, K, w, panel_stride, bias, activation, y, ldy, ncols); break;
  }
}
#endif

void check_packed(const torch::Tensor& packed, int64_t out_features) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kLanes, "rowgemm: packed weight must be [panels][K][8]");
  TORCH_CHECK(packed.scalar_type() == torch::kFloat && packed.is_contiguous() && packed.device().is_cpu(),
              "rowgemm: packed weight must be a contiguous float32 CPU tensor");
  TORCH_CHECK(packed.size(0) == (out_features + kLanes - 1) / kLanes, "rowgemm: packed weight has the wrong panel count");
}

}  // namespace

bool supported() { return cpu_supported(); }

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

// bias: N -> P*8 zero padded (or an empty tensor for none)
torch::Tensor pack_bias(const torch::Tensor& bias) {
  TORCH_CHECK(bias.dim() == 1 && bias.scalar_type() == torch::kFloat && bias.device().is_cpu(),
              "rowgemm.pack_bias: bias must be a 1-D float32 CPU tensor");
  const int64_t N = bias.size(0);
  auto out = torch::zeros({(N + kLanes - 1) / kLanes * kLanes}, bias.options());
  out.narrow(0, 0, N).copy_(bias);
  return out;
}

// x: ... x K (float32, CPU); packed from pack(); bias from pack_bias() or
// undefined; activation 0 = none, 1 = relu.  Returns ... x N.
torch::Tensor linear(const torch::Tensor& x_in, const torch::Tensor& packed, int64_t out_features,
                     const c10::optional<torch::Tensor>& bias, int64_t activation) {
  TORCH_CHECK(cpu_supported(), "rowgemm: this CPU has no AVX2/FMA");
  check_packed(packed, out_features);
  TORCH_CHECK(x_in.scalar_type() == torch::kFloat && x_in.device().is_cpu(), "rowgemm: x must be float32 on the CPU");
  const int64_t K = packed.size(1);
  TORCH_CHECK(x_in.size(-1) == K, "rowgemm: x has ", x_in.size(-1), " features, the weight ", K);
  TORCH_CHECK(activation == 0 || activation == 1, "rowgemm: activation must be 0 (none) or 1 (relu)");
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == packed.size(0) * kLanes && bias->is_contiguous(), "rowgemm: bias must come from pack_bias");
    b = bias->data_ptr<float>();
  }
  auto out_shape = x_in.sizes().vec();
  out_shape.back() = out_features;
  const int64_t m = x_in.numel() / K;
  auto y = torch::empty({m, out_features}, x_in.options());
  if (m == 0 || out_features == 0) return y.view(out_shape);
  if (K == 0) {
    if (b != nullptr) y.copy_(bias->narrow(0, 0, out_features).expand({m, out_features}));
    else y.zero_();
    if (activation == 1) y.clamp_min_(0);
    return y.view(out_shape);
  }
#ifdef ROWGEMM_X86
  // rows interleaved per group of 4: xt[g][k][r]
  const int64_t groups = (m + kGroupRows - 1) / kGroupRows;
  auto x2 = x_in.reshape({m, K});
  auto xt = torch::empty({groups * K * kGroupRows}, x_in.options());
  {
    const auto xc = x2.contiguous();
    const float* xs = xc.data_ptr<float>();
    float* xd = xt.data_ptr<float>();
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t rows = std::min<int64_t>(kGroupRows, m - g * kGroupRows);
      float* dst = xd + g * K * kGroupRows;
      for (int64_t r = 0; r < rows; ++r) {
        const float* src = xs + (g * kGroupRows + r) * K;
        for (int64_t k = 0; k < K; ++k) dst[k * rows + r] = src[k];
      }
    }
  }
  const float* xd = xt.data_ptr<float>();
  const float* w = packed.data_ptr<float>();
  float* yd = y.data_ptr<float>();
  const int64_t P = packed.size(0);
  const int64_t panel_stride = K * kLanes;
  const int64_t nblocks = (P + kBlockPanels - 1) / kBlockPanels;
  const int act = static_cast<int>(activation);
  at::parallel_for(0, nblocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t p = blk * kBlockPanels;
      const int64_t nv = std::min<int64_t>(kBlockPanels, P - p);
      const int64_t col = p * kLanes;
      const float* wb = w + p * panel_stride;
      const float* bb = b != nullptr ? b + col : nullptr;
      for (int64_t g = 0; g < groups; ++g) {
        const int rows = static_cast<int>(std::min<int64_t>(kGroupRows, m - g * kGroupRows));
        const float* xg = xd + g * K * kGroupRows;
        float* yg = yd + g * kGroupRows * out_features + col;
        const int64_t ncols = out_features - col;
        if (nv == 3) rows_block<3>(rows, xg, K, wb, panel_stride, bb, act, yg, out_features, ncols);
        else if (nv == 2) rows_block<2>(rows, xg, K, wb, panel_stride, bb, act, yg, out_features, ncols);
        else rows_block<1>(rows, xg, K, wb, panel_stride, bb, act, yg, out_features, ncols);
      }
    }
  });
#else
  TORCH_CHECK(false, "rowgemm: built without x86-64 support");
#endif
  return y.view(out_shape);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Row-blocked float32 products (y = x W^T + b) for few-row verify passes";
  m.def("supported", &supported, "whether this CPU runs the kernel (AVX2 and FMA)");
  m.def("pack", &pack, "pack an N x K weight into [ceil(N/8)][K][8] panels");
  m.def("pack_bias", &pack_bias, "zero-pad a bias to the packed weight's columns");
  m.def("linear", &linear, "x W^T + b through a packed weight", pybind11::arg("x"), pybind11::arg("packed"),
        pybind11::arg("out_features"), pybind11::arg("bias") = c10::nullopt, pybind11::arg("activation") = 0);
}
