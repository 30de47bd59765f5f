// C = op(A) op(B) for XLA:CPU as an XLA FFI handler, float32, either operand transposed.
//
// Why: a small transformer's matmuls on a CPU ([tokens, 128] x [128, 344] and their gradients) are
// too small for XLA:CPU's own dots (Eigen, YNNPACK, oneDNN alike) to use two cores well: on a 2-core
// Intel Xeon they ran at ~150-230 GFLOP/s on two threads against ~170 on one. Two things make the
// difference here (docs/benchmarks.md):
//  - the work of a call is cut into runs of A's rows (token rows), and each thread starts on the run
//    its CPU had in the call before (cpu_parallel.h), so it reads rows it wrote from its own cache;
//  - the weight gradient X^T dY, whose contraction runs over the tokens, is summed as two halves of
//    the tokens, each thread one half, and the halves added: each reads only its own rows of X, dY.
// The product itself is cpu_gemm.h's (BLIS's design).
//
// Layouts (row-major, float32): a [M, K] (or [K, M] with transpose_a), b [K, N] (or [N, K] with
// transpose_b), c [M, N]. Each element of C is summed over K in an order that depends only on K (in
// 128-long blocks; with transpose_a and K >= kSplitK, each half so and then the two added), not on
// M, N or the thread count: a row of C is the same bit for bit whatever other rows are computed.
// Built and loaded by jaxtrain/kernels/cpu/library.py with attention.cc.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu_gemm.h"
#include "cpu_parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace jaxtrain::gemm;

ffi::Error Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> b, bool transpose_a,
                  bool transpose_b, ffi::ResultBuffer<ffi::F32> c) {
  auto ad = a.dimensions(), bd = b.dimensions(), cd = c->dimensions();
  if (ad.size() != 2 || bd.size() != 2 || cd.size() != 2) return ffi::Error::InvalidArgument("a, b and c must be 2-D");
  const int64_t m = transpose_a ? ad[1] : ad[0], k = transpose_a ? ad[0] : ad[1];
  const int64_t kb = transpose_b ? bd[1] : bd[0], n = transpose_b ? bd[0] : bd[1];
  if (k != kb) return ffi::Error::InvalidArgument("the contracting dimensions differ");
  if (cd[0] != m || cd[1] != n) return ffi::Error::InvalidArgument("c's shape is not [M, N]");
  const Gemm g{m, n, k, a.typed_data(), transpose_a ? 1 : k, transpose_a ? m : 1,
               b.typed_data(), transpose_b ? 1 : n, transpose_b ? k : 1, c->typed_data()};
  if (m == 0 || n == 0) return ffi::Error::Success();
  if (k == 0) {
    std::fill(g.c, g.c + m * n, 0.0f);
    return ffi::Error::Success();
  }
  // Tasks: (K slice, run of rows, panel of columns), in that order, so that a thread's range of them
  // is one slice or one run of rows: its own token rows in either case.
  const int64_t slices = transpose_a && k >= kSplitK && m * n <= kMaxSplitOut ? 2 : 1;
  const int64_t panels = (n + kCols - 1) / kCols;
  const RowRuns runs(m);
  thread_local std::vector<float> scratch;  // the second slice's sum
  if (slices > 1) scratch.resize(m * n);
  float* const partial = scratch.data();  // not `scratch` in the tasks: a helper's thread_local is its own
  jaxtrain::ParallelFor(pool, slices * runs.runs * panels, pool.num_threads(), [&](int64_t task) {
    const int64_t slice = task / (runs.runs * panels), run = task / panels % runs.runs, j0 = task % panels * kCols;
    const int64_t i0 = run * runs.rows, i1 = std::min(m, i0 + runs.rows);
    if (i0 < i1) Task(g, slice ? partial : g.c, j0, i0, i1, slice * (k / 2), slices == 1 || slice ? k : k / 2);
  });
  if (slices > 1) {
    for (int64_t i = 0; i < m * n; ++i) g.c[i] += partial[i];
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxtrainCpuMatmul, Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("transpose_a")
                                  .Attr<bool>("transpose_b")
                                  .Ret<ffi::Buffer<ffi::F32>>());
