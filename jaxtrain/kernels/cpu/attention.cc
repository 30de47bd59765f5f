// Causal softmax attention for XLA:CPU as two XLA FFI handlers (forward, backward), float32.
//
// Why: on a CPU, a short sequence's attention is many tiny batched matmuls (one per batch
// element and head), which XLA runs at a fraction of the matmul rate; here each (batch, kv
// head) pair is one task whose keys and values stay in L1/L2 while all its rows are done.
// The algorithm is FlashAttention's (Dao et al. 2022; FlashAttention-2, Dao 2023): the forward
// keeps the row's log-sum-exp, the backward recomputes the probabilities from it:
//   P = exp(S - lse), dP = dO V^T, dS = P * (dP - rowsum(dO * O)), dQ = s dS K, dK = s dS^T Q, dV = P^T dO
// with S = s Q K^T (s the softmax scale). Rows of a task are independent in the forward; in the
// backward, dK and dV of a kv head are summed over its query heads (grouped-query attention)
// inside the task, so no two tasks write the same memory.
//
// Per head, the [T, T] scores are computed in register tiles of 8 rows by 16 or 32 columns,
// skipping the tiles above the causal diagonal; the softmax runs on each row in between. The
// products over the key dimension (P V, dS K) stop at the row block's last visible key, and
// those over the rows (dS^T Q, P^T dO) start at the key block's first row.
//
// Layouts (row-major, float32): q, o, dq [B, T, H, D]; k, v, dk, dv [B, T, KVH, D]; lse [B, H, T].
// The rope handlers also take cos, sin [T, D / 2] and rotate q and k first (Rotate below): the model's
// rotary embedding, which XLA made a pass over q and k each way.
// T and D must be multiples of 16. Tasks are spread over XLA's intra-op thread pool and the
// calling thread (cpu_parallel.h), each thread starting on the batch elements whose token rows its CPU
// had in the kernel before (the projections' matmul, matmul.cc, cuts its rows the same way).
// Built and loaded by jaxtrain/kernels/cpu/library.py.
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include <algorithm>
#include <bit>
#include <cmath>
#include <climits>
#include <cstdint>
#include <vector>

#include "cpu_math.h"
#include "cpu_parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jaxtrain::Exp;

struct Dims {
  int64_t b, t, h, kvh, d;
};

// Max and sum of x[0..n), n % 16 == 0, in 16 lanes (a float reduction in one chain does not vectorize).
inline float Max16(const float* x, int64_t n) {
  float lane[16];
  for (int j = 0; j < 16; ++j) lane[j] = x[j];
  for (int64_t i = 16; i < n; i += 16)
    for (int j = 0; j < 16; ++j) lane[j] = std::max(lane[j], x[i + j]);
  float m = lane[0];
  for (int j = 1; j < 16; ++j) m = std::max(m, lane[j]);
  return m;
}

inline float Sum16(const float* x, int64_t n) {
  float lane[16] = {};
  for (int64_t i = 0; i < n; i += 16)
    for (int j = 0; j < 16; ++j) lane[j] += x[i + j];
  float s = 0.0f;
  for (int j = 0; j < 16; ++j) s += lane[j];
  return s;
}

// Row i of a causal score matrix is visible up to column i; its first Visible16(i) columns hold
// the visible ones and a few masked ones (a multiple of 16, for the vector loops).
inline int64_t Visible16(int64_t i) { return (i + 16) / 16 * 16; }

constexpr int64_t kRows = 8;  // rows of C a micro-kernel step keeps in registers

// Columns [j0, j0 + W) of rows [i0, i0 + kRows) of C = A B over k in [lo, hi): kRows x W
// accumulators (W = 16 or 32 floats: one or two AVX-512 registers a row) stay in registers.
// A's element (i, k) is at a[i * ars + k * acs], so A may be a transposed view.
using jaxtrain::V16;
using jaxtrain::V16u;

