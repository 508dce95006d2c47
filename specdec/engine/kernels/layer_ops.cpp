// The small per-layer ops of a decode step, one call each where PyTorch runs several tensor ops (a small model's
// decode is dispatch-bound: ~5-30 us an op here, against microseconds of arithmetic). Each keeps a row's bits a
// function of that row alone (batch invariance); rope and write_kv give exactly the bits of the tensor ops they
// replace (engine/model.py, engine/attention.py keep those as the reference and for other devices).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <immintrin.h>
#include <type_traits>
#include <vector>

#include "fixed_sums.h"

namespace {

// RMSNorm of each row in one call: torch's F.rms_norm in float32, the cast and the weight multiply are ~8 tensor ops,
// 50 us a call here, twice a layer. y = T(T(x * r) * w) with r = 1 / sqrt(mean(x^2) + eps) in float32, the sum of
// squares in a fixed order (8 strided partial sums, then pairwise), so a row's bits depend on that row alone.
template <typename T>
void rms_rows(const T* x, const T* w, int64_t M, int64_t D, float eps, T* y) {
  at::parallel_for(0, M, 8, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const T* xr = x + m * D;
      float part[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      int64_t d = 0;
      for (; d + 8 <= D; d += 8)
        for (int j = 0; j < 8; ++j) {
          const float v = static_cast<float>(xr[d + j]);
          part[j] += v * v;
        }
      for (; d < D; ++d) {
        const float v = static_cast<float>(xr[d]);
        part[d % 8] += v * v;
      }
      const float sum = tree8(part);
      const float r = 1.f / std::sqrt(sum / static_cast<float>(D) + eps);
      for (d = 0; d < D; ++d) {
        const T normed = static_cast<T>(static_cast<float>(xr[d]) * r);
        y[m * D + d] = static_cast<T>(static_cast<float>(normed) * static_cast<float>(w[d]));
      }
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  const int64_t D = x.size(-1);
  TORCH_CHECK(w.dim() == 1 && w.size(0) == D && w.scalar_type() == x.scalar_type(), "rms_norm: w [D] in x's dtype");
  const at::Tensor xc = x.contiguous(), wc = w.contiguous();
  at::Tensor y = at::empty_like(xc);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_rows<scalar_t>(xc.data_ptr<scalar_t>(), wc.data_ptr<scalar_t>(), xc.numel() / std::max<int64_t>(D, 1), D,
                       static_cast<float>(eps), y.data_ptr<scalar_t>());
  });
  return y;
}

// Batch-invariant attention, each (row, head) on its own: the row's query against the keys it sees (its sequence's
// slots 0..lens-1, read straight out of the paged float32 cache), softmax and the weighted sum of values, all in
// float32 in one fixed order (8 strided partial sums per dot product, keys in position order). A row's bits depend on
// that row alone: no padding, no tiles, no GEMM kernel picked by shape. It replaces ~15 tensor ops a layer (gathers,
// casts, two batched GEMMs, softmax) that cost ~150 us a layer at decode.
// a . b[k] for NK keys at once, each key's sums in one fixed order (8 strided partial sums, then a fixed tree): NK
// independent chains (a decode's attention one key at a time was bound by the latency of one chain of adds, ~9 us a
// head for 128 keys on a Zen 4). Written with one 8-lane vector a key: GCC left the plain loop over an array of key
// pointers scalar (a 140-token Qwen 1.5B prefill spent 15% of its time in attention, now 4%).
template <int NK>
inline void dots8(const float* a, const float* const b[NK], int64_t n, float* out) {
  float acc[NK][8] = {};
  int64_t i = 0;
#ifdef __AVX2__   // the same sums as the loops below, which take the rest (n % 8) and builds without AVX2
  __m256 va[NK];
  for (int k = 0; k < NK; ++k) va[k] = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(a + i);
    for (int k = 0; k < NK; ++k) va[k] = _mm256_add_ps(va[k], _mm256_mul_ps(x, _mm256_loadu_ps(b[k] + i)));
  }
  if constexpr (NK == 8) {
    if (i == n) {   // tree8 of the 8 keys at once, a key a lane (the scalar tree was a fifth of the kernel's time)
      const __m256 h01 = _mm256_hadd_ps(va[0], va[1]), h23 = _mm256_hadd_ps(va[2], va[3]);
      const __m256 h45 = _mm256_hadd_ps(va[4], va[5]), h67 = _mm256_hadd_ps(va[6], va[7]);
      // lanes (p0 + p1) + (p2 + p3) of keys 0-3, then (p4 + p5) + (p6 + p7) of keys 0-3; the same for keys 4-7
      const __m256 g0 = _mm256_hadd_ps(h01, h23), g1 = _mm256_hadd_ps(h45, h67);
      _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(g0, g1, 0x20), _mm256_permute2f128_ps(g0, g1, 0x31)));
      return;
    }
  }
  for (int k = 0; k < NK; ++k) _mm256_storeu_ps(acc[k], va[k]);
