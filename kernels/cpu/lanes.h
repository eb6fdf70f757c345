// Attention of up to 32 "lane" vectors (cluster centroids, or a block of consecutive queries) against a
// range of keys, in tiles of keys with an online softmax: the engine of centroid_attention (lanes =
// clusters, all keys, with top-k tracking) and banded_attention (lanes = 32 queries, the keys of their band).
//
// Layout: the lanes are the vector lanes. Scores of a tile are (tile x 32) floats, one row per key, so that
// the softmax statistics, the masks and the top-k bisection run on 16 lanes per instruction and the keys
// are read row by row in their own layout (no transposition of K or V). Inputs in fp16/bf16 are widened
// tile by tile into small float buffers (never a full-size copy). Every task computes in a fixed order
// that does not depend on how the work is split between threads.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common.h"
#include "vec.h"

namespace bert_cluster {

constexpr int kLaneCount = 32;     // lanes per task (2 vectors)
constexpr int64_t kKeyTile = 256;  // keys per tile: a (256 x 32) score tile is 32 KiB

inline int64_t pad16(int64_t x) { return (x + 15) / 16 * 16; }

// A tile of key or value rows as float32 for the kernels below: rows [j0, j0 + rows) of one (row, head),
// in place for float32 inputs (when `in_place_ok`), else widened into buf with rows of `width` floats
// (zero-padded past d). Returns the rows and sets *stride.
const float* float_rows(const Rows& src, InputType type, int64_t r, int64_t h, int64_t j0, int64_t rows, int64_t d,
                        int64_t width, bool in_place_ok, float* buf, int64_t* stride);

// The value rows j0 .. j0 + rows as float32 (like float_rows, width pad16(dv)), with the rows of padded keys
// (valid[j] false) set to 0 in a copy: a padded value never reaches an output, whatever it holds.
const float* value_rows(const Rows& src, InputType type, int64_t r, int64_t h, int64_t j0, int64_t rows, int64_t dv,
                        const bool* valid, float* buf, int64_t* stride);

// src (n values of `type`) as float32 into dst.
void widen_row(InputType type, const void* src, float* dst, int64_t n);

// Rows to start fetching while a tile is scored: with each block of keys scored, the same rows of `keys`
// (the caller points it some rows ahead) and of `values`, `*_step` bytes apart, `*_bytes` bytes each.
struct TilePrefetch {
  const char* keys;
  int64_t key_step, key_bytes;
  const char* values;
  int64_t value_step, value_bytes;
};

// s (rows x 32, row-major) = scaling * k . qt for the first 16 * lane_vectors lanes; k: rows of dk floats,
// kstride apart; qt: dk x 32, lane-major. With `prefetch`, its rows are fetched block by block as the
// keys are scored (the same scores).
void score_tile(const float* qt, const float* k, int64_t kstride, int64_t rows, int64_t dk, float scaling,
                int lane_vectors, float* s, const TilePrefetch* prefetch = nullptr);

// s[t][c] = -inf for the lanes c outside [first[t], last[t]] (an empty range when first > last).
void mask_tile(float* s, int64_t rows, const int32_t* first, const int32_t* last, int lane_vectors);

// Online softmax step for one tile: s (rows x 32 scores, -inf where masked) becomes p = e^(s - M); the
// running max m, sum z and accumulated rows acc (lanes x dvp) are rescaled where the max grows.
void softmax_tile(float* s, int64_t rows, int64_t lanes, int lane_vectors, float* m, float* z, float* acc,
                  int64_t dvp);

// acc (lanes x dvp) += p^T v for the first `lanes` lanes: p (rows x 32), v rows (dvp floats readable) vstride apart.
void accumulate_tile(const float* p, const float* v, int64_t vstride, int64_t rows, int64_t lanes, float* acc,
                     int64_t dvp);

// out[0..dv) += sum_j w[j] * rows[j][0..dv)
void weighted_rows(const float* w, const float* const* rows, int64_t count, int64_t dv, float* out);

// out[i] = e^(x[i] - shift) * scale for i < n
void exp_shifted(const float* x, int64_t n, float shift, float scale, float* out);

// kt (dk x pad16(kv)) = rows[0..kv) (dk floats each) transposed, zero-padded, in 16 x 16 register blocks.
void transpose_rows(const float* const* rows, int64_t kv, int64_t dk, float* kt);

// The refinements (topk_refine, refine_with_query_mass) score a cluster of at most this many members from
// its key rows (row_scores), a larger one from its keys transposed once; the same on every ISA, whose
// libraries give the same bits. Measured with topk_refine, 12 heads x 64 dims, C = 25, k = 32, one
// thread: at 128 tokens (5 members a cluster on average) 0.345 -> 0.315 ms with AVX-512; at 512 tokens
// (20 on average) 12 was even and 16 or 24 up to 10% slower. With AVX2, whose transpositions are
// cheaper against the additions, about even: 0.433 -> 0.427 ms at 128 tokens, 1.25 -> 1.29 at 512.
constexpr int64_t kRowScoreMembers = 12;

// Scores (M x kvp, row-major, scaled) of M query rows qm against kvp key rows krows (dk floats each, dk a
// multiple of 16; rows past the real keys all zeros), with no transposition: a key's score is the hsum of
// 16 chains of dk / 16 multiply-adds, 16 keys summed at once (lane_sums). Transposing 32 keys of 64 dims
// costs 8 blocks of 16 x 16 whatever the members; this costs 30 shuffles per 16 keys and member instead.
template <int M>
BC_INLINE void row_scores(const float* const* qm, const float* const* krows, int64_t kvp, int64_t dk, float scaling,
                          float* __restrict scores) {
#if BC_NATIVE_BYTES == 32
  // AVX2: 16 chains of two halves are 32 registers of 16, and they spilled (i-clustered+ at 128 tokens spent
  // a tenth of a call scoring its small clusters' centroids and members on a Zen 1). Four keys at a time
  // instead (8 chains), each key's halves added as soon as its chains end (lane_sums' first level): the
  // same multiply-adds and additions in the same order, so the same bits.
  using Part = f32x16::Part;
  auto load8 = [](const float* p) {
    Part v;
    std::memcpy(&v, p, sizeof(v));
    return v;
  };
  for (int m = 0; m < M; ++m) {
    for (int64_t j0 = 0; j0 < kvp; j0 += 16) {
      f32x16 sums;
      for (int g = 0; g < 2; ++g) {
        Part x[8];
        for (int l0 = 0; l0 < 8; l0 += 4) {
          Part low[4] = {}, high[4] = {};
          for (int64_t d = 0; d < dk; d += 16) {
            const Part q0 = load8(qm[m] + d), q1 = load8(qm[m] + d + 8);
            for (int i = 0; i < 4; ++i) {
              const float* key = krows[j0 + 8 * g + l0 + i] + d;
              low[i] += q0 * load8(key);
              high[i] += q1 * load8(key + 8);
            }
          }
          for (int i = 0; i < 4; ++i) x[kLaneSlot[l0 + i]] = low[i] + high[i];
        }
        sums.p[g] = lane_sums8(x);
      }
      store16(scores + m * kvp + j0, sums * scaling);
    }
  }
#else
  for (int m = 0; m < M; ++m) {
    for (int64_t j0 = 0; j0 < kvp; j0 += 16) {
      f32x16 acc[16];
      for (int t = 0; t < 16; ++t) acc[t] = f32x16{};
      for (int64_t d = 0; d < dk; d += 16) {
        const f32x16 x = load16(qm[m] + d);
        for (int t = 0; t < 16; ++t) acc[t] += x * load16(krows[j0 + t] + d);
      }
      store16(scores + m * kvp + j0, lane_sums(acc) * scaling);
    }
  }
#endif
}

// The k best keys of each lane by (score desc, key index asc), over tiles seen in key order. A key with
// score -inf is never picked (as in the reference). Keys are composites (order key of the score in the
// high word, ~index in the low word), all distinct: descending composite order is score desc, then index
// asc, so the answer does not depend on the order keys arrive in. Each lane appends the keys above its
// threshold to an unordered buffer of k + kKeyTile; when a tile's candidates would not fit, a linear-time
// selection keeps the k best and raises the threshold to the k-th best's score (a later key with that
// score has a larger index and loses the tie). A task's first tile only admits keys that reach the
// smallest of the 4th largest scores of ceil(k / 4) groups of its rows (k distinct keys reach it).
// `finish` sorts each lane's k best once.
struct LaneTopK {
  int64_t k = 0;
  int64_t lanes = 0;
  int64_t capacity = 0;         // per lane: k + kKeyTile
  int64_t stride = 0;           // per lane: capacity + 16 (a vector store may run 16 slots past a list)
  std::vector<uint64_t> keys;   // lanes x stride; after finish(), each lane's list, descending
  std::vector<uint64_t> sort_tmp;  // capacity: scratch for the selection and the sort
  int64_t count[kLaneCount] = {};
  float thr[kLaneCount] = {};  // a key enters a lane only with a score above this
  bool started = false;        // a tile was seen (the first one gets a lower bound of its own)

