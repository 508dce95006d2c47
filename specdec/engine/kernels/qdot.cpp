// Quantized linear y = x W^T with 4-, 6- or 8-bit weight codes and int8 activations, llama.cpp's Q4 x Q8 scheme:
// every group of 32 inputs has a weight scale s and offset o per output (w = s * q + o) and, per row, an activation
// scale a (x ~ a * xq, xq in -127..127, rounded inside the call). Per output n and row m, in this order:
//     y = 0;  for g = 0, 1, ...:  y = fma(float(dot(q[n,g], xq[m,g])), a[m,g] * s[n,g], y);
//                                  y = fma(o[n,g], a[m,g] * sum(xq[m,g]), y)
// The dot of codes (0..15, 0..63 or 0..255, unsigned) with int8 activations is exact in int32 (VNNI dpbusd, or AVX2's
// maddubs, which cannot saturate on 4- or 6-bit codes), and every output's float chain is the one above whatever the
// number of rows, tiles or threads: a row's output bits do not depend on its neighbours (batch invariance, issue F).
//
// Layout: outputs in blocks of 16, the vector width, so one vector holds 16 outputs and the float chain of each
// output is a lane (no horizontal sums). A block's record for one group of 32 inputs: its codes, P rows of 64 bytes =
// 16 outputs x 4 consecutive inputs (VNNI's "4 bytes a lane"; 8 such rows cover the group; 8-bit: P = 8; 4-bit:
// P = 4, byte r of packed row p holds row 2p in the low nibble and row 2p + 1 in the high one, so one load, a mask
// and a shift give two rows; 6-bit: P = 6, the low 4 bits as 4-bit codes, then two rows of the 2 high bits), then
// its 16 scales and 16 offsets in fp16. Blocks come in quads (64 outputs) whose four records of a group lie side by
// side: packed [N/64, K/32, 4, P * 64 + 64]. A one-row product reads a thread's share of the weights as one forward
// stream, codes and scales together: on a 2-core EPYC (Zen 4) a Qwen 1.5B step's matmuls took 1.06-1.46x as long
// (1 to 16 rows) with codes, scales and offsets in three arrays (12 streams a thread for one row; the short
// streams of scales never got the hardware prefetcher going). An activation's 4 bytes are broadcast to every lane,
// so a group's dot for 16 outputs is 8 dpbusd.
// Tiles: a quad's 4 blocks side by side for up to WIDE rows (4 x 6 accumulators of AVX-512's 32 registers), each
// record unpacked once for all of them; calls of 32 rows or more run one block at a time, 8 rows a tile, the quad's
// records then read from the cache. On a 2-core Sapphire Rapids (vector path, Qwen 1.5B-shaped weights) 4-row
// quad-wide tiles took 0.63x the time of 8-row one-block tiles at 8 rows, 0.85x at 16, the same at 32 and 1.1x at
// 64-128; and 6-row quad-wide tiles 0.72-0.86x the time of 4-row ones at 5-6 rows (spills and all). A 2-core Zen 4
// EPYC, which runs each 512-bit op as two 256-bit halves, is the other way round: 8-row one-block tiles took 0.86x
// the time of quad-wide ones at 8-16 rows, and 4-row quad-wide tiles 0.92x that of 6-row ones at 6 rows. So both
// schemes are built, and kernels/__init__.py times them once per process and picks one (qdot_tiles). Which tiles run
// never changes a bit. With AMX (below) calls of 16 rows or more run whole 16-row tiles on the tile unit. Compiled
// at first use by kernels/__init__.py with -march=native.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__AMX_INT8__) && defined(__AMX_TILE__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <sys/syscall.h>
#include <unistd.h>
#define SPECDEC_AMX 1
#endif

