// CPU kernel of attention(q, k, v, masked) {scale, optionally softcap}: grouped-query attention with an online
// (flash-style) softmax. The work is split into (kv head, block of queries) units, shared out between
// threads; a unit walks the keys in tiles, so each K and V row is read from memory once per unit and
// reused from L1 by every query head of the group and every query of the block. Scores, softmax and
// the weighted sum accumulate in f32 (f64 for f64).
//
// Masked keys are skipped: they would get exp(lowest - max) == 0 exactly. A query row masked
// everywhere gets the mean of every value row, which is what a softmax over all-equal (lowest)
// scores gives in the unfused graph.
#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include <fmt/format.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "kernels/cpu/gemm.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/strided.h"
#include "kernels/cpu/vector_math.h"

namespace kiln::kernels {
namespace {

using graph::Op;

constexpr int64_t kQueryBlock = 8;  // queries per unit (prefill); decode has one
constexpr int64_t kKeyTile = 64;    // keys per tile: K and V tiles of 64 x head_dim stay in L1

struct Dims {
  int64_t seq, heads, head_dim, total, kv_heads, group;
};

Dims check_operands(std::span<const TensorView> inputs, std::span<const TensorView> outputs) {
  if (inputs.size() != 4 || outputs.size() != 1)
    throw ValueError(fmt::format("attention: expected 4 operands (q, k, v, masked) and 1 result, got {} and {}",
                                 inputs.size(), outputs.size()));
  const TensorView &q = inputs[0], &k = inputs[1], &v = inputs[2], &masked = inputs[3], &out = outputs[0];
  if (q.shape.size() != 3 || k.shape.size() != 3 || k.shape != v.shape || masked.shape.size() != 2 ||
      k.shape[2] != q.shape[2] || masked.shape[0] != q.shape[0] || masked.shape[1] != k.shape[0])
    throw ShapeError(fmt::format("attention: expected q [seq, heads, head_dim], k and v [total, kv_heads, "
                                 "head_dim], masked [seq, total]; got q {}, k {}, v {}, masked {}",
                                 describe(q), describe(k), describe(v), describe(masked)));
  if (k.shape[1] < 1 || q.shape[1] % k.shape[1] != 0)
    throw ShapeError(fmt::format("attention: q's {} heads are not a multiple of k's {} kv heads (q {}, k {})",
                                 q.shape[1], k.shape[1], describe(q), describe(k)));
  if (k.dtype != q.dtype || v.dtype != q.dtype || masked.dtype != DType::boolean)
    throw DTypeError(fmt::format("attention: q, k and v must share a float dtype and masked be bool; got q {}, "
                                 "k {}, v {}, masked {}",
                                 describe(q), describe(k), describe(v), describe(masked)));
  if (out.shape != q.shape || out.dtype != q.dtype || !out.is_contiguous())
    throw ShapeError(fmt::format("attention: the result {} must be a contiguous {}", describe(out), describe(q)));
  return Dims{q.shape[0], q.shape[1], q.shape[2], k.shape[0], k.shape[1], q.shape[1] / k.shape[1]};
}

template <class T>
void attention_loop(const KernelContext& ctx, const Dims& d, double scale_attr, double softcap_attr,
                    std::span<const TensorView> inputs, const TensorView& out) {
  using C = std::conditional_t<std::is_same_v<T, double>, double, float>;
  const TensorView &q = inputs[0], &k = inputs[1], &v = inputs[2], &masked = inputs[3];
  const C scale = static_cast<C>(scale_attr);
  const C softcap = static_cast<C>(softcap_attr);
  const T* q_data = q.as<T>();
  const T* k_data = k.as<T>();
  const T* v_data = v.as<T>();
  const bool* mask = masked.as<bool>();
  T* o_data = out.as<T>();
  const int64_t hd = d.head_dim;
  const int64_t query_blocks = (d.seq + kQueryBlock - 1) / kQueryBlock;

  parallel_for(ctx, d.kv_heads * query_blocks, 1, [&](int64_t first_unit, int64_t end_unit) {
    const int64_t rows = kQueryBlock * d.group;  // (query, head of the group) pairs of a unit
    std::vector<C> q_rows(static_cast<size_t>(rows * hd));      // [query, group, hd]
    std::vector<C> acc(static_cast<size_t>(rows * hd));         // [query, group, hd]
    std::vector<C> running_max(static_cast<size_t>(rows)), running_sum(static_cast<size_t>(rows));
    std::vector<C> k_tile(static_cast<size_t>(hd * kKeyTile));  // [hd, key]: scores vectorise over keys
    std::vector<C> v_tile(static_cast<size_t>(kKeyTile * hd));
    std::vector<C> scores(static_cast<size_t>(kKeyTile));
    std::vector<char> visible(static_cast<size_t>(kKeyTile));
    std::vector<char> any_visible(static_cast<size_t>(kQueryBlock));

    for (int64_t unit = first_unit; unit < end_unit; ++unit) {
      const int64_t kv = unit % d.kv_heads;
      const int64_t s0 = (unit / d.kv_heads) * kQueryBlock;
      const int64_t queries = std::min(kQueryBlock, d.seq - s0);
      for (int64_t s = 0; s < queries; ++s)
        for (int64_t g = 0; g < d.group; ++g) {
          const T* src = q_data + (s0 + s) * q.strides[0] + (kv * d.group + g) * q.strides[1];
          C* dst = &q_rows[static_cast<size_t>((s * d.group + g) * hd)];
          for (int64_t i = 0; i < hd; ++i) dst[i] = static_cast<C>(src[i * q.strides[2]]);
        }
      std::fill(acc.begin(), acc.end(), C(0));
      std::fill(running_max.begin(), running_max.end(), -std::numeric_limits<C>::infinity());
      std::fill(running_sum.begin(), running_sum.end(), C(0));
      std::fill(any_visible.begin(), any_visible.end(), 0);

      for (int64_t t0 = 0; t0 < d.total; t0 += kKeyTile) {
        const int64_t keys = std::min(kKeyTile, d.total - t0);
        for (int64_t t = 0; t < keys; ++t) {
          const T* k_row = k_data + (t0 + t) * k.strides[0] + kv * k.strides[1];
          const T* v_row = v_data + (t0 + t) * v.strides[0] + kv * v.strides[1];
          for (int64_t i = 0; i < hd; ++i) {
            k_tile[static_cast<size_t>(i * kKeyTile + t)] = static_cast<C>(k_row[i * k.strides[2]]);
            v_tile[static_cast<size_t>(t * hd + i)] = static_cast<C>(v_row[i * v.strides[2]]);
          }
        }
        for (int64_t s = 0; s < queries; ++s) {
          const bool* mask_row = mask + (s0 + s) * masked.strides[0] + t0 * masked.strides[1];
          bool any = false;
          for (int64_t t = 0; t < keys; ++t) {
            visible[static_cast<size_t>(t)] = !mask_row[t * masked.strides[1]];
            any = any || visible[static_cast<size_t>(t)];
          }
          if (!any) continue;
          any_visible[static_cast<size_t>(s)] = 1;
          for (int64_t g = 0; g < d.group; ++g) {
            const int64_t row = s * d.group + g;
            const C* q_row = &q_rows[static_cast<size_t>(row * hd)];
            C* a = &acc[static_cast<size_t>(row * hd)];
            // scores[t] = q . k_t for the whole tile, one q element at a time: independent lanes per
            // key, so the loop vectorises without reordering any sum.
            C* score = scores.data();
            std::fill(score, score + keys, C(0));
            for (int64_t i = 0; i < hd; ++i) {
              const C qi = q_row[i];
              const C* k_column = &k_tile[static_cast<size_t>(i * kKeyTile)];
              for (int64_t t = 0; t < keys; ++t) score[t] += qi * k_column[t];
            }
            C tile_max = -std::numeric_limits<C>::infinity();
            for (int64_t t = 0; t < keys; ++t) {
              score[t] *= scale;
              if (softcap > C(0)) score[t] = softcap * std::tanh(score[t] / softcap);
              if (visible[static_cast<size_t>(t)]) tile_max = std::max(tile_max, score[t]);
            }
            C& m = running_max[static_cast<size_t>(row)];
            C& l = running_sum[static_cast<size_t>(row)];
            if (tile_max > m) {
              // Rescale what was summed against the old max (exp(-inf) = 0 the first time).
              const C correction = std::exp(m - tile_max);
              l *= correction;
              for (int64_t i = 0; i < hd; ++i) a[i] *= correction;
              m = tile_max;
            }
            for (int64_t t = 0; t < keys; ++t) {
              if (!visible[static_cast<size_t>(t)]) continue;
              const C p = std::exp(scores[static_cast<size_t>(t)] - m);
              l += p;
              const C* v_row = &v_tile[static_cast<size_t>(t * hd)];
              for (int64_t i = 0; i < hd; ++i) a[i] += p * v_row[i];
            }
          }
        }
      }

      for (int64_t s = 0; s < queries; ++s) {
        if (!any_visible[static_cast<size_t>(s)] && d.total > 0) {
          // Masked everywhere: every score is the same, so every value row weighs 1 / total.
          for (int64_t g = 0; g < d.group; ++g) {
            C* a = &acc[static_cast<size_t>((s * d.group + g) * hd)];
            for (int64_t t = 0; t < d.total; ++t) {
              const T* v_row = v_data + t * v.strides[0] + kv * v.strides[1];
              for (int64_t i = 0; i < hd; ++i) a[i] += static_cast<C>(v_row[i * v.strides[2]]);
            }
            running_sum[static_cast<size_t>(s * d.group + g)] = static_cast<C>(d.total);
          }
        }
        for (int64_t g = 0; g < d.group; ++g) {
          const int64_t row = s * d.group + g;
          const C l = running_sum[static_cast<size_t>(row)];
          const C inv = l > C(0) ? C(1) / l : C(0);  // total == 0: nothing to attend, the result is 0
          const C* a = &acc[static_cast<size_t>(row * hd)];
          T* dst = o_data + ((s0 + s) * d.heads + kv * d.group + g) * hd;
          for (int64_t i = 0; i < hd; ++i) dst[i] = static_cast<T>(a[i] * inv);
        }
      }
    }
  });
}

#if defined(__x86_64__)
// f32 with AVX-512, one query row at a time: decode reads the whole KV cache, so it must stream K and
// V at memory speed. Per (query, kv head): one pass over K computing every score of the group's
// heads, a vectorised softmax, one pass over V. No tiles: one query's scores for the whole history
// fit in L1/L2 (total * group floats); in prefill the K and V rows of a head stay in L2 across the
// queries.
#define KILN_AVX512 __attribute__((target("avx512f,avx512dq,fma")))
// GCC 12's AVX-512 intrinsics start from _mm512_undefined_ps(), which -Wmaybe-uninitialized
// misreports once inlined into a target("avx512f") function (GCC bug 105593, fixed in GCC 13).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

// Lane j <- the sum of v[j]'s lanes, for 16 vectors at once: a transpose-and-add tree, about three
// instructions per vector where a reduction of each would take eight.
KILN_AVX512 inline __m512 reduce16(const __m512* v) {
  __m512 t[8], u[4];
  for (int j = 0; j < 8; ++j)  // 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] of a = v[2j], b = v[2j+1]
    t[j] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * j], v[2 * j + 1]), _mm512_unpackhi_ps(v[2 * j], v[2 * j + 1]));
  for (int k = 0; k < 4; ++k) {  // 128-bit lane L: the lane-L sums of v[4k .. 4k+3]
    const __m512d a = _mm512_castps_pd(t[2 * k]), b = _mm512_castps_pd(t[2 * k + 1]);
    u[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 x01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
  const __m512 x23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(x01, x23, 0x88), _mm512_shuffle_f32x4(x01, x23, 0xDD));
}