  void reset(int64_t k_, int64_t lanes_) {
    k = k_;
    lanes = lanes_;
    capacity = k + kKeyTile;
    stride = capacity + 16;
    keys.resize(stride * kLaneCount);
    sort_tmp.resize(capacity);
    started = false;
    for (int c = 0; c < kLaneCount; ++c) {
      count[c] = 0;
      thr[c] = kNegInf;
    }
  }
  const uint64_t* list(int64_t lane) const { return keys.data() + lane * stride; }
  uint64_t* list(int64_t lane) { return keys.data() + lane * stride; }

  static uint64_t composite(float score, int64_t index) {
    const int32_t key = order_key(score + 0.0f);  // -0 -> +0: equal scores get equal keys
    return (static_cast<uint64_t>(static_cast<uint32_t>(key) ^ 0x80000000u) << 32) |
           (0xFFFFFFFFull - static_cast<uint64_t>(index));
  }
  static int64_t index_of(uint64_t c) { return static_cast<int64_t>(0xFFFFFFFFull - (c & 0xFFFFFFFFull)); }
  static float score_of(uint64_t c) { return from_order_key(static_cast<int32_t>((c >> 32) ^ 0x80000000u)); }
};

// Add the candidates of one tile (scores s, keys j0 + t) to each lane's buffer.
void topk_tile(LaneTopK& top, const float* s, int64_t rows, int64_t j0, int lane_vectors);

// Each lane's min(k, seen) best keys, sorted descending, at top.list(lane); top.count[lane] their number.
void topk_finish(LaneTopK& top);

}  // namespace bert_cluster