#endif
  for (; i + 8 <= n; i += 8)
    for (int k = 0; k < NK; ++k)
      for (int j = 0; j < 8; ++j) acc[k][j] += a[i + j] * b[k][i + j];
  for (; i < n; ++i)
    for (int k = 0; k < NK; ++k) acc[k][i % 8] += a[i] * b[k][i];
  for (int k = 0; k < NK; ++k)
    out[k] = tree8(acc[k]);
}

// exp(x) for the softmax's x = score - max <= 0, in float32 arithmetic that vectors can run (exp_le0_8; the scalar
// std::exp was a third of the kernel's time): x = k ln2 + r (k rounded by the 1.5 * 2^23 shift, ln2 in two parts),
// exp(r) by Cephes' degree-6 polynomial, times 2^k from the exponent bits. Within 1 ulp of std::exp (every float in
// [-87, 0] checked); below -87 (2^-126 and less) it gives 0. One fixed sequence of IEEE operations, so a lane and the
// scalar tail give the same bits and a row's result does not depend on where its keys fall in a vector.
// Its constants: one copy for the scalar function and its 8-lane twin, whose bits must agree.
constexpr float EXP_LO = -87.f, EXP_LOG2E = 1.44269504088896341f, EXP_SHIFT = 12582912.f;
constexpr float EXP_LN2_HI = 0.693359375f, EXP_LN2_LO = -2.12194440e-4f;
constexpr float EXP_POLY[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

inline float exp_le0(float x) {
  const float xc = x < EXP_LO ? EXP_LO : x;
  const float k = (xc * EXP_LOG2E + EXP_SHIFT) - EXP_SHIFT;
  const float r = (xc - k * EXP_LN2_HI) - k * EXP_LN2_LO;
  float y = EXP_POLY[0];
  for (int i = 1; i < 6; ++i) y = y * r + EXP_POLY[i];
  y = (y * (r * r) + r) + 1.f;
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return x < EXP_LO ? 0.f : y * scale;
}

#ifdef __AVX2__
// exp_le0 of 8 lanes: the same IEEE operations in the same order, so each lane's bits are the scalar's (GCC left the
// scalar loop unvectorized here, and it took 40% of a Zen 3's attention time once the weighted sums were vectors)
inline __m256 exp_le0_8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(EXP_LO), under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  const __m256 xc = _mm256_blendv_ps(x, lo, under);
  const __m256 shift = _mm256_set1_ps(EXP_SHIFT);
  const __m256 k = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(xc, _mm256_set1_ps(EXP_LOG2E)), shift), shift);
  const __m256 r = _mm256_sub_ps(_mm256_sub_ps(xc, _mm256_mul_ps(k, _mm256_set1_ps(EXP_LN2_HI))),
                                 _mm256_mul_ps(k, _mm256_set1_ps(EXP_LN2_LO)));
  __m256 y = _mm256_set1_ps(EXP_POLY[0]);
  for (int i = 1; i < 6; ++i) y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(EXP_POLY[i]));
  y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(y, _mm256_mul_ps(r, r)), r), _mm256_set1_ps(1.f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(y, _mm256_castsi256_ps(bits)));
}
#endif

constexpr int64_t PF = 8;   // keys ahead to prefetch
constexpr int NK = 8;       // keys a dot product call takes at once
#ifdef __AVX512F__
constexpr int64_t WSUM = 128;   // outputs of a weighted sum held in registers: 8 zmm
#else
constexpr int64_t WSUM = 64;    // 8 ymm
#endif