template <int64_t W>
inline void Block(int64_t i0, int64_t j0, int64_t lo, int64_t hi, const float* a, int64_t ars, int64_t acs,
                  const float* b, int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  // Explicit 16-float vectors, each A element broadcast from memory: left to itself GCC loaded a
  // transposed A's 8 contiguous elements as one vector and permuted them into broadcasts.
  constexpr int64_t NV = W / 16;
  V16 acc[kRows][NV];
  for (int64_t r = 0; r < kRows; ++r)
    for (int64_t v = 0; v < NV; ++v)
      acc[r][v] = accumulate ? *reinterpret_cast<const V16u*>(c + (i0 + r) * ldc + j0 + 16 * v) : V16{};
  for (int64_t k = lo; k < hi; ++k) {
    const float* bk = b + k * ldb + j0;
    V16 bv[NV];
    for (int64_t v = 0; v < NV; ++v) bv[v] = *reinterpret_cast<const V16u*>(bk + 16 * v);
    const float* ak = a + i0 * ars + k * acs;
    for (int64_t r = 0; r < kRows; ++r) {
      const float ar = ak[r * ars];
      for (int64_t v = 0; v < NV; ++v) acc[r][v] += ar * bv[v];
    }
  }
  for (int64_t r = 0; r < kRows; ++r)
    for (int64_t v = 0; v < NV; ++v) *reinterpret_cast<V16u*>(c + (i0 + r) * ldc + j0 + 16 * v) = acc[r][v];
}

// C[i][j] (+)= sum_{k in range(i0)} A[i][k] B[k][j] for i < m (m % kRows == 0) and j < n (n % 16 == 0),
// where i0 is i's row block and range(i0) a pair [lo, hi) (the causal limits).
template <typename Range>
void Gemm(int64_t m, int64_t n, const float* a, int64_t ars, int64_t acs, const float* b, int64_t ldb, float* c,
          int64_t ldc, bool accumulate, Range range) {
  for (int64_t i0 = 0; i0 < m; i0 += kRows) {
    const auto [lo, hi] = range(i0);
    int64_t j0 = 0;
    for (; j0 + 32 <= n; j0 += 32) Block<32>(i0, j0, lo, hi, a, ars, acs, b, ldb, c, ldc, accumulate);
    if (j0 < n) Block<16>(i0, j0, lo, hi, a, ars, acs, b, ldb, c, ldc, accumulate);
  }
}

// Copies head `head` of a [T, heads, D] slab transposed, into a dense [D, T]: the B operand of
// Q K^T (and of dO V^T). Every other operand is read or written in place through its row stride.
inline void GatherTransposed(const float* slab, int64_t t, int64_t heads, int64_t head, int64_t d, float* dst) {
  const float* src = slab + head * d;
  const int64_t stride = heads * d;  // floats from one row of the head to the next
#ifdef __AVX512F__
  // 16 rows of a column at a time with one gather (t % 16 == 0): the element-by-element copy was
  // ~20% of a task's time at the shakespeare-char shape (perf).
  if (stride * 15 <= INT32_MAX) {
    const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(static_cast<int32_t>(stride)));
    for (int64_t i = 0; i < t; i += 16)
      for (int64_t c = 0; c < d; ++c)
        _mm512_storeu_ps(dst + c * t + i, _mm512_i32gather_ps(rows, src + i * stride + c, 4));
    return;
  }
#endif
  for (int64_t i = 0; i < t; ++i)
    for (int64_t c = 0; c < d; ++c) dst[c * t + i] = src[i * stride + c];
}

// Rotary position embedding (Su et al. 2021; HF's rotate_half convention) of rows [0, t) of one head:
// y1 = x1 cos - x2 sin, y2 = x2 cos + x1 sin per half of the row, or its transpose (inverse: the
// gradient) dx1 = dy1 cos + dy2 sin, dx2 = dy2 cos - dy1 sin. cos, sin: [T, D / 2]. Row i of x is at
// x + i * xs, of y at y + i * ys; y may be x.
struct Rope {
  const float *cos, *sin;
};

inline void Rotate(const Rope& rope, const float* x, int64_t xs, float* y, int64_t ys, int64_t t, int64_t d,
                   bool inverse) {
  const int64_t half = d / 2;
  const float sign = inverse ? -1.0f : 1.0f;
  for (int64_t i = 0; i < t; ++i) {
    const float *ci = rope.cos + i * half, *si = rope.sin + i * half;
    const float* xi = x + i * xs;
    float* yi = y + i * ys;
    for (int64_t c = 0; c < half; ++c) {
      const float a = xi[c], b = xi[c + half], sn = sign * si[c];
      yi[c] = a * ci[c] - b * sn;
      yi[c + half] = b * ci[c] + a * sn;
    }
  }
}

// Causal ranges for a row block starting at i0: keys [0, i0 + kRows) (rounded up to a vector
// width for the output columns), and, for products over rows of a transposed matrix, rows [i0, T).
inline int64_t KeysUpTo(int64_t i0, int64_t t) { return std::min(t, i0 + kRows); }
inline int64_t Columns(int64_t i0, int64_t t) { return std::min(t, (i0 + kRows + 15) / 16 * 16); }

