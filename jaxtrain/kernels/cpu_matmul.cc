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
// The product itself is BLIS's (Goto & van de Geijn 2008, "Anatomy of high-performance matrix
// multiplication"; Van Zee & van de Geijn 2015): B is packed into panels of kCols columns, and a
// micro-kernel sweeps kRows rows of A (read in place through its strides) over a 128-row block of a
// panel (32 KiB, in L1) with a kRows x kCols tile of C in vector registers.
//
// Layouts (row-major, float32): a [M, K] (or [K, M] with transpose_a), b [K, N] (or [N, K] with
// transpose_b), c [M, N]. Each element of C is summed over K in an order that depends only on K (in
// 128-long blocks; with transpose_a and K >= kSplitK, each half so and then the two added), not on
// M, N or the thread count: a row of C is the same bit for bit whatever other rows are computed.
// Built and loaded by jaxtrain/kernels/cpu_fused.py with cpu_attention.cc.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu_parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kRows = 6;                    // rows of a C tile
constexpr int64_t kVectors = 4;                 // 16-float vectors a row of a C tile spans
constexpr int64_t kCols = 16 * kVectors;        // 6 x 4 accumulators + 4 B vectors + a broadcast: 29 registers
constexpr int64_t kBlockK = 128;                // rows of a panel block: 128 x 64 floats, 32 KiB
constexpr int64_t kChunkRows = 64 * kRows;      // rows of A a task sweeps at most
constexpr int64_t kSplitK = 256;                // transpose_a: from this K on, summed as two halves
constexpr int64_t kMaxSplitOut = int64_t{1} << 20;  // ... when C has at most this many floats

typedef float V16 __attribute__((vector_size(64)));
typedef float V16u __attribute__((vector_size(64), aligned(4)));

// C[r][0, 16 NV) (+)= sum_p A(r, p) panel[p][0, 16 NV) for r < R, with A(r, p) at a[r * ars + p * acs]
// and the panel's rows kCols floats apart; `add` adds to C instead of overwriting it.
template <int R, int NV>
inline void Micro(int64_t k, const float* a, int64_t ars, int64_t acs, const float* panel, float* c, int64_t ldc,
                  bool add) {
  V16 acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = add ? *reinterpret_cast<const V16u*>(c + r * ldc + 16 * v) : V16{};
  for (int64_t p = 0; p < k; ++p) {
    V16 b[NV];
    for (int v = 0; v < NV; ++v) b[v] = *reinterpret_cast<const V16*>(panel + p * kCols + 16 * v);
    const float* ap = a + p * acs;
    for (int r = 0; r < R; ++r) {
      const float x = ap[r * ars];
      for (int v = 0; v < NV; ++v) acc[r][v] += x * b[v];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) *reinterpret_cast<V16u*>(c + r * ldc + 16 * v) = acc[r][v];
}

// Micro<rows, vectors> for run-time rows in [1, kRows] and vectors in [1, kVectors].
template <int R = kRows>
inline void Dispatch(int rows, int vectors, int64_t k, const float* a, int64_t ars, int64_t acs, const float* panel,
                     float* c, int64_t ldc, bool add) {
  if constexpr (R > 0) {
    if (rows != R) return Dispatch<R - 1>(rows, vectors, k, a, ars, acs, panel, c, ldc, add);
    switch (vectors) {
      case 4: return Micro<R, 4>(k, a, ars, acs, panel, c, ldc, add);
      case 3: return Micro<R, 3>(k, a, ars, acs, panel, c, ldc, add);
      case 2: return Micro<R, 2>(k, a, ars, acs, panel, c, ldc, add);
      default: return Micro<R, 1>(k, a, ars, acs, panel, c, ldc, add);
    }
  }
}

struct Gemm {
  int64_t m, n, k;
  const float* a;
  int64_t ars, acs;  // A(i, p) = a[i * ars + p * acs]
  const float* b;
  int64_t brs, bcs;  // B(p, j) = b[p * brs + j * bcs]
  float* c;          // C(i, j) = c[i * n + j]
};

// C's rows [i0, i1) by columns [j0, j0 + kCols) (fewer at the right edge), summed over p in [p0, p1).
void Task(const Gemm& g, float* c, int64_t j0, int64_t i0, int64_t i1, int64_t p0, int64_t p1) {
  thread_local std::vector<float> buffer;
  const int64_t k = p1 - p0, rows = i1 - i0;
  const int64_t width = std::min(kCols, g.n - j0);
  const int vectors = static_cast<int>((width + 15) / 16);
  const bool whole = width == 16 * vectors;  // else the tile goes through a buffer, then its valid columns
  const size_t need = (k + (whole ? 0 : rows)) * kCols + 16;
  if (buffer.size() < need) buffer.resize(need);
  // 64-byte aligned: the micro-kernel loads whole aligned vectors from the panel
  float* panel = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buffer.data()) + 63) & ~uintptr_t{63});
  for (int64_t p = 0; p < k; ++p) {
    const float* src = g.b + (p0 + p) * g.brs + j0 * g.bcs;
    float* dst = panel + p * kCols;
    if (g.bcs == 1) {
      std::copy(src, src + width, dst);
    } else {
      for (int64_t j = 0; j < width; ++j) dst[j] = src[j * g.bcs];
    }
    std::fill(dst + width, dst + 16 * vectors, 0.0f);
  }
  float* out = whole ? c + i0 * g.n + j0 : panel + k * kCols;
  const int64_t ldc = whole ? g.n : kCols;
  for (int64_t kb = 0; kb < k; kb += kBlockK) {
    const int64_t kn = std::min(kBlockK, k - kb);
    for (int64_t i = i0; i < i1; i += kRows) {
      Dispatch(static_cast<int>(std::min(kRows, i1 - i)), vectors, kn, g.a + i * g.ars + (p0 + kb) * g.acs, g.ars,
               g.acs, panel + kb * kCols, out + (i - i0) * ldc, ldc, kb > 0);
    }
  }
  if (!whole) {
    for (int64_t r = 0; r < rows; ++r) std::copy(out + r * kCols, out + r * kCols + width, c + (i0 + r) * g.n + j0);
  }
}

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
  const int64_t panels = (n + kCols - 1) / kCols, tiles = (m + kRows - 1) / kRows;
  const int64_t runs = (tiles * kRows + kChunkRows - 1) / kChunkRows;
  const int64_t tiles_per_run = (tiles + runs - 1) / runs;
  thread_local std::vector<float> scratch;  // the second slice's sum
  if (slices > 1) scratch.resize(m * n);
  float* const partial = scratch.data();  // not `scratch` in the tasks: a helper's thread_local is its own
  jaxtrain::ParallelFor(pool, slices * runs * panels, pool.num_threads(), [&](int64_t task) {
    const int64_t slice = task / (runs * panels), run = task / panels % runs, j0 = task % panels * kCols;
    const int64_t i0 = run * tiles_per_run * kRows, i1 = std::min(m, i0 + tiles_per_run * kRows);
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
