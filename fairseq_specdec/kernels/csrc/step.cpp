// The tail of one iteration of the speculative loop under strict
// verification, on a CPU, in one call: from the verify pass's log-probs to
// the tokens each row appends.  It replaces some twenty tensor operations
// of the tensor acceptance step (generation/accept_step.py TensorStep: fairseq's per-step rules, the running
// scores along the draft path, each slot's top-2 pick, the accepted prefix,
// the EOS search, the running score after the new tokens), each of which
// costs more in dispatch than in arithmetic at a verify pass's few rows.
//
// Contract (the values of the tensor-operation path, exactly):
// * fairseq's rules as FairseqRules.mask (generation/accept_step.py) applies them with
//   no --unk-penalty: NaN reads -inf, the pad reads -inf, the EOS reads -inf
//   at output steps before min_len, every token but the EOS reads -inf at
//   steps >= max_len (slot j of row r is output step lengths[r] + j);
// * the running score before slot j is cum, then the drafted tokens'
//   log-probs added one at a time in float32 (SequenceGenerator's order);
// * slot j's greedy token is the index of the largest float32 sum
//   log-prob + running score, which is what fairseq's top-2 takes first
//   when that largest value is unique;
// * a draft is accepted while it equals its slot's greedy token; the row
//   appends the accepted drafts and the greedy token of the first slot not
//   accepted, cut after the first EOS among them.
// With ``relaxed`` (top-beta verification, TopBetaAcceptance with the
// verifier's scores): a draft is acceptable where its masked log-prob is
// finite, among its parent slot's ``beta`` largest and within ``tau`` of the
// largest; the row keeps the deepest node whose ancestors and itself are all
// acceptable (the first in slot order: in a chain, the longest acceptable
// prefix), and only that slot needs its greedy pick.  A draft whose rank
// among the beta largest is decided by equal values (torch's top-k picks
// among them) is reported as a tie too.
// Where the largest sum of a slot the row reads is not unique (a tie, or a
// NaN running score), the top-2's choice between the tied tokens is
// torch's, so the call reports a tie and computes nothing the caller may
// use: the caller takes the tensor-operation path for the iteration.  Slots
// after the first one not accepted are not read (their log-probs may be
// anything); the returned tokens there are the drafts (the pad in the last
// slot) with log-prob 0, scratch that the loop writes past the accepted
// output.  ``lprobs`` is only read.
#include <ATen/ATen.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

namespace {

// fairseq's rules at one output step: NaN, the pad, the EOS before
// min_len, and every token but the EOS at the length limit read -inf.
struct Rules {
  int64_t pad, eos;
  bool no_eos, eos_only;
  float masked(const float* row, int64_t v) const {
    const float x = row[v];
    if (std::isnan(x) || v == pad || (no_eos && v == eos) || (eos_only && v != eos))
      return -std::numeric_limits<float>::infinity();
    return x;
  }
};

// The greedy pick of one slot: the index of the largest masked log-prob +
// running, and whether it is unique.
struct Pick {
  int64_t token;
  float lprob;  // the masked log-prob of ``token``
  bool unique;
};

inline Pick pick(const float* row, int64_t V, float running, const Rules& rules) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  if (rules.eos_only) {  // every other token reads -inf: the EOS, unless it does too
    const float x = rules.masked(row, rules.eos);
    return {rules.eos, x, V == 1 || x + running > kNegInf};
  }
  float best = kNegInf;
  int64_t arg = -1;
  int64_t count = 0;
  for (int64_t v = 0; v < V; ++v) {
    const float s = rules.masked(row, v) + running;
    if (s > best) {
      best = s;
      arg = v;
      count = 1;
    } else if (s == best) {
      ++count;
    }
  }
  if (arg < 0) return {0, kNegInf, V == 1};  // every sum -inf
  return {arg, rules.masked(row, arg), count == 1};
}

