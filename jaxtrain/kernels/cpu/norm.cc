// RMSNorm (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization") for XLA:CPU as two XLA FFI
// handlers, float32:
//   r = 1 / sqrt(mean(x^2) + eps), y = (x r) scale
//   dx = r (dy scale) - x r^3 mean(dy scale x), dscale = sum over rows of dy x r
//
// Why: XLA:CPU made the shakespeare-char model's nine norms ~12 small fusions and reductions a step
// in the forward and backward (~1.5 ms of a ~19 ms step on a 2-core Intel Xeon), each a pass over
// [tokens, embed] started on XLA's threads in any order. Here a call is one task per run of token
// rows (cpu_gemm.h's runs, so a thread starts on the rows its CPU had in the matmul before:
// cpu_parallel.h), each row done in one pass while in L1.
//
// Layouts (row-major, float32): x, y, dy, dx [M, D]; scale, dscale [D]; r [M]. A row's sums run over D
// in 16 lanes and then across them, in an order fixed by D; dscale sums each run of rows in order and
// then the runs in order, so the results depend on M and D only, not on the thread count.
// Built and loaded by jaxtrain/kernels/cpu/library.py.
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_gemm.h"
#include "cpu_math.h"
#include "cpu_parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jaxtrain::V16;
using jaxtrain::V16u;
using jaxtrain::gemm::RowRuns;

// sum_j a[j] b[j] over n floats: 16 lanes, then the lanes in order, then the last n % 16.
inline float Dot(const float* a, const float* b, int64_t n) {
  V16 acc{};
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) acc += *reinterpret_cast<const V16u*>(a + j) * *reinterpret_cast<const V16u*>(b + j);
  float sum = 0.0f;
  for (int q = 0; q < 16; ++q) sum += acc[q];
  for (; j < n; ++j) sum += a[j] * b[j];
  return sum;
}

// body(i0, i1) for each run of rows, a thread first on its own runs.
template <typename Body>
void Runs(ffi::ThreadPool& pool, int64_t m, Body body) {
  if (m == 0) return;
  const RowRuns runs(m);
  jaxtrain::ParallelFor(pool, runs.runs, pool.num_threads(), [&](int64_t run) {
    const int64_t i0 = run * runs.rows;
    if (i0 < m) body(run, i0, std::min(m, i0 + runs.rows));
  });
}

ffi::Error Forward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> scale, float eps,
                   ffi::ResultBuffer<ffi::F32> y, ffi::ResultBuffer<ffi::F32> r) {
  auto xd = x.dimensions();
  if (xd.size() != 2 || scale.dimensions().size() != 1 || scale.dimensions()[0] != xd[1])
    return ffi::Error::InvalidArgument("shapes: x [M, D], scale [D]");
  const int64_t m = xd[0], d = xd[1];
  const float *xp = x.typed_data(), *sp = scale.typed_data();
  float *yp = y->typed_data(), *rp = r->typed_data();
  Runs(pool, m, [&](int64_t, int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const float* xi = xp + i * d;
      float* yi = yp + i * d;
      const float ri = 1.0f / std::sqrt(Dot(xi, xi, d) / static_cast<float>(d) + eps);
      rp[i] = ri;
      for (int64_t j = 0; j < d; ++j) yi[j] = xi[j] * ri * sp[j];
    }
  });
  return ffi::Error::Success();
}

ffi::Error Backward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> scale,
                    ffi::Buffer<ffi::F32> r, ffi::Buffer<ffi::F32> dy, ffi::ResultBuffer<ffi::F32> dx,
                    ffi::ResultBuffer<ffi::F32> dscale) {
  auto xd = x.dimensions();
  if (xd.size() != 2 || scale.dimensions().size() != 1 || scale.dimensions()[0] != xd[1] ||
      r.dimensions().size() != 1 || r.dimensions()[0] != xd[0] || dy.dimensions().size() != 2 ||
      dy.dimensions()[0] != xd[0] || dy.dimensions()[1] != xd[1])
    return ffi::Error::InvalidArgument("shapes: x and dy [M, D], scale [D], r [M]");
  const int64_t m = xd[0], d = xd[1];
  const float *xp = x.typed_data(), *sp = scale.typed_data(), *rp = r.typed_data(), *dyp = dy.typed_data();
  float *dxp = dx->typed_data(), *dsp = dscale->typed_data();
  const RowRuns runs(m);
  std::vector<float> partial(m == 0 ? 0 : runs.runs * d, 0.0f);  // each run's dscale
  Runs(pool, m, [&](int64_t run, int64_t i0, int64_t i1) {
    thread_local std::vector<float> g;
    g.resize(d);
    float* ds = partial.data() + run * d;
    for (int64_t i = i0; i < i1; ++i) {
      const float *xi = xp + i * d, *dyi = dyp + i * d;
      float* dxi = dxp + i * d;
      const float ri = rp[i];
      for (int64_t j = 0; j < d; ++j) g[j] = dyi[j] * sp[j];
      const float c = Dot(g.data(), xi, d) / static_cast<float>(d) * ri * ri * ri;
      for (int64_t j = 0; j < d; ++j) {
        dxi[j] = ri * g[j] - c * xi[j];
        ds[j] += dyi[j] * xi[j] * ri;
      }
    }
  });
  std::fill(dsp, dsp + d, 0.0f);
  for (int64_t run = 0; run * d < static_cast<int64_t>(partial.size()); ++run)
    for (int64_t j = 0; j < d; ++j) dsp[j] += partial[run * d + j];
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxtrainCpuRmsNormForward, Forward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("eps")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxtrainCpuRmsNormBackward, Backward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