// o[d] += p[j] * v[slot j][d] over keys j0 <= j < j1, in order, for D outputs held in registers (v: this head's first
// output, `stride` floats between slots); o holds the sums over the keys before j0
typedef float v16f __attribute__((vector_size(64)));   // 16 floats (two ymm where a CPU has no zmm)

template <int64_t D>
inline void weighted_sum(const float* p, const float* v, int64_t stride, const int64_t* sl, int64_t j0, int64_t j1,
                         float* o) {
  // explicit vectors: from the plain loop GCC kept the sums in memory and loaded every other value row by gathers
#if defined(__AVX2__) && !defined(__AVX512F__)
  // without zmm, 8-float intrinsics (the same multiplies and adds): GCC split the 16-float vectors below into stack
  // round trips, every weight broadcast by 16 scalar stores and the sums spilled (60% of a Zen 3's attention time)
  constexpr int64_t N = D / 8;
  __m256 acc[N];
  for (int64_t n = 0; n < N; ++n) acc[n] = _mm256_loadu_ps(o + 8 * n);
  for (int64_t j = j0; j < j1; ++j) {
    const float* vr = v + sl[j] * stride;
    const __m256 w = _mm256_set1_ps(p[j]);
    for (int64_t n = 0; n < N; ++n) acc[n] = _mm256_add_ps(acc[n], _mm256_mul_ps(w, _mm256_loadu_ps(vr + 8 * n)));
  }
  for (int64_t n = 0; n < N; ++n) _mm256_storeu_ps(o + 8 * n, acc[n]);
#else
  constexpr int64_t N = D / 16;
  v16f acc[N];
  for (int64_t n = 0; n < N; ++n) std::memcpy(&acc[n], o + 16 * n, sizeof(v16f));
  for (int64_t j = j0; j < j1; ++j) {
    const float* vr = v + sl[j] * stride;
    const float w = p[j];
    for (int64_t n = 0; n < N; ++n) {
      v16f x;
      std::memcpy(&x, vr + 16 * n, sizeof x);
      acc[n] += w * x;
    }
  }
  for (int64_t n = 0; n < N; ++n) std::memcpy(o + 16 * n, &acc[n], sizeof(v16f));
#endif
}

constexpr int64_t VB = 16;      // keys a block of the weighted sums: their value rows stay in L1 for every query
constexpr int64_t RC = 16;      // rows a work unit at most (its scores: RC x heads a kv head x keys floats)

