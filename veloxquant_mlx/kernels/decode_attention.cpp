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
//
// paged_decode_attention reads the stored part straight from the KV arena's blocks
// through the layer's block table, so the batch's per-layer gather (a copy of every row's
// stored keys and values, each step: at 16 SmolLM2 rows ~3.5 MB a layer) never runs.
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
  int block_size;  // > 0: the stored part is the arena's blocks, read through a table
  bool operator==(const Shape&) const = default;
};

// A run of columns whose keys and values each lie in consecutive (head_dim) rows: the
// stored part (or one of its blocks), or the fresh part. mask: one byte a column, or null
// (all seen).
struct Part {
  const float *keys, *values;
  const uint8_t* mask;
  int columns;
};

// One batch row and KV head: its group of query heads ``q`` (rep x head_dim) over the
// parts in order, into ``out``; ``scores``: room for every column.
using GroupKernel = void (*)(const Shape&, const float* q, float* out,
                             const std::vector<Part>& parts, float* scores);

void attend_group_portable(const Shape& s, const float* q, float* out,
                           const std::vector<Part>& parts, float* scores) {
  const int rep = s.heads / s.kv_heads, d = s.head_dim, total = s.stored + s.fresh;
  const float none = -std::numeric_limits<float>::infinity();
  for (int r = 0; r < rep; r++, q += d, out += d) {
    float top = none;
    int at = 0;
    for (const Part& p : parts)
      for (int j = 0; j < p.columns; j++, at++) {
        float v = none;
        if (!p.mask || p.mask[j]) {
          const float* key = p.keys + static_cast<size_t>(j) * d;
          v = 0.0f;
          for (int i = 0; i < d; i++) v += q[i] * key[i];
          v *= s.scale;
        }
        scores[at] = v;
        top = std::max(top, v);
      }
    std::fill(out, out + d, 0.0f);
    if (top == none) continue;  // nothing seen: zeros
    float sum = 0.0f;
    for (int j = 0; j < total; j++) sum += scores[j] = std::exp(scores[j] - top);
    at = 0;
    for (const Part& p : parts)
      for (int j = 0; j < p.columns; j++, at++)
        for (int i = 0; i < d; i++)
          out[i] += scores[at] * p.values[static_cast<size_t>(j) * d + i];
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
    const Shape& s, const float* q, float* out, const std::vector<Part>& parts,
    float* scores) {
  constexpr int d = 8 * DV;
  const int rep = s.heads / s.kv_heads, total = s.stored + s.fresh;
  const float none = -std::numeric_limits<float>::infinity();
  for (int r = 0; r < rep; r++, q += d, out += d) {
    __m256 qv[DV], o[DV];
    #pragma GCC unroll 16
    for (int k = 0; k < DV; k++) {
      qv[k] = _mm256_mul_ps(_mm256_loadu_ps(q + 8 * k), _mm256_set1_ps(s.scale));
      o[k] = _mm256_setzero_ps();
    }
    float top = none;
    int at = 0;
    for (const Part& p : parts)
      for (int j = 0; j < p.columns; j++, at++) {
        if (p.mask && !p.mask[j]) {
          scores[at] = none;
          continue;
        }
        const float* key = p.keys + static_cast<size_t>(j) * d;
        __m256 even = _mm256_setzero_ps(), odd = _mm256_setzero_ps();
        #pragma GCC unroll 16
        for (int k = 0; k + 1 < DV; k += 2) {
          even = _mm256_fmadd_ps(qv[k], _mm256_loadu_ps(key + 8 * k), even);
          odd = _mm256_fmadd_ps(qv[k + 1], _mm256_loadu_ps(key + 8 * k + 8), odd);
        }
        if (DV % 2) even = _mm256_fmadd_ps(qv[DV - 1], _mm256_loadu_ps(key + d - 8), even);
        float v = hsum(_mm256_add_ps(even, odd));
        scores[at] = v;
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
      at = 0;
      for (const Part& p : parts)
        for (int c = 0; c < p.columns; c++, at++) {
          float w = scores[at];
          if (w == 0.0f) continue;
          const float* value = p.values + static_cast<size_t>(c) * d;
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
  const int32_t* table;              // paged: (2 rows, blocks) arena block ids, keys' first
  int table_blocks, arena_blocks;    // paged: the table's width, the arena's blocks
  const uint8_t* masks[2];           // null: all seen
  bool shared[2];                    // the mask is one row for every batch row
  float* y;
};

// The stored part of row b, KV head g, block by block from the arena. A block id outside
// the arena reads block 0 under an all-hidden mask: a bad table hides columns, never
// reads outside the arena.
void paged_parts(const Groups& j, int b, int g, const uint8_t* mask, const uint8_t* hidden,
                 std::vector<Part>& parts) {
  const Shape& s = *j.s;
  size_t head = static_cast<size_t>(g) * j.arena_blocks * s.block_size * s.head_dim;
  const int32_t* key_ids = j.table + static_cast<size_t>(b) * j.table_blocks;
  const int32_t* value_ids = j.table + static_cast<size_t>(j.rows + b) * j.table_blocks;
  for (int k = 0, start = 0; start < s.stored; k++, start += s.block_size) {
    int kid = key_ids[k], vid = value_ids[k];
    bool bad = kid < 0 || kid >= j.arena_blocks || vid < 0 || vid >= j.arena_blocks;
    auto block = [&](int id) {
      return j.stored + head + static_cast<size_t>(bad ? 0 : id) * s.block_size * s.head_dim;
    };
    parts.push_back({block(kid), block(vid), bad ? hidden : mask ? mask + start : nullptr,
                     std::min(s.block_size, s.stored - start)});
  }
}

void run_groups(void* ctx, int i0, int i1) {
  const Groups& j = *static_cast<const Groups*>(ctx);
  const Shape& s = *j.s;
  int d = s.head_dim, rep = s.heads / s.kv_heads;
  std::vector<float> scores(static_cast<size_t>(s.stored) + s.fresh);
  std::vector<uint8_t> hidden(static_cast<size_t>(std::max(s.block_size, 0)), 0);
  std::vector<Part> parts;
  for (int i = i0; i < i1; i++) {
    int b = i / s.kv_heads, g = i % s.kv_heads;
    auto row = [&](const float* base, int columns, int stack) {
      return base + ((static_cast<size_t>(stack) * j.rows + b) * s.kv_heads + g) * columns * d;
    };
    const uint8_t* masks[2];
    const int columns[2] = {s.stored, s.fresh};
    for (int p = 0; p < 2; p++)
      masks[p] = j.masks[p] ? j.masks[p] + (j.shared[p] ? 0 : static_cast<size_t>(b)) * columns[p]
                            : nullptr;
    parts.clear();
    if (s.block_size > 0)
      paged_parts(j, b, g, masks[0], hidden.data(), parts);
    else
      parts.push_back({row(j.stored, s.stored, 0), row(j.stored, s.stored, 1), masks[0],
                       s.stored});
    parts.push_back({row(j.fresh, s.fresh, 0), row(j.fresh, s.fresh, 1), masks[1], s.fresh});
    size_t first = (static_cast<size_t>(b) * s.heads + g * rep) * d;
    j.attend(s, j.q + first, j.y + first, parts, scores.data());
  }
}

class DecodeAttention : public CpuPrimitive<Shape> {
 public:
  DecodeAttention(mx::Stream stream, Shape shape)
      : CpuPrimitive(stream, shape, "DecodeAttention") {}

  // inputs: queries, stored (paged: the arena), fresh, [table], [stored mask], [fresh mask]
  void eval_cpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override {
    auto& encoder = encoder_for(inputs, outputs);
    mx::array& out = outputs[0];
    int rows = inputs[0].shape(0);
    bool paged = s_.block_size > 0;
    int table_blocks = paged ? inputs[3].shape(1) : 0;
    int arena_blocks = paged ? inputs[1].shape(1) / s_.block_size : 0;
    std::vector<Strided> in(inputs.begin(), inputs.end());
    std::array<bool, 2> shared{};  // a mask given as one row for every batch row
    size_t next = paged ? 4 : 3;
    if (s_.stored_mask) shared[0] = inputs[next++].size() == static_cast<size_t>(s_.stored);
    if (s_.fresh_mask) shared[1] = inputs[next].size() == static_cast<size_t>(s_.fresh);
    encoder.dispatch([s = s_, in, shared, rows, paged, table_blocks, arena_blocks,
                      y = out.data<float>()]() {
      std::vector<std::vector<char>> copies(in.size());
      auto at = [&](size_t i) { return in[i].packed(copies[i]); };
      size_t next = paged ? 4 : 3;
      const uint8_t* stored_mask = s.stored_mask ? static_cast<const uint8_t*>(at(next++)) : nullptr;
      const uint8_t* fresh_mask = s.fresh_mask ? static_cast<const uint8_t*>(at(next)) : nullptr;
      Groups job{&s, group_kernel(s.head_dim), rows,
                 static_cast<const float*>(at(0)), static_cast<const float*>(at(1)),
                 static_cast<const float*>(at(2)),
                 paged ? static_cast<const int32_t*>(at(3)) : nullptr, table_blocks,
                 arena_blocks, {stored_mask, fresh_mask}, {shared[0], shared[1]}, y};
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

// The queries' (rows, heads, head_dim), checked: one column a row.
std::array<int, 3> query_shape(const mx::array& queries) {
  require(queries.ndim() == 4 && queries.shape(2) == 1,
          "queries must be (rows, heads, 1, head_dim): one column a row");
  return {queries.shape(0), queries.shape(1), queries.shape(3)};
}

void require_stacked(const mx::array& part, int rows, int kv_heads, int d, const char* name) {
  require(part.ndim() == 4 && part.shape(0) == 2 * rows && part.shape(3) == d &&
              part.shape(1) == kv_heads,
          std::string(name) + " must be (2 rows, kv_heads, columns, head_dim): keys' rows "
          "over values'");
}

// The node, given its leading inputs; the masks are checked and appended here.
mx::array attention_node(Shape shape, int rows, std::vector<mx::array> inputs,
                         const std::optional<mx::array>& stored_mask,
                         const std::optional<mx::array>& fresh_mask, mx::Stream stream) {
  require(shape.kv_heads > 0 && shape.heads % shape.kv_heads == 0,
          "heads must be a multiple of kv_heads");
  auto add_mask = [&](const std::optional<mx::array>& mask, int columns, const char* name) {
    if (!mask) return false;
    require(mask->ndim() >= 1 && mask->ndim() <= Strided::kMaxDims && mask->shape(-1) == columns &&
                (mask->size() == static_cast<size_t>(columns) ||
                 mask->size() == static_cast<size_t>(rows) * columns),
            std::string(name) + " must hold one value a column, shared or for each row");
    inputs.push_back(mx::astype(*mask, mx::bool_, stream));
    return true;
  };
  shape.stored_mask = add_mask(stored_mask, shape.stored, "stored_mask");
  shape.fresh_mask = add_mask(fresh_mask, shape.fresh, "fresh_mask");
  mx::Shape out_shape{rows, shape.heads, 1, shape.head_dim};
  return mx::array(out_shape, mx::float32, std::make_shared<DecodeAttention>(stream, shape),
                   std::move(inputs));
}

mx::array decode_attention(const mx::array& queries, const mx::array& stored,
                           const mx::array& fresh, std::optional<mx::array> stored_mask,
                           std::optional<mx::array> fresh_mask, float scale,
                           mx::StreamOrDevice s) {
  auto stream = cpu_stream(s, "decode_attention");
  auto [rows, heads, d] = query_shape(queries);
  require(stored.ndim() == 4, "stored must be (2 rows, kv_heads, columns, head_dim)");
  int kv_heads = stored.shape(1);
  require_stacked(stored, rows, kv_heads, d, "stored");
  require_stacked(fresh, rows, kv_heads, d, "fresh");
  Shape shape{heads, kv_heads, d, stored.shape(2), fresh.shape(2), scale, false, false, 0};
  return attention_node(shape, rows,
                        {mx::astype(queries, mx::float32, stream),
                         mx::astype(stored, mx::float32, stream),
                         mx::astype(fresh, mx::float32, stream)},
                        stored_mask, fresh_mask, stream);
}

mx::array paged_decode_attention(const mx::array& queries, const mx::array& arena,
                                 const mx::array& table, int columns, const mx::array& fresh,
                                 std::optional<mx::array> stored_mask,
                                 std::optional<mx::array> fresh_mask, float scale,
                                 int block_size, mx::StreamOrDevice s) {
  auto stream = cpu_stream(s, "paged_decode_attention");
  auto [rows, heads, d] = query_shape(queries);
  require(block_size > 0, "block_size must be positive");
  require(arena.ndim() == 3 && arena.shape(2) == d && arena.shape(1) % block_size == 0 &&
              arena.shape(1) > 0,
          "arena must be (kv_heads, slots, head_dim), slots a multiple of block_size");
  int kv_heads = arena.shape(0);
  require(table.ndim() == 2 && table.shape(0) == 2 * rows &&
              columns >= 1 && columns <= table.shape(1) * block_size,
          "table must be (2 rows, blocks) block ids, keys' rows over values', covering the "
          "stored columns (at least 1)");
  require_stacked(fresh, rows, kv_heads, d, "fresh");
  Shape shape{heads, kv_heads, d, columns, fresh.shape(2), scale, false, false, block_size};
  return attention_node(shape, rows,
                        {mx::astype(queries, mx::float32, stream),
                         mx::astype(arena, mx::float32, stream),
                         mx::astype(fresh, mx::float32, stream),
                         mx::astype(table, mx::int32, stream)},
                        stored_mask, fresh_mask, stream);
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
  m.def("paged_decode_attention", &paged_decode_attention, nb::arg("queries"),
        nb::arg("arena"), nb::arg("table"), nb::arg("columns"), nb::arg("fresh"),
        nb::arg("stored_mask") = nb::none(), nb::arg("fresh_mask") = nb::none(),
        nb::kw_only(), nb::arg("scale"), nb::arg("block_size"),
        nb::arg("stream") = nb::none(),
        "decode_attention with the stored part read from a KV arena's blocks: arena "
        "(kv_heads, slots, head_dim), block b's columns at slots [b * block_size, (b + 1) * "
        "block_size); table (2 rows, blocks) block ids, keys' rows then values'; the "
        "stored part is each row's first ``columns`` columns along its blocks. A block id "
        "outside the arena hides its columns.");
}

}  // namespace veloxquant