// q . k_j for the keys j < n (n <= 16) whose rows start k_row apart: one vector of scores (0 past n).
KILN_AVX512 inline __m512 dots16(const float* q, const float* k, int64_t k_row, int64_t hd, int64_t n) {
  __m512 part[16];
  for (int j = 0; j < 16; ++j) part[j] = _mm512_setzero_ps();
  for (int64_t c = 0; c < hd; c += 16) {
    const __mmask16 m = vmath::first_lanes(hd - c);
    const __m512 qv = _mm512_maskz_loadu_ps(m, q + c);
    for (int64_t j = 0; j < n; ++j) part[j] = _mm512_fmadd_ps(qv, _mm512_maskz_loadu_ps(m, k + j * k_row + c), part[j]);
  }
  return reduce16(part);
}

// dst[0, hd) = inv * sum_t p[t] v_t over t < total, value rows v_row apart; NV = ceil(hd / 16)
// vectors held in registers (two sets, even and odd keys, so consecutive FMAs do not wait on each
// other). Keys with p[t] == 0 (hidden) are skipped.
template <int NV>
KILN_AVX512 void weighted_sum(const float* p, const float* v, int64_t v_row, int64_t total, int64_t hd, float inv,
                              float* dst) {
  __mmask16 mask[NV];
  __m512 even[NV], odd[NV];
  for (int i = 0; i < NV; ++i) {
    mask[i] = vmath::first_lanes(hd - 16 * i);
    even[i] = odd[i] = _mm512_setzero_ps();
  }
  int64_t t = 0;
  for (; t + 2 <= total; t += 2) {
    const float p0 = p[t], p1 = p[t + 1];
    if (p0 == 0.0f && p1 == 0.0f) continue;
    const __m512 w0 = _mm512_set1_ps(p0), w1 = _mm512_set1_ps(p1);
    const float* v0 = v + t * v_row;
    const float* v1 = v0 + v_row;
    for (int i = 0; i < NV; ++i) {
      even[i] = _mm512_fmadd_ps(w0, _mm512_maskz_loadu_ps(mask[i], v0 + 16 * i), even[i]);
      odd[i] = _mm512_fmadd_ps(w1, _mm512_maskz_loadu_ps(mask[i], v1 + 16 * i), odd[i]);
    }
  }
  if (t < total && p[t] != 0.0f) {
    const __m512 w0 = _mm512_set1_ps(p[t]);
    for (int i = 0; i < NV; ++i)
      even[i] = _mm512_fmadd_ps(w0, _mm512_maskz_loadu_ps(mask[i], v + t * v_row + 16 * i), even[i]);
  }
  const __m512 scale = _mm512_set1_ps(inv);
  for (int i = 0; i < NV; ++i)
    _mm512_mask_storeu_ps(dst + 16 * i, mask[i], _mm512_mul_ps(_mm512_add_ps(even[i], odd[i]), scale));
}