// The ``beta`` largest masked log-probs of a row (no running score), largest first.
inline void top_values(const float* row, int64_t V, int64_t beta, const Rules& rules, std::vector<float>& top) {
  top.assign(static_cast<size_t>(beta), -std::numeric_limits<float>::infinity());
  for (int64_t v = 0; v < V; ++v) {
    const float x = rules.masked(row, v);
    if (x <= top[beta - 1]) continue;
    int64_t i = beta - 1;
    while (i > 0 && top[i - 1] < x) {
      top[i] = top[i - 1];
      --i;
    }
    top[i] = x;
  }
}

// Whether a token of masked log-prob x (finite) is among the row's ``beta``
// largest as torch's top-k would say: 1 yes, 0 no, -1 undecided (values
// equal to x straddle the beta-th place).
inline int in_top(const float* row, int64_t V, int64_t beta, float x, const std::vector<float>& top,
                  const Rules& rules) {
  const float kth = top[beta - 1];
  if (x > kth) return 1;
  if (x < kth) return 0;
  int64_t greater = 0, equal = 0;
  for (int64_t v = 0; v < V; ++v) {
    const float y = rules.masked(row, v);
    greater += y > x;
    equal += y == x;
  }
  return greater + equal <= beta ? 1 : -1;
}

}  // namespace

