// The dropless MoE's grouped SwiGLU for XLA:CPU as XLA FFI handlers, float32: each expert's SwiGLU
// (Shazeer 2020) on its own group of rows, the rows sorted by expert (MegaBlocks' grouped GEMM, Gale et
// al. 2023, without its padding to blocks):
//   for rows r of group e: g = x Wg[e], u = x Wu[e], h = silu(g) u, out = h Wd[e]
// and its gradients (as mlp.cc's, per group), with the weight gradients a sum over the group's rows:
//   dWg[e] = x_e^T dg_e, dWu[e] = x_e^T du_e, dWd[e] = h_e^T dout_e.
//
// Why: XLA:CPU has no grouped GEMM (it expands ragged_dot into one masked dense product per group), and
// the windowed 2-D products (xla/grouped_windows.py) compute up to a window of discarded rows per expert and run
// the SwiGLU's elementwise work as passes of their own. Here a task is one run of one group's rows by one
// panel of columns (cpu_tiles.h), so no row is computed twice and the elementwise work runs on the tile.
//  - GroupedSwigluForward (x, sizes, Wg, Wu) -> (h, g, u)
//  - GroupedSwigluBackward (dout, sizes, Wd, g, u) -> (dg, du)
//  - GroupedMatmulSum (sizes, a1, b1, a2, b2, ...; transpose_b) -> sum_i a_i op(b_i[e]) per group:
//    out = h Wd[e] (b [E, K, N]) and dx = dg Wg[e]^T + du Wu[e]^T (transpose_b: b [E, N, K])
//  - GroupedWeightGrad (a, sizes, b) -> c [E, K, N], c[e] = a_e^T b_e
//
// Layouts (row-major): x, out, dout, dx [M, D] and h, g, u, dg, du [M, F] float32; sizes [E] int32, the
// rows of each expert in order (group e is rows [sum(sizes[:e]), sum(sizes[:e+1]))); Wg, Wu [E, D, F] and
// Wd [E, F, D] float32. Rows past the groups belong to no expert: their outputs and gradients are 0.
// Sizes are clamped to [0, M] in total. Each element is summed over its K as cpu_gemm.h says, so a row's
// results do not depend on the other rows, the grouping of the others or the thread count. Built and
// loaded by jaxtrain/kernels/cpu/library.py.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu_gemm.h"
#include "cpu_tiles.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace jaxtrain::gemm;
using namespace jaxtrain::tiles;

// Where each group starts: [E + 1] row offsets, the sizes clamped so that they stay within m rows.
std::vector<int64_t> Offsets(ffi::Buffer<ffi::S32>& sizes, int64_t m) {
  const int64_t e = static_cast<int64_t>(sizes.element_count());
  std::vector<int64_t> at(e + 1, 0);
  for (int64_t i = 0; i < e; ++i) at[i + 1] = std::min(m, at[i] + std::max<int32_t>(0, sizes.typed_data()[i]));
  return at;
}

std::vector<Run> GroupRuns(const std::vector<int64_t>& at) {
  std::vector<Run> runs;
  for (size_t e = 0; e + 1 < at.size(); ++e) AddRuns(runs, static_cast<int64_t>(e), at[e], at[e + 1]);
  return runs;
}

// The rows past the last group: no expert's, so 0.
void ZeroTail(float* c, int64_t from, int64_t m, int64_t n) { std::fill(c + from * n, c + m * n, 0.0f); }