// acc[0, n) += p * x[0, n)
KILN_AVX512 inline void axpy_avx512(float* acc, float p, const float* x, int64_t n) {
  const __m512 pv = _mm512_set1_ps(p);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = vmath::first_lanes(n - i);
    _mm512_mask_storeu_ps(acc + i, m,
                          _mm512_fmadd_ps(pv, _mm512_maskz_loadu_ps(m, x + i), _mm512_maskz_loadu_ps(m, acc + i)));
  }
}

// One query row.
struct RowOperands {
  const float* q;        // [heads, hd], head stride q_head
  const float* k;        // [total, kv_heads, hd]
  const float* v;
  const bool* mask;      // [total], stride mask_stride
  float* out;            // [heads, hd], contiguous
  int64_t q_head, k_row, k_head, v_row, v_head, mask_stride;
  bool all_masked;       // every key masked: every value row weighs the same, as the general loop does
};

// One query row, one kv head and its group of query heads; scores [group, total] and acc [group, hd]
// are scratch.
KILN_AVX512 void attend_row(const Dims& d, float scale, float softcap, const RowOperands& o, int64_t kv,
                                std::vector<float>& scores, std::vector<float>& acc) {
  const int64_t hd = d.head_dim, total = d.total, group = d.group;
  const float* q_rows[64];  // the group's heads, 64 at a time
  for (int64_t g0 = 0; g0 < group; g0 += 64) {
    const int64_t gs = std::min<int64_t>(64, group - g0);
    for (int64_t g = 0; g < gs; ++g) q_rows[g] = o.q + (kv * group + g0 + g) * o.q_head;
    // Scores, 16 keys at a time; a block of keys all hidden (the future, in causal prefill) is skipped.
    const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t t0 = 0; t0 < total; t0 += 16) {
      const int64_t n = std::min<int64_t>(16, total - t0);
      __mmask16 hidden = 0;
      if (!o.all_masked)
        for (int64_t j = 0; j < n; ++j) hidden |= static_cast<__mmask16>(o.mask[(t0 + j) * o.mask_stride] ? 1u << j : 0u);
      const __mmask16 valid = vmath::first_lanes(n);
      for (int64_t g = 0; g < gs; ++g) {
        float* row = scores.data() + g * total + t0;
        if (o.all_masked) {
          _mm512_mask_storeu_ps(row, valid, _mm512_setzero_ps());
        } else if (hidden == valid) {
          _mm512_mask_storeu_ps(row, valid, minus_inf);
        } else {
          const __m512 dots = dots16(q_rows[g], o.k + t0 * o.k_row + kv * o.k_head, o.k_row, hd, n);
          _mm512_mask_storeu_ps(row, valid,
                                _mm512_mask_mov_ps(_mm512_mul_ps(dots, _mm512_set1_ps(scale)), hidden, minus_inf));
        }
      }
    }
    // Softmax numerators and their sums; hidden keys (-inf) get exactly 0.
    float sums[64];
    for (int64_t g = 0; g < gs; ++g) {
      float* row = scores.data() + g * total;
      if (softcap > 0.0f && !o.all_masked)
        for (int64_t t = 0; t < total; ++t)
          if (row[t] != -std::numeric_limits<float>::infinity()) row[t] = softcap * std::tanh(row[t] / softcap);
      __m512 mx = minus_inf;
      for (int64_t t = 0; t < total; t += 16) {
        const __mmask16 m = vmath::first_lanes(total - t);
        mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(mx, m, row + t));
      }
      const __m512 max = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
      __m512 sum = _mm512_setzero_ps();
      for (int64_t t = 0; t < total; t += 16) {
        const __mmask16 m = vmath::first_lanes(total - t);
        const __m512 s = _mm512_maskz_loadu_ps(m, row + t);
        const __mmask16 shown = _mm512_mask_cmp_ps_mask(m, s, minus_inf, _CMP_NEQ_OQ);
        const __m512 p = _mm512_maskz_mov_ps(shown, vmath::exp_avx512(_mm512_sub_ps(s, max)));
        _mm512_mask_storeu_ps(row + t, m, p);
        sum = _mm512_add_ps(sum, p);
      }
      sums[g] = _mm512_reduce_add_ps(sum);
    }
    // Weighted sum of the value rows: per head, in registers (the group's V rows stay in L1/L2);
    // head dims over 128 accumulate in memory, each value row read once for the group.
    const float* v_head = o.v + kv * o.v_head;
    for (int64_t g = 0; g < gs; ++g) {
      const float inv = sums[g] > 0.0f ? 1.0f / sums[g] : 0.0f;  // total == 0: the result is 0
      const float* p = scores.data() + g * total;
      float* dst = o.out + (kv * group + g0 + g) * hd;
      switch ((hd + 15) / 16) {
        case 1: weighted_sum<1>(p, v_head, o.v_row, total, hd, inv, dst); continue;
        case 2: weighted_sum<2>(p, v_head, o.v_row, total, hd, inv, dst); continue;
        case 3: weighted_sum<3>(p, v_head, o.v_row, total, hd, inv, dst); continue;
        case 4: weighted_sum<4>(p, v_head, o.v_row, total, hd, inv, dst); continue;
        case 5: weighted_sum<5>(p, v_head, o.v_row, total, hd, inv, dst); continue;
        case 6: weighted_sum<6>(p, v_head, o.v_row, total, hd, inv, dst); continue;
        case 7: weighted_sum<7>(p, v_head, o.v_row, total, hd, inv, dst); continue;
        case 8: weighted_sum<8>(p, v_head, o.v_row, total, hd, inv, dst); continue;
        default: break;
      }
      std::fill(acc.begin(), acc.begin() + hd, 0.0f);
      for (int64_t t = 0; t < total; ++t)
        if (p[t] != 0.0f) axpy_avx512(acc.data(), p[t], v_head + t * o.v_row, hd);
      for (int64_t i = 0; i < hd; ++i) dst[i] = acc[static_cast<size_t>(i)] * inv;
    }
  }
}

