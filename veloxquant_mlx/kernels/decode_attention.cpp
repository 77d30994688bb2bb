// decode_attention: one decode call's attention for a layer, over a paged batch's stored
// keys and values and its new (or held) ones, as one MLX operation (CPU stream).
//
// Why: as MLX ops the same attention is ~17 graph nodes a layer (scale, reshapes, two
// score products, masks, concatenation, softmax, two value products), each run by the
// stream at a few microseconds whatever its size: on a one-row SmolLM2 step ~500 nodes,
// several milliseconds. Here a query head's row stays in registers while it reads its
// group's keys, its softmax is one vectorised pass, and larger calls share their (row, KV
// head) pairs out to the codes kernel's threads. Calls beyond
// paged_attention.NATIVE_MAX_SCORES stay on MLX's products: the caller picks.
#include <algorithm>
#include <array>
#include <cmath>
#include <optional>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/variant.h>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"

#include "codes_kernel.h"
#include "cpu_primitive.h"
#include "extension.h"
#include "strided.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define VQ_X86 1
#include "vq_exp.h"
#endif

namespace nb = nanobind;

namespace veloxquant {
namespace {

struct Shape {
  int heads, kv_heads, head_dim, stored, fresh;  // fresh: the new (or held) columns
  float scale;
  bool stored_mask, fresh_mask;
  bool operator==(const Shape&) const = default;
};

// One batch row and KV head: its group of query heads ``q`` (rep x head_dim) over both
// parts, into ``out``. keys[p] / values[p]: the part's (columns x head_dim) rows; masks[p]:
// one byte a column, or null (all seen); ``scores``: room for every column.
using GroupKernel = void (*)(const Shape&, const float* q, float* out,
                             const float* const keys[2], const float* const values[2],
                             const uint8_t* const masks[2], float* scores);

void attend_group_portable(const Shape& s, const float* q, float* out,
                           const float* const keys[2], const float* const values[2],
                           const uint8_t* const masks[2], float* scores) {
  const int rep = s.heads / s.kv_heads, d = s.head_dim, total = s.stored + s.fresh;
  const int columns[2] = {s.stored, s.fresh};
  const float none = -std::numeric_limits<float>::infinity();
  for (int r = 0; r < rep; r++, q += d, out += d) {
    float top = none;
    for (int p = 0, at = 0; p < 2; at += columns[p], p++)
      for (int j = 0; j < columns[p]; j++) {
        float v = none;
        if (!masks[p] || masks[p][j]) {
          const float* key = keys[p] + static_cast<size_t>(j) * d;
          v = 0.0f;
          for (int i = 0; i < d; i++) v += q[i] * key[i];
          v *= s.scale;
        }
        scores[at + j] = v;
        top = std::max(top, v);
      }
    std::fill(out, out + d, 0.0f);
    if (top == none) continue;  // nothing seen: zeros
    float sum = 0.0f;
    for (int j = 0; j < total; j++) sum += scores[j] = std::exp(scores[j] - top);
    for (int p = 0, at = 0; p < 2; at += columns[p], p++)
      for (int j = 0; j < columns[p]; j++)
        for (int i = 0; i < d; i++)
          out[i] += scores[at + j] * values[p][static_cast<size_t>(j) * d + i];
    for (int i = 0; i < d; i++) out[i] /= sum;
  }
}

#ifdef VQ_X86
__attribute__((target("avx2,fma"))) inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// attend_group_portable with AVX2 for head_dim = 8 * DV: each query head's scaled row held
// in registers for its dot products (two chains), one vectorised exp pass over its scores,
// then the values summed in registers (the head's loops unrolled, so they stay there).
// The callers are compiled for SSE: it ends with
// vzeroupper (without it, the SSE code after ran ~10x slower here).
template <int DV>
__attribute__((target("avx2,fma"))) void attend_group_avx2(
    const Shape& s, const float* q, float* out, const float* const keys[2],
    const float* const values[2], const uint8_t* const masks[2], float* scores) {
  constexpr int d = 8 * DV;
  const int rep = s.heads / s.kv_heads, total = s.stored + s.fresh;
  const int columns[2] = {s.stored, s.fresh};
  const float none = -std::numeric_limits<float>::infinity();
  for (int r = 0; r < rep; r++, q += d, out += d) {
    __m256 qv[DV], o[DV];
    #pragma GCC unroll 16
    for (int k = 0; k < DV; k++) {
      qv[k] = _mm256_mul_ps(_mm256_loadu_ps(q + 8 * k), _mm256_set1_ps(s.scale));
      o[k] = _mm256_setzero_ps();
    }
    float top = none;
    for (int p = 0, at = 0; p < 2; at += columns[p], p++)
      for (int j = 0; j < columns[p]; j++) {
        if (masks[p] && !masks[p][j]) {
          scores[at + j] = none;
          continue;
        }
        const float* key = keys[p] + static_cast<size_t>(j) * d;
        __m256 even = _mm256_setzero_ps(), odd = _mm256_setzero_ps();
        #pragma GCC unroll 16
        for (int k = 0; k + 1 < DV; k += 2) {
          even = _mm256_fmadd_ps(qv[k], _mm256_loadu_ps(key + 8 * k), even);
          odd = _mm256_fmadd_ps(qv[k + 1], _mm256_loadu_ps(key + 8 * k + 8), odd);
        }
        if (DV % 2) even = _mm256_fmadd_ps(qv[DV - 1], _mm256_loadu_ps(key + d - 8), even);
        float v = hsum(_mm256_add_ps(even, odd));
        scores[at + j] = v;
        top = std::max(top, v);
      }
    if (top != none) {  // else nothing seen: zeros
      __m256 sums = _mm256_setzero_ps(), shift = _mm256_set1_ps(top);
      int j = 0;
      for (; j + 8 <= total; j += 8) {  // a masked score (-inf) gives exactly 0
        __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(scores + j), shift));
        _mm256_storeu_ps(scores + j, e);
        sums = _mm256_add_ps(sums, e);
      }
      float sum = hsum(sums);
      for (; j < total; j++) sum += scores[j] = std::exp(scores[j] - top);
      for (int p = 0, at = 0; p < 2; at += columns[p], p++)
        for (int c = 0; c < columns[p]; c++) {
          float w = scores[at + c];
          if (w == 0.0f) continue;
          const float* value = values[p] + static_cast<size_t>(c) * d;
          __m256 wv = _mm256_set1_ps(w);
          #pragma GCC unroll 16
          for (int k = 0; k < DV; k++)
            o[k] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(value + 8 * k), o[k]);
        }
      __m256 inv = _mm256_set1_ps(1.0f / sum);
      #pragma GCC unroll 16
      for (int k = 0; k < DV; k++) o[k] = _mm256_mul_ps(o[k], inv);
    }
    #pragma GCC unroll 16
    for (int k = 0; k < DV; k++) _mm256_storeu_ps(out + 8 * k, o[k]);
  }
  _mm256_zeroupper();
}
#endif