ffi::Error GroupedSwigluForward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> sizes,
                                ffi::Buffer<ffi::F32> wg, ffi::Buffer<ffi::F32> wu, ffi::ResultBuffer<ffi::F32> h,
                                ffi::ResultBuffer<ffi::F32> g, ffi::ResultBuffer<ffi::F32> u) {
  if (x.dimensions().size() != 2 || wg.dimensions().size() != 3) return ffi::Error::InvalidArgument("x 2-D, Wg 3-D");
  const int64_t m = x.dimensions()[0], d = x.dimensions()[1], e = wg.dimensions()[0], f = wg.dimensions()[2];
  if (!HasShape(sizes.dimensions(), {e}) || !HasShape(wg.dimensions(), {e, d, f}) ||
      !HasShape(wu.dimensions(), {e, d, f}) || !HasShape(h->dimensions(), {m, f}) ||
      !HasShape(g->dimensions(), {m, f}) || !HasShape(u->dimensions(), {m, f}))
    return ffi::Error::InvalidArgument("shapes: x [M, D], sizes [E], Wg and Wu [E, D, F], h, g and u [M, F]");
  const std::vector<int64_t> at = Offsets(sizes, m);
  float *const hp = h->typed_data(), *const gp = g->typed_data(), *const up = u->typed_data();
  RunTiles(pool, GroupRuns(at), f, [&](const Run& r, int64_t j0, int64_t width) {
    const Gemm gate{m, f, d, x.typed_data(), d, 1, wg.typed_data() + r.group * d * f, f, 1, gp};
    const Gemm upg{m, f, d, x.typed_data(), d, 1, wu.typed_data() + r.group * d * f, f, 1, up};
    Product(gate, r.i0, r.i1, j0, width, false);
    Product(upg, r.i0, r.i1, j0, width, false);
    SwigluTile(gp, up, hp, f, r.i0, r.i1, j0, width);
  });
  for (float* p : {hp, gp, up}) ZeroTail(p, at.back(), m, f);
  return ffi::Error::Success();
}

ffi::Error GroupedSwigluBackward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> dout, ffi::Buffer<ffi::S32> sizes,
                                 ffi::Buffer<ffi::F32> wd, ffi::Buffer<ffi::F32> g, ffi::Buffer<ffi::F32> u,
                                 ffi::ResultBuffer<ffi::F32> dg, ffi::ResultBuffer<ffi::F32> du) {
  if (dout.dimensions().size() != 2 || wd.dimensions().size() != 3)
    return ffi::Error::InvalidArgument("dout 2-D, Wd 3-D");
  const int64_t m = dout.dimensions()[0], d = dout.dimensions()[1], e = wd.dimensions()[0], f = wd.dimensions()[1];
  if (!HasShape(sizes.dimensions(), {e}) || !HasShape(wd.dimensions(), {e, f, d}) ||
      !HasShape(g.dimensions(), {m, f}) || !HasShape(u.dimensions(), {m, f}) || !HasShape(dg->dimensions(), {m, f}) ||
      !HasShape(du->dimensions(), {m, f}))
    return ffi::Error::InvalidArgument("shapes: dout [M, D], sizes [E], Wd [E, F, D], g, u, dg and du [M, F]");
  const std::vector<int64_t> at = Offsets(sizes, m);
  float *const dgp = dg->typed_data(), *const dup = du->typed_data();
  RunTiles(pool, GroupRuns(at), f, [&](const Run& r, int64_t j0, int64_t width) {
    // dh = dout Wd[e]^T, written where dg goes and then replaced by dg
    const Gemm dh{m, f, d, dout.typed_data(), d, 1, wd.typed_data() + r.group * f * d, 1, d, dgp};
    Product(dh, r.i0, r.i1, j0, width, false);
    SwigluGradTile(dgp, g.typed_data(), u.typed_data(), dup, f, r.i0, r.i1, j0, width);
  });
  for (float* p : {dgp, dup}) ZeroTail(p, at.back(), m, f);
  return ffi::Error::Success();
}