void rows_f32_avx512(const KernelContext& ctx, const Dims& d, float scale, float softcap,
                     std::span<const TensorView> inputs, const TensorView& out) {
  const TensorView &q = inputs[0], &k = inputs[1], &v = inputs[2], &masked = inputs[3];
  // Units of (query row, kv head); each is one decode-shaped problem.
  parallel_for(ctx, d.seq * d.kv_heads, 1, [&](int64_t first, int64_t end) {
    thread_local std::vector<float> scores, acc;
    scores.resize(static_cast<size_t>(std::min<int64_t>(d.group, 64) * d.total));
    acc.resize(static_cast<size_t>(std::min<int64_t>(d.group, 64) * d.head_dim));
    for (int64_t unit = first; unit < end; ++unit) {
      const int64_t s = unit / d.kv_heads, kv = unit % d.kv_heads;
      RowOperands o{q.as<float>() + s * q.strides[0], k.as<float>(), v.as<float>(),
                       masked.as<bool>() + s * masked.strides[0], out.as<float>() + s * d.heads * d.head_dim,
                       q.strides[1], k.strides[0], k.strides[1], v.strides[0], v.strides[1], masked.strides[1], true};
      for (int64_t t = 0; t < d.total && o.all_masked; ++t) o.all_masked = o.mask[t * o.mask_stride];
      attend_row(d, scale, softcap, o, kv, scores, acc);
    }
  });
}
#pragma GCC diagnostic pop
#undef KILN_AVX512

