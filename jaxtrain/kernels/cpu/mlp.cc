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
// (out = h Wd and the weight gradients x^T dg, x^T du, h^T dout are matmul.cc's.)
//
// Layouts (row-major, float32): x, dout, dx [M, D]; Wg, Wu [D, F]; Wd [F, D]; h, g, u, dg, du [M, F].
// Each product's element is summed over its K as cpu_gemm.h says, so a row's results do not depend on
// the other rows or the thread count. Built and loaded by jaxtrain/kernels/cpu/library.py.
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

ffi::Error SwigluForward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> wg,
                         ffi::Buffer<ffi::F32> wu, ffi::ResultBuffer<ffi::F32> h, ffi::ResultBuffer<ffi::F32> g,
                         ffi::ResultBuffer<ffi::F32> u) {
  if (x.dimensions().size() != 2 || wg.dimensions().size() != 2) return ffi::Error::InvalidArgument("x, Wg: 2-D");
  const int64_t m = x.dimensions()[0], d = x.dimensions()[1], f = wg.dimensions()[1];
  if (!HasShape(wg.dimensions(), {d, f}) || !HasShape(wu.dimensions(), {d, f}) || !HasShape(h->dimensions(), {m, f}) ||
      !HasShape(g->dimensions(), {m, f}) || !HasShape(u->dimensions(), {m, f}))
    return ffi::Error::InvalidArgument("shapes: x [M, D], Wg and Wu [D, F], h, g and u [M, F]");
  const Gemm gate{m, f, d, x.typed_data(), d, 1, wg.typed_data(), f, 1, g->typed_data()};
  const Gemm up{m, f, d, x.typed_data(), d, 1, wu.typed_data(), f, 1, u->typed_data()};
  float* const hp = h->typed_data();
  Tiles(pool, m, f, [&](int64_t i0, int64_t i1, int64_t j0, int64_t width) {
    Product(gate, i0, i1, j0, width, false);
    Product(up, i0, i1, j0, width, false);
    SwigluTile(gate.c, up.c, hp, f, i0, i1, j0, width);
  });
  return ffi::Error::Success();
}

ffi::Error SwigluBackward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> dout, ffi::Buffer<ffi::F32> wd,
                          ffi::Buffer<ffi::F32> g, ffi::Buffer<ffi::F32> u, ffi::ResultBuffer<ffi::F32> dg,
                          ffi::ResultBuffer<ffi::F32> du) {
  if (dout.dimensions().size() != 2 || wd.dimensions().size() != 2) return ffi::Error::InvalidArgument("dout, Wd: 2-D");
  const int64_t m = dout.dimensions()[0], d = dout.dimensions()[1], f = wd.dimensions()[0];
  if (!HasShape(wd.dimensions(), {f, d}) || !HasShape(g.dimensions(), {m, f}) || !HasShape(u.dimensions(), {m, f}) ||
      !HasShape(dg->dimensions(), {m, f}) || !HasShape(du->dimensions(), {m, f}))
    return ffi::Error::InvalidArgument("shapes: dout [M, D], Wd [F, D], g, u, dg and du [M, F]");
  // dh = dout Wd^T, written where dg goes and then replaced by dg
  const Gemm dh{m, f, d, dout.typed_data(), d, 1, wd.typed_data(), 1, d, dg->typed_data()};
  const float *const gp = g.typed_data(), *const up = u.typed_data();
  float* const dup = du->typed_data();
  Tiles(pool, m, f, [&](int64_t i0, int64_t i1, int64_t j0, int64_t width) {
    Product(dh, i0, i1, j0, width, false);
    SwigluGradTile(dh.c, gp, up, dup, f, i0, i1, j0, width);
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
    if (!HasShape(a->dimensions(), {m, k}) || !HasShape(b->dimensions(), {n, k}))
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