ffi::Error CheckShapes(const Dims& m) {
  if (m.h % m.kvh != 0) return ffi::Error::InvalidArgument("heads must be a multiple of kv heads");
  if (m.t % 16 != 0 || m.d % 16 != 0)
    return ffi::Error::InvalidArgument("length and head_dim must be multiples of 16");
  return ffi::Error::Success();
}

// One (batch, kv head) pair of the forward: its query heads' rows, keys and values. With rope, q and
// k are rotated first (into buffers: the operands are the unrotated ones).
void ForwardTask(const Dims& m, float scale, const float* qp, const float* kp, const float* vp, float* op, float* lp,
                 const Rope* rope, int64_t task) {
  const int64_t g = m.h / m.kvh, t = m.t, d = m.d;
  const int64_t bi = task / m.kvh, kh = task % m.kvh;
  const int64_t qs = m.h * d, ks = m.kvh * d;  // row strides of the [T, heads, D] slabs
  thread_local std::vector<float> buffer;
  buffer.resize(t * d + t * t + (rope ? 2 * t * d : 0));
  float* kt = buffer.data();
  float* s = kt + t * d;
  float* qr = s + t * t;  // rope: a query head's rotated rows, then the kv head's rotated keys
  if (rope) {
    Rotate(*rope, kp + bi * t * ks + kh * d, ks, qr + t * d, d, t, d, false);
    GatherTransposed(qr + t * d, t, 1, 0, d, kt);
  } else {
    GatherTransposed(kp + bi * t * ks, t, m.kvh, kh, d, kt);
  }
  const float* vv = vp + bi * t * ks + kh * d;
  auto all_d = [&](int64_t) { return std::make_pair(int64_t{0}, d); };
  for (int64_t hh = kh * g; hh < (kh + 1) * g; ++hh) {
    const float* qq = qp + bi * t * qs + hh * d;
    int64_t qstride = qs;
    if (rope) {
      Rotate(*rope, qq, qs, qr, d, t, d, false);
      qq = qr;
      qstride = d;
    }
    // S = Q K^T on the columns a row block can see (scaled in the softmax below)
    for (int64_t i0 = 0; i0 < t; i0 += kRows)
      Gemm(kRows, Columns(i0, t), qq + i0 * qstride, qstride, 1, kt, t, s + i0 * t, t, false, all_d);
    float* lrow = lp + (bi * m.h + hh) * t;
    for (int64_t i = 0; i < t; ++i) {
      float* si = s + i * t;
      const int64_t n = Visible16(i);
      for (int64_t j = 0; j < n; ++j) si[j] = j <= i ? si[j] * scale : -INFINITY;  // Exp gives 0 there
      const float mx = Max16(si, n);
      for (int64_t j = 0; j < n; ++j) si[j] = Exp(si[j] - mx);
      const float l = Sum16(si, n);
      const float inv = 1.0f / l;
      for (int64_t j = 0; j < n; ++j) si[j] *= inv;
      for (int64_t j = n; j < t; ++j) si[j] = 0.0f;
      lrow[i] = mx + std::log(l);
    }
    Gemm(t, d, s, t, 1, vv, ks, op + bi * t * qs + hh * d, qs, false,
         [&](int64_t i0) { return std::make_pair(int64_t{0}, KeysUpTo(i0, t)); });
  }
}

ffi::Error ForwardCall(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& q, ffi::Buffer<ffi::F32>& k,
                       ffi::Buffer<ffi::F32>& v, float scale, ffi::ResultBuffer<ffi::F32>& o,
                       ffi::ResultBuffer<ffi::F32>& lse, const Rope* rope) {
  auto qd = q.dimensions(), kd = k.dimensions();
  if (qd.size() != 4 || kd.size() != 4) return ffi::Error::InvalidArgument("q, k, v must be [B, T, heads, D]");
  Dims m{qd[0], qd[1], qd[2], kd[2], qd[3]};
  if (auto err = CheckShapes(m); err.failure()) return err;
  const float* qp = q.typed_data();
  const float* kp = k.typed_data();
  const float* vp = v.typed_data();
  float* op = o->typed_data();
  float* lp = lse->typed_data();
  jaxtrain::ParallelFor(pool, m.b * m.kvh, pool.num_threads(),
                        [&](int64_t task) { ForwardTask(m, scale, qp, kp, vp, op, lp, rope, task); });
  return ffi::Error::Success();
}

