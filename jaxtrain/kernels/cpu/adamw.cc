// The train step's guarded optimizer update for XLA:CPU as one XLA FFI handler over every parameter,
// float32: the gradients' global L2 norm, the non-finite guard, global-norm clipping and AdamW
// (Loshchilov & Hutter 2019), with optax's arithmetic (jaxtrain/train/optimizer.py):
//   norm = sqrt(sum of every g^2); finite = isfinite(loss) and isfinite(norm); if not finite, nothing
//   changes. Else, per element: g = g (norm < clip ? 1 : clip / norm); mu = (1 - b1) g + b1 mu;
//   nu = (1 - b2) g^2 + b2 nu; u = (mu / bc1) / (sqrt(nu / bc2) + eps); u += wd p where the leaf
//   decays; p = p + (-lr) u.   bc1 = 1 - b1^count and bc2 = 1 - b2^count come from the caller.
//
// Why: XLA:CPU made the update a fusion per parameter (and per moment) inside a conditional, plus a
// reduction per gradient for the norm: ~100 thunks, each a pass over one small array started on its
// own. Here a call is two passes over chunks of all of them on both threads (cpu_parallel.h).
//
// Operands: hyper f32[9] = (loss, lr, b1, b2, eps, weight_decay, clip_norm, bc1, bc2), then the L
// params, the L gradients, the L first and the L second moments (each leaf's four the same shape).
// Results: the L params, L first and L second moments (aliased to their operands by the caller), and
// the norm f32[]. Attribute decay: int32[L], 1 where the leaf decays. The norm sums chunks of kChunk
// floats in 16 lanes, then the chunks in order in double (rounded to float32 before the root), so it
// depends on the shapes only.
// The update is written as XLA:CPU compiles optax's (jax 0.10.2): its algebraic simplifier turns
// (mu / bc1) / d into mu / (bc1 d), and LLVM contracts four products into fused multiply-adds, the
// ones below and no others (this file is compiled without contraction). So, given the same norm, the
// params and moments are the XLA path's bit for bit (tests/unit/test_cpu_adamw.py).
// Built and loaded by jaxtrain/kernels/cpu/library.py.
#pragma GCC optimize("fp-contract=off")
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_math.h"
#include "cpu_parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jaxtrain::V16;
using jaxtrain::V16u;

constexpr int64_t kChunk = 8192;  // floats a task: 32 KiB of each of p, g, mu and nu

struct Leaf {
  const float *p, *g, *mu, *nu;
  float *p_out, *mu_out, *nu_out;
  int64_t n;
  bool decay;
};

struct Chunk {
  int64_t leaf, begin, end;
};

float SumSquares(const float* x, int64_t n) {
  V16 acc{};
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const V16 v = *reinterpret_cast<const V16u*>(x + j);
    acc += v * v;
  }
  float sum = 0.0f;
  for (int q = 0; q < 16; ++q) sum += acc[q];
  for (; j < n; ++j) sum += x[j] * x[j];
  return sum;
}

struct Hyper {
  float scale, omb1, b1, omb2, b2, bc1, bc2, eps, wd, neg_lr;
};

// A leaf's elements [begin, end), in place on its results (already holding the operands), in optax's
// order (scale_by_adam, add_decayed_weights, scale_by_learning_rate, apply_updates) with jaxtrain's
// clipping (a scalar factor). Locals and restrict pointers: else the compiler keeps it scalar.
template <bool kDecay>
void Update(const Hyper& hyper, const Leaf& leaf, int64_t begin, int64_t end) {
  const Hyper h = hyper;
  const float* __restrict g = leaf.g;
  float* __restrict p = leaf.p_out;
  float* __restrict mu = leaf.mu_out;
  float* __restrict nu = leaf.nu_out;
  for (int64_t j = begin; j < end; ++j) {
    const float gj = g[j] * h.scale;
    const float m = std::fma(h.omb1, gj, h.b1 * mu[j]);
    const float v = std::fma(h.b2, nu[j], h.omb2 * (gj * gj));
    float u = m / (h.bc1 * (std::sqrt(v / h.bc2) + h.eps));
    if (kDecay) u = std::fma(h.wd, p[j], u);
    p[j] = std::fma(h.neg_lr, u, p[j]);
    mu[j] = m;
    nu[j] = v;
  }
}

