// Fused block-sparse flash attention for the XLA CPU backend (float32).
//
// One call handles one device's q [B, T, N, H] against k [B, S, K, H] and
// v [B, S, K, V] (GQA: query head n reads kv head n / (N / K)). Masks follow
// lctx/kernels/masking.py: segment ids (0 = padding, sees nothing), causality and
// window on explicit positions. Blocks that the masks hide entirely are skipped;
// blocks they leave whole skip the element mask.
//
// Why a fused kernel: XLA CPU runs each block's matmuls well but cannot fuse the
// softmax between them, so every [rows, keys] score tile makes several passes
// through memory. Here a tile stays in L1/L2 from its scores to its products.
//
// The forward is FlashAttention's online softmax (out, lse). The backward is
// FlashAttention-2's: probabilities recomputed from the saved lse, dK/dV
// accumulated per kv block, dQ per q head over all kv blocks. Operands are first
// copied contiguous one head at a time (see "Packing" below).
//
// Layout contract with the Python side (lctx/kernels/cpu_fused.py): T is a
// multiple of 8 and S of 64 (the caller pads, marking padding with segment 0);
// H and V are multiples of 16; block_q is a multiple of 8, block_kv of 64.
//
// Vector code uses GCC vector extensions (16 floats), so it compiles to AVX-512
// where the host has it and to narrower registers elsewhere.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));
typedef int32_t i16 __attribute__((vector_size(64)));

constexpr float kMaskedLse = -1e30f;  // masking.MASKED_LSE

inline v16 ld(const float* p) { return *reinterpret_cast<const v16u*>(p); }
inline void st(float* p, v16 x) { *reinterpret_cast<v16u*>(p) = x; }
inline v16 bc(float x) { return v16{} + x; }