ffi::Error Forward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                   ffi::Buffer<ffi::F32> v, float scale, ffi::ResultBuffer<ffi::F32> o,
                   ffi::ResultBuffer<ffi::F32> lse) {
  return ForwardCall(pool, q, k, v, scale, o, lse, nullptr);
}

// The rope tables' shapes: [T, D / 2] each.
bool RopeShapes(ffi::Buffer<ffi::F32>& q, ffi::Buffer<ffi::F32>& cos, ffi::Buffer<ffi::F32>& sin) {
  auto qd = q.dimensions(), cd = cos.dimensions(), sd = sin.dimensions();
  return qd.size() == 4 && cd.size() == 2 && sd.size() == 2 && cd[0] == qd[1] && cd[1] * 2 == qd[3] &&
         sd[0] == cd[0] && sd[1] == cd[1];
}

ffi::Error RopeForward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                       ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::F32> cos, ffi::Buffer<ffi::F32> sin, float scale,
                       ffi::ResultBuffer<ffi::F32> o, ffi::ResultBuffer<ffi::F32> lse) {
  if (!RopeShapes(q, cos, sin)) return ffi::Error::InvalidArgument("cos and sin must be [T, head_dim / 2]");
  const Rope rope{cos.typed_data(), sin.typed_data()};
  return ForwardCall(pool, q, k, v, scale, o, lse, &rope);
}

// One (batch, kv head) pair of the backward: dK and dV summed over its query heads here, written by
// the first and added to by the others. With rope, the products use the rotated q and k, and dQ and
// dK are rotated back (the rotation's transpose) once complete.
void BackwardTask(const Dims& m, float scale, const float* qp, const float* kp, const float* vp, const float* op,
                  const float* lp, const float* dop, float* dqp, float* dkp, float* dvp, const Rope* rope,
                  int64_t task) {
  const int64_t g = m.h / m.kvh, t = m.t, d = m.d;
  const int64_t bi = task / m.kvh, kh = task % m.kvh;
  const int64_t qs = m.h * d, ks = m.kvh * d;  // row strides of the [T, heads, D] slabs
  thread_local std::vector<float> buffer;
  buffer.resize(2 * t * d + 2 * t * t + (rope ? 2 * t * d : 0));
  float *kt = buffer.data(), *vt = kt + t * d, *p = vt + t * d, *ds = p + t * t;
  float *qr = ds + t * t, *kr = qr + t * d;  // rope: a query head's and the kv head's rotated rows
  const int64_t koff = bi * t * ks + kh * d, qoff = bi * t * qs;
  const float* kk = kp + koff;
  int64_t kstride = ks;
  if (rope) {
    Rotate(*rope, kk, ks, kr, d, t, d, false);
    kk = kr;
    kstride = d;
    GatherTransposed(kr, t, 1, 0, d, kt);
  } else {
    GatherTransposed(kp + bi * t * ks, t, m.kvh, kh, d, kt);
  }
  GatherTransposed(vp + bi * t * ks, t, m.kvh, kh, d, vt);
  float* dk = dkp + koff;
  float* dv = dvp + koff;
  auto all_d = [&](int64_t) { return std::make_pair(int64_t{0}, d); };
  auto keys = [&](int64_t i0) { return std::make_pair(int64_t{0}, KeysUpTo(i0, t)); };
  auto rows_from = [&](int64_t j0) { return std::make_pair(j0, t); };  // row i sees key j only if i >= j
  for (int64_t hh = kh * g; hh < (kh + 1) * g; ++hh) {
    const bool first = hh == kh * g;
    const float *qq = qp + qoff + hh * d, *oo = op + qoff + hh * d, *dd = dop + qoff + hh * d;
    int64_t qstride = qs;
    if (rope) {
      Rotate(*rope, qq, qs, qr, d, t, d, false);
      qq = qr;
      qstride = d;
    }
    for (int64_t i0 = 0; i0 < t; i0 += kRows) {
      const int64_t cols = Columns(i0, t);
      Gemm(kRows, cols, qq + i0 * qstride, qstride, 1, kt, t, p + i0 * t, t, false, all_d);
      Gemm(kRows, cols, dd + i0 * qs, qs, 1, vt, t, ds + i0 * t, t, false, all_d);  // dP
    }
    const float* lrow = lp + (bi * m.h + hh) * t;
    for (int64_t i = 0; i < t; ++i) {
      float* pi = p + i * t;
      float* dsi = ds + i * t;
      float prod[16] = {};  // rowsum(dO * O) in 16 lanes (d % 16 == 0)
      for (int64_t c = 0; c < d; c += 16)
        for (int j = 0; j < 16; ++j) prod[j] += dd[i * qs + c + j] * oo[i * qs + c + j];
      const float di = Sum16(prod, 16), li = lrow[i];
      const int64_t n = Visible16(i);
      for (int64_t j = i + 1; j < n; ++j) pi[j] = -INFINITY;
      for (int64_t j = 0; j < n; ++j) pi[j] = Exp(pi[j] * scale - li);
      for (int64_t j = 0; j < n; ++j) dsi[j] = pi[j] * (dsi[j] - di) * scale;  // dQ's and dK's scale, once
      for (int64_t j = n; j < t; ++j) pi[j] = dsi[j] = 0.0f;
    }
    float* dq = dqp + qoff + hh * d;
    Gemm(t, d, ds, t, 1, kk, kstride, dq, qs, false, keys);  // dQ = s dS K
    if (rope) Rotate(*rope, dq, qs, dq, qs, t, d, true);
    Gemm(t, d, ds, 1, t, qq, qstride, dk, ks, !first, rows_from);  // dK (+)= s dS^T Q
    Gemm(t, d, p, 1, t, dd, qs, dv, ks, !first, rows_from);  // dV (+)= P^T dO
  }
  if (rope) Rotate(*rope, dk, ks, dk, ks, t, d, true);
}