namespace {

constexpr int G = 32;      // inputs per group
constexpr int B = 16;      // outputs per block (lanes of a vector)
constexpr int Q = 4;       // blocks per quad
constexpr int ROWS = 8;    // rows of a one-block tile
constexpr int ONE_BLOCK_ROWS = 32;   // calls of fewer rows run quad-wide tiles only
// The tile scheme: 0 wide (quad-wide tiles of up to WIDE rows below ONE_BLOCK_ROWS rows), 1 narrow (quad-wide tiles
// of up to NARROW rows below ROWS rows, 8-row one-block tiles from there)
int tile_scheme = 0;
// Software prefetch of the weights, this many bytes ahead of the record a quad-wide tile unpacks (0: none). The
// hardware's streamer starts again at every 4 KB page and every call: cycling through Qwen 1.5B's layer weights one row
// at a time streamed them at 14-24 GB/s on a 2-core Sapphire Rapids, its 200 MB output head at 24-31. One prefetch a
// 64-byte line, 1024 bytes ahead: a Qwen 1.5B decode step 0.87x the time, the 0.5B's 0.92x, 4 rows 0.87-0.88x (one
// process alternating; kernels/__init__.py). Prefetches never fault, so reading past a thread's last quad is harmless.
int prefetch_bytes = 1024;
template <int BITS> constexpr int REC = G * B * BITS / 8 + 4 * B;   // bytes of a record: codes, scales, offsets

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
// 16 int32 / float lanes in one zmm
constexpr int WIDE = 6;    // rows of a quad-wide tile
constexpr int NARROW = 4;  // rows of a quad-wide tile, narrow scheme
struct VI { __m512i v; };
struct VF { __m512 v; };
inline VI load64(const uint8_t* p) { return {_mm512_loadu_si512(p)}; }
inline VI izero() { return {_mm512_setzero_si512()}; }
inline VI iadd(VI a, VI b) { return {_mm512_add_epi32(a.v, b.v)}; }
inline void nibbles(VI v, VI& lo, VI& hi) {
  const __m512i m = _mm512_set1_epi8(0x0F);
  lo = {_mm512_and_si512(v.v, m)};
  hi = {_mm512_and_si512(_mm512_srli_epi16(v.v, 4), m)};
}
template <int BITS>   // acc + per lane sum of its 4 code bytes times x's 4 bytes
inline VI dot4(VI acc, VI codes, int32_t x4) { return {_mm512_dpbusd_epi32(acc.v, codes.v, _mm512_set1_epi32(x4))}; }
template <int BITS>   // a group's dot for 16 outputs: 8 rows of 4 codes a lane against 32 activations
inline VI group_dot(const VI c[8], const int32_t* x4) {
  VI d0 = izero(), d1 = izero();   // two chains; integer sums are exact in any order
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    d0 = dot4<BITS>(d0, c[i], x4[i]);
    d1 = dot4<BITS>(d1, c[4 + i], x4[4 + i]);
  }
  return iadd(d0, d1);
}
inline VF tofloat(VI a) { return {_mm512_cvtepi32_ps(a.v)}; }
inline VF halfs(const at::Half* p) {
  return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
inline VF fset(float f) { return {_mm512_set1_ps(f)}; }
inline VF fzero() { return {_mm512_setzero_ps()}; }
inline VI ior(VI a, VI b) { return {_mm512_or_si512(a.v, b.v)}; }
template <int S>   // bits 2S, 2S + 1 of each byte moved to bits 4, 5 (a 6-bit code's high bits), the rest zero
inline VI top2(VI h) {
  const __m512i m = _mm512_set1_epi8(0x30);
  if constexpr (S <= 2) return {_mm512_and_si512(_mm512_slli_epi16(h.v, 4 - 2 * S), m)};
  else return {_mm512_and_si512(_mm512_srli_epi16(h.v, 2 * S - 4), m)};
}
inline VF fmul(VF a, VF b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline VF ffma(VF a, VF b, VF c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline void fstore(float* p, VF a) { _mm512_storeu_ps(p, a.v); }
#else
// AVX2: the same 16 lanes as two ymm (outputs 0-7 and 8-15; their bytes are the first and second 32 of a row);
// 16 registers hold a quad's 4 accumulators for one row, no more
constexpr int WIDE = 1;
constexpr int NARROW = 1;
struct VI { __m256i l, h; };
struct VF { __m256 l, h; };
inline VI load64(const uint8_t* p) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))};
}
inline __m256i lo4(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
inline __m256i hi4(__m256i v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F)); }
inline void nibbles(VI v, VI& lo, VI& hi) {
  lo = {lo4(v.l), lo4(v.h)};
  hi = {hi4(v.l), hi4(v.h)};
}
// A group's dot for 16 outputs: 8 rows of 4 codes a lane against 32 activations. maddubs leaves int16 sums of 2
// products, and 4- and 6-bit codes keep several such sums within an int16 (|x| <= 127): a 4-bit pair is at most
// 2 * 15 * 127 = 3810, a lane's 8 pairs at most 30480; a 6-bit pair 16002, two of them 32004. So they are added as
// int16 and widened once (madd by 1), where each 4 products took a madd and an add: the same exact sum. 8-bit codes
// would saturate maddubs' pairs (255 * 127 * 2): their nibbles are summed apart, 16 * hi + lo.
template <int BITS>
inline VI group_dot(const VI c[8], const int32_t* x4) {
  const __m256i one = _mm256_set1_epi16(1);
  if constexpr (BITS == 4) {
    __m256i l = _mm256_setzero_si256(), h = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
      const __m256i x = _mm256_set1_epi32(x4[i]);
      l = _mm256_add_epi16(l, _mm256_maddubs_epi16(c[i].l, x));
      h = _mm256_add_epi16(h, _mm256_maddubs_epi16(c[i].h, x));
    }
    return {_mm256_madd_epi16(l, one), _mm256_madd_epi16(h, one)};
  } else if constexpr (BITS == 6) {
    __m256i l = _mm256_setzero_si256(), h = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int i = 0; i < 8; i += 2) {
      const __m256i x0 = _mm256_set1_epi32(x4[i]), x1 = _mm256_set1_epi32(x4[i + 1]);
      l = _mm256_add_epi32(l, _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(c[i].l, x0),
                                                                  _mm256_maddubs_epi16(c[i + 1].l, x1)), one));
      h = _mm256_add_epi32(h, _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(c[i].h, x0),
                                                                  _mm256_maddubs_epi16(c[i + 1].h, x1)), one));
    }
    return {l, h};
  } else {
    __m256i lh = _mm256_setzero_si256(), ll = _mm256_setzero_si256();
    __m256i hh = _mm256_setzero_si256(), hl = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
      const __m256i x = _mm256_set1_epi32(x4[i]);
      lh = _mm256_add_epi16(lh, _mm256_maddubs_epi16(hi4(c[i].l), x));
      ll = _mm256_add_epi16(ll, _mm256_maddubs_epi16(lo4(c[i].l), x));
      hh = _mm256_add_epi16(hh, _mm256_maddubs_epi16(hi4(c[i].h), x));
      hl = _mm256_add_epi16(hl, _mm256_maddubs_epi16(lo4(c[i].h), x));
    }
    return {_mm256_add_epi32(_mm256_slli_epi32(_mm256_madd_epi16(lh, one), 4), _mm256_madd_epi16(ll, one)),
            _mm256_add_epi32(_mm256_slli_epi32(_mm256_madd_epi16(hh, one), 4), _mm256_madd_epi16(hl, one))};
  }
}
inline VF tofloat(VI a) { return {_mm256_cvtepi32_ps(a.l), _mm256_cvtepi32_ps(a.h)}; }
inline VF halfs(const at::Half* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline VF fset(float f) { return {_mm256_set1_ps(f), _mm256_set1_ps(f)}; }
inline VF fzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline VI ior(VI a, VI b) { return {_mm256_or_si256(a.l, b.l), _mm256_or_si256(a.h, b.h)}; }
template <int S>
inline __m256i top2_half(__m256i h) {
  const __m256i m = _mm256_set1_epi8(0x30);
  if constexpr (S <= 2) return _mm256_and_si256(_mm256_slli_epi16(h, 4 - 2 * S), m);
  else return _mm256_and_si256(_mm256_srli_epi16(h, 2 * S - 4), m);
}
template <int S>
inline VI top2(VI h) { return {top2_half<S>(h.l), top2_half<S>(h.h)}; }
inline VF fmul(VF a, VF b) { return {_mm256_mul_ps(a.l, b.l), _mm256_mul_ps(a.h, b.h)}; }
inline VF ffma(VF a, VF b, VF c) { return {_mm256_fmadd_ps(a.l, b.l, c.l), _mm256_fmadd_ps(a.h, b.h, c.h)}; }
inline void fstore(float* p, VF a) { _mm256_storeu_ps(p, a.l); _mm256_storeu_ps(p + 8, a.h); }
#endif

// The 8 rows of 16 x 4 codes of one block's group. 6-bit codes: their low 4 bits as 4-bit codes, then 2 rows of
// high bits, bits 2s, 2s + 1 of row h's byte being the high bits of row 4h + s.
template <int BITS>
inline void unpack(const uint8_t* p, VI c[8]) {
  if constexpr (BITS == 8) {
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) c[i] = load64(p + 64 * i);
  } else {
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) nibbles(load64(p + 64 * i), c[2 * i], c[2 * i + 1]);
    if constexpr (BITS == 6) {
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const VI hv = load64(p + 256 + 64 * h);
        c[4 * h] = ior(c[4 * h], top2<0>(hv));
        c[4 * h + 1] = ior(c[4 * h + 1], top2<1>(hv));
        c[4 * h + 2] = ior(c[4 * h + 2], top2<2>(hv));
        c[4 * h + 3] = ior(c[4 * h + 3], top2<3>(hv));
      }
    }
  }
}