ffi::Error AdamW(ffi::ThreadPool pool, ffi::RemainingArgs args, ffi::RemainingRets rets,
                 ffi::Span<const int32_t> decay) {
  const int64_t l = static_cast<int64_t>(decay.size());
  if (static_cast<int64_t>(args.size()) != 1 + 4 * l || static_cast<int64_t>(rets.size()) != 3 * l + 1)
    return ffi::Error::InvalidArgument("operands: hyper, then L params, grads, mu, nu; results: 3 L + 1");
  auto hyper_arg = args.get<ffi::Buffer<ffi::F32>>(0);
  if (!hyper_arg.has_value() || hyper_arg->element_count() != 9)
    return ffi::Error::InvalidArgument("hyper: float32[9]");
  const float* hp = hyper_arg->typed_data();
  const float loss = hp[0], lr = hp[1], b1 = hp[2], b2 = hp[3], eps = hp[4], wd = hp[5], clip = hp[6];
  std::vector<Leaf> leaves(l);
  std::vector<Chunk> chunks;
  for (int64_t i = 0; i < l; ++i) {
    const float* in[4];
    int64_t n = -1;
    for (int64_t k = 0; k < 4; ++k) {
      auto a = args.get<ffi::Buffer<ffi::F32>>(1 + k * l + i);
      if (!a.has_value()) return ffi::Error::InvalidArgument("params, grads and moments must be float32");
      if (n >= 0 && static_cast<int64_t>(a->element_count()) != n)
        return ffi::Error::InvalidArgument("a leaf's param, grad and moments differ in size");
      n = static_cast<int64_t>(a->element_count());
      in[k] = a->typed_data();
    }
    float* out[3];
    for (int64_t k = 0; k < 3; ++k) {
      auto r = rets.get<ffi::Buffer<ffi::F32>>(k * l + i);
      if (!r.has_value() || static_cast<int64_t>((*r)->element_count()) != n)
        return ffi::Error::InvalidArgument("results: each leaf's param and moments, float32");
      out[k] = (*r)->typed_data();
    }
    leaves[i] = Leaf{in[0], in[1], in[2], in[3], out[0], out[1], out[2], n, decay[i] != 0};
    for (int64_t b = 0; b < n; b += kChunk) chunks.push_back(Chunk{i, b, std::min(n, b + kChunk)});
  }
  auto norm_ret = rets.get<ffi::Buffer<ffi::F32>>(3 * l);
  if (!norm_ret.has_value() || (*norm_ret)->element_count() != 1) return ffi::Error::InvalidArgument("norm: f32[]");
  const int64_t tasks = static_cast<int64_t>(chunks.size());
  std::vector<float> partial(tasks);
  jaxtrain::ParallelFor(pool, tasks, pool.num_threads(), [&](int64_t t) {
    const Chunk& c = chunks[t];
    partial[t] = SumSquares(leaves[c.leaf].g + c.begin, c.end - c.begin);
  });
  double total = 0.0;
  for (float s : partial) total += s;
  // the sum rounded to float32 before the root, as XLA's norm is: a sum past float32's range is inf, and
  // the step is skipped on both paths (a root taken in double was finite)
  const float norm = std::sqrt(static_cast<float>(total));
  *(*norm_ret)->typed_data() = norm;
  for (const Leaf& leaf : leaves) {  // results not aliased to their operands (XLA copies): the operands first
    const size_t bytes = sizeof(float) * leaf.n;
    if (leaf.p_out != leaf.p) std::memcpy(leaf.p_out, leaf.p, bytes);
    if (leaf.mu_out != leaf.mu) std::memcpy(leaf.mu_out, leaf.mu, bytes);
    if (leaf.nu_out != leaf.nu) std::memcpy(leaf.nu_out, leaf.nu, bytes);
  }
  if (!(std::isfinite(loss) && std::isfinite(norm))) return ffi::Error::Success();  // skipped: nothing changes
  const Hyper h{norm < clip ? 1.0f : clip / norm, 1.0f - b1, b1, 1.0f - b2, b2, hp[7], hp[8], eps, wd, -lr};
  jaxtrain::ParallelFor(pool, tasks, pool.num_threads(), [&](int64_t t) {
    const Chunk& c = chunks[t];
    const Leaf& leaf = leaves[c.leaf];
    leaf.decay ? Update<true>(h, leaf, c.begin, c.end) : Update<false>(h, leaf, c.begin, c.end);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxtrainCpuAdamW, AdamW,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<ffi::Span<const int32_t>>("decay"));