// A work unit is one sequence's kv head for a chunk of its rows and the query heads that share that kv head (GQA): it
// reads each key and value row from memory once for all of them, where one (row, head) at a time read them once per
// query (SmolLM2: 3 heads a kv head, and a verify's rows all see the same keys). Each query's arithmetic is exactly
// the one-query loop's (the same dots, softmax and sums in the same order), so a row's bits depend on that row alone.
template <typename T>
void attend_rows(const T* q, int64_t q_stride, int64_t H, int64_t hd, const float* k, const float* v, int64_t Hkv,
                 const int64_t* rows, const int64_t* slots, const int64_t* lens, int64_t Sm, int64_t m, int64_t Lp,
                 float scale, T* out) {
  const int64_t g = H / Hkv, S = Sm / m;
  // split rows (then heads) until there are a few units a thread, so that a decode of one sequence keeps both cores
  const int64_t want = 4 * at::get_num_threads();
  int64_t rc = std::min(m, RC), hs = g;
  while (rc > 1 && S * Hkv * ((m + rc - 1) / rc) < want) rc = (rc + 1) / 2;
  if (S * Hkv * ((m + rc - 1) / rc) < want) hs = 1;
  const int64_t nrc = (m + rc - 1) / rc, nhs = g / hs;
  at::parallel_for(0, S * Hkv * nrc * nhs, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> p(rc * hs * Lp), qf(rc * hs * hd), o(rc * hs * hd);
    std::vector<int64_t> qrow(rc * hs), qh(rc * hs), ql(rc * hs);
    for (int64_t it = i0; it < i1; ++it) {
      const int64_t s = it / (Hkv * nrc * nhs), kvh = it / (nrc * nhs) % Hkv, r0 = it / nhs % nrc * rc;
      const int64_t h0 = kvh * g + it % nhs * hs;
      const int64_t* sl = slots + s * Lp;
      int64_t nq = 0, Lmax = 0;                        // this unit's queries: (row, head), keys each sees
      for (int64_t r = r0; r < std::min(m, r0 + rc); ++r) {
        const int64_t row = rows[s * m + r], L = lens[s * m + r];
        if (row < 0 || L <= 0) continue;               // a padding row of the group
        for (int64_t h = h0; h < h0 + hs; ++h, ++nq) {
          qrow[nq] = row, qh[nq] = h, ql[nq] = L;
          for (int64_t d = 0; d < hd; ++d) qf[nq * hd + d] = static_cast<float>(q[row * q_stride + h * hd + d]);
        }
        Lmax = std::max(Lmax, L);
      }
      // scores: NK keys at a time for every query that sees them all, one at a time at a query's last keys
      for (int64_t j = 0; j < Lmax; j += NK) {
        const float* keys[NK];
        for (int u = 0; u < NK; ++u) keys[u] = k + (sl[std::min(j + u, Lmax - 1)] * Hkv + kvh) * hd;
        if (j + PF + NK <= Lmax)   // keys PF ahead: the cache was written a step ago, and the weights evicted it since
          for (int64_t u = j + PF; u < j + PF + NK; ++u)
            for (int64_t b = 0; b < hd; b += 16) __builtin_prefetch(k + (sl[u] * Hkv + kvh) * hd + b);
        for (int64_t i = 0; i < nq; ++i) {
          float* pi = p.data() + i * Lp;
          if (j + NK <= ql[i])
            dots8<NK>(qf.data() + i * hd, keys, hd, pi + j);
          else
            for (int64_t u = j; u < ql[i]; ++u) dots8<1>(qf.data() + i * hd, &keys[u - j], hd, pi + u);
        }
      }
      for (int64_t i = 0; i < nq; ++i) {              // softmax of each query's scores
        float* pi = p.data() + i * Lp;
        const int64_t L = ql[i];
        float m8[8];                                   // the max in 8 strided parts (it vectorizes; max is exact)
        std::fill(m8, m8 + 8, -INFINITY);
        int64_t j = 0;
        for (; j + 8 <= L; j += 8)
          for (int u = 0; u < 8; ++u) {
            pi[j + u] *= scale;
            m8[u] = std::max(m8[u], pi[j + u]);
          }
        for (; j < L; ++j) {
          pi[j] *= scale;
          m8[0] = std::max(m8[0], pi[j]);
        }
        const float mx = *std::max_element(m8, m8 + 8);
        j = 0;
#ifdef __AVX2__
        for (const __m256 m = _mm256_set1_ps(mx); j + 8 <= L; j += 8)
          _mm256_storeu_ps(pi + j, exp_le0_8(_mm256_sub_ps(_mm256_loadu_ps(pi + j), m)));
#endif
        for (; j < L; ++j) pi[j] = exp_le0(pi[j] - mx);
        float part[8] = {};                            // 8 strided partial sums, then a fixed tree (as dots8)
        for (j = 0; j + 8 <= L; j += 8)
          for (int u = 0; u < 8; ++u) part[u] += pi[j + u];
        for (; j < L; ++j) part[j % 8] += pi[j];
        const float sum = tree8(part);
        for (j = 0; j < L; ++j) pi[j] = pi[j] / sum;
      }
      // o[d] += w_j * v_j[d] over j in order, VB keys at a time for every query, up to 128 outputs at a time held in
      // registers: as many independent chains as registers allow (with 32 at a time the adds' latency bound a
      // prefill's attention); heads of 64 (SmolLM2) take 64 at a time rather than two passes of 32 over the keys
      std::fill(o.begin(), o.begin() + nq * hd, 0.f);
      const float* vh = v + kvh * hd;
      const int64_t vb = nq > 1 ? VB : Lmax;           // (one query: nothing to share, no blocks)
      for (int64_t j0 = 0; j0 < Lmax; j0 += vb) {
        for (int64_t u = j0 + vb; u < std::min(j0 + 2 * vb, Lmax); ++u)   // the next block's values
          for (int64_t b = 0; b < hd; b += 16) __builtin_prefetch(vh + sl[u] * Hkv * hd + b);
        for (int64_t i = 0; i < nq; ++i) {
          const int64_t j1 = std::min(j0 + vb, ql[i]);
          if (j1 <= j0) continue;
          const float* pi = p.data() + i * Lp;
          float* oi = o.data() + i * hd;
          int64_t d0 = 0;
          if (hd % WSUM == 0)
            for (; d0 < hd; d0 += WSUM) weighted_sum<WSUM>(pi, vh + d0, Hkv * hd, sl, j0, j1, oi + d0);
          else if (WSUM > 64 && hd % 64 == 0)
            for (; d0 < hd; d0 += 64) weighted_sum<64>(pi, vh + d0, Hkv * hd, sl, j0, j1, oi + d0);
          for (; d0 + 32 <= hd; d0 += 32) weighted_sum<32>(pi, vh + d0, Hkv * hd, sl, j0, j1, oi + d0);
          for (int64_t d = d0; d < hd; ++d)
            for (int64_t j = j0; j < j1; ++j) oi[d] += pi[j] * vh[sl[j] * Hkv * hd + d];
        }
      }
      for (int64_t i = 0; i < nq; ++i) {
        T* orow = out + qrow[i] * H * hd + qh[i] * hd;
        for (int64_t d = 0; d < hd; ++d) orow[d] = static_cast<T>(o[i * hd + d]);
      }
    }
  });
}