// One group's step of an output's float chain (the header's order): acc + float(dot) * (a * s), then + o * asum. Every
// tile path calls this one, which is what keeps a row's bits the same whichever path ran it.
inline VF group_step(VF acc, VI dot, float a, float asum, VF sv, VF ov) {
  acc = ffma(tofloat(dot), fmul(fset(a), sv), acc);
  return ffma(ov, fset(asum), acc);
}

// A block's 16 outputs of one row to the activations' dtype (round to nearest even), the first `left` of them. bf16
// with AVX-512 BF16: one vcvtneps2bf16, which rounds as c10's scalar conversion does except for NaN and denormals
// (flushed to zero); which way an output goes depends on its column alone, so rows stay batch-invariant. The scalar
// loop of 16 conversions was ~7% of an 8-row product.
template <typename T>
inline void store16(VF v, T* y, int64_t left) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (left >= B) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v.v)));
      return;
    }
  }
#endif
  float out[B];
  fstore(out, v);
  for (int j = 0; j < B && j < left; ++j) y[j] = static_cast<T>(out[j]);
}

struct Rows {                // the quantized activations of a tile's first row
  const int8_t* xq;          // [R, K]
  const float* a;            // [R, K/32] scales
  const float* asum;         // [R, K/32] a * sum(xq)
};

