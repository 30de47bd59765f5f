// Products cut into tasks, and the SwiGLU's elementwise work on a task's tile: shared by the dense MLP's
// kernels (mlp.cc) and the MoE experts' grouped ones (grouped.cc).
//
// A task is one run of a result's rows by one panel of kCols columns (cpu_gemm.h). A run lies inside one
// group of rows (the whole result for a dense product; one expert's rows for a grouped one), and the
// runs are listed in row order, so a thread's range of tasks is a range of token rows (cpu_parallel.h).
#pragma once

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <vector>

#include "cpu_gemm.h"
#include "cpu_math.h"
#include "cpu_parallel.h"
#include "xla/ffi/api/ffi.h"

namespace jaxtrain::tiles {

using namespace jaxtrain::gemm;

// Whether an FFI buffer's dimensions are `want`.
template <typename Dims>
inline bool HasShape(const Dims& dims, std::initializer_list<int64_t> want) {
  return dims.size() == want.size() && std::equal(want.begin(), want.end(), dims.begin());
}

struct Run {
  int64_t group, i0, i1;  // rows [i0, i1) of group `group`
};

// Appends the runs of rows [begin, end) of `group`: at most kChunkRows each, as cpu_gemm.h's RowRuns.
inline void AddRuns(std::vector<Run>& runs, int64_t group, int64_t begin, int64_t end) {
  if (end <= begin) return;
  const RowRuns cut(end - begin);
  for (int64_t r = 0; r < cut.runs; ++r) {
    const int64_t i0 = begin + r * cut.rows, i1 = std::min(end, i0 + cut.rows);
    if (i0 < i1) runs.push_back({group, i0, i1});
  }
}

// Runs body(run, j0, width) for each run by each panel [j0, j0 + width) of n columns, a thread first on
// its own runs.
template <typename Body>
void RunTiles(xla::ffi::ThreadPool& pool, const std::vector<Run>& runs, int64_t n, Body body) {
  if (runs.empty() || n == 0) return;
  const int64_t panels = (n + kCols - 1) / kCols;
  ParallelFor(pool, static_cast<int64_t>(runs.size()) * panels, pool.num_threads(), [&](int64_t task) {
    const int64_t j0 = task % panels * kCols;
    body(runs[task / panels], j0, std::min(kCols, n - j0));
  });
}

// RunTiles over the m rows of one group: body(i0, i1, j0, width).
template <typename Body>
void Tiles(xla::ffi::ThreadPool& pool, int64_t m, int64_t n, Body body) {
  std::vector<Run> runs;
  AddRuns(runs, 0, 0, m);
  RunTiles(pool, runs, n, [&](const Run& r, int64_t j0, int64_t width) { body(r.i0, r.i1, j0, width); });
}

// c's tile (+)= the product's, or 0 where K is 0 (Task sums nothing then).
inline void Product(const Gemm& g, int64_t i0, int64_t i1, int64_t j0, int64_t width, bool accumulate) {
  if (g.k > 0) return Task(g, g.c, j0, i0, i1, 0, g.k, accumulate);
  if (accumulate) return;
  for (int64_t i = i0; i < i1; ++i) std::fill(g.c + i * g.n + j0, g.c + i * g.n + j0 + width, 0.0f);
}

// f(in, out) on 16 lanes of a row's floats at a time: whole vectors, then the last count % 16 through
// zero-padded copies.
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

// SwiGLU (Shazeer 2020) on a tile of [rows, f] arrays: h = silu(g) u.
inline void SwigluTile(const float* g, const float* u, float* h, int64_t f, int64_t i0, int64_t i1, int64_t j0,
                       int64_t width) {
  for (int64_t i = i0; i < i1; ++i) {
    const int64_t o = i * f + j0;
    Rows16<2, 1>(width, {g + o, u + o}, {h + o}, [](const V16* a, V16* b) { b[0] = a[0] * Sigmoid(a[0]) * a[1]; });
  }
}

// Its gradients on a tile, given dh where dg goes: dg = dh u silu'(g) (in place of dh), du = dh silu(g),
// with silu'(g) = sigmoid(g) (1 + g (1 - sigmoid(g))).
inline void SwigluGradTile(float* dh, const float* g, const float* u, float* du, int64_t f, int64_t i0, int64_t i1,
                           int64_t j0, int64_t width) {
  for (int64_t i = i0; i < i1; ++i) {
    const int64_t o = i * f + j0;
    Rows16<3, 2>(width, {dh + o, g + o, u + o}, {dh + o, du + o}, [](const V16* a, V16* b) {
      const V16 s = Sigmoid(a[1]);
      b[0] = a[0] * a[2] * s * (1.0f + a[1] * (1.0f - s));
      b[1] = a[0] * a[1] * s;
    });
  }
}

}  // namespace jaxtrain::tiles