// The AVX-512 path applies: f32, rows contiguous in their last dim, and the GEMM's ISA level (what the
// CPU has, unless a test forced a lower one) includes AVX-512 DQ.
bool use_rows_avx512(std::span<const TensorView> inputs) {
  if (inputs[0].dtype != DType::f32) return false;
  for (int i = 0; i < 3; ++i)
    if (inputs[static_cast<size_t>(i)].strides[2] != 1) return false;
  static const bool has_dq = __builtin_cpu_supports("avx512dq");
  const gemm::Isa isa = gemm::active_isa();
  return has_dq && (isa == gemm::Isa::avx512 || isa == gemm::Isa::avx512_bf16);
}
#endif

struct AttentionParams {
  double scale;
  double softcap = 0;  // 0: none; else each scaled score becomes softcap * tanh(score / softcap) (Gemma 2)
  explicit AttentionParams(const KernelInit& init) : scale(init.attr<double>("scale")) {
    if (init.has_attr("softcap")) softcap = init.attr<double>("softcap");
    if (!(softcap >= 0)) throw ValueError(fmt::format("attention: softcap must be >= 0, got {}", softcap));
  }
};

void attention_kernel(const KernelContext& ctx, const AttentionParams& params,
                      std::span<const TensorView> inputs, std::span<const TensorView> outputs) {
  const Dims d = check_operands(inputs, outputs);
  const double scale = params.scale, softcap = params.softcap;
#if defined(__x86_64__)
  if (use_rows_avx512(inputs))
    return rows_f32_avx512(ctx, d, static_cast<float>(scale), static_cast<float>(softcap), inputs, outputs[0]);
#endif
  switch (inputs[0].dtype) {
    case DType::f32: return attention_loop<float>(ctx, d, scale, softcap, inputs, outputs[0]);
    case DType::f64: return attention_loop<double>(ctx, d, scale, softcap, inputs, outputs[0]);
    case DType::f16: return attention_loop<f16_t>(ctx, d, scale, softcap, inputs, outputs[0]);
    case DType::bf16: return attention_loop<bf16_t>(ctx, d, scale, softcap, inputs, outputs[0]);
    default: break;
  }
  throw DTypeError(fmt::format("attention: q must be a float dtype, got {}", describe(inputs[0])));
}

}  // namespace

void register_cpu_attention(KernelRegistry& r) {
  r.add(Op::attention, DeviceKind::CPU, {DType::f32, DType::f64, DType::f16, DType::bf16},
        &with_params<AttentionParams, attention_kernel>);
}

}  // namespace kiln::kernels