// q [T, H, hd] (rows may be strided: the q part of the fused q|k rows), k/v cache float32 [slots, Hkv, hd]; one group:
// rows [S, m] (-1 = padding), slots [S, Lp], lens [S, m] keys each row sees; writes out [T, H * hd] at its rows.
void attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& rows,
            const at::Tensor& slots, const at::Tensor& lens, double scale, at::Tensor out) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), "attend: q [T, H, hd] with dense rows");
  TORCH_CHECK(k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat && k.is_contiguous() &&
              v.is_contiguous(), "attend: float32 contiguous k/v cache");
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == q.scalar_type(), "attend: out [T, H * hd] in q's dtype");
  const at::Tensor r = rows.contiguous(), s = slots.contiguous(), l = lens.contiguous();
  const int64_t H = q.size(1), hd = q.size(2), Hkv = k.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "attend", [&] {
    attend_rows<scalar_t>(q.data_ptr<scalar_t>(), q.stride(0), H, hd, k.data_ptr<float>(), v.data_ptr<float>(), Hkv,
                          r.data_ptr<int64_t>(), s.data_ptr<int64_t>(), l.data_ptr<int64_t>(), r.numel(),
                          r.size(1), s.size(1), static_cast<float>(scale), out.data_ptr<scalar_t>());
  });
}

// Rotate-half rotary embedding of x [T, heads, hd] (rows may be strided) with cos / sin [T, hd] (the second half of
// sin negated, engine/model.py rotary_tables): out = x * cos + roll(x, hd / 2) * sin, each product and the sum
// computed in A (float, or double for double) and rounded to T as the three tensor ops round them (bitwise the same).
template <typename T>
void rope_rows(const T* x, int64_t xs0, int64_t heads, int64_t hd, const T* c, const T* s, int64_t Tn, T* out) {
  using A = std::conditional_t<std::is_same_v<T, double>, double, float>;
  const int64_t half = hd / 2;
  at::parallel_for(0, Tn * heads, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / heads, h = i % heads;
      const T* xr = x + t * xs0 + h * hd;
      const T* ct = c + t * hd;
      const T* st = s + t * hd;
      T* o = out + i * hd;
      // two halves, the partner half + or - half away: no modulo per element (it kept the loop scalar: 54 us for a
      // 16-row SmolLM2 verify's q and k, 2.0x the three tensor ops, on an Emerald Rapids Xeon)
      for (int64_t d = 0; d < half; ++d) {
        const T a = static_cast<T>(static_cast<A>(xr[d]) * static_cast<A>(ct[d]));
        const T b = static_cast<T>(static_cast<A>(xr[d + half]) * static_cast<A>(st[d]));
        o[d] = static_cast<T>(static_cast<A>(a) + static_cast<A>(b));
      }
      for (int64_t d = half; d < hd; ++d) {
        const T a = static_cast<T>(static_cast<A>(xr[d]) * static_cast<A>(ct[d]));
        const T b = static_cast<T>(static_cast<A>(xr[d - half]) * static_cast<A>(st[d]));
        o[d] = static_cast<T>(static_cast<A>(a) + static_cast<A>(b));
      }
    }
  });
}

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2) && x.size(2) % 2 == 0,
              "rope: x [T, heads, hd] with dense rows and an even hd");
  const at::Tensor c = cos.contiguous(), s = sin.contiguous();
  TORCH_CHECK(c.scalar_type() == x.scalar_type() && s.scalar_type() == x.scalar_type() && c.numel() == x.size(0) *
              x.size(2) && s.numel() == c.numel(), "rope: cos / sin [T, hd] in x's dtype");
  at::Tensor out = at::empty({x.size(0), x.size(1), x.size(2)}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rope", [&] {
    rope_rows<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), x.size(1), x.size(2), c.data_ptr<scalar_t>(),
                        s.data_ptr<scalar_t>(), x.size(0), out.data_ptr<scalar_t>());
  });
  return out;
}