// Outputs of CB blocks of a quad (from its block j0; 16 * CB columns from column n0) for R rows; y points at row 0,
// column n0.
template <int BITS, int CB, int R, typename T>
inline void tile(const uint8_t* quad, int j0, Rows x, int64_t K, int64_t N, int64_t n0, T* y) {
  constexpr int CODES = G * B * BITS / 8;
  const int64_t ng = K / G;
  VF acc[R][CB];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int b = 0; b < CB; ++b) acc[r][b] = fzero();
  for (int64_t g = 0; g < ng; ++g) {
#pragma GCC unroll 4
    for (int b = 0; b < CB; ++b) {
      const uint8_t* rec = quad + (g * Q + j0 + b) * REC<BITS>;
      if constexpr (CB == Q) {     // records in stream order (one-block tiles stride through a quad: no prefetch)
        if (prefetch_bytes)
          for (int l = 0; l < REC<BITS>; l += 64) _mm_prefetch(reinterpret_cast<const char*>(rec + prefetch_bytes + l),
                                                                _MM_HINT_T0);
      }
      VI c[8];
      unpack<BITS>(rec, c);
      const VF sv = halfs(reinterpret_cast<const at::Half*>(rec + CODES));
      const VF ov = halfs(reinterpret_cast<const at::Half*>(rec + CODES + 2 * B));
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int32_t* x4 = reinterpret_cast<const int32_t*>(x.xq + r * K + g * G);
        acc[r][b] = group_step(acc[r][b], group_dot<BITS>(c, x4), x.a[r * ng + g], x.asum[r * ng + g], sv, ov);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int b = 0; b < CB; ++b) store16(acc[r][b], y + r * N + b * B, N - n0 - b * B);
}

template <int BITS, int CB, int R, typename T>   // a tile of r (1..R) rows: the template of its size
inline void tile_r(int r, const uint8_t* quad, int j0, Rows x, int64_t K, int64_t N, int64_t n0, T* y) {
  if constexpr (R > 1) {
    if (r < R) return tile_r<BITS, CB, R - 1, T>(r, quad, j0, x, K, N, n0, y);
  }
  tile<BITS, CB, R>(quad, j0, x, K, N, n0, y);
}

