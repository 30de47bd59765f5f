// The SwiGLU MLP's products with their elementwise work folded in, for XLA:CPU as XLA FFI handlers,
// float32. SwiGLU (Shazeer 2020, "GLU Variants Improve Transformer"):
//   g = x Wg, u = x Wu, h = silu(g) u, out = h Wd        (silu(g) = g sigmoid(g))
// and its gradients, with dh = dout Wd^T:
//   dg = dh u sigmoid(g) (1 + g (1 - sigmoid(g))), du = dh silu(g), dx = dg Wg^T + du Wu^T
//
// Why: left to XLA, the shakespeare-char model's silu and products are 3 passes over [tokens, d_ff]
// in the forward and 2 more in the backward, each ~0.1 ms on a 2-core Intel Xeon (more than the
// arithmetic: a pass reads what the other CPU wrote), and dx is two products and an add. Here a task
// is one run of token rows by one panel of d_ff columns (cpu_gemm.h), and the elementwise work runs on
// the task's tile right after its product, from the thread's own cache:
//  - SwigluForward (x, Wg, Wu) -> (h, g, u): the gate and up tiles, then h on them;
//  - SwigluBackward (dout, Wd, g, u) -> (dg, du): the dh tile, then dg and du on it;
//  - MatmulSum (a1, b1, a2, b2, ...) -> a1 b1^T + a2 b2^T + ...: dx as one sum (b's given as [N, K]: Wg, Wu).
// (out = h Wd and the weight gradients x^T dg, x^T du, h^T dout are cpu_matmul.cc's.)
//
// Layouts (row-major, float32): x, dout, dx [M, D]; Wg, Wu [D, F]; Wd [F, D]; h, g, u, dg, du [M, F].
// Each product's element is summed over its K as cpu_gemm.h says, so a row's results do not depend on
// the other rows or the thread count. Built and loaded by jaxtrain/kernels/cpu_fused.py.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu_gemm.h"
#include "cpu_math.h"
#include "cpu_parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace jaxtrain::gemm;
using jaxtrain::Sigmoid;
using jaxtrain::V16;
using jaxtrain::V16u;

// Runs body(i0, i1, j0, width) for each run of rows [i0, i1) by panel [j0, j0 + width) of an m x n
// result, a thread first on its own runs of rows (cpu_parallel.h).
template <typename Body>
void Tiles(ffi::ThreadPool& pool, int64_t m, int64_t n, Body body) {
  if (m == 0 || n == 0) return;
  const int64_t panels = (n + kCols - 1) / kCols;
  const RowRuns runs(m);
  jaxtrain::ParallelFor(pool, runs.runs * panels, pool.num_threads(), [&](int64_t task) {
    const int64_t i0 = task / panels * runs.rows, i1 = std::min(m, i0 + runs.rows), j0 = task % panels * kCols;
    if (i0 < i1) body(i0, i1, j0, std::min(kCols, n - j0));
  });
}

// c's tile (+)= the product's, or 0 where K is 0 (Task sums nothing then).
void Product(const Gemm& g, int64_t i0, int64_t i1, int64_t j0, int64_t width, bool accumulate) {
  if (g.k > 0) return Task(g, g.c, j0, i0, i1, 0, g.k, accumulate);
  if (accumulate) return;
  for (int64_t i = i0; i < i1; ++i) std::fill(g.c + i * g.n + j0, g.c + i * g.n + j0 + width, 0.0f);
}

// f(count, in..., out...) on 16 lanes of a row's floats at a time: whole vectors, then the last
// count % 16 through zero-padded copies.
template <int NIn, int NOut, typename F>
inline void Rows16(int64_t count, const float* const (&in)[NIn], float* const (&out)[NOut], F f) {
  V16 a[NIn], b[NOut];
  int64_t j = 0;
  for (; j + 16 <= count; j += 16) {
    for (int q = 0; q < NIn; ++q) a[q] = *reinterpret_cast<const V16u*>(in[q] + j);
    f(a, b);
    for (int q = 0; q < NOut; ++q) *reinterpret_cast<V16u*>(out[q] + j) = b[q];
  }
  if (j == count) return;
  alignas(64) float lanes[NIn > NOut ? NIn : NOut][16] = {};
  for (int q = 0; q < NIn; ++q) std::copy(in[q] + j, in[q] + count, lanes[q]);
  for (int q = 0; q < NIn; ++q) a[q] = *reinterpret_cast<const V16*>(lanes[q]);
  f(a, b);
  for (int q = 0; q < NOut; ++q) {
    *reinterpret_cast<V16*>(lanes[q]) = b[q];
    std::copy(lanes[q], lanes[q] + (count - j), out[q] + j);
  }
}

bool Is2D(ffi::Buffer<ffi::F32>& a, int64_t rows, int64_t cols) {
  auto d = a.dimensions();
  return d.size() == 2 && d[0] == rows && d[1] == cols;
}

bool Is2D(ffi::ResultBuffer<ffi::F32>& a, int64_t rows, int64_t cols) {
  auto d = a->dimensions();
  return d.size() == 2 && d[0] == rows && d[1] == cols;
}