// This forward's keys and values into the paged cache: cache[slots[t]] = k[t] (cast to the cache dtype, exact: a
// widening cast or none), for k and v at once; k / v [T, Hkv, hd] may be strided views of the fused qkv rows.
template <typename S, typename C>
void store_rows(const S* src, int64_t ss0, int64_t ss1, int64_t Hkv, int64_t hd, const int64_t* slots, int64_t Tn,
                C* cache) {
  for (int64_t t = 0; t < Tn; ++t)
    for (int64_t h = 0; h < Hkv; ++h) {
      const S* a = src + t * ss0 + h * ss1;
      C* b = cache + (slots[t] * Hkv + h) * hd;
      for (int64_t d = 0; d < hd; ++d) b[d] = static_cast<C>(a[d]);
    }
}

void write_kv(at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slots, const at::Tensor& k,
              const at::Tensor& v) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.scalar_type() == v_cache.scalar_type(),
              "write_kv: contiguous caches of one dtype");
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k.stride(2) == 1 && v.stride(2) == 1 && k.scalar_type() ==
              v.scalar_type() && k.size(0) == slots.numel(), "write_kv: k / v [T, Hkv, hd] with dense head vectors");
  const at::Tensor sl = slots.contiguous();
  const int64_t Hkv = k.size(1), hd = k.size(2);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "write_kv", [&] {
    using S = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k_cache.scalar_type(), "write_kv_cache", [&] {
      store_rows<S, scalar_t>(k.data_ptr<S>(), k.stride(0), k.stride(1), Hkv, hd, sl.data_ptr<int64_t>(), k.size(0),
                              k_cache.data_ptr<scalar_t>());
      store_rows<S, scalar_t>(v.data_ptr<S>(), v.stride(0), v.stride(1), Hkv, hd, sl.data_ptr<int64_t>(), v.size(0),
                              v_cache.data_ptr<scalar_t>());
    });
  });
}

// A linear of kernels.block: kind > 0, qdot's codes of that many bits then the bias (quant.QLinear.mm); kind 0, a
// weight prepacked for oneDNN with its bias (prepack.prepacked_linear); kind -1, a bf16 weight for bf16_linear with
// its bias (where bf16 is emulated); b undefined or empty: none. All through the dispatcher, as from Python.
at::Tensor block_linear_rows(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, int64_t kind, int64_t n);

// Fewer rows than `lo` are zero-padded up to lo rows, as row_tiles.RowTiles pads them (the same call, the same bits):
// the prepacked kernels round a 1-row call (a GEMV) differently from calls of lo or more rows.
at::Tensor block_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, int64_t kind, int64_t n,
                        int64_t lo) {
  if (x.size(0) >= lo) return block_linear_rows(x, w, b, kind, n);
  at::Tensor xp = at::zeros({lo, x.size(1)}, x.options());
  xp.narrow(0, 0, x.size(0)).copy_(x);
  return block_linear_rows(xp, w, b, kind, n).narrow(0, 0, x.size(0));
}