// The AVX2 kernel for the common head sizes where the CPU has it, else the plain loop.
GroupKernel group_kernel(int head_dim) {
#ifdef VQ_X86
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    switch (head_dim) {
      case 32: return attend_group_avx2<4>;
      case 64: return attend_group_avx2<8>;
      case 96: return attend_group_avx2<12>;
      case 128: return attend_group_avx2<16>;
    }
  }
#endif
  (void)head_dim;
  return attend_group_portable;
}

// Below this many multiply-adds a call runs on the stream's thread alone: waking a helper
// costs more than a one-row call over a short context takes (tens of microseconds).
constexpr long kMinParallelWork = 1L << 20;

// A call's (batch row, KV head) pairs, for vq_parallel_for: each pair is independent.
struct Groups {
  const Shape* s;
  GroupKernel attend;
  int rows;
  const float *q, *stored, *fresh;  // stored and fresh: keys' rows over values'
  const uint8_t* masks[2];           // null: all seen
  bool shared[2];                    // the mask is one row for every batch row
  float* y;
};

void run_groups(void* ctx, int i0, int i1) {
  const Groups& j = *static_cast<const Groups*>(ctx);
  const Shape& s = *j.s;
  int d = s.head_dim, rep = s.heads / s.kv_heads;
  std::vector<float> scores(static_cast<size_t>(s.stored) + s.fresh);
  for (int i = i0; i < i1; i++) {
    int b = i / s.kv_heads, g = i % s.kv_heads;
    auto part = [&](const float* base, int columns, int stack) {
      return base + ((static_cast<size_t>(stack) * j.rows + b) * s.kv_heads + g) * columns * d;
    };
    const float* keys[2] = {part(j.stored, s.stored, 0), part(j.fresh, s.fresh, 0)};
    const float* values[2] = {part(j.stored, s.stored, 1), part(j.fresh, s.fresh, 1)};
    const int columns[2] = {s.stored, s.fresh};
    const uint8_t* masks[2];
    for (int p = 0; p < 2; p++)
      masks[p] = j.masks[p] ? j.masks[p] + (j.shared[p] ? 0 : static_cast<size_t>(b)) * columns[p]
                            : nullptr;
    size_t first = (static_cast<size_t>(b) * s.heads + g * rep) * d;
    j.attend(s, j.q + first, j.y + first, keys, values, masks, scores.data());
  }
}

class DecodeAttention : public CpuPrimitive<Shape> {
 public:
  DecodeAttention(mx::Stream stream, Shape shape)
      : CpuPrimitive(stream, shape, "DecodeAttention") {}