// lprobs: B x m x V float32 (contiguous CPU); drafts: B x (m - 1) int64 (the
// tokens of slots 1 .. m - 1); cum: B float32; lengths: B int64; drafted: B
// counts (or empty: the accepted counts stand in); parents: undefined for a
// chain (slot j's parent is j - 1), or B x m int64, a draft tree's parent
// slot of every slot (-1 at slot 0, parents[r][j] < j).  In a tree, slot j's
// output step is lengths[r] + its depth, the running score before it adds
// its ancestors' log-probs, and the walk from slot 0 moves to the first child
// (in slot order) whose draft is the slot's greedy token.  Returns
// (new_tokens B x m int64, new_lprobs B x m float32, n_new B int64, cum B
// float32, counts 4 x B int64 [n_new, finished, accepted, drafted], path
// B x m int64: the slot each appended token was picked at, tie).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, bool> strict_step(
    const at::Tensor& lprobs, const at::Tensor& drafts, const at::Tensor& cum, const at::Tensor& lengths,
    const std::vector<int64_t>& drafted, int64_t pad, int64_t eos, int64_t min_len, int64_t max_len,
    const c10::optional<at::Tensor>& parents_opt, bool relaxed, int64_t beta, double tau) {
  TORCH_CHECK(!relaxed || beta >= 1, "strict_step: relaxed verification needs beta >= 1");
  TORCH_CHECK(lprobs.dim() == 3 && lprobs.scalar_type() == at::kFloat && lprobs.device().is_cpu() &&
                  lprobs.is_contiguous(),
              "strict_step: lprobs must be a contiguous B x m x V float32 CPU tensor");
  const int64_t B = lprobs.size(0), m = lprobs.size(1), V = lprobs.size(2), k = m - 1;
  TORCH_CHECK(m >= 1 && V >= 1, "strict_step: lprobs has no slot or no vocabulary");
  TORCH_CHECK(drafts.dim() == 2 && drafts.size(0) == B && drafts.size(1) == k && drafts.scalar_type() == at::kLong &&
                  drafts.device().is_cpu() && drafts.is_contiguous(),
              "strict_step: drafts must be a contiguous B x (m - 1) int64 CPU tensor");
  TORCH_CHECK(cum.dim() == 1 && cum.size(0) == B && cum.scalar_type() == at::kFloat && cum.device().is_cpu() &&
                  cum.is_contiguous(),
              "strict_step: cum must be a contiguous float32 CPU vector of B");
  TORCH_CHECK(lengths.dim() == 1 && lengths.size(0) == B && lengths.scalar_type() == at::kLong &&
                  lengths.device().is_cpu() && lengths.is_contiguous(),
              "strict_step: lengths must be a contiguous int64 CPU vector of B");
  TORCH_CHECK(drafted.empty() || static_cast<int64_t>(drafted.size()) == B,
              "strict_step: drafted must hold one count per row (or none)");
  TORCH_CHECK(pad >= 0 && pad < V && eos >= 0 && eos < V, "strict_step: pad and eos must be tokens of the vocabulary");
  const int64_t* par = nullptr;
  if (parents_opt.has_value() && parents_opt->defined()) {
    const auto& p = *parents_opt;
    TORCH_CHECK(p.dim() == 2 && p.size(0) == B && p.size(1) == m && p.scalar_type() == at::kLong && p.device().is_cpu() &&
                    p.is_contiguous(),
                "strict_step: parents must be a contiguous B x m int64 CPU tensor");
    par = p.data_ptr<int64_t>();
    for (int64_t r = 0; r < B; ++r)
      for (int64_t j = 1; j < m; ++j)
        TORCH_CHECK(par[r * m + j] >= 0 && par[r * m + j] < j, "strict_step: row ", r, " slot ", j,
                    " has parent ", par[r * m + j], ": a tree's parents come before their children");
  }

  auto long_opts = drafts.options();
  auto new_tokens = at::empty({B, m}, long_opts);
  auto new_lprobs = at::empty({B, m}, lprobs.options());
  auto n_new = at::empty({B}, long_opts);
  auto cum_out = at::empty({B}, cum.options());
  auto counts = at::empty({4, B}, long_opts);
  auto path_out = at::empty({B, m}, long_opts);
  const float* lp = lprobs.data_ptr<float>();
  const int64_t* dr = drafts.data_ptr<int64_t>();
  const float* cm = cum.data_ptr<float>();
  const int64_t* len = lengths.data_ptr<int64_t>();
  int64_t* nt = new_tokens.data_ptr<int64_t>();
  float* nl = new_lprobs.data_ptr<float>();
  int64_t* nn = n_new.data_ptr<int64_t>();
  float* co = cum_out.data_ptr<float>();
  int64_t* ct = counts.data_ptr<int64_t>();
  int64_t* po = path_out.data_ptr<int64_t>();
  std::vector<float> running(static_cast<size_t>(m));  // by depth, along the walked path
  // relaxed: per slot its beta largest masked log-probs, whether computed; per node reached, depth
  std::vector<std::vector<float>> tops(static_cast<size_t>(m));
  std::vector<char> have_top, reach;
  std::vector<int64_t> depth;

  for (int64_t r = 0; r < B; ++r) {
    const int64_t* draft = dr + r * k;
    const int64_t* parent = par != nullptr ? par + r * m : nullptr;
    int64_t* tokens = nt + r * m;
    float* tok_lprobs = nl + r * m;
    int64_t* path = po + r * m;
    running[0] = cm[r];
    int64_t accepted = 0;
    int64_t slot = 0;
    // the verifier's greedy token at slot s (depth j), written as the row's
    // j-th token; not unique on a tie or a NaN running score
    // fairseq's rules at output step len[r] + j
    auto rules_at = [&](int64_t j) -> Rules {
      const int64_t step = len[r] + j;
      return {pad, eos, step < min_len, step >= max_len};
    };
    auto verifier_token = [&](int64_t s, int64_t j) -> Pick {
      if (std::isnan(running[j])) return {0, 0.0f, false};
      const Pick p = pick(lp + (r * m + s) * V, V, running[j], rules_at(j));
      if (p.unique) {
        tokens[j] = p.token;
        tok_lprobs[j] = p.lprob;
      }
      return p;
    };
    if (relaxed) {
      // every node whose ancestors are all acceptable, in slot order (parents
      // first); the deepest of them (the first in slot order) ends the path
      reach.assign(static_cast<size_t>(m), 0);
      depth.assign(static_cast<size_t>(m), 0);
      have_top.assign(static_cast<size_t>(m), 0);
      reach[0] = 1;
      int64_t best = 0;
      for (int64_t c = 1; c < m; ++c) {
        const int64_t p = parent == nullptr ? c - 1 : parent[c];
        depth[c] = depth[p] + 1;
        if (!reach[p]) continue;
        const int64_t token = draft[c - 1];
        if (token < 0 || token >= V) continue;
        const Rules rules = rules_at(depth[p]);
        const float* row = lp + (r * m + p) * V;
        const float x = rules.masked(row, token);
        if (!std::isfinite(x)) continue;
        std::vector<float>& top = tops[p];
        if (!have_top[p]) {
          top_values(row, V, beta, rules, top);
          have_top[p] = 1;
        }
        const int ranked = in_top(row, V, beta, x, top, rules);
        if (ranked < 0) return {new_tokens, new_lprobs, n_new, cum_out, counts, path_out, true};
        if (ranked == 1 && static_cast<double>(top[0] - x) <= tau) {
          reach[c] = 1;
          if (depth[c] > depth[best]) best = c;
        }
      }
      accepted = depth[best];
      for (int64_t s2 = best, j = accepted; j >= 0; --j) {
        path[j] = s2;
        s2 = j > 0 ? (parent == nullptr ? s2 - 1 : parent[s2]) : 0;
      }
      for (int64_t j = 0; j < accepted; ++j) {  // the accepted drafts and the running scores before each
        const int64_t token = draft[path[j + 1] - 1];
        tokens[j] = token;
        tok_lprobs[j] = lp[(r * m + path[j]) * V + token];
        running[j + 1] = running[j] + tok_lprobs[j];
      }
      slot = best;
      if (!verifier_token(slot, accepted).unique) return {new_tokens, new_lprobs, n_new, cum_out, counts, path_out, true};
    } else {
      for (int64_t j = 0;; ++j) {  // depth j, slot ``slot``, while the drafts before it are accepted
        const Pick p = verifier_token(slot, j);
        if (!p.unique) return {new_tokens, new_lprobs, n_new, cum_out, counts, path_out, true};
        path[j] = slot;
        int64_t next = -1;
        if (parent == nullptr) {
          if (slot < k && draft[slot] == p.token) next = slot + 1;
        } else {
          for (int64_t c = slot + 1; c < m; ++c)
            if (parent[c] == slot && draft[c - 1] == p.token) {
              next = c;
              break;
            }
        }
        if (next < 0) break;
        running[j + 1] = running[j] + p.lprob;  // the draft's log-prob: it is the greedy token
        slot = next;
        ++accepted;
      }
    }
    for (int64_t j = accepted + 1; j < m; ++j) {  // scratch past the verifier's token
      tokens[j] = parent == nullptr && j < k ? draft[j] : pad;
      tok_lprobs[j] = 0.0f;
      path[j] = parent == nullptr ? j : slot;
    }
    int64_t added = accepted + 1;
    bool finished = false;
    for (int64_t j = 0; j <= accepted; ++j) {
      if (tokens[j] == eos) {
        added = j + 1;
        finished = true;
        break;
      }
    }
    nn[r] = added;
    co[r] = running[added - 1] + tok_lprobs[added - 1];
    ct[r] = added;
    ct[B + r] = finished ? 1 : 0;
    ct[2 * B + r] = accepted;
    ct[3 * B + r] = drafted.empty() ? accepted : drafted[r];
  }
  return {new_tokens, new_lprobs, n_new, cum_out, counts, path_out, false};
}