at::Tensor block_linear_rows(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, int64_t kind, int64_t n) {
  const bool bias = b.defined() && b.numel();
  if (kind == -1) {
    static auto dense = c10::Dispatcher::singleton().findSchemaOrThrow("specdec::bf16_linear", "")
        .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&)>();
    return dense.call(x, w, bias ? std::optional<at::Tensor>(b) : std::nullopt);
  }
  static auto qdot = c10::Dispatcher::singleton().findSchemaOrThrow("specdec::qdot", "")
                         .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t)>();
  if (kind > 0) {
    at::Tensor y = qdot.call(x, w, kind, n);
    return bias ? y + b : y;
  }
  static auto packed = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "")
      .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, c10::string_view,
                        c10::List<std::optional<at::Scalar>>, std::optional<c10::string_view>)>();
  return packed.call(x.contiguous(), w, bias ? std::optional<at::Tensor>(b) : std::nullopt, "none",
                     c10::List<std::optional<at::Scalar>>(), "");
}

// One transformer block (engine/model.py Block.forward) whose linears are qdot's, prepacked or bf16_linear's: the
// same ops in the same order as the Python path, called from here instead of through ~25 Python calls, so the same
// bits (tests compare the two with torch.equal). Without qdot's time (a stand-in returning zeros) a Qwen 0.5B decode
// step was 4.1 ms, ~100 us a layer of it Python; with this call a whole step took 0.80x the time at 1 row (1.5B:
// 0.87x, SmolLM2 w4a8: 0.68x, SmolLM2 bf16 prepacked: 0.87x at 1-16 rows; a 2-core Sapphire Rapids; SmolLM2 bf16 on
// bf16_linear, a Zen 3: 0.81x at 1 row, 0.91x at 8, 0.97x at 40). w: attn norm, qkv
// weight, qkv bias (empty: none), wo, mlp norm, gate-up, down; meta: H, Hkv, hd, then kind (block_linear) and outputs
// of qkv, wo, gate-up and down; attn: each attention group's rows, slots and lens.
at::Tensor block(const at::Tensor& x, at::TensorList w, at::IntArrayRef meta, double eps, const at::Tensor& cos,
                 const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& write_slots,
                 at::TensorList attn, double scale, int64_t lo) {
  TORCH_CHECK(w.size() == 7 && meta.size() == 11 && attn.size() % 3 == 0, "block: 7 weights, 11 sizes, 3 per group");
  const int64_t H = meta[0], Hkv = meta[1], hd = meta[2], T = x.size(0);
  at::Tensor qkv = block_linear(rms_norm(x, w[0], eps), w[1], w[2], meta[3], meta[4], lo);
  const auto parts = qkv.split_with_sizes({(H + Hkv) * hd, Hkv * hd}, -1);
  const at::Tensor qk = rope(parts[0].view({T, H + Hkv, hd}), cos, sin);
  const at::Tensor q = qk.narrow(1, 0, H), k = qk.narrow(1, H, Hkv), v = parts[1].view({T, Hkv, hd});
  write_kv(k_cache, v_cache, write_slots, k, v);
  at::Tensor o = at::empty({T, H * hd}, x.options());
  for (size_t g = 0; g < attn.size(); g += 3) attend(q, k_cache, v_cache, attn[g], attn[g + 1], attn[g + 2], scale, o);
  const at::Tensor h = x + block_linear(o, w[3], at::Tensor(), meta[5], meta[6], lo);
  const auto gu = block_linear(rms_norm(h, w[4], eps), w[5], at::Tensor(), meta[7], meta[8], lo).chunk(2, -1);
  return h + block_linear(at::silu(gu[0]) * gu[1], w[6], at::Tensor(), meta[9], meta[10], lo);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specdec, m) {
  m.def("block(Tensor x, Tensor[] w, int[] meta, float eps, Tensor cos, Tensor sin, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, Tensor write_slots, Tensor[] attn, float scale, int lo) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("attend(Tensor q, Tensor k, Tensor v, Tensor rows, Tensor slots, Tensor lens, float scale, Tensor(a!) out) -> ()");
  m.def("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("write_kv(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, Tensor k, Tensor v) -> ()");
}
TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("block", block);
  m.impl("rms_norm", rms_norm);
  m.impl("attend", attend);
  m.impl("rope", rope);
  m.impl("write_kv", write_kv);
}
// kernels.block's weight list holds oneDNN-prepacked tensors for a bf16 model, which dispatch to this key
TORCH_LIBRARY_IMPL(specdec, MkldnnCPU, m) {
  m.impl("block", block);
}
