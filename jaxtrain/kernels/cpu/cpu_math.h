// Elementwise math for jaxtrain's XLA:CPU kernels (attention.cc, mlp.cc), written so that
// GCC vectorizes a loop of it (the <cmath> functions are a call per element).
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>

namespace jaxtrain {

typedef float V16 __attribute__((vector_size(64)));              // 16 floats: one AVX-512 register
typedef float V16u __attribute__((vector_size(64), aligned(4)));  // ... loaded from any float's address
typedef int32_t V16i __attribute__((vector_size(64)));

// exp(x) for x = n ln2 + r (n an integer, |r| <= ln2/2) without its 2^n: r by a two-part ln2, exp(r) by
// Cephes' expf polynomial (S. Moshier). T: float or V16.
template <typename T>
inline T ExpReduced(T x, T n) {
  const T r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  T p = T{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  return p * r * r + r + 1.0f;
}

// exp(x) for x <= 88, vectorizable (std::exp is a call per element): x = n ln2 + r with |r| <= ln2/2,
// exp(r) by Cephes' expf polynomial (S. Moshier), 2^n put into the exponent bits. Relative error
// ~1e-7; below -87.3 the result is flushed to 0, as exp underflows there anyway.
inline float Exp(float x) {
  const float clamped = std::max(x, -87.3f);
  const float n = std::nearbyint(clamped * 1.44269504088896341f);
  const float p = ExpReduced(clamped, n);
  const float scale = std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
  return x < -87.3f ? 0.0f : p * scale;
}

// Exp on 16 lanes, the same steps in vector operations (GCC does not vectorize Exp's loops where
// they have more work in them): n by adding 1.5 * 2^23, which rounds to the nearest integer as
// nearbyint does, and its bits then hold n.
inline V16 Exp(V16 x) {
  constexpr float kShift = 12582912.0f;  // 1.5 * 2^23, bits 0x4B400000
  const V16i under = x < -87.3f;
  x = under ? V16{} - 87.3f : x;
  const V16 t = x * 1.44269504088896341f + kShift;
  const V16 n = t - kShift;
  const V16 p = ExpReduced(x, n);
  const V16 scale = __builtin_bit_cast(V16, (__builtin_bit_cast(V16i, t) - 0x4B400000 + 127) << 23);
  return under ? V16{} : p * scale;
}

// The logistic sigmoid 1 / (1 + exp(-x)) on 16 lanes, for every float x: exp's argument is capped at
// 88.3, where the result is ~5e-39 (as good as 0) and exp does not yet overflow.
inline V16 Sigmoid(V16 x) {
  const V16 e = -x;
  return 1.0f / (1.0f + Exp(e < 88.3f ? e : V16{} + 88.3f));
}

}  // namespace jaxtrain
