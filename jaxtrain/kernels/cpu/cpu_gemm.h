// The float32 GEMM core of jaxtrain's XLA:CPU kernels (matmul.cc, mlp.cc): one task of
// C = op(A) op(B), a run of C's rows by one panel of its columns, summed over a slice of K.
//
// The product is BLIS's (Goto & van de Geijn 2008, "Anatomy of high-performance matrix
// multiplication"; Van Zee & van de Geijn 2015): B is packed into panels of kCols columns, and a
// micro-kernel sweeps kRows rows of A (read in place through its strides) over a 128-row block of a
// panel (32 KiB, in L1) with a kRows x kCols tile of C in vector registers. Each element of C is
// summed over K in 128-long blocks in order, so its bits depend only on K, not on M, N, the task or
// the thread.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu_math.h"

namespace jaxtrain::gemm {

constexpr int64_t kRows = 6;                    // rows of a C tile
constexpr int64_t kVectors = 4;                 // 16-float vectors a row of a C tile spans
constexpr int64_t kCols = 16 * kVectors;        // 6 x 4 accumulators + 4 B vectors + a broadcast: 29 registers
constexpr int64_t kBlockK = 128;                // rows of a panel block: 128 x 64 floats, 32 KiB
constexpr int64_t kChunkRows = 64 * kRows;      // rows of A a task sweeps at most
constexpr int64_t kSplitK = 256;                // transpose_a: from this K on, summed as two halves
constexpr int64_t kMaxSplitOut = int64_t{1} << 20;  // ... when C has at most this many floats

using jaxtrain::V16;
using jaxtrain::V16u;

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

// C's rows [i0, i1) by columns [j0, j0 + kCols) (fewer at the right edge), summed over p in [p0, p1);
// `accumulate` adds the sum to what C holds, instead of writing it.
inline void Task(const Gemm& g, float* c, int64_t j0, int64_t i0, int64_t i1, int64_t p0, int64_t p1,
                 bool accumulate = false) {
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
  if (!whole && accumulate) {
    for (int64_t r = 0; r < rows; ++r) std::copy(c + (i0 + r) * g.n + j0, c + (i0 + r) * g.n + j0 + width, out + r * kCols);
  }
  for (int64_t kb = 0; kb < k; kb += kBlockK) {
    const int64_t kn = std::min(kBlockK, k - kb);
    for (int64_t i = i0; i < i1; i += kRows) {
      Dispatch(static_cast<int>(std::min(kRows, i1 - i)), vectors, kn, g.a + i * g.ars + (p0 + kb) * g.acs, g.ars,
               g.acs, panel + kb * kCols, out + (i - i0) * ldc, ldc, accumulate || kb > 0);
    }
  }
  if (!whole) {
    for (int64_t r = 0; r < rows; ++r) std::copy(out + r * kCols, out + r * kCols + width, c + (i0 + r) * g.n + j0);
  }
}

// How a call cuts C's m rows: `runs` runs of `rows` rows each (a multiple of kRows; the last may be
// shorter), at most kChunkRows each. A thread's range of tasks is then its own token rows.
struct RowRuns {
  int64_t runs, rows;
  explicit RowRuns(int64_t m) {
    const int64_t tiles = (m + kRows - 1) / kRows;
    runs = std::max<int64_t>(1, (tiles * kRows + kChunkRows - 1) / kChunkRows);
    rows = (tiles + runs - 1) / runs * kRows;
  }
};

}  // namespace jaxtrain::gemm