// Horizontal max / sum as a tree of lane shuffles (a lane-by-lane loop is a
// 16-long dependency chain, paid once per row and block).
inline v16 vmax(v16 a, v16 b) { return a > b ? a : b; }
inline float hmax(v16 x) {
  x = vmax(x, __builtin_shuffle(x, i16{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7}));
  x = vmax(x, __builtin_shuffle(x, i16{4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11}));
  x = vmax(x, __builtin_shuffle(x, i16{2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13}));
  x = vmax(x, __builtin_shuffle(x, i16{1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14}));
  return x[0];
}
inline float hsum(v16 x) {
  x += __builtin_shuffle(x, i16{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
  x += __builtin_shuffle(x, i16{4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
  x += __builtin_shuffle(x, i16{2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
  x += __builtin_shuffle(x, i16{1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
  return x[0];
}

// exp for softmax arguments (x <= ~88): Cephes' expf polynomial after range
// reduction; x < -87 (including -inf) gives exactly 0. Relative error ~2e-7.
inline v16 vexp(v16 x) {
  const v16 lo = bc(-87.0f);
  const i16 under = x < lo;
  x = under ? lo : x;
  const v16 magic = bc(12582912.0f);  // 1.5 * 2^23: round to nearest
  const v16 n = (x * 1.44269504088896341f + magic) - magic;
  v16 r = x - n * 0.693359375f;
  r = r - n * (-2.12194440e-4f);
  v16 p = bc(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const i16 bits = (__builtin_convertvector(n, i16) + 127) << 23;
  const v16 res = p * (v16)bits;
  return under ? bc(0.f) : res;
}

// C[rows, cols] = A[rows, inner] * BT[inner, cols]; A rows at stride lda, BT rows
// at stride ldb. rows % 4 == 0, cols % 64 == 0.
void gemm_abt(const float* a, int64_t lda, const float* bt, int64_t ldb, int64_t inner,
              float* c, int64_t ldc, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; r += 4) {
    const float* a0 = a + r * lda;
    for (int64_t j = 0; j < cols; j += 64) {
      v16 acc[4][4] = {};
      const float* bp = bt + j;
      for (int64_t h = 0; h < inner; ++h, bp += ldb) {
        const v16 b0 = ld(bp), b1 = ld(bp + 16), b2 = ld(bp + 32), b3 = ld(bp + 48);
#pragma GCC unroll 4
        for (int rr = 0; rr < 4; ++rr) {
          const float x = a0[rr * lda + h];
          acc[rr][0] += x * b0;
          acc[rr][1] += x * b1;
          acc[rr][2] += x * b2;
          acc[rr][3] += x * b3;
        }
      }
#pragma GCC unroll 4
      for (int rr = 0; rr < 4; ++rr) {
        float* cp = c + (r + rr) * ldc + j;
        st(cp, acc[rr][0]);
        st(cp + 16, acc[rr][1]);
        st(cp + 32, acc[rr][2]);
        st(cp + 48, acc[rr][3]);
      }
    }
  }
}

// C[rows, W] += P[rows, inner] * B[inner, W]; P rows at stride ldp, B rows at
// stride ldb, C rows at stride ldc. rows % 8 == 0, W % 16 == 0.
template <int NV>
inline void gemm_nn_chunk(const float* p, int64_t ldp, int64_t inner, const float* b,
                          int64_t ldb, float* c, int64_t ldc, int64_t rows) {
  for (int64_t r = 0; r < rows; r += 8) {
    v16 acc[8][NV];
#pragma GCC unroll 8
    for (int rr = 0; rr < 8; ++rr)
#pragma GCC unroll 2
      for (int u = 0; u < NV; ++u) acc[rr][u] = ld(c + (r + rr) * ldc + 16 * u);
    const float* pr = p + r * ldp;
    for (int64_t j = 0; j < inner; ++j) {
      v16 bv[NV];
#pragma GCC unroll 2
      for (int u = 0; u < NV; ++u) bv[u] = ld(b + j * ldb + 16 * u);
#pragma GCC unroll 8
      for (int rr = 0; rr < 8; ++rr) {
        const float x = pr[rr * ldp + j];
#pragma GCC unroll 2
        for (int u = 0; u < NV; ++u) acc[rr][u] += x * bv[u];
      }
    }
#pragma GCC unroll 8
    for (int rr = 0; rr < 8; ++rr)
#pragma GCC unroll 2
      for (int u = 0; u < NV; ++u) st(c + (r + rr) * ldc + 16 * u, acc[rr][u]);
  }
}

void gemm_nn(const float* p, int64_t ldp, int64_t inner, const float* b, int64_t ldb, float* c,
             int64_t ldc, int64_t rows, int64_t width) {
  int64_t w = 0;
  for (; w + 32 <= width; w += 32) gemm_nn_chunk<2>(p, ldp, inner, b + w, ldb, c + w, ldc, rows);
  if (w < width) gemm_nn_chunk<1>(p, ldp, inner, b + w, ldb, c + w, ldc, rows);
}

// D[cols, W] += P[rows, cols]^T * B[rows, W]; cols % 8 == 0, W % 16 == 0.
template <int NV>
inline void gemm_tn_chunk(const float* p, int64_t ldp, int64_t rows, int64_t cols,
                          const float* b, int64_t ldb, float* d, int64_t ldd) {
  for (int64_t j = 0; j < cols; j += 8) {
    v16 acc[8][NV];
#pragma GCC unroll 8
    for (int jj = 0; jj < 8; ++jj)
#pragma GCC unroll 2
      for (int u = 0; u < NV; ++u) acc[jj][u] = ld(d + (j + jj) * ldd + 16 * u);
    for (int64_t r = 0; r < rows; ++r) {
      v16 bv[NV];
#pragma GCC unroll 2
      for (int u = 0; u < NV; ++u) bv[u] = ld(b + r * ldb + 16 * u);
      const float* pr = p + r * ldp + j;
#pragma GCC unroll 8
      for (int jj = 0; jj < 8; ++jj) {
        const float x = pr[jj];
#pragma GCC unroll 2
        for (int u = 0; u < NV; ++u) acc[jj][u] += x * bv[u];
      }
    }
#pragma GCC unroll 8
    for (int jj = 0; jj < 8; ++jj)
#pragma GCC unroll 2
      for (int u = 0; u < NV; ++u) st(d + (j + jj) * ldd + 16 * u, acc[jj][u]);
  }
}

void gemm_tn(const float* p, int64_t ldp, int64_t rows, int64_t cols, const float* b,
             int64_t ldb, float* d, int64_t ldd, int64_t width) {
  int64_t w = 0;
  for (; w + 32 <= width; w += 32) gemm_tn_chunk<2>(p, ldp, rows, cols, b + w, ldb, d + w, ldd);
  if (w < width) gemm_tn_chunk<1>(p, ldp, rows, cols, b + w, ldb, d + w, ldd);
}

// Scratch without std::vector's zero fill (every buffer below is written before
// it is read, or cleared explicitly).
struct Scratch {
  explicit Scratch(int64_t n) : p(new float[n]) {}
  float* data() { return p.get(); }
  float& operator[](int64_t i) { return p[i]; }
  std::unique_ptr<float[]> p;
};

struct Dims {
  int64_t b, t, s, n, k, h, v;
};

struct Mask {
  const int32_t *q_pos, *q_seg, *kv_pos, *kv_seg;  // [B, T] / [B, S]
  bool causal;
  int64_t window;  // <= 0: none
};

struct BlockStat {
  int64_t pos_min, pos_max, seg_min, seg_max;
};

std::vector<BlockStat> block_stats(const int32_t* pos, const int32_t* seg, int64_t len,
                                   int64_t blk) {
  std::vector<BlockStat> out;
  for (int64_t i0 = 0; i0 < len; i0 += blk) {
    BlockStat st{pos[i0], pos[i0], seg[i0], seg[i0]};
    for (int64_t i = i0; i < std::min(len, i0 + blk); ++i) {
      st.pos_min = std::min<int64_t>(st.pos_min, pos[i]);
      st.pos_max = std::max<int64_t>(st.pos_max, pos[i]);
      st.seg_min = std::min<int64_t>(st.seg_min, seg[i]);
      st.seg_max = std::max<int64_t>(st.seg_max, seg[i]);
    }
    out.push_back(st);
  }
  return out;
}

// 0: every pair masked (skip), 1: mixed (element mask), 2: every pair visible.
int classify(const BlockStat& q, const BlockStat& k, bool causal, int64_t w) {
  if (q.seg_max == 0 || k.seg_max == 0) return 0;  // all padding (ids are >= 0)
  if (q.seg_max < k.seg_min || k.seg_max < q.seg_min) return 0;
  bool full = q.seg_min == q.seg_max && k.seg_min == k.seg_max;  // one equal, nonzero id
  if (causal) {
    if (k.pos_min > q.pos_max) return 0;
    if (k.pos_max > q.pos_min) full = false;
  }
  if (w > 0) {
    if (k.pos_max <= q.pos_min - w) return 0;
    if (k.pos_min <= q.pos_max - w) full = false;
    if (!causal) {
      if (k.pos_min >= q.pos_max + w) return 0;
      if (k.pos_max >= q.pos_min + w) full = false;
    }
  }
  return full ? 2 : 1;
}

std::vector<int8_t> block_classes(const Mask& m, const Dims& d, int64_t bi, int64_t bq,
                                  int64_t bk) {
  const auto qs = block_stats(m.q_pos + bi * d.t, m.q_seg + bi * d.t, d.t, bq);
  const auto ks = block_stats(m.kv_pos + bi * d.s, m.kv_seg + bi * d.s, d.s, bk);
  std::vector<int8_t> cls(qs.size() * ks.size());
  for (size_t i = 0; i < qs.size(); ++i)
    for (size_t j = 0; j < ks.size(); ++j)
      cls[i * ks.size() + j] = static_cast<int8_t>(classify(qs[i], ks[j], m.causal, m.window));
  return cls;
}

typedef int32_t i16u __attribute__((vector_size(64), aligned(4)));
inline i16 ldi(const int32_t* p) { return *reinterpret_cast<const i16u*>(p); }

// Sets hidden entries of a [rows, cols] tile (stride ldt) to -inf; cols % 16 == 0.
// Window bounds are clamped to int32 (positions are int32, so nothing is lost).
void mask_tile(const Mask& m, const Dims& d, int64_t bi, int64_t r0, int64_t rows, int64_t j0,
               int64_t cols, float* tile, int64_t ldt) {
  const int32_t* qp = m.q_pos + bi * d.t + r0;
  const int32_t* qs = m.q_seg + bi * d.t + r0;
  const int32_t* kp = m.kv_pos + bi * d.s + j0;
  const int32_t* ks = m.kv_seg + bi * d.s + j0;
  const v16 ninf = bc(-INFINITY);
  auto clamp32 = [](int64_t x) {
    return static_cast<int32_t>(std::clamp<int64_t>(x, INT32_MIN, INT32_MAX));
  };
  for (int64_t r = 0; r < rows; ++r) {
    const int32_t p = qp[r], sg = qs[r];
    float* row = tile + r * ldt;
    if (sg == 0) {  // padding query: sees nothing
      for (int64_t j = 0; j < cols; j += 16) st(row + j, ninf);
      continue;
    }
    // Visible keys: kp in (lo, hi] where lo = p - w (or none) and hi = p (causal) or
    // p + w - 1 (non-causal window) or none.
    const int32_t lo = m.window > 0 ? clamp32(int64_t{p} - m.window) : INT32_MIN;
    const int32_t hi = m.causal ? p : (m.window > 0 ? clamp32(int64_t{p} + m.window - 1)
                                                     : INT32_MAX);
    const bool has_lo = m.window > 0;
    for (int64_t j = 0; j < cols; j += 16) {
      const i16 k = ldi(kp + j);
      i16 vis = (ldi(ks + j) == sg) & (k <= hi);
      if (has_lo) vis &= k > lo;
      const v16 x = ld(row + j);
      st(row + j, vis ? x : ninf);
    }
  }
}

// Packing. In the caller's layout the rows of one head sit N*H (or K*H) floats
// apart; read in place, the matmul loops would touch one cache set over and over
// (the strides are powers of two). So operands are first copied contiguous, one
// head at a time, so that one kv head's K and V stay in L2 while its q heads run.

// [len][w] rows at `stride` -> contiguous [len][w], times scale. w % 16 == 0.
void pack_rows(const float* src, int64_t stride, int64_t len, int64_t w, float* dst,
               float scale = 1.f) {
  for (int64_t j = 0; j < len; ++j)
    for (int64_t x = 0; x < w; x += 16) st(dst + j * w + x, ld(src + j * stride + x) * scale);
}

// The inverse: contiguous [len][w] -> rows at `stride`, times scale.
void unpack_rows(const float* src, int64_t len, int64_t w, float* dst, int64_t stride,
                 float scale = 1.f) {
  for (int64_t j = 0; j < len; ++j)
    for (int64_t x = 0; x < w; x += 16) st(dst + j * stride + x, ld(src + j * w + x) * scale);
}

// [len][width] rows at `stride` -> block-major transposed [nblk][width][blk]: one
// kv block of B^T for gemm_abt, rows blk floats apart.
void pack_transposed_blocks(const float* src, int64_t stride, int64_t len, int64_t width,
                            int64_t blk, float* dst) {
  for (int64_t j0 = 0; j0 < len; j0 += blk) {
    float* out = dst + j0 * width;  // block j0/blk starts at (j0/blk) * width * blk
    const int64_t n = std::min(blk, len - j0);
    for (int64_t c0 = 0; c0 < n; c0 += 64) {  // 64 source rows at a time stay in L1
      const int64_t c1 = std::min(n, c0 + 64);
      for (int64_t x = 0; x < width; ++x)
        for (int64_t c = c0; c < c1; ++c) out[x * blk + c] = src[(j0 + c) * stride + x];
    }
  }
}

void forward(const float* q, const float* k, const float* v, const Mask& m, const Dims& d,
             float scale, int64_t block_q, int64_t block_kv, float* out, float* lse) {
  const int64_t g = d.n / d.k, nk = (d.s + block_kv - 1) / block_kv;
  // Per kv head: K^T in kv blocks and V rows; per q head: q rows (pre-scaled, so
  // tiles hold scaled scores).
  Scratch kt(d.h * nk * block_kv);
  Scratch vc(d.s * d.v);
  Scratch qc(d.t * d.h);
  Scratch acc(block_q * d.v);
  Scratch tile(block_q * block_kv);
  Scratch mx(block_q);
  Scratch sm(block_q);
  for (int64_t bi = 0; bi < d.b; ++bi) {
    const auto cls = block_classes(m, d, bi, block_q, block_kv);
    for (int64_t kh = 0; kh < d.k; ++kh) {
      pack_transposed_blocks(k + (bi * d.s * d.k + kh) * d.h, d.k * d.h, d.s, d.h, block_kv,
                             kt.data());
      pack_rows(v + (bi * d.s * d.k + kh) * d.v, d.k * d.v, d.s, d.v, vc.data());
      for (int64_t n = kh * g; n < (kh + 1) * g; ++n) {
        pack_rows(q + (bi * d.t * d.n + n) * d.h, d.n * d.h, d.t, d.h, qc.data(), scale);
        for (int64_t r0 = 0, iq = 0; r0 < d.t; r0 += block_q, ++iq) {
          const int64_t bq = std::min(block_q, d.t - r0);
          const float* qb = qc.data() + r0 * d.h;
          std::fill(acc.data(), acc.data() + bq * d.v, 0.f);
          std::fill(mx.data(), mx.data() + bq, kMaskedLse);
          std::fill(sm.data(), sm.data() + bq, 0.f);
          for (int64_t j0 = 0, jk = 0; j0 < d.s; j0 += block_kv, ++jk) {
            const int c = cls[iq * nk + jk];
            if (c == 0) continue;
            const int64_t bk = std::min(block_kv, d.s - j0);
            gemm_abt(qb, d.h, kt.data() + j0 * d.h, block_kv, d.h, tile.data(), block_kv, bq, bk);
            if (c == 1) mask_tile(m, d, bi, r0, bq, j0, bk, tile.data(), block_kv);
            for (int64_t r = 0; r < bq; ++r) {
              float* row = tile.data() + r * block_kv;
              // bk % 64 == 0: four independent chains hide the max/add latency.
              v16 m0 = bc(-INFINITY), m1 = m0, m2 = m0, m3 = m0;
              for (int64_t j = 0; j < bk; j += 64) {
                m0 = vmax(m0, ld(row + j));
                m1 = vmax(m1, ld(row + j + 16));
                m2 = vmax(m2, ld(row + j + 32));
                m3 = vmax(m3, ld(row + j + 48));
              }
              const float m_new = std::max(mx[r], hmax(vmax(vmax(m0, m1), vmax(m2, m3))));
              const float corr = std::exp(mx[r] - m_new);
              v16 s0 = {}, s1 = {}, s2 = {}, s3 = {};
              const v16 mn = bc(m_new);
              for (int64_t j = 0; j < bk; j += 64) {
                const v16 p0 = vexp(ld(row + j) - mn), p1 = vexp(ld(row + j + 16) - mn);
                const v16 p2 = vexp(ld(row + j + 32) - mn), p3 = vexp(ld(row + j + 48) - mn);
                st(row + j, p0);
                st(row + j + 16, p1);
                st(row + j + 32, p2);
                st(row + j + 48, p3);
                s0 += p0;
                s1 += p1;
                s2 += p2;
                s3 += p3;
              }
              sm[r] = sm[r] * corr + hsum((s0 + s1) + (s2 + s3));
              mx[r] = m_new;
              if (corr != 1.f) {
                float* ar = acc.data() + r * d.v;
                for (int64_t x = 0; x < d.v; x += 16) st(ar + x, ld(ar + x) * corr);
              }
            }
            gemm_nn(tile.data(), block_kv, bk, vc.data() + j0 * d.v, d.v, acc.data(), d.v, bq,
                    d.v);
          }
          for (int64_t r = 0; r < bq; ++r) {
            const bool seen = sm[r] > 0.f;
            const float inv = seen ? 1.f / sm[r] : 0.f;
            float* o = out + ((bi * d.t + r0 + r) * d.n + n) * d.v;
            const float* ar = acc.data() + r * d.v;
            for (int64_t x = 0; x < d.v; x += 16) st(o + x, ld(ar + x) * inv);
            lse[(bi * d.n + n) * d.t + r0 + r] = seen ? mx[r] + std::log(sm[r]) : kMaskedLse;
          }
        }
      }
    }
  }
}

void backward(const float* q, const float* k, const float* v, const float* dout,
              const float* lse, const float* delta, const Mask& m, const Dims& d, float scale,
              int64_t block_q, int64_t block_kv, float* dq, float* dk, float* dv) {
  const int64_t g = d.n / d.k, nk = (d.s + block_kv - 1) / block_kv;
  // Per kv head: K^T and V^T in kv blocks, K rows, and its group's q (pre-scaled:
  // scores come out scaled and dK = dS^T (scale q) directly), dout and dq rows.
  Scratch kt(d.h * nk * block_kv);
  Scratch vt(d.v * nk * block_kv);
  Scratch kc(d.s * d.h);
  Scratch qc(g * d.t * d.h);
  Scratch dc(g * d.t * d.v);
  Scratch dqc(g * d.t * d.h);
  Scratch dkt(block_kv * d.h);
  Scratch dvt(block_kv * d.v);
  Scratch pt(block_q * block_kv);
  Scratch dst(block_q * block_kv);
  for (int64_t bi = 0; bi < d.b; ++bi) {
    const auto cls = block_classes(m, d, bi, block_q, block_kv);
    for (int64_t kh = 0; kh < d.k; ++kh) {
      const float* kb = k + (bi * d.s * d.k + kh) * d.h;
      const float* vb = v + (bi * d.s * d.k + kh) * d.v;
      pack_transposed_blocks(kb, d.k * d.h, d.s, d.h, block_kv, kt.data());
      pack_transposed_blocks(vb, d.k * d.v, d.s, d.v, block_kv, vt.data());
      pack_rows(kb, d.k * d.h, d.s, d.h, kc.data());
      for (int64_t gi = 0; gi < g; ++gi) {
        const int64_t n = kh * g + gi;
        pack_rows(q + (bi * d.t * d.n + n) * d.h, d.n * d.h, d.t, d.h, qc.data() + gi * d.t * d.h,
                  scale);
        pack_rows(dout + (bi * d.t * d.n + n) * d.v, d.n * d.v, d.t, d.v,
                  dc.data() + gi * d.t * d.v);
      }
      std::fill(dqc.data(), dqc.data() + g * d.t * d.h, 0.f);
      for (int64_t j0 = 0, jk = 0; j0 < d.s; j0 += block_kv, ++jk) {
        const int64_t bk = std::min(block_kv, d.s - j0);
        std::fill(dkt.data(), dkt.data() + bk * d.h, 0.f);
        std::fill(dvt.data(), dvt.data() + bk * d.v, 0.f);
        for (int64_t gi = 0; gi < g; ++gi) {
          const int64_t n = kh * g + gi;
          for (int64_t r0 = 0, iq = 0; r0 < d.t; r0 += block_q, ++iq) {
            const int c = cls[iq * nk + jk];
            if (c == 0) continue;
            const int64_t bq = std::min(block_q, d.t - r0);
            const float* qb = qc.data() + (gi * d.t + r0) * d.h;
            const float* db = dc.data() + (gi * d.t + r0) * d.v;
            const float* lr = lse + (bi * d.n + n) * d.t + r0;
            const float* er = delta + (bi * d.n + n) * d.t + r0;
            gemm_abt(qb, d.h, kt.data() + j0 * d.h, block_kv, d.h, pt.data(), block_kv, bq, bk);
            if (c == 1) mask_tile(m, d, bi, r0, bq, j0, bk, pt.data(), block_kv);
            gemm_abt(db, d.v, vt.data() + j0 * d.v, block_kv, d.v, dst.data(), block_kv, bq, bk);
            for (int64_t r = 0; r < bq; ++r) {
              float* prow = pt.data() + r * block_kv;
              float* drow = dst.data() + r * block_kv;
              const v16 l = bc(lr[r]), e = bc(er[r]);
              for (int64_t j = 0; j < bk; j += 16) {
                const v16 p = vexp(ld(prow + j) - l);
                st(prow + j, p);
                st(drow + j, p * (ld(drow + j) - e));
              }
            }
            gemm_tn(pt.data(), block_kv, bq, bk, db, d.v, dvt.data(), d.v, d.v);
            gemm_nn(dst.data(), block_kv, bk, kc.data() + j0 * d.h, d.h,
                    dqc.data() + (gi * d.t + r0) * d.h, d.h, bq, d.h);
            gemm_tn(dst.data(), block_kv, bq, bk, qb, d.h, dkt.data(), d.h, d.h);
          }
        }
        unpack_rows(dkt.data(), bk, d.h, dk + ((bi * d.s + j0) * d.k + kh) * d.h, d.k * d.h);
        unpack_rows(dvt.data(), bk, d.v, dv + ((bi * d.s + j0) * d.k + kh) * d.v, d.k * d.v);
      }
      for (int64_t gi = 0; gi < g; ++gi)  // dQ = scale dS K
        unpack_rows(dqc.data() + gi * d.t * d.h, d.t, d.h,
                    dq + (bi * d.t * d.n + kh * g + gi) * d.h, d.n * d.h, scale);
    }
  }
}

ffi::Error check(const Dims& d, int64_t block_q, int64_t block_kv) {
  if (d.t % 8 || d.s % 64)
    return ffi::Error::InvalidArgument("lctx cpu attention: q_len must be a multiple of 8 and "
                                       "kv_len of 64 (pad in the caller); got " +
                                       std::to_string(d.t) + ", " + std::to_string(d.s));
  if (d.h % 16 || d.v % 16)
    return ffi::Error::InvalidArgument("lctx cpu attention: head dims must be multiples of 16");
  if (d.k == 0 || d.n % d.k)
    return ffi::Error::InvalidArgument("lctx cpu attention: q heads must be a multiple of kv heads");
  if (block_q < 8 || block_q % 8 || block_kv < 64 || block_kv % 64)
    return ffi::Error::InvalidArgument("lctx cpu attention: block_q must be a positive multiple "
                                       "of 8 and block_kv of 64");
  return ffi::Error::Success();
}

Dims dims_of(ffi::Buffer<ffi::F32>& q, ffi::Buffer<ffi::F32>& k, ffi::Buffer<ffi::F32>& v) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  return Dims{qd[0], qd[1], kd[1], qd[2], kd[2], qd[3], vd[3]};
}

ffi::Error forward_impl(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                        ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> q_pos,
                        ffi::Buffer<ffi::S32> q_seg, ffi::Buffer<ffi::S32> kv_pos,
                        ffi::Buffer<ffi::S32> kv_seg, ffi::ResultBuffer<ffi::F32> out,
                        ffi::ResultBuffer<ffi::F32> lse, int64_t causal, int64_t window,
                        float scale, int64_t block_q, int64_t block_kv) {
  const Dims d = dims_of(q, k, v);
  if (auto e = check(d, block_q, block_kv); e.failure()) return e;
  const Mask m{q_pos.typed_data(), q_seg.typed_data(), kv_pos.typed_data(), kv_seg.typed_data(),
               causal != 0, window};
  forward(q.typed_data(), k.typed_data(), v.typed_data(), m, d, scale, block_q, block_kv,
          out->typed_data(), lse->typed_data());
  return ffi::Error::Success();
}

ffi::Error backward_impl(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                         ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::F32> dout,
                         ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::F32> delta,
                         ffi::Buffer<ffi::S32> q_pos, ffi::Buffer<ffi::S32> q_seg,
                         ffi::Buffer<ffi::S32> kv_pos, ffi::Buffer<ffi::S32> kv_seg,
                         ffi::ResultBuffer<ffi::F32> dq, ffi::ResultBuffer<ffi::F32> dk,
                         ffi::ResultBuffer<ffi::F32> dv, int64_t causal, int64_t window,
                         float scale, int64_t block_q, int64_t block_kv) {
  const Dims d = dims_of(q, k, v);
  if (auto e = check(d, block_q, block_kv); e.failure()) return e;
  const Mask m{q_pos.typed_data(), q_seg.typed_data(), kv_pos.typed_data(), kv_seg.typed_data(),
               causal != 0, window};
  backward(q.typed_data(), k.typed_data(), v.typed_data(), dout.typed_data(), lse.typed_data(),
           delta.typed_data(), m, d, scale, block_q, block_kv, dq->typed_data(),
           dk->typed_data(), dv->typed_data());
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(LctxCpuAttentionForward, forward_impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("causal")
                                  .Attr<int64_t>("window")
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("block_q")
                                  .Attr<int64_t>("block_kv"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(LctxCpuAttentionBackward, backward_impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("causal")
                                  .Attr<int64_t>("window")
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("block_q")
                                  .Attr<int64_t>("block_kv"));
