// The host's float32 FMA throughput, measured: the peak a CPU run's MFU divides by (peak.py).
//
// Each thread runs independent chains of vector FMAs (enough of them to cover the FMA units' latency)
// until a shared deadline; the result is every thread's FLOPs (2 per lane per FMA) over the longest
// thread's time. No program does more float32 FLOPs a second on these cores at their present clock, so
// a train step's achieved rate stays below it. Plain C ABI, called through ctypes (not an XLA kernel).
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

namespace {

#if defined(__AVX512F__) && (defined(__x86_64__) || defined(__i386__))
typedef __m512 Vec;
constexpr int kLanes = 16;
constexpr int kChains = 16;  // 2 FMA ports x 4 cycles of latency, doubled; 16 of the 32 zmm registers
inline Vec Set(float x) { return _mm512_set1_ps(x); }
inline Vec Fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float Sum(Vec v) { return _mm512_reduce_add_ps(v); }
#elif defined(__FMA__) && (defined(__x86_64__) || defined(__i386__))
typedef __m256 Vec;
constexpr int kLanes = 8;
constexpr int kChains = 10;  // of the 16 ymm registers
inline Vec Set(float x) { return _mm256_set1_ps(x); }
inline Vec Fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float Sum(Vec v) {
  alignas(32) float out[8];
  _mm256_store_ps(out, v);
  float s = 0;
  for (float x : out) s += x;
  return s;
}
#else  // another CPU: GCC's vectors of 4 floats (NEON on aarch64), fused where the target fuses
typedef float Vec __attribute__((vector_size(16)));
constexpr int kLanes = 4;
constexpr int kChains = 16;
inline Vec Set(float x) { return Vec{x, x, x, x}; }
inline Vec Fma(Vec a, Vec b, Vec c) { return a * b + c; }
inline float Sum(Vec v) { return v[0] + v[1] + v[2] + v[3]; }
#endif

constexpr long kBlock = 1 << 14;  // FMA rounds between two looks at the clock

// Rounds of kChains FMAs until `deadline`; returns the rounds run and adds the chains' sum to *sink.
long Chains(std::chrono::steady_clock::time_point deadline, float* sink) {
  Vec acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = Set(1.0f + c * 1e-3f);
  const Vec a = Set(0.9999999f), b = Set(1e-7f);
  long rounds = 0;
  do {
    for (long i = 0; i < kBlock; ++i) {
      for (int c = 0; c < kChains; ++c) acc[c] = Fma(acc[c], a, b);
    }
    rounds += kBlock;
  } while (std::chrono::steady_clock::now() < deadline);
  float s = 0;
  for (int c = 0; c < kChains; ++c) s += Sum(acc[c]);
  *sink = s;
  return rounds;
}

}  // namespace

// FLOP/s of `threads` threads running FMA chains for about `seconds` (0 on bad arguments).
extern "C" double JaxtrainCpuFmaPeak(int threads, double seconds) {
  if (threads < 1 || threads > 4096 || !(seconds > 0) || seconds > 60) return 0.0;
  std::atomic<int> ready{0};
  std::atomic<bool> go{false};
  std::vector<long> rounds(threads, 0);
  std::vector<double> took(threads, 0.0);
  std::vector<float> sinks(threads, 0.0f);
  auto work = [&](int t) {
    ready.fetch_add(1);
    while (!go.load()) {
    }
    const auto start = std::chrono::steady_clock::now();
    const auto deadline = start + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                      std::chrono::duration<double>(seconds));
    rounds[t] = Chains(deadline, &sinks[t]);
    took[t] = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(work, t);
  while (ready.load() < threads - 1) {
  }
  go.store(true);
  work(0);
  for (auto& th : pool) th.join();
  double flops = 0, longest = 0;
  for (int t = 0; t < threads; ++t) {
    flops += 2.0 * kLanes * kChains * static_cast<double>(rounds[t]);
    longest = std::max(longest, took[t]);
  }
  volatile float keep = 0;  // the chains' results are used: nothing is optimized away
  for (float s : sinks) keep = keep + s;
  return longest > 0 ? flops / longest : 0.0;
}
