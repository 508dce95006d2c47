// A bf16 linear for CPUs without bf16 arithmetic (AVX2 only, e.g. a Zen 3 EPYC). There PyTorch's bf16 GEMM costs
// every row as much as the first (a 3072 x 576 weight: 0.22 ms a row, 1.8 ms for 8, 17 for 64, measured), so a
// verify of 8 rows cost 8 decodes and batching bought nothing. Here each weight row is widened to float32 in
// registers once per group of up to 8 rows of x, which share it.
//
// Row invariance by construction: an output's sum runs over k in 8 strided float32 lanes, in k order, ended by the
// fixed tree8 and the bias, rounded to bf16 once; nothing of it depends on the other rows or their number.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <algorithm>
#include <immintrin.h>

#include "fixed_sums.h"

namespace {

inline __m256 widen(const at::BFloat16* w) {   // 8 bf16 -> 8 float32: the bits, 16 places up
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// y[r][n] for rows x[0..R) (float32, row stride K) and weight rows n0..n1: every weight row read once for all R.
template <int R>
void rows_dot(const float* x, int64_t K, const at::BFloat16* w, const at::BFloat16* b, int64_t n0, int64_t n1,
              at::BFloat16* y, int64_t N) {
  for (int64_t n = n0; n < n1; ++n) {
    const at::BFloat16* wn = w + n * K;
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) {
      const __m256 wv = widen(wn + k);
      for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * K + k), wv, acc[r]);
    }
    const float bias = b ? static_cast<float>(b[n]) : 0.f;
    for (int r = 0; r < R; ++r) {
      float p[8];
      _mm256_storeu_ps(p, acc[r]);
      y[r * N + n] = static_cast<at::BFloat16>(tree8(p) + bias);
    }
  }
}

using RowsDot = void (*)(const float*, int64_t, const at::BFloat16*, const at::BFloat16*, int64_t, int64_t,
                         at::BFloat16*, int64_t);
constexpr RowsDot ROWS_DOT[9] = {nullptr, rows_dot<1>, rows_dot<2>, rows_dot<3>, rows_dot<4>,
                                 rows_dot<5>, rows_dot<6>, rows_dot<7>, rows_dot<8>};

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1) && w.size(1) % 8 == 0,
              "bf16_linear: x [M, K], w [N, K] with K a multiple of 8");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "bf16_linear: bf16 x and w");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const at::Tensor xf = x.to(at::kFloat).contiguous(), wc = w.contiguous();
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == at::kBFloat16 && b.numel() == N, "bf16_linear: a bf16 bias of N");
  }
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = xf.data_ptr<float>();
  const at::BFloat16* wp = wc.data_ptr<at::BFloat16>();
  const at::BFloat16* bp = b.defined() ? b.data_ptr<at::BFloat16>() : nullptr;
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  // outputs in chunks of <= 128 KB of weights, so that groups of rows after the first find them in L2
  const int64_t chunk = std::max<int64_t>(8, (128 << 10) / (2 * K));
  at::parallel_for(0, N, chunk, [&](int64_t s, int64_t e) {
    for (int64_t n0 = s; n0 < e; n0 += chunk) {
      const int64_t n1 = std::min(e, n0 + chunk);
      for (int64_t m = 0; m < M; m += 8) {
        const int r = static_cast<int>(std::min<int64_t>(8, M - m));
        ROWS_DOT[r](xp + m * K, K, wp, bp, n0, n1, yp + m * N, N);
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specdec, m) {
  m.def("bf16_linear(Tensor x, Tensor w, Tensor? b) -> Tensor");
}
TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("bf16_linear", bf16_linear);
}