// After a draft tree's verify pass: move the accepted path's cache entries to
// where a chain would have written them.  caches: B x H x cap x d float32
// contiguous CPU tensors (every layer's keys and values); for each row r of
// ``rows`` (int64), entry src[i][j] goes to dst[i][j] for j = 0 .. count-1
// (src, dst: len(rows) x count int64), in order of j.  A path's slots only
// grow, so src[i][j] >= dst[i][j] and no later source is overwritten first.
void move_cache_entries(const std::vector<at::Tensor>& caches, const at::Tensor& rows, const at::Tensor& src,
                        const at::Tensor& dst) {
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.is_contiguous() && rows.device().is_cpu(),
              "move_cache_entries: rows must be a contiguous int64 CPU vector");
  const int64_t R = rows.size(0);
  TORCH_CHECK(src.dim() == 2 && src.size(0) == R && dst.sizes() == src.sizes() && src.scalar_type() == at::kLong &&
                  dst.scalar_type() == at::kLong && src.is_contiguous() && dst.is_contiguous() && src.device().is_cpu() &&
                  dst.device().is_cpu(),
              "move_cache_entries: src and dst must be contiguous int64 CPU tensors of len(rows) x count");
  const int64_t count = src.size(1);
  const int64_t* rw = rows.data_ptr<int64_t>();
  const int64_t* sp = src.data_ptr<int64_t>();
  const int64_t* dp = dst.data_ptr<int64_t>();
  for (const auto& cache : caches) {
    TORCH_CHECK(cache.dim() == 4 && cache.scalar_type() == at::kFloat && cache.is_contiguous() && cache.device().is_cpu(),
                "move_cache_entries: every cache must be a contiguous float32 B x H x cap x d CPU tensor");
    const int64_t B = cache.size(0), H = cache.size(1), cap = cache.size(2), d = cache.size(3);
    float* base = cache.data_ptr<float>();
    for (int64_t i = 0; i < R; ++i) {
      const int64_t r = rw[i];
      TORCH_CHECK(r >= 0 && r < B, "move_cache_entries: row ", r, " is not in the cache");
      for (int64_t j = 0; j < count; ++j) {
        const int64_t from = sp[i * count + j], to = dp[i * count + j];
        TORCH_CHECK(from >= 0 && from < cap && to >= 0 && to < cap, "move_cache_entries: position out of the cache");
        if (from == to) continue;
        for (int64_t h = 0; h < H; ++h) {
          float* head = base + (r * H + h) * cap * d;
          std::memmove(head + to * d, head + from * d, sizeof(float) * d);
        }
      }
    }
  }
}