ffi::Error BackwardCall(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& q, ffi::Buffer<ffi::F32>& k,
                        ffi::Buffer<ffi::F32>& v, ffi::Buffer<ffi::F32>& o, ffi::Buffer<ffi::F32>& lse,
                        ffi::Buffer<ffi::F32>& dout, float scale, ffi::ResultBuffer<ffi::F32>& dq,
                        ffi::ResultBuffer<ffi::F32>& dk, ffi::ResultBuffer<ffi::F32>& dv, const Rope* rope) {
  auto qd = q.dimensions(), kd = k.dimensions();
  Dims m{qd[0], qd[1], qd[2], kd[2], qd[3]};
  if (auto err = CheckShapes(m); err.failure()) return err;
  const float* qp = q.typed_data();
  const float* kp = k.typed_data();
  const float* vp = v.typed_data();
  const float* op = o.typed_data();
  const float* lp = lse.typed_data();
  const float* dop = dout.typed_data();
  float* dqp = dq->typed_data();
  float* dkp = dk->typed_data();
  float* dvp = dv->typed_data();
  jaxtrain::ParallelFor(pool, m.b * m.kvh, pool.num_threads(), [&](int64_t task) {
    BackwardTask(m, scale, qp, kp, vp, op, lp, dop, dqp, dkp, dvp, rope, task);
  });
  return ffi::Error::Success();
}

ffi::Error Backward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                    ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::F32> o, ffi::Buffer<ffi::F32> lse,
                    ffi::Buffer<ffi::F32> dout, float scale, ffi::ResultBuffer<ffi::F32> dq,
                    ffi::ResultBuffer<ffi::F32> dk, ffi::ResultBuffer<ffi::F32> dv) {
  return BackwardCall(pool, q, k, v, o, lse, dout, scale, dq, dk, dv, nullptr);
}

ffi::Error RopeBackward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                        ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::F32> o, ffi::Buffer<ffi::F32> lse,
                        ffi::Buffer<ffi::F32> dout, ffi::Buffer<ffi::F32> cos, ffi::Buffer<ffi::F32> sin,
                        float scale, ffi::ResultBuffer<ffi::F32> dq, ffi::ResultBuffer<ffi::F32> dk,
                        ffi::ResultBuffer<ffi::F32> dv) {
  if (!RopeShapes(q, cos, sin)) return ffi::Error::InvalidArgument("cos and sin must be [T, head_dim / 2]");
  const Rope rope{cos.typed_data(), sin.typed_data()};
  return BackwardCall(pool, q, k, v, o, lse, dout, scale, dq, dk, dv, &rope);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxtrainCpuAttentionForward, Forward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxtrainCpuAttentionBackward, Backward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxtrainCpuAttentionRopeForward, RopeForward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxtrainCpuAttentionRopeBackward, RopeBackward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