#ifdef SPECDEC_AMX
// AMX (Sapphire Rapids and later): tiles of 16 rows. A group's integer dot for 16 rows x 16 outputs is one tile
// multiply (signed activations x unsigned codes, TDPBSUD: exact int32 sums, the same as dpbusd's), and the record's
// code rows are already the B tile's layout (4 inputs x 16 outputs a 64-byte row). Only the integer products move to
// the tile unit; each row's float chain is group_step, as in tile(), so outputs are bitwise those of tile(). That
// chain (4 float ops per row, output and group) is then about half the time: a 2-core Sapphire Rapids ran Qwen 1.5B's
// matmuls 1.2x faster at 64-128 rows, about even at 16-32; a prefill of 140 tokens 1.13-1.17x.
constexpr int TR = 16;   // rows of an AMX tile
constexpr int AMX_MIN_ROWS = 16;  // fewer rows, and the rows past the last whole tile, run on tile()
bool amx_enabled = true;

bool amx_ready() {   // Linux hands out the tile state on request, once per process (ARCH_REQ_XCOMP_PERM, XTILEDATA)
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok && amx_enabled;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tiles 0, 1: int32 sums (16 rows x 16 outputs); 2, 3: activations (16 rows x 32 bytes); 4, 5: codes (8 x 64 bytes).
// Two sets, so one group's tile multiply overlaps the previous group's float chain.
const TileConfig& tile_config() {
  static const TileConfig c = [] {
    TileConfig t;
    for (int i : {0, 1}) t.rows[i] = TR, t.colsb[i] = 64;
    for (int i : {2, 3}) t.rows[i] = TR, t.colsb[i] = G;
    for (int i : {4, 5}) t.rows[i] = 8, t.colsb[i] = 64;
    return t;
  }();
  return c;
}

// sums[16][16] = activations of a group (16 rows) . codes; a macro, as GCC's tile intrinsics take literal tile numbers
#define TILE_DOT(TC, TA, TB, xg, K, codes, sums) \
  do {                                           \
    _tile_zero(TC);                              \
    _tile_loadd(TA, xg, K);                      \
    _tile_loadd(TB, codes, 64);                  \
    _tile_dpbsud(TC, TA, TB);                    \
    _tile_stored(TC, sums, 64);                  \
  } while (0)

// One block (16 outputs from n0) for rows [0, m1), a multiple of 16 rows; codes: the block's unpacked code rows,
// 512 bytes per group (an 8-bit record's own rows, stride `cstride` between groups).
template <typename T>
void amx_block(const uint8_t* codes, int64_t cstride, const uint8_t* rec0, int64_t rstride, int codes_bytes,
               const int8_t* xq, const float* a, const float* asum, int64_t m1, int64_t K, int64_t N, int64_t n0,
               T* y) {
  const int64_t ng = K / G;
  alignas(64) int32_t sums[4][TR * B];
  for (int64_t m = 0; m < m1; m += TR) {
    VF acc[TR];
#pragma GCC unroll 16
    for (int r = 0; r < TR; ++r) acc[r] = fzero();
    auto chain = [&](int64_t g, const int32_t* s) {
      const uint8_t* rec = rec0 + g * rstride;
      const VF sv = halfs(reinterpret_cast<const at::Half*>(rec + codes_bytes));
      const VF ov = halfs(reinterpret_cast<const at::Half*>(rec + codes_bytes + 2 * B));
#pragma GCC unroll 16
      for (int r = 0; r < TR; ++r) {
        acc[r] = group_step(acc[r], load64(reinterpret_cast<const uint8_t*>(s + r * B)), a[(m + r) * ng + g],
                            asum[(m + r) * ng + g], sv, ov);
      }
    };
    // the tile unit runs two groups ahead of the float chain (sums of 4 groups in flight)
    auto dots = [&](int64_t g, int32_t* s0, int32_t* s1) {
      if (g < ng) TILE_DOT(0, 2, 4, xq + m * K + g * G, K, codes + g * cstride, s0);
      if (g + 1 < ng) TILE_DOT(1, 3, 5, xq + m * K + (g + 1) * G, K, codes + (g + 1) * cstride, s1);
    };
    dots(0, sums[0], sums[1]);
    for (int64_t g = 0; g < ng; g += 2) {
      int32_t* s = sums[g & 2];
      dots(g + 2, sums[(g + 2) & 2], sums[((g + 2) & 2) + 1]);
      chain(g, s);
      if (g + 1 < ng) chain(g + 1, s + TR * B);
    }
#pragma GCC unroll 16
    for (int r = 0; r < TR; ++r) store16(acc[r], y + (m + r) * N + n0, N - n0);
  }
}

// Rows [0, m1) of a quad's 4 blocks: each block's codes unpacked once (4- and 6-bit) for all its row tiles.
template <int BITS, typename T>
void amx_quad(const uint8_t* quad, std::vector<uint8_t>& buf, const int8_t* xq, const float* a, const float* asum,
              int64_t m1, int64_t K, int64_t N, int64_t n0, T* y) {
  constexpr int CODES = G * B * BITS / 8;
  const int64_t ng = K / G;
  for (int j = 0; j < Q && n0 + j * B < N; ++j) {
    const uint8_t* rec0 = quad + j * REC<BITS>;
    if constexpr (BITS == 8) {
      amx_block<T>(rec0, Q * REC<8>, rec0, Q * REC<8>, CODES, xq, a, asum, m1, K, N, n0 + j * B, y);
    } else {
      buf.resize(ng * 8 * 64);
      for (int64_t g = 0; g < ng; ++g) {
        VI c[8];
        unpack<BITS>(rec0 + g * Q * REC<BITS>, c);
        for (int i = 0; i < 8; ++i) _mm512_storeu_si512(buf.data() + g * 512 + 64 * i, c[i].v);
      }
      amx_block<T>(buf.data(), 512, rec0, Q * REC<BITS>, CODES, xq, a, asum, m1, K, N, n0 + j * B, y);
    }
  }
}
#endif

template <int BITS, typename T>
void run(const uint8_t* packed, const int8_t* xq, const float* a, const float* asum, int64_t M, int64_t N, int64_t K,
         T* y) {
  const int64_t ng = K / G, n_quads = (N + Q * B - 1) / (Q * B);
  int64_t m_done = 0;
#ifdef SPECDEC_AMX
  if (M >= AMX_MIN_ROWS && amx_ready()) {   // whole 16-row tiles on AMX, the rest below
    m_done = M / TR * TR;
    at::parallel_for(0, n_quads, 1, [&](int64_t q0, int64_t q1) {
      std::vector<uint8_t> buf;
      _tile_loadconfig(&tile_config());     // per thread: other code (oneDNN) may have set its own
      for (int64_t q = q0; q < q1; ++q) amx_quad<BITS, T>(packed + q * ng * Q * REC<BITS>, buf, xq, a, asum, m_done,
                                                          K, N, q * Q * B, y);
      _tile_release();
    });
  }
#endif
  if (m_done == M) return;
  const bool narrow = tile_scheme == 1;
  const int64_t one_block_from = narrow ? ROWS : ONE_BLOCK_ROWS;
  at::parallel_for(0, n_quads, 1, [&](int64_t q0, int64_t q1) {
    for (int64_t q = q0; q < q1; ++q) {
      const uint8_t* quad = packed + q * ng * Q * REC<BITS>;
      const int64_t n0 = q * Q * B;
      for (int64_t m = m_done; m < M;) {
        const Rows x{xq + m * K, a + m * ng, asum + m * ng};
        const int64_t left = M - m;
        if ((M >= one_block_from && left >= ROWS) || (WIDE == 1 && left > 1)) {   // one block at a time, 8 rows
          const int r = static_cast<int>(std::min<int64_t>(ROWS, left));
          for (int j = 0; j < Q; ++j) tile_r<BITS, 1, ROWS, T>(r, quad, j, x, K, N, n0 + j * B, y + m * N + n0 + j * B);
          m += r;
        } else if (narrow) {                               // the quad's 4 blocks side by side
          const int r = static_cast<int>(std::min<int64_t>(NARROW, left));
          tile_r<BITS, Q, NARROW, T>(r, quad, 0, x, K, N, n0, y + m * N + n0);
          m += r;
        } else {
          const int r = static_cast<int>(std::min<int64_t>(WIDE, left));
          tile_r<BITS, Q, WIDE, T>(r, quad, 0, x, K, N, n0, y + m * N + n0);
          m += r;
        }
      }
    }
  });
}

// x [M, K] -> xq int8 [M, K], a and asum float32 [M, K/32]: per group a = max|x| / 127, xq = round(x / a), in float32.
#if defined(__AVX512F__) && defined(__AVX512BW__)
inline __m512 bf16x16(const at::BFloat16* p) {   // exact: a bf16 is a float's top 16 bits
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
// One bf16 group, vectorized: the scalar loop's bits (max and integer sums are exact in any order, the division and
// the rounding to nearest even are IEEE's per lane); values already integral convert exactly. The scalar loop cost
// ~10% of an 8-row product of Qwen 1.5B's layer shapes on a Sapphire Rapids.
inline void quantize_group(const at::BFloat16* x, int8_t* xq, float& a, float& asum) {
  const __m512 lo = bf16x16(x), hi = bf16x16(x + 16);
  const float scale = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi))) / 127.f;
  int sum = 0;
  if (scale > 0.f) {
    const __m512 sv = _mm512_set1_ps(scale);
    constexpr int RN = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    const __m512i ql = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_div_ps(lo, sv), RN));
    const __m512i qh = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_div_ps(hi, sv), RN));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq), _mm512_cvtepi32_epi8(ql));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + 16), _mm512_cvtepi32_epi8(qh));
    sum = _mm512_reduce_add_epi32(_mm512_add_epi32(ql, qh));
  } else {
    std::memset(xq, 0, G);
  }
  a = scale;
  asum = scale * static_cast<float>(sum);
}
#endif

