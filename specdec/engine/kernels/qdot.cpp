// Quantized linear y = x W^T with 4- or 8-bit weight codes and int8 activations, llama.cpp's Q4 x Q8 scheme:
// every group of 32 inputs has a weight scale s and offset o per output (w = s * q + o) and, per row, an activation
// scale a (x ~ a * xq, xq in -127..127, rounded inside the call). Per output n and row m:
//     y[m, n] = sum_g  a[m,g] * s[n,g] * dot(q[n,g], xq[m,g])  +  o[n,g] * (a[m,g] * sum(xq[m,g]))
// The dot of codes (0..15 or 0..255, unsigned) with int8 activations is exact in int32 (VNNI dpbusd, or AVX2's
// maddubs, which cannot saturate on 4-bit codes). The float sums run in one fixed order per (m, n), whatever the
// number of rows or threads: a row's output bits do not depend on its neighbours (batch invariance, issue F).
// Rows are processed in tiles of up to ROWS sharing each unpacked weight group, so a multi-row verify reads the
// weights once. Compiled at first use by specdec/engine/kernels/__init__.py with -march=native.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <cmath>
#include <type_traits>

namespace {

constexpr int G = 32;     // inputs per group
constexpr int ROWS = 4;   // rows sharing one pass over a weight column
constexpr int A = 2;      // accumulators per row, the same for every tile size (it fixes the order of the sums)

// 8 int32 lanes of dot(codes, xq) over one group; both paths give the same integers.
template <int BITS>
inline __m256i group_dot(__m256i codes, __m256i xq) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), codes, xq);
#else
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (BITS == 4) return _mm256_madd_epi16(_mm256_maddubs_epi16(codes, xq), ones);
  // 8-bit codes would saturate maddubs' int16 pairs (255 * 127 * 2): split them into nibbles, 16 * hi + lo
  const __m256i m = _mm256_set1_epi8(0x0F);
  __m256i lo = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_and_si256(codes, m), xq), ones);
  __m256i hi = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(codes, 4), m), xq), ones);
  return _mm256_add_epi32(_mm256_slli_epi32(hi, 4), lo);
#endif
}

// The codes of groups g and g + 1 of a weight row (g even). 4-bit: byte j of a pair holds code j of group g (low
// nibble) and code j of group g + 1 (high nibble), so one load, a mask and a shift unpack two groups.
template <int BITS>
inline void load_pair(const uint8_t* row, int64_t g, __m256i& c0, __m256i& c1) {
  if constexpr (BITS == 8) {
    c0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + g * G));
    c1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + (g + 1) * G));
  } else {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + g * (G / 2)));
    const __m256i m = _mm256_set1_epi8(0x0F);
    c0 = _mm256_and_si256(v, m);
    c1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), m);
  }
}

inline float hsum(__m256 v) {   // one fixed reduction order
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// One output column n for R rows. sf / of: the column's scales and offsets as float32; cs: scratch for R * n_groups
// floats. A accumulators per row, taking groups in turn, keep A * R multiply-add chains in flight (a single chain
// waits out the FMA latency on every group); a step covers S groups (whole pairs, as the codes are packed).
template <int BITS, int R, typename T>
inline void column(const uint8_t* codes, const float* sf, const float* of, const int8_t* xq, const float* a,
                   const float* asum, int64_t K, int64_t n_groups, float* cs, T* y, int64_t y_stride) {
  for (int r = 0; r < R; ++r) {   // cs[r, g] = a[r, g] * s[g]
    int64_t g = 0;
    for (; g + 8 <= n_groups; g += 8)
      _mm256_storeu_ps(cs + r * n_groups + g,
                       _mm256_mul_ps(_mm256_loadu_ps(a + r * n_groups + g), _mm256_loadu_ps(sf + g)));
    for (; g < n_groups; ++g) cs[r * n_groups + g] = a[r * n_groups + g] * sf[g];
  }
  __m256 acc[R][A];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int i = 0; i < A; ++i) acc[r][i] = _mm256_setzero_ps();
  // S groups a step, group g + i into accumulator i % A; every index is a constant once unrolled, which keeps acc
  // in registers (a runtime index spilled it to the stack on every multiply-add)
  constexpr int S = A > 2 ? A : 2;
  auto step = [&](int64_t g, auto pairs) {
#pragma GCC unroll 4
    for (int p = 0; p < decltype(pairs)::value; ++p) {
      __m256i c[2];
      load_pair<BITS>(codes, g + 2 * p, c[0], c[1]);
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const int i = 2 * p + h;
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * K + (g + i) * G));
          __m256 d = _mm256_cvtepi32_ps(group_dot<BITS>(c[h], x));
          acc[r][i % A] = _mm256_fmadd_ps(d, _mm256_broadcast_ss(cs + r * n_groups + g + i), acc[r][i % A]);
        }
      }
    }
  };
  int64_t g = 0;
  for (; g + S <= n_groups; g += S) step(g, std::integral_constant<int, S / 2>{});
  for (; g < n_groups; g += 2) step(g, std::integral_constant<int, 1>{});   // n_groups is even
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    __m256 t = acc[r][0];
#pragma GCC unroll 4
    for (int i = 1; i < A; ++i) t = _mm256_add_ps(t, acc[r][i]);
    // the offsets' term: 8 groups a vector, then the rest one at a time
    __m256 to = _mm256_setzero_ps();
    int64_t h = 0;
    for (; h + 8 <= n_groups; h += 8)
      to = _mm256_fmadd_ps(_mm256_loadu_ps(of + h), _mm256_loadu_ps(asum + r * n_groups + h), to);
    float o = hsum(to);
    for (; h < n_groups; ++h) o = std::fma(of[h], asum[r * n_groups + h], o);
    y[r * y_stride] = static_cast<T>(hsum(t) + o);   // to the activations' dtype (round to nearest even)
  }
}