ffi::Error SwigluForward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> wg,
                         ffi::Buffer<ffi::F32> wu, ffi::ResultBuffer<ffi::F32> h, ffi::ResultBuffer<ffi::F32> g,
                         ffi::ResultBuffer<ffi::F32> u) {
  if (x.dimensions().size() != 2 || wg.dimensions().size() != 2) return ffi::Error::InvalidArgument("x, Wg: 2-D");
  const int64_t m = x.dimensions()[0], d = x.dimensions()[1], f = wg.dimensions()[1];
  if (!Is2D(wg, d, f) || !Is2D(wu, d, f) || !Is2D(h, m, f) || !Is2D(g, m, f) || !Is2D(u, m, f))
    return ffi::Error::InvalidArgument("shapes: x [M, D], Wg and Wu [D, F], h, g and u [M, F]");
  const Gemm gate{m, f, d, x.typed_data(), d, 1, wg.typed_data(), f, 1, g->typed_data()};
  const Gemm up{m, f, d, x.typed_data(), d, 1, wu.typed_data(), f, 1, u->typed_data()};
  float* const hp = h->typed_data();
  Tiles(pool, m, f, [&](int64_t i0, int64_t i1, int64_t j0, int64_t width) {
    Product(gate, i0, i1, j0, width, false);
    Product(up, i0, i1, j0, width, false);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t o = i * f + j0;
      Rows16<2, 1>(width, {gate.c + o, up.c + o}, {hp + o}, [](const V16* a, V16* b) {
        b[0] = a[0] * Sigmoid(a[0]) * a[1];  // h = silu(g) u
      });
    }
  });
  return ffi::Error::Success();
}

ffi::Error SwigluBackward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> dout, ffi::Buffer<ffi::F32> wd,
                          ffi::Buffer<ffi::F32> g, ffi::Buffer<ffi::F32> u, ffi::ResultBuffer<ffi::F32> dg,
                          ffi::ResultBuffer<ffi::F32> du) {
  if (dout.dimensions().size() != 2 || wd.dimensions().size() != 2) return ffi::Error::InvalidArgument("dout, Wd: 2-D");
  const int64_t m = dout.dimensions()[0], d = dout.dimensions()[1], f = wd.dimensions()[0];
  if (!Is2D(wd, f, d) || !Is2D(g, m, f) || !Is2D(u, m, f) || !Is2D(dg, m, f) || !Is2D(du, m, f))
    return ffi::Error::InvalidArgument("shapes: dout [M, D], Wd [F, D], g, u, dg and du [M, F]");
  // dh = dout Wd^T, written where dg goes and then replaced by dg
  const Gemm dh{m, f, d, dout.typed_data(), d, 1, wd.typed_data(), 1, d, dg->typed_data()};
  const float *const gp = g.typed_data(), *const up = u.typed_data();
  float* const dup = du->typed_data();
  Tiles(pool, m, f, [&](int64_t i0, int64_t i1, int64_t j0, int64_t width) {
    Product(dh, i0, i1, j0, width, false);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t o = i * f + j0;
      Rows16<3, 2>(width, {dh.c + o, gp + o, up + o}, {dh.c + o, dup + o}, [](const V16* a, V16* b) {
        const V16 s = Sigmoid(a[1]);
        b[0] = a[0] * a[2] * s * (1.0f + a[1] * (1.0f - s));  // dg = dh u silu'(g)
        b[1] = a[0] * a[1] * s;                               // du = dh silu(g)
      });
    }
  });
  return ffi::Error::Success();
}

// c = sum_i a_i b_i^T over the pairs (a_i [M, K_i], b_i [N, K_i]) given in order: a projection's input
// gradient where its input fed several products (dg Wg^T + du Wu^T; dq Wq^T + dk Wk^T + dv Wv^T).
ffi::Error MatmulSum(ffi::ThreadPool pool, ffi::RemainingArgs args, ffi::ResultBuffer<ffi::F32> c) {
  auto cd = c->dimensions();
  if (cd.size() != 2 || args.size() == 0 || args.size() % 2) return ffi::Error::InvalidArgument("pairs of a, b; c 2-D");
  const int64_t m = cd[0], n = cd[1];
  std::vector<Gemm> products;
  for (size_t i = 0; i < args.size(); i += 2) {
    auto a = args.get<ffi::Buffer<ffi::F32>>(i);
    auto b = args.get<ffi::Buffer<ffi::F32>>(i + 1);
    if (!a.has_value() || !b.has_value()) return ffi::Error::InvalidArgument("a and b must be float32");
    const int64_t k = a->dimensions().size() == 2 ? a->dimensions()[1] : -1;
    if (!Is2D(*a, m, k) || !Is2D(*b, n, k))
      return ffi::Error::InvalidArgument("shapes: each a_i [M, K_i], b_i [N, K_i], c [M, N]");
    products.push_back(Gemm{m, n, k, a->typed_data(), k, 1, b->typed_data(), 1, k, c->typed_data()});
  }
  Tiles(pool, m, n, [&](int64_t i0, int64_t i1, int64_t j0, int64_t width) {
    for (size_t p = 0; p < products.size(); ++p) Product(products[p], i0, i1, j0, width, p > 0);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxtrainCpuSwigluForward, SwigluForward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxtrainCpuSwigluBackward, SwigluBackward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxtrainCpuMatmulSum, MatmulSum,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().RemainingArgs().Ret<ffi::Buffer<ffi::F32>>());