// c = sum_i a_i op(b_i[e]) on each group's rows, over the pairs (a_i [M, K_i]; b_i [E, K_i, N], or
// [E, N, K_i] with transpose_b) given in order, each product summed over its K as one call would be.
ffi::Error GroupedMatmulSum(ffi::ThreadPool pool, ffi::Buffer<ffi::S32> sizes, ffi::RemainingArgs args,
                            bool transpose_b, ffi::ResultBuffer<ffi::F32> c) {
  auto cd = c->dimensions();
  if (cd.size() != 2 || args.size() == 0 || args.size() % 2) return ffi::Error::InvalidArgument("pairs of a, b; c 2-D");
  const int64_t m = cd[0], n = cd[1], e = static_cast<int64_t>(sizes.element_count());
  struct Pair {
    const float *a, *b;
    int64_t k;
  };
  std::vector<Pair> pairs;
  for (size_t i = 0; i < args.size(); i += 2) {
    auto a = args.get<ffi::Buffer<ffi::F32>>(i);
    auto b = args.get<ffi::Buffer<ffi::F32>>(i + 1);
    if (!a.has_value() || !b.has_value()) return ffi::Error::InvalidArgument("a and b must be float32");
    const int64_t k = a->dimensions().size() == 2 ? a->dimensions()[1] : -1;
    const bool fits = transpose_b ? HasShape(b->dimensions(), {e, n, k}) : HasShape(b->dimensions(), {e, k, n});
    if (!HasShape(a->dimensions(), {m, k}) || !fits)
      return ffi::Error::InvalidArgument("shapes: each a_i [M, K_i], b_i [E, K_i, N] ([E, N, K_i] transposed), c [M, N]");
    pairs.push_back({a->typed_data(), b->typed_data(), k});
  }
  const std::vector<int64_t> at = Offsets(sizes, m);
  RunTiles(pool, GroupRuns(at), n, [&](const Run& r, int64_t j0, int64_t width) {
    for (size_t p = 0; p < pairs.size(); ++p) {
      const int64_t k = pairs[p].k;
      const float* b = pairs[p].b + r.group * k * n;
      const Gemm prod{m, n, k, pairs[p].a, k, 1, b, transpose_b ? 1 : n, transpose_b ? k : 1, c->typed_data()};
      Product(prod, r.i0, r.i1, j0, width, p > 0);
    }
  });
  ZeroTail(c->typed_data(), at.back(), m, n);
  return ffi::Error::Success();
}

// c[e] = a_e^T b_e for each group e of rows (a [M, K], b [M, N], c [E, K, N]): an expert's weight
// gradient, summed over its rows in order; 0 for an expert without rows. A task is one run of c[e]'s K
// rows by one panel of its columns.
ffi::Error GroupedWeightGrad(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::S32> sizes,
                             ffi::Buffer<ffi::F32> b, ffi::ResultBuffer<ffi::F32> c) {
  if (a.dimensions().size() != 2 || b.dimensions().size() != 2) return ffi::Error::InvalidArgument("a, b: 2-D");
  const int64_t m = a.dimensions()[0], k = a.dimensions()[1], n = b.dimensions()[1];
  const int64_t e = static_cast<int64_t>(sizes.element_count());
  if (!HasShape(sizes.dimensions(), {e}) || !HasShape(b.dimensions(), {m, n}) || !HasShape(c->dimensions(), {e, k, n}))
    return ffi::Error::InvalidArgument("shapes: a [M, K], sizes [E], b [M, N], c [E, K, N]");
  const std::vector<int64_t> at = Offsets(sizes, m);
  std::vector<Run> runs;
  for (int64_t g = 0; g < e; ++g) AddRuns(runs, g, 0, k);
  RunTiles(pool, runs, n, [&](const Run& r, int64_t j0, int64_t width) {
    const int64_t first = at[r.group], rows = at[r.group + 1] - first;
    // A(i, p) = a[first + p][i]: the group's rows transposed; C = c[e], [K, N]
    const Gemm grad{k, n, rows, a.typed_data() + first * k, 1, k, b.typed_data() + first * n, n, 1,
                    c->typed_data() + r.group * k * n};
    Product(grad, r.i0, r.i1, j0, width, false);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxtrainCpuGroupedSwigluForward, GroupedSwigluForward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxtrainCpuGroupedSwigluBackward, GroupedSwigluBackward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxtrainCpuGroupedMatmulSum, GroupedMatmulSum,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .Attr<bool>("transpose_b")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxtrainCpuGroupedWeightGrad, GroupedWeightGrad,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