// The loop's commit (generation/state.py DecodingState.commit) in one call:
// for each row r, new_tokens[r, j] and new_lprobs[r, j] are written into
// tokens[r, lengths[r] + 1 + j] and pos_scores[r, lengths[r] + 1 + j] for
// every column j of new_tokens (those past n_new[r] are scratch, as the
// tensor form's scatter writes them), in place.  Returns the new lengths
// (lengths + n_new, a new tensor: the old one is not changed) and each row's
// newest token (B x 1: new_tokens[r, n_new[r] - 1], what tokens then holds
// at column lengths[r] + n_new[r]).  tokens: B x W int64, pos_scores: B x W
// float32, lengths and n_new: B int64, new_tokens: B x n int64, new_lprobs:
// B x n float32, all CPU; 1 <= n_new[r] <= n and lengths[r] + n < W.
std::tuple<at::Tensor, at::Tensor> append_rows(at::Tensor& tokens, at::Tensor& pos_scores, const at::Tensor& lengths,
                                               const at::Tensor& new_tokens_in, const at::Tensor& new_lprobs_in,
                                               const at::Tensor& n_new_in) {
  TORCH_CHECK(tokens.dim() == 2 && tokens.scalar_type() == at::kLong && tokens.is_contiguous() && tokens.device().is_cpu(),
              "append_rows: tokens must be a contiguous B x W int64 CPU tensor");
  const int64_t B = tokens.size(0), W = tokens.size(1);
  TORCH_CHECK(pos_scores.sizes() == tokens.sizes() && pos_scores.scalar_type() == at::kFloat &&
                  pos_scores.is_contiguous() && pos_scores.device().is_cpu(),
              "append_rows: pos_scores must be a contiguous B x W float32 CPU tensor");
  TORCH_CHECK(lengths.dim() == 1 && lengths.size(0) == B && lengths.scalar_type() == at::kLong && lengths.device().is_cpu(),
              "append_rows: lengths must be an int64 CPU vector of B");
  TORCH_CHECK(new_tokens_in.dim() == 2 && new_tokens_in.size(0) == B && new_tokens_in.scalar_type() == at::kLong &&
                  new_tokens_in.device().is_cpu(),
              "append_rows: new_tokens must be a B x n int64 CPU tensor");
  const int64_t n = new_tokens_in.size(1);
  TORCH_CHECK(new_lprobs_in.dim() == 2 && new_lprobs_in.size(0) == B && new_lprobs_in.size(1) == n &&
                  new_lprobs_in.scalar_type() == at::kFloat && new_lprobs_in.device().is_cpu(),
              "append_rows: new_lprobs must be a B x n float32 CPU tensor");
  TORCH_CHECK(n_new_in.dim() == 1 && n_new_in.size(0) == B && n_new_in.scalar_type() == at::kLong &&
                  n_new_in.device().is_cpu(),
              "append_rows: n_new must be an int64 CPU vector of B");
  const at::Tensor lens = lengths.contiguous(), nt = new_tokens_in.contiguous(), nl = new_lprobs_in.contiguous(),
                   nn = n_new_in.contiguous();
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t* tp = nt.data_ptr<int64_t>();
  const float* sp = nl.data_ptr<float>();
  const int64_t* np = nn.data_ptr<int64_t>();
  for (int64_t r = 0; r < B; ++r) {
    TORCH_CHECK(np[r] >= 1 && np[r] <= n, "append_rows: row ", r, " appends ", np[r], " of ", n, " tokens");
    TORCH_CHECK(lp[r] >= 0 && lp[r] + n < W, "append_rows: row ", r, " at length ", lp[r], " cannot take ", n,
                " columns of ", W);
  }
  at::Tensor out_lengths = at::empty({B}, lengths.options());
  at::Tensor newest = at::empty({B, 1}, tokens.options());
  int64_t* ol = out_lengths.data_ptr<int64_t>();
  int64_t* nw = newest.data_ptr<int64_t>();
  int64_t* tk = tokens.data_ptr<int64_t>();
  float* ps = pos_scores.data_ptr<float>();
  for (int64_t r = 0; r < B; ++r) {
    const int64_t at_col = r * W + lp[r] + 1;
    std::memcpy(tk + at_col, tp + r * n, sizeof(int64_t) * n);
    std::memcpy(ps + at_col, sp + r * n, sizeof(float) * n);
    ol[r] = lp[r] + np[r];
    nw[r] = tp[r * n + np[r] - 1];
  }
  return {out_lengths, newest};
}