  // inputs: queries, stored, fresh, [stored mask], [fresh mask]
  void eval_cpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override {
    auto& encoder = encoder_for(inputs, outputs);
    mx::array& out = outputs[0];
    int rows = inputs[0].shape(0);
    std::vector<Strided> in(inputs.begin(), inputs.end());
    std::array<bool, 2> shared{};  // a mask given as one row for every batch row
    size_t next = 3;
    if (s_.stored_mask) shared[0] = inputs[next++].size() == static_cast<size_t>(s_.stored);
    if (s_.fresh_mask) shared[1] = inputs[next].size() == static_cast<size_t>(s_.fresh);
    encoder.dispatch([s = s_, in, shared, rows, y = out.data<float>()]() {
      std::vector<std::vector<char>> copies(in.size());
      auto at = [&](size_t i) { return in[i].packed(copies[i]); };
      const float* q = static_cast<const float*>(at(0));
      const float* stored = static_cast<const float*>(at(1));
      const float* fresh = static_cast<const float*>(at(2));
      size_t next = 3;
      const uint8_t* stored_mask = s.stored_mask ? static_cast<const uint8_t*>(at(next++)) : nullptr;
      const uint8_t* fresh_mask = s.fresh_mask ? static_cast<const uint8_t*>(at(next)) : nullptr;
      Groups job{&s, group_kernel(s.head_dim), rows, q, stored, fresh,
                 {stored_mask, fresh_mask}, {shared[0], shared[1]}, y};
      long work = 2L * rows * s.heads * (s.stored + s.fresh) * s.head_dim;
      if (work < kMinParallelWork)
        run_groups(&job, 0, rows * s.kv_heads);
      else
        vq_parallel_for(rows * s.kv_heads, work, run_groups, &job);
    });
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }
};

void require(bool ok, const std::string& why) {
  if (!ok) throw std::invalid_argument("decode_attention: " + why);
}

mx::array decode_attention(const mx::array& queries, const mx::array& stored,
                           const mx::array& fresh, std::optional<mx::array> stored_mask,
                           std::optional<mx::array> fresh_mask, float scale,
                           mx::StreamOrDevice s) {
  auto stream = cpu_stream(s, "decode_attention");
  require(queries.ndim() == 4 && queries.shape(2) == 1,
          "queries must be (rows, heads, 1, head_dim): one column a row");
  int rows = queries.shape(0), heads = queries.shape(1), d = queries.shape(3);
  for (const auto* part : {&stored, &fresh})
    require(part->ndim() == 4 && part->shape(0) == 2 * rows && part->shape(3) == d &&
                part->shape(1) == stored.shape(1),
            "stored and fresh must be (2 rows, kv_heads, columns, head_dim): keys' rows "
            "over values'");
  int kv_heads = stored.shape(1);
  require(kv_heads > 0 && heads % kv_heads == 0, "heads must be a multiple of kv_heads");
  std::vector<mx::array> inputs{mx::astype(queries, mx::float32, stream),
                                mx::astype(stored, mx::float32, stream),
                                mx::astype(fresh, mx::float32, stream)};
  auto add_mask = [&](const std::optional<mx::array>& mask, int columns, const char* name) {
    if (!mask) return false;
    require(mask->ndim() >= 1 && mask->ndim() <= Strided::kMaxDims && mask->shape(-1) == columns &&
                (mask->size() == static_cast<size_t>(columns) ||
                 mask->size() == static_cast<size_t>(rows) * columns),
            std::string(name) + " must hold one value a column, shared or for each row");
    inputs.push_back(mx::astype(*mask, mx::bool_, stream));
    return true;
  };
  bool has_stored = add_mask(stored_mask, stored.shape(2), "stored_mask");
  bool has_fresh = add_mask(fresh_mask, fresh.shape(2), "fresh_mask");
  Shape shape{heads, kv_heads, d, stored.shape(2), fresh.shape(2), scale, has_stored, has_fresh};
  return mx::array(queries.shape(), mx::float32,
                   std::make_shared<DecodeAttention>(stream, shape), inputs);
}

}  // namespace

void add_attention_op(nb::module_& m) {
  m.def("decode_attention", &decode_attention, nb::arg("queries"), nb::arg("stored"),
        nb::arg("fresh"), nb::arg("stored_mask") = nb::none(),
        nb::arg("fresh_mask") = nb::none(), nb::kw_only(), nb::arg("scale"),
        nb::arg("stream") = nb::none(),
        "Attention of one query column a row (queries: rows, heads, 1, head_dim) over two "
        "parts of keys and values, each (2 rows, kv_heads, columns, head_dim) with the "
        "keys' rows first; the masks (True: seen) hold one value a column, for every row "
        "or each. One softmax over both parts; a row that sees nothing gets zeros.");
}

}  // namespace veloxquant