inline void widen(const at::Half* h, float* f, int64_t n) {   // fp16 -> fp32, 8 at a time (F16C)
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(f + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
  for (; i < n; ++i) f[i] = h[i];
}

template <int BITS, typename T>
void run(const uint8_t* codes, const at::Half* s, const at::Half* o, const int8_t* xq, const float* a,
         const float* asum, int64_t M, int64_t N, int64_t K, T* y) {
  const int64_t n_groups = K / G, row_bytes = K * BITS / 8;
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    std::vector<float> sf(n_groups), of(n_groups), cs(ROWS * n_groups);
    for (int64_t n = n0; n < n1; ++n) {
      widen(s + n * n_groups, sf.data(), n_groups);
      widen(o + n * n_groups, of.data(), n_groups);
      const uint8_t* cn = codes + n * row_bytes;
      for (int64_t m = 0; m < M; m += ROWS) {
        const int64_t r = std::min<int64_t>(ROWS, M - m);
        const int8_t* x = xq + m * K;
        const float *am = a + m * n_groups, *sm = asum + m * n_groups;
        T* ym = y + m * N + n;
        switch (r) {
          case 4: column<BITS, 4>(cn, sf.data(), of.data(), x, am, sm, K, n_groups, cs.data(), ym, N); break;
          case 3: column<BITS, 3>(cn, sf.data(), of.data(), x, am, sm, K, n_groups, cs.data(), ym, N); break;
          case 2: column<BITS, 2>(cn, sf.data(), of.data(), x, am, sm, K, n_groups, cs.data(), ym, N); break;
          default: column<BITS, 1>(cn, sf.data(), of.data(), x, am, sm, K, n_groups, cs.data(), ym, N); break;
        }
      }
    }
  });
}

// x [M, K] -> xq int8 [M, K], a and asum float32 [M, K/32]: per group a = max|x| / 127, xq = round(x / a), in float32.
template <typename T>
void quantize_rows(const T* x, int64_t M, int64_t K, int8_t* xq, float* a, float* asum) {
  const int64_t n_groups = K / G;
  at::parallel_for(0, M * n_groups, 256, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      float xg[G];
      for (int j = 0; j < G; ++j) xg[j] = static_cast<float>(x[i * G + j]);
      float amax = 0.f;
      for (int j = 0; j < G; ++j) amax = std::max(amax, std::fabs(xg[j]));
      const float scale = amax / 127.f;
      int sum = 0;
      for (int j = 0; j < G; ++j) {
        const int q = scale > 0.f ? static_cast<int>(std::nearbyint(xg[j] / scale)) : 0;
        xq[i * G + j] = static_cast<int8_t>(q);
        sum += q;
      }
      a[i] = scale;
      asum[i] = scale * static_cast<float>(sum);
    }
  });
}

at::Tensor qdot(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& offset,
                int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "qdot: bits must be 4 or 8");
  TORCH_CHECK(x.dim() == 2 && codes.dim() == 2, "qdot: x [M, K] and codes [N, K*bits/8]");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  TORCH_CHECK(K % (2 * G) == 0 && codes.size(1) == K * bits / 8,
              "qdot: K must be a multiple of 64 matching the codes");
  TORCH_CHECK(codes.scalar_type() == at::kByte && scale.scalar_type() == at::kHalf &&
              offset.scalar_type() == at::kHalf, "qdot: codes uint8, scale and offset float16");
  TORCH_CHECK(codes.is_contiguous() && scale.is_contiguous() && offset.is_contiguous(), "qdot: contiguous weights");
  // one scratch allocation (a and asum, then xq) and the output in x's dtype: a small model makes ~120 of these
  // calls a step, where each extra tensor op costs microseconds
  const at::Tensor xc = x.contiguous();
  const int64_t n_groups = K / G;
  at::Tensor scratch = at::empty({2 * M * n_groups * 4 + M * K}, x.options().dtype(at::kByte));
  float* a = reinterpret_cast<float*>(scratch.data_ptr<uint8_t>());
  float* asum = a + M * n_groups;
  int8_t* xq = reinterpret_cast<int8_t*>(asum + M * n_groups);
  at::Tensor y = at::empty({M, N}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "qdot", [&] {
    quantize_rows<scalar_t>(xc.data_ptr<scalar_t>(), M, K, xq, a, asum);
    (bits == 4 ? run<4, scalar_t> : run<8, scalar_t>)(codes.data_ptr<uint8_t>(), scale.data_ptr<at::Half>(),
                                                      offset.data_ptr<at::Half>(), xq, a, asum, M, N, K,
                                                      y.data_ptr<scalar_t>());
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(specdec, m) {
  m.def("qdot(Tensor x, Tensor codes, Tensor scale, Tensor offset, int bits) -> Tensor");
}
TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("qdot", qdot);
}
