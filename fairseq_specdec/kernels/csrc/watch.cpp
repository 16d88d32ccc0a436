// The signature that WeightsWatch (fairseq_specdec/utils/projection.py)
// compares to tell whether a list of weights changed since its last look,
// computed in one call instead of some hundred tensor operations and
// attribute reads (a verify pass's layouts watch every parameter of the
// decoder at the first pass of every batch).
//
// A weight's signature is, as int64 values:
//   its data address, its version (-1 for an inference tensor, which keeps
//   no version counter), its dtype, its number of dimensions and its sizes,
//   then kSamples of its elements, evenly spaced (element i * step for
//   step = max(1, numel / kSamples), the first kSamples of those that
//   exist), each element's bytes zero-extended into one int64 value.
// The list's signature is the weights' signatures one after the other,
// preceded by their count.  Only contiguous (strided) CPU tensors whose
// elements fit in 8 bytes have one; for any other list the calls say so and
// the watch compares with tensor operations instead.
#include <ATen/ATen.h>

#include <cstring>
#include <vector>

namespace {

constexpr int64_t kSamples = 16;

bool has_signature(const at::Tensor& w) {
  return w.defined() && w.layout() == at::kStrided && w.device().is_cpu() && w.is_contiguous() &&
         w.element_size() <= 8;
}

void append(std::vector<int64_t>& out, const at::Tensor& w) {
  out.push_back(reinterpret_cast<int64_t>(w.data_ptr()));
  out.push_back(w.is_inference() ? -1 : static_cast<int64_t>(w._version()));
  out.push_back(static_cast<int64_t>(w.scalar_type()));
  out.push_back(w.dim());
  for (int64_t size : w.sizes()) out.push_back(size);
  const int64_t n = w.numel(), step = std::max<int64_t>(1, n / kSamples), size = w.element_size();
  const char* data = static_cast<const char*>(w.data_ptr());
  for (int64_t i = 0, at = 0; i < kSamples && at < n; ++i, at += step) {
    int64_t value = 0;
    std::memcpy(&value, data + at * size, static_cast<size_t>(size));
    out.push_back(value);
  }
}

// false where a weight has no signature
bool signature_of(const std::vector<at::Tensor>& weights, std::vector<int64_t>& out) {
  out.clear();
  out.reserve(1 + weights.size() * (6 + kSamples));
  out.push_back(static_cast<int64_t>(weights.size()));
  for (const auto& w : weights) {
    if (!has_signature(w)) return false;
    append(out, w);
  }
  return true;
}

}  // namespace

// The list's signature (an int64 CPU tensor), or an undefined tensor (None)
// where a weight has none.
at::Tensor weights_signature(const std::vector<at::Tensor>& weights) {
  std::vector<int64_t> sig;
  if (!signature_of(weights, sig)) return at::Tensor();
  auto out = at::empty({static_cast<int64_t>(sig.size())}, at::TensorOptions().dtype(at::kLong));
  std::memcpy(out.data_ptr<int64_t>(), sig.data(), sizeof(int64_t) * sig.size());
  return out;
}

// 1: the list has this signature; 0: it has another one; -1: a weight has
// none (the caller compares otherwise).
int64_t same_signature(const std::vector<at::Tensor>& weights, const at::Tensor& signature) {
  TORCH_CHECK(signature.dim() == 1 && signature.scalar_type() == at::kLong && signature.device().is_cpu() &&
                  signature.is_contiguous(),
              "same_signature: the signature must be a contiguous int64 CPU vector");
  thread_local std::vector<int64_t> sig;
  if (!signature_of(weights, sig)) return -1;
  const bool same = static_cast<int64_t>(sig.size()) == signature.numel() &&
                    std::memcmp(sig.data(), signature.data_ptr<int64_t>(), sizeof(int64_t) * sig.size()) == 0;
  return same ? 1 : 0;
}
