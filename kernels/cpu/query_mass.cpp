// refine_with_query_mass on the CPU (i-clustered+, issue 13): topk_refine with each query's own share of
// attention on its cluster's top-k keys. See bert_cluster/reference.py (refine_with_query_mass) for the
// formula; in short, for query i in cluster j with top-k keys T:
//   log rho_i = log((1 - m_j) / m_j) + log Z_T(c_j) - log Z_T(q_i) + R(q_i) - R(c_j)
//   R(x)      = s x . mu_j + s^2 / 2 x^2 . var_j   (mu, var: mean and variance of the valid keys outside T)
//   out_i     = m_i softmax_T(s q_i . K) V_T + (1 - m_i) (Vc_j - Vtop_j) / (1 - m_j),  m_i = 1 / (1 + rho_i)
// Softmax and accumulation in float32.
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "../checks.h"
#include "common.h"
#include "lanes.h"
#include "ops.h"
#include "parallel.h"
#include "steps.h"
#include "vec.h"

namespace bert_cluster {
namespace {

constexpr int64_t kLanes = 16;  // the width of f32x16 (vec.h)
constexpr float kInf = std::numeric_limits<float>::infinity();

inline int64_t round_up(int64_t x) { return (x + kLanes - 1) / kLanes * kLanes; }

// What every member of one cluster shares.
struct Cluster {
  const float* kt;         // (dk, kp): the valid top-k keys, transposed, zero-padded to kp = round_up(kv)
  const float* const* krows;  // or, for a small cluster (kRowScoreMembers), their kp rows (zeros past kv)
  const float* const* vrows;  // kv value rows, dvp = round_up(dv) floats readable each (zeros past dv)
  int64_t kv;              // valid top-k keys
  const float* key_mean;   // (dk): mean of the row's valid keys outside T
  const float* half_var;   // (dk): s / 2 * their variance
  float log_base;          // log((1 - m_j) / m_j) + log Z_T(c_j) - R(c_j), -inf when T holds every valid key
  const float* rest_mean;  // (dvp): (Vc - Vtop) / (1 - m_j), 0 when T holds every valid key
};

// R(x) = s x . (mu + s / 2 var x) = s x . mu + s^2 / 2 x^2 . var, with half_var = s / 2 var.
// rest_logz in two parts, so that a block's members add up their lanes together (hsums): the lane-wise
// sums over whole vectors, then scaling * (their hsum + the features past them).
BC_INLINE f32x16 rest_lanes(const float* __restrict x, const float* __restrict mean, const float* __restrict half_var,
                            int64_t dk) {
  f32x16 acc = {};
  for (int64_t d = 0; d + 16 <= dk; d += 16) {
    const f32x16 v = load16(x + d);
    acc += v * (load16(mean + d) + load16(half_var + d) * v);
  }
  return acc;
}

BC_INLINE float rest_finish(float sum, const float* __restrict x, const float* __restrict mean,
                            const float* __restrict half_var, int64_t dk, float scaling) {
  for (int64_t d = dk / 16 * 16; d < dk; ++d) sum += x[d] * (mean[d] + half_var[d] * x[d]);
  return scaling * sum;
}

BC_INLINE float rest_logz(const float* __restrict x, const float* __restrict mean, const float* __restrict half_var,
                          int64_t dk, float scaling) {
  return rest_finish(hsum(rest_lanes(x, mean, half_var, dk)), x, mean, half_var, dk, scaling);
}

// M queries of one cluster (rows q[m], outputs out[m]): scores over the top-k keys (each transposed key
// vector loaded once for the M queries, or from the key rows for a small cluster), their log-sum-exp, the
// query's own mass, the weighted values plus the rest.
template <int M>
BC_INLINE void refine_block(const float* const* q, float* const* out, const Cluster& cluster, int64_t dk, int64_t dv,
                            float scaling, float* __restrict scores, float* __restrict row) {
  // Local copies: restrict pointers and scalars the compiler need not reload after each store.
  const float* __restrict kt = cluster.kt;
  const float* const* vrows = cluster.vrows;
  const float* __restrict key_mean = cluster.key_mean;
  const float* __restrict half_var = cluster.half_var;
  const float* __restrict rest_mean = cluster.rest_mean;
  const int64_t kv = cluster.kv;
  const float log_base = cluster.log_base;
  const int64_t kp = round_up(kv), dvp = round_up(dv);
  if (cluster.krows != nullptr) {
    row_scores<M>(q, cluster.krows, kp, dk, scaling, scores);
  } else {
    for (int64_t c0 = 0; c0 < kp; c0 += 2 * kLanes) {
      const bool pair = c0 + kLanes < kp;
      f32x16 a[M] = {}, b[M] = {};
      for (int64_t d = 0; d < dk; ++d) {
        const f32x16 k0 = load16(kt + d * kp + c0);
        const f32x16 k1 = pair ? load16(kt + d * kp + c0 + kLanes) : f32x16{};
        for (int m = 0; m < M; ++m) {
          const float x = q[m][d];
          a[m] += x * k0;
          b[m] += x * k1;
        }
      }
      for (int m = 0; m < M; ++m) {
        store16(scores + m * kp + c0, a[m] * scaling);
        if (pair) store16(scores + m * kp + c0 + kLanes, b[m] * scaling);
      }
    }
  }
  // From 4 members on, each member's exponentials and R(q_i)'s lanes first, then the 2M lane sums in one
  // pass (hsums: the same bits as hsum one by one, without 2M chains of dependent reductions); below (AVX2's
  // blocks of 2), each member's right away, as keeping the sums for later was slower there.
  constexpr bool kTogether = M >= 4;
  float rest[M], mx[M], sum[M], rest_sum[M];
  f32x16 acc[kTogether ? M : 1], rest_acc[kTogether ? M : 1];
  for (int m = 0; m < M; ++m) {
    float* sm = scores + m * kp;
    const int slot = kTogether ? m : 0;
    mx[m] = max_of(sm, kv);
    acc[slot] = f32x16{};
    for (int64_t c0 = 0; c0 < kp; c0 += kLanes) {
      f32x16 e = fast_exp16(load16(sm + c0) - mx[m]);
      e = select(first_lanes(kv - c0), e, f32x16{});  // padding lanes: 0
      acc[slot] += e;
      store16(sm + c0, e);
    }
    rest_acc[slot] = rest_lanes(q[m], key_mean, half_var, dk);
    if constexpr (!kTogether) {
      sum[m] = hsum(acc[0]);
      rest_sum[m] = hsum(rest_acc[0]);
    }
  }
  if constexpr (kTogether) {
    hsums<M>(acc, sum);
    hsums<M>(rest_acc, rest_sum);
  }
  for (int m = 0; m < M; ++m) {
    float* sm = scores + m * kp;
    // rho_i = other / sum with other = exp(log_base + R(q_i) - mx), as Z_T(q_i) = sum e^mx. Then
    // m_i / sum = 1 / (sum + other) scales the exps, and 1 - m_i = other / (sum + other).
    const float other =
        std::exp(log_base + rest_finish(rest_sum[m], q[m], key_mean, half_var, dk, scaling) - mx[m]);
    float coef;
    if (other < kInf) {
      coef = 1.f / (sum[m] + other);
      rest[m] = other * coef;
    } else {
      coef = 0.f;
      rest[m] = 1.f;
    }
    for (int64_t c0 = 0; c0 < kp; c0 += kLanes) store16(sm + c0, load16(sm + c0) * coef);
  }
  for (int64_t c0 = 0; c0 < dvp; c0 += 2 * kLanes) {
    const bool pair = c0 + kLanes < dvp;
    const f32x16 r0 = load16(rest_mean + c0);
    const f32x16 r1 = pair ? load16(rest_mean + c0 + kLanes) : f32x16{};
    f32x16 a[M], b[M];
    for (int m = 0; m < M; ++m) {
      a[m] = rest[m] * r0;
      b[m] = rest[m] * r1;
    }
    for (int64_t l = 0; l < kv; ++l) {
      const f32x16 v0 = load16(vrows[l] + c0);
      const f32x16 v1 = pair ? load16(vrows[l] + c0 + kLanes) : f32x16{};
      for (int m = 0; m < M; ++m) {
        const float w = scores[m * kp + l];
        a[m] += w * v0;
        b[m] += w * v1;
      }
    }
    for (int m = 0; m < M; ++m) {
      // Straight into the output row when it holds whole vectors, else through `row`.
      float* dst = dvp == dv ? out[m] : row + m * dvp;
      store16(dst + c0, a[m]);
      if (pair) store16(dst + c0 + kLanes, b[m]);
    }
  }
  if (dvp != dv)
    for (int m = 0; m < M; ++m) std::copy(row + m * dvp, row + m * dvp + dv, out[m]);
}

// Members refined together: 2 * kBlock accumulators, which must stay in registers (32 with AVX-512; with AVX2
// an accumulator takes 2 of 16, and blocks of 8 spilled them: the op took 2.2x the AVX-512 time at 4,096
// tokens where topk_refine, already blocked by 2 there, took 1.7x).
constexpr int kBlock = kNativeBytes == 64 ? 8 : 2;

// refine_block for `count` (1..kBlock) members: every block size has its own instance, so that a cluster's
// last, partial block keeps its members together.
void refine_members(int count, const float* const* q, float* const* out, const Cluster& c, int64_t dk, int64_t dv,
                    float scaling, float* scores, float* row) {
  if constexpr (kBlock == 2) {
    if (count == 2) return refine_block<2>(q, out, c, dk, dv, scaling, scores, row);
    return refine_block<1>(q, out, c, dk, dv, scaling, scores, row);
  }
  switch (count) {
    case 8: refine_block<8>(q, out, c, dk, dv, scaling, scores, row); break;
    case 7: refine_block<7>(q, out, c, dk, dv, scaling, scores, row); break;
    case 6: refine_block<6>(q, out, c, dk, dv, scaling, scores, row); break;
    case 5: refine_block<5>(q, out, c, dk, dv, scaling, scores, row); break;
    case 4: refine_block<4>(q, out, c, dk, dv, scaling, scores, row); break;
    case 3: refine_block<3>(q, out, c, dk, dv, scaling, scores, row); break;
    case 2: refine_block<2>(q, out, c, dk, dv, scaling, scores, row); break;
    default: refine_block<1>(q, out, c, dk, dv, scaling, scores, row);
  }
}

// key_mean[d] -= the sum of feature d over the kv rows, and half_var[d] -= the sum of its squares, from
// the rows themselves (dk a multiple of 16): bit for bit the sums over the transposed keys in
// gather_top_keys (key j joins lane j % 16's chain in key order; the 16 chains are added in hsum's
// order, lane-wise here), without its 2 dk hsums, a third of this op's own time at 128 tokens
// (i-clustered+ at 512 tokens, one thread: 3.59 -> 3.45 ms with AVX-512). With AVX2 the 16 chains of the
// AVX-512 form took 32 of 16 registers and made it slower (5.24 -> 5.49 ms); its own form below does not.
void subtract_row_stats(const float* const* rows, int64_t kv, int64_t dk, float* __restrict key_mean,
                        float* __restrict half_var) {
#if BC_NATIVE_BYTES == 32
  // AVX2: 8 features at a time, sums and squares in one pass over the rows, and tree_sum16's levels taken
  // as soon as their two terms exist (chains t and t + 8, then pairs 4 and 2 apart), so that a few
  // registers hold what 16 chains of 16 lanes would (32 of AVX2's 16 registers: they spilled, and
  // i-clustered+ at 128 tokens, where most clusters are scored from their rows, spent 9.6% of a call in
  // gather_top_keys on a Zen 1). The same additions in the same order: the same bits.
  using Part = f32x16::Part;
  auto load8 = [](const float* p) {
    Part v;
    std::memcpy(&v, p, sizeof(v));
    return v;
  };
  struct Sums {
    Part sum, squares;
    Sums operator+(const Sums& o) const { return {sum + o.sum, squares + o.squares}; }
  };
  for (int64_t d0 = 0; d0 < dk; d0 += kLanes / 2) {
    auto chain = [&](int64_t t) {  // rows t, t + 16, ... in order, from zero
      Sums acc{Part{}, Part{}};
      for (int64_t j = t; j < kv; j += kLanes) {
        const Part x = load8(rows[j] + d0);
        acc.sum = acc.sum + x;
        acc.squares = acc.squares + x * x;
      }
      return acc;
    };
    auto first = [&](int t) { return chain(t) + chain(t + 8); };  // tree_sum16's b[t], t < 8
    auto second = [&](int t) { return first(t) + first(t + 4); };  // then b[t] + b[t + 4], t < 4
    auto third = [&](int t) { return second(t) + second(t + 2); };  // then t < 2
    const Sums total = third(0) + third(1);
    const Part mean = load8(key_mean + d0) - total.sum, var = load8(half_var + d0) - total.squares;
    std::memcpy(key_mean + d0, &mean, sizeof(mean));
    std::memcpy(half_var + d0, &var, sizeof(var));
  }
#else
  auto subtract = [&](int64_t d0, float* __restrict out, auto term) {
    f32x16 acc[kLanes];
    for (int t = 0; t < kLanes; ++t) acc[t] = f32x16{};
    for (int64_t c0 = 0; c0 < kv; c0 += kLanes)
      for (int t = 0; t < kLanes && c0 + t < kv; ++t) acc[t] = term(acc[t], load16(rows[c0 + t] + d0));
    store16(out + d0, load16(out + d0) - tree_sum16(acc));
  };
  for (int64_t d0 = 0; d0 < dk; d0 += kLanes) {
    subtract(d0, key_mean, [](f32x16 acc, f32x16 x) { return acc + x; });
    subtract(d0, half_var, [](f32x16 acc, f32x16 x) { return acc + x * x; });
  }
#endif
}

// One cluster's top-k keys: key_mean and half_var (which hold the sums over every valid key) less theirs,
// top_score (kvp) their scaled scores against the centroid; with from_rows from the kvp rows (zeros past
// kv), else from kt (dk x kvp), their rows transposed here (zero columns past kv). Returns the largest
// score.
float gather_top_keys(const float* const* rows, int64_t kv, int64_t dk, int64_t kvp, const float* centroid,
                      float scale, bool from_rows, float* __restrict kt, float* __restrict key_mean,
                      float* __restrict half_var, float* __restrict top_score) {
  const bool stats_from_rows = from_rows || (kNativeBytes >= 32 && dk % kLanes == 0);
  if (stats_from_rows) subtract_row_stats(rows, kv, dk, key_mean, half_var);
  if (from_rows) {
    row_scores<1>(&centroid, rows, kvp, dk, scale, top_score);
    return kv > 0 ? max_of(top_score, kv) : kNegInf;
  }
  transpose_rows(rows, kv, dk, kt);  // zero columns past kv: they add nothing below
  if (!stats_from_rows) {
    for (int64_t d = 0; d < dk; ++d) {
      f32x16 sum = {}, squares = {};
      for (int64_t c0 = 0; c0 < kvp; c0 += kLanes) {
        const f32x16 x = load16(kt + d * kvp + c0);
        sum += x;
        squares += x * x;
      }
      key_mean[d] -= hsum(sum);
      half_var[d] -= hsum(squares);
    }
  }
  // Two vectors of keys at a time: two independent FMA chains over d (one would wait on each FMA).
  f32x16 top = f32x16{} + kNegInf;
  for (int64_t c0 = 0; c0 < kvp; c0 += 2 * kLanes) {
    const bool pair = c0 + kLanes < kvp;
    f32x16 acc = {}, acc2 = {};
    for (int64_t d = 0; d < dk; ++d) {
      acc += centroid[d] * load16(kt + d * kvp + c0);
      if (pair) acc2 += centroid[d] * load16(kt + d * kvp + c0 + kLanes);
    }
    acc *= scale;
    store16(top_score + c0, acc);
    top = select(first_lanes(kv - c0) & (acc > top), acc, top);
    if (pair) {
      acc2 *= scale;
      store16(top_score + c0 + kLanes, acc2);
      top = select(first_lanes(kv - c0 - kLanes) & (acc2 > top), acc2, top);
    }
  }
  return hmax(top);
}

// sum[0..dk) += x and squares[0..dk) += x^2 over the valid rows of keys (n rows, `stride` floats apart),
// 64 features at a time in registers (eight independent chains per row; each feature summed in row order).
void sum_valid_rows(const float* __restrict keys, int64_t stride, const bool* __restrict valid, int64_t n, int64_t dk,
                    float* __restrict sum, float* __restrict squares) {
  constexpr int V = 4;
  int64_t d0 = 0;
  for (; d0 + V * 16 <= dk; d0 += V * 16) {
    f32x16 s[V], q[V];
    for (int v = 0; v < V; ++v) {
      s[v] = load16(sum + d0 + v * 16);
      q[v] = load16(squares + d0 + v * 16);
    }
    for (int64_t l = 0; l < n; ++l) {
      if (!valid[l]) continue;
      for (int v = 0; v < V; ++v) {
        const f32x16 x = load16(keys + l * stride + d0 + v * 16);
        s[v] += x;
        q[v] += x * x;
      }
    }
    for (int v = 0; v < V; ++v) {
      store16(sum + d0 + v * 16, s[v]);
      store16(squares + d0 + v * 16, q[v]);
    }
  }
  for (; d0 + 16 <= dk; d0 += 16) {
    f32x16 s = load16(sum + d0), q = load16(squares + d0);
    for (int64_t l = 0; l < n; ++l) {
      if (!valid[l]) continue;
      const f32x16 x = load16(keys + l * stride + d0);
      s += x;
      q += x * x;
    }
    store16(sum + d0, s);
    store16(squares + d0, q);
  }
  for (int64_t l = 0; l < n; ++l) {
    if (!valid[l]) continue;
    const float* x = keys + l * stride;
    for (int64_t d = d0; d < dk; ++d) {
      sum[d] += x[d];
      squares[d] += x[d] * x[d];
    }
  }
}

// query_mass_heads' buffers, kept per thread: run per head (clustered_heads), allocating its fourteen
// buffers for every head was about 2% of an i-clustered+ call at 128 tokens (malloc and free in the
// profile). Each is written before it is read, except zero_row, which stays zeros.
struct QueryMassScratch {
  Floats kt, vt, scores, row, rest_mean, key_sum, square_sum, key_mean, half_var, top_score, zero_row;
  std::vector<const float*> key_rows, value_rows;
  std::vector<int64_t> slot, start, fill, order;
  QueryMassScratch(int64_t n, int64_t clusters, int64_t k, int64_t dk, int64_t dv)
      : kt(dk * round_up(k)),
        vt(k * round_up(dv)),
        scores(kBlock * round_up(k)),
        row(kBlock * round_up(dv)),
        rest_mean(round_up(dv)),
        key_sum(dk),
        square_sum(dk),
        key_mean(dk),
        half_var(dk),
        top_score(round_up(k)),
        zero_row(dk),
        key_rows(round_up(k)),
        value_rows(k),
        slot(k),
        start(clusters + 1),
        fill(clusters),
        order(n) {}
};

}  // namespace

void query_mass_heads(const QueryMassJob& job, int64_t begin, int64_t end) {
  const Rows qr = job.q, kr = job.keys, vr = job.values;
  const bool* okp = job.valid;
  const int64_t* ap = job.assign;
  const float* cenp = job.centroids;
  const float* cvp = job.centroid_values;
  const int64_t* tip = job.indices;
  const float* tmp = job.mass;
  const float* tvp = job.top_values;
  const int64_t heads = job.heads, n = job.n, clusters = job.clusters, k = job.k, dk = job.dk, dv = job.dv;
  const float scale = job.scaling;
  const int64_t kp = round_up(k), dvp = round_up(dv);
  const bool value_rows_direct = dv % kLanes == 0;  // whole vectors: the kernel reads the value rows in place
  QueryMassScratch& sc = thread_scratch<QueryMassScratch>(n, clusters, k, dk, dv);
  Floats &kt = sc.kt, &vt = sc.vt, &scores = sc.scores, &row = sc.row, &rest_mean = sc.rest_mean;
  Floats &key_sum = sc.key_sum, &square_sum = sc.square_sum, &key_mean = sc.key_mean, &half_var = sc.half_var;
  Floats &top_score = sc.top_score, &zero_row = sc.zero_row;
  std::vector<const float*>&key_rows = sc.key_rows, &value_rows = sc.value_rows;
  std::vector<int64_t>&slot = sc.slot, &start = sc.start, &fill = sc.fill, &order = sc.order;
  for (int64_t rh = begin; rh < end; ++rh) {
    const int64_t r = rh / heads, h = rh % heads;
    const float* qh = qr.at<float>(r, h);
    const float* kh = kr.at<float>(r, h);
    const float* vh = vr.at<float>(r, h);
    const bool* okr = okp + r * n;
    int64_t valid_keys = 0;
    for (int64_t l = 0; l < n; ++l) valid_keys += okr[l] ? 1 : 0;
    std::fill(key_sum.begin(), key_sum.end(), 0.f);
    std::fill(square_sum.begin(), square_sum.end(), 0.f);
    sum_valid_rows(kh, kr.s2, okr, n, dk, key_sum.data(), square_sum.data());
    // Counting sort of the head's queries by cluster: members of cluster c are order[start[c] .. start[c + 1]).
    int64_t* st = start.data();
    std::fill(st, st + clusters + 1, 0);
    const int64_t* ar = ap + rh * n;
    float* orow = job.out.head(rh);
    const int64_t os = job.out.s2;  // from one output row to the next
    for (int64_t i = 0; i < n; ++i) {
      TORCH_CHECK_VALUE(ar[i] >= -1 && ar[i] < clusters, "assignments must be -1 or in 0..", clusters - 1,
                        ", got ", ar[i]);
      if (ar[i] >= 0) {
        st[ar[i] + 1] += 1;
      } else {
        std::fill(orow + i * os, orow + i * os + dv, 0.f);  // padded query: zeros
      }
    }
    for (int64_t c = 0; c < clusters; ++c) st[c + 1] += st[c];
    std::copy(st, st + clusters, fill.begin());
    for (int64_t i = 0; i < n; ++i)
      if (ar[i] >= 0) order[fill[ar[i]]++] = i;
    // The rows of a cluster's top-k keys and values sit anywhere in the head: start fetching those of the
    // next cluster while this one computes.
    auto prefetch_cluster = [&](int64_t c) {
      for (int64_t j = 0; j < k; ++j) {
        const int64_t l = tip[(rh * clusters + c) * k + j];
        if (l < 0 || l >= n) continue;
        for (int64_t b = 0; b < dk; b += 16) __builtin_prefetch(kh + l * kr.s2 + b);
        for (int64_t b = 0; b < dv; b += 16) __builtin_prefetch(vh + l * vr.s2 + b);
      }
    };
    int64_t next = 0;
    while (next < clusters && st[next + 1] == st[next]) ++next;
    if (next < clusters) prefetch_cluster(next);
    for (int64_t c = 0; c < clusters; ++c) {
      const int64_t task = rh * clusters + c;
      const int64_t members = st[c + 1] - st[c];
      if (members == 0) continue;
      next = c + 1;
      while (next < clusters && st[next + 1] == st[next]) ++next;
      if (next < clusters) prefetch_cluster(next);
      const int64_t* member = order.data() + st[c];
      int64_t kv = 0;
      for (int64_t j = 0; j < k; ++j) {
        const int64_t l = tip[task * k + j];
        if (l < 0) continue;
        TORCH_CHECK_VALUE(l < n, "topk_indices must be -1 or in 0..", n - 1, ", got ", l);
        slot[kv++] = l;
      }
      const float* centroid = cenp + task * dk;
      const float m = tmp[task], rest = 1.f - m;
      const bool no_rest = kv >= valid_keys;
      // The top-k keys (transposed) and values of the cluster; their sum; the centroid's log Z_T.
      const int64_t kvp = round_up(kv);
      for (int64_t j = 0; j < kv; ++j) {
        key_rows[j] = kh + slot[j] * kr.s2;
        if (value_rows_direct) {
          value_rows[j] = vh + slot[j] * vr.s2;
        } else {
          float* dst = vt.data() + j * dvp;
          std::copy(vh + slot[j] * vr.s2, vh + slot[j] * vr.s2 + dv, dst);
          std::fill(dst + dv, dst + dvp, 0.f);
          value_rows[j] = dst;
        }
      }
      std::copy(key_sum.begin(), key_sum.end(), key_mean.begin());
      std::copy(square_sum.begin(), square_sum.end(), half_var.begin());
      // A small cluster is scored from its key rows (row_scores), a larger one from its keys transposed.
      const bool from_rows = dk % kLanes == 0 && members <= kRowScoreMembers;
      if (from_rows) std::fill(key_rows.begin() + kv, key_rows.begin() + kvp, zero_row.data());
      const float top_max = gather_top_keys(key_rows.data(), kv, dk, kvp, centroid, scale, from_rows, kt.data(),
                                            key_mean.data(), half_var.data(), top_score.data());
      // The exps of the top-k scores 16 at a time, as the members' softmax takes them: one libm call per
      // key, its sum kept in memory around each call, was 3.5% of a call at 128 tokens (0.857 -> 0.815 ms,
      // one thread). The sum adds in another order, at rounding level.
      f32x16 top_exps = {};
      for (int64_t c0 = 0; c0 < kv; c0 += kLanes)
        top_exps += select(first_lanes(kv - c0), fast_exp16(load16(top_score.data() + c0) - top_max), f32x16{});
      const float top_sum = hsum(top_exps);
      const float rest_count = static_cast<float>(std::max<int64_t>(valid_keys - kv, 1));
      for (int64_t d = 0; d < dk; ++d) {
        key_mean[d] /= rest_count;
        const float variance = half_var[d] / rest_count - key_mean[d] * key_mean[d];
        half_var[d] = 0.5f * scale * (variance > 0.f ? variance : 0.f);
      }
      std::fill(rest_mean.begin(), rest_mean.end(), 0.f);
      float log_base = -kInf;
      if (!no_rest) {
        const float divisor = rest > 0.f ? rest : 1.f;
        for (int64_t d = 0; d < dv; ++d) rest_mean[d] = (cvp[task * dv + d] - tvp[task * dv + d]) / divisor;
        const float log_odds = std::log(std::max(rest, 0.f)) - std::log(std::max(m, std::numeric_limits<float>::min()));
        log_base = log_odds + top_max + std::log(top_sum) -
                   rest_logz(centroid, key_mean.data(), half_var.data(), dk, scale);
      }
      if (kv == 0) {  // no key to refine: the centroid's row
        for (int64_t j = 0; j < members; ++j) std::copy(rest_mean.begin(), rest_mean.begin() + dv, orow + member[j] * os);
        continue;
      }
      const Cluster cluster{kt.data(), from_rows ? key_rows.data() : nullptr, value_rows.data(), kv,
                            key_mean.data(), half_var.data(), log_base, rest_mean.data()};
      for (int64_t j = 0; j < members; j += kBlock) {
        const int count = static_cast<int>(std::min<int64_t>(kBlock, members - j));
        const float* qs[kBlock];
        float* outs[kBlock];
        for (int b = 0; b < count; ++b) {
          qs[b] = qh + member[j + b] * qr.s2;
          outs[b] = orow + member[j + b] * os;
        }
        // The next block's query and output rows: a cluster's members lie anywhere in the head, and waiting
        // for them took most of the refinement's time on heads larger than the cache.
        for (int64_t b = j + kBlock; b < std::min<int64_t>(members, j + 2 * kBlock); ++b) {
          const float* next_q = qh + member[b] * qr.s2;
          const float* next_out = orow + member[b] * os;
          for (int64_t d = 0; d < dk; d += 16) __builtin_prefetch(next_q + d);
          for (int64_t d = 0; d < dv; d += 16) __builtin_prefetch(next_out + d, 1);
        }
        refine_members(count, qs, outs, cluster, dk, dv, scale, scores.data(), row.data());
      }
    }
  }
}

at::Tensor refine_with_query_mass_cpu(const at::Tensor& queries, const at::Tensor& keys, const at::Tensor& values,
                                      const at::Tensor& valid, const at::Tensor& assignments,
                                      const at::Tensor& centroids, const at::Tensor& centroid_values,
                                      const at::Tensor& topk_indices, const at::Tensor& topk_mass,
                                      const at::Tensor& topk_values, double scaling, double dropout, int64_t seed) {
  if (dropout != 0.0)
    return refine_with_query_mass_dropped_cpu(
        float_rows(queries), float_rows(keys), float_rows(values), valid.contiguous(), assignments.contiguous(),
        float_rows(centroids), float_rows(centroid_values), topk_indices.contiguous(), float_rows(topk_mass),
        float_rows(topk_values), scaling, dropout, seed);
  check_refine_args(queries, keys, values, assignments, centroid_values, topk_indices, topk_mass, topk_values);
  const int64_t rows = queries.size(0), heads = queries.size(1), n = queries.size(2);
  const int64_t dk = queries.size(3), dv = values.size(3);
  const int64_t clusters = centroid_values.size(2), k = topk_indices.size(3);
  check_valid(valid, rows, n, queries);
  check_dim(centroids, 4, "centroids", "(R, H, C, Dk)");
  check_dtype(centroids, at::kFloat, "centroids");
  TORCH_CHECK_VALUE(centroids.size(0) == rows && centroids.size(1) == heads && centroids.size(2) == clusters &&
                        centroids.size(3) == dk,
                    "centroids must be (R, H, C, Dk) = (", rows, ", ", heads, ", ", clusters, ", ", dk, "), got ",
                    centroids.sizes());
  check_same_device(centroids, queries, "centroids", "queries");
  // float32 rows are read where they are (HF layout: a head's rows a hidden state apart); others widened.
  auto float_rows = [](const at::Tensor& t) {
    return t.scalar_type() == at::kFloat ? last_dim_contiguous(t) : t.to(at::kFloat).contiguous();
  };
  const at::Tensor q = float_rows(queries), kf = float_rows(keys), vf = float_rows(values);
  const at::Tensor ok = valid.contiguous();
  const at::Tensor a = assignments.contiguous(), cen = centroids.contiguous(), cv = centroid_values.contiguous();
  const at::Tensor ti = topk_indices.contiguous(), tm = topk_mass.contiguous(), tv = topk_values.contiguous();
  at::Tensor out = empty_tensor({rows, heads, n, dv}, q.options());  // every row is written below
  if (out.numel() == 0) return out;

  QueryMassJob job{Rows::of(q), Rows::of(kf), Rows::of(vf), ok.data_ptr<bool>(), a.data_ptr<int64_t>(),
                   cen.data_ptr<float>(), cv.data_ptr<float>(), tm.data_ptr<float>(), tv.data_ptr<float>(),
                   ti.data_ptr<int64_t>(), heads, n, clusters, k, dk, dv, static_cast<float>(scaling),
                   OutRows::of(out)};
  parallel_for(0, rows * heads, grain_for(n * k * (dk + dv)),
               [&](int64_t begin, int64_t end) { query_mass_heads(job, begin, end); });
  return out;
}

}  // namespace bert_cluster