template <typename T>
void quantize_rows(const T* x, int64_t M, int64_t K, int8_t* xq, float* a, float* asum) {
  const int64_t n_groups = K / G;
  at::parallel_for(0, M * n_groups, 256, [&](int64_t i0, int64_t i1) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    if constexpr (std::is_same_v<T, at::BFloat16>) {
      for (int64_t i = i0; i < i1; ++i) quantize_group(x + i * G, xq + i * G, a[i], asum[i]);
      return;
    }
#endif
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

at::Tensor qdot(const at::Tensor& x, const at::Tensor& packed, int64_t bits, int64_t N) {
  TORCH_CHECK(bits == 4 || bits == 6 || bits == 8, "qdot: bits must be 4, 6 or 8");
  TORCH_CHECK(x.dim() == 2, "qdot: x [M, K]");
  const int64_t M = x.size(0), K = x.size(1), n_quads = (N + Q * B - 1) / (Q * B);
  TORCH_CHECK(K % G == 0 && packed.numel() == n_quads * K / G * Q * (bits == 4 ? REC<4> : bits == 6 ? REC<6> : REC<8>),
              "qdot: K must be a multiple of 32 and the weights [N/64, K/32, 4, record]");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous(), "qdot: packed weights contiguous uint8");
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
    (bits == 4 ? run<4, scalar_t> : bits == 6 ? run<6, scalar_t> : run<8, scalar_t>)(
        packed.data_ptr<uint8_t>(), xq, a, asum, M, N, K, y.data_ptr<scalar_t>());
  });
  return y;
}

}  // namespace