// Rows kept after some rows finished, in place: in every tensor (B x H x cap
// x d float32, contiguous, CPU: a layer's cached keys or values, or its
// encoder keys and values seen as B x heads x S x d), row order[i]'s first
// ``width`` positions of every head are copied to row i, for i in order.
// ``order`` must be strictly increasing (the rows kept, in their order), so
// that no row is overwritten before it is read.  Rows from len(order) on and
// positions from ``width`` on are left as they were (scratch).
void compact_rows(const std::vector<at::Tensor>& tensors, const std::vector<int64_t>& order, int64_t width) {
  for (size_t i = 1; i < order.size(); ++i)
    TORCH_CHECK(order[i] > order[i - 1], "compact_rows: the rows kept must be strictly increasing");
  for (const auto& t : tensors) {
    TORCH_CHECK(t.dim() == 4 && t.scalar_type() == at::kFloat && t.is_contiguous() && t.device().is_cpu(),
                "compact_rows: every tensor must be a contiguous float32 B x H x cap x d CPU tensor");
    const int64_t B = t.size(0), H = t.size(1), cap = t.size(2), d = t.size(3);
    TORCH_CHECK(width >= 0 && width <= cap, "compact_rows: width ", width, " is past the capacity ", cap);
    TORCH_CHECK(order.empty() || (order.front() >= 0 && order.back() < B), "compact_rows: a row kept is not in the tensor");
    float* base = t.data_ptr<float>();
    for (size_t i = 0; i < order.size(); ++i) {
      const int64_t from = order[i], to = static_cast<int64_t>(i);
      if (from == to) continue;
      for (int64_t h = 0; h < H; ++h)
        std::memcpy(base + (to * H + h) * cap * d, base + (from * H + h) * cap * d, sizeof(float) * width * d);
    }
  }
}