// Whether multi-row products may use AMX tiles (enable: 1 yes, 0 no, -1 leave as is): returns whether they will.
// Tests and benchmarks compare both paths in one process.
bool qdot_amx(int64_t enable) {
#ifdef SPECDEC_AMX
  if (enable >= 0) amx_enabled = enable;
  return amx_ready();
#else
  return false;
#endif
}

// The tile scheme of the vector path (scheme: 0 wide, 1 narrow, -1 leave as is): returns the one in use.
// The AVX2 build has one (tiles of one row); it stays 0.
int64_t qdot_tiles(int64_t scheme) {
  if (WIDE > 1 && (scheme == 0 || scheme == 1)) tile_scheme = static_cast<int>(scheme);   // AVX2: one scheme
  return tile_scheme;
}

// Bytes of software prefetch ahead of the weights being read (bytes >= 0 sets it, -1 leaves it): returns it.
int64_t qdot_prefetch(int64_t bytes) {
  if (bytes >= 0) prefetch_bytes = static_cast<int>(bytes);
  return prefetch_bytes;
}

TORCH_LIBRARY(specdec, m) {
  m.def("qdot(Tensor x, Tensor packed, int bits, int n) -> Tensor");
  m.def("qdot_prefetch(int bytes) -> int", qdot_prefetch);
  m.def("qdot_amx(int enable) -> bool", qdot_amx);
  m.def("qdot_tiles(int scheme) -> int", qdot_tiles);
}
TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("qdot", qdot);
}
