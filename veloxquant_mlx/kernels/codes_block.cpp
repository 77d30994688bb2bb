// codes_block: a Llama-shaped block's decode call on either side of its attention, as one
// MLX operation each (CPU stream), its weights as codes:
//
//   block_qkv  x -> rms_norm -> q/k/v (one codes product, + bias) -> head norms -> RoPE
//              -> queries (rows, heads, 1, D), keys over values (2 rows, kv heads, 1, D)
//   block_mlp  x, attention -> h = x + o(attention) -> rms_norm -> gate/up (one product)
//              -> silu(gate) * up -> h + down(...)
//
// Why: the same work as MLX ops is ~50 graph nodes a layer, each built by the host and run
// by the stream at a few microseconds (a one-row SmolLM2 step had ~1,600 such nodes beside
// its ~120 products). The products are codes_kernel.c's, threads included; the rest is a
// few loops over rows, small next to them.
#include <algorithm>
#include <cmath>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/variant.h>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"

#include "codes_kernel.h"
#include "cpu_primitive.h"
#include "extension.h"
#include "strided.h"

namespace nb = nanobind;

namespace veloxquant {
namespace {

// A weight as Python hands it: codes, scales, biases, bits, columns per scale.
using CodesArg = std::tuple<mx::array, mx::array, mx::array, int, int>;

struct Format {
  int bits, group;
  bool operator==(const Format&) const = default;
};

// One weight's codes as they lie when the operation runs.
struct Weight {
  Strided codes, scales, biases;
  int rows, cols;
  Format format;
  bool half;

  Weight(const mx::array& c, const mx::array& s, const mx::array& b, Format f)
      : codes(c), scales(s), biases(b), rows(c.shape(0)),
        cols(static_cast<int>(c.shape(1) * 8 / f.bits)), format(f),
        half(s.dtype() == mx::float16) {}

  // out (m x rows) = x (m x cols) times the weight, transposed.
  void times(int m, const float* x, float* out, int float32_above) const {
    std::vector<char> c, s, b;  // only for inputs that are views
    vq_codes w{rows, cols, format.bits, format.group,
               static_cast<const uint8_t*>(codes.packed(c)), scales.packed(s),
               biases.packed(b), half};
    if (vq_codes_matmul(&w, m, x, out, codes_path(m, float32_above, false), 0) != 0)
      throw std::runtime_error("codes_block: out of memory for the quantized rows");
  }
};

const float* floats(const Strided& a, std::vector<char>& copy) {
  return static_cast<const float*>(a.packed(copy));
}

// out = x / rms(x) * w over n values (out may be x). The sum of squares in double: the
// only rounding left is float32's, whatever n.
void rms_norm(const float* x, const float* w, int n, float eps, float* out) {
  double squares = 0.0;
  for (int j = 0; j < n; j++) squares += static_cast<double>(x[j]) * x[j];
  float r = 1.0f / std::sqrt(static_cast<float>(squares / n) + eps);
  for (int j = 0; j < n; j++) out[j] = x[j] * r * w[j];
}

// RoPE of one head's leading ``dims`` values, in place: pairs (2i, 2i+1) when traditional,
// else (i, i + dims/2), as mx.fast.rope rotates them.
void rotate(float* v, int dims, bool traditional, const float* cos, const float* sin) {
  int half = dims / 2;
  for (int i = 0; i < half; i++) {
    int a = traditional ? 2 * i : i, b = traditional ? 2 * i + 1 : i + half;
    float x1 = v[a], x2 = v[b];
    v[a] = x1 * cos[i] - x2 * sin[i];
    v[b] = x1 * sin[i] + x2 * cos[i];
  }
}

// The weight's three arrays checked for ``cols`` input columns, scales and biases cast to
// the type the kernel reads; appended to ``inputs``.
Format add_weight(const CodesArg& w, int cols, const char* name, mx::Stream stream,
                  std::vector<mx::array>& inputs) {
  const auto& [codes, scales, biases, bits, group] = w;
  std::string why = codes_problem(cols, codes, scales, biases, bits, group);
  if (!why.empty()) throw std::invalid_argument(std::string(name) + ": " + why);
  auto params = params_dtype(scales, biases);
  inputs.insert(inputs.end(), {codes, mx::astype(scales, params, stream),
                               mx::astype(biases, params, stream)});
  return {bits, group};
}

void require(bool ok, const std::string& why) {
  if (!ok) throw std::invalid_argument(why);
}

// ------------------------------------------------------------------ block_qkv

struct QkvShape {
  int heads, kv_heads, head_dim, rope_dims;
  bool traditional, bias, head_norms;
  float eps, head_eps;
  int float32_above;
  Format format;
  bool operator==(const QkvShape&) const = default;
};

class BlockQkv : public CpuPrimitive<QkvShape> {
 public:
  BlockQkv(mx::Stream stream, QkvShape shape) : CpuPrimitive(stream, shape, "BlockQkv") {}

  // inputs: x, norm, codes, scales, biases, cos, sin, [bias], [q_norm, k_norm]
  void eval_cpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override {
    auto& encoder = encoder_for(inputs, outputs);
    int hidden = inputs[0].shape(-1), rows = static_cast<int>(inputs[0].size() / hidden);
    int half = s_.rope_dims / 2, table_rows = static_cast<int>(inputs[5].size() / half);
    std::vector<Strided> in(inputs.begin(), inputs.end());
    Weight w(inputs[2], inputs[3], inputs[4], s_.format);
    encoder.dispatch([s = s_, in, w, hidden, rows, half, table_rows,
                      q = outputs[0].data<float>(), kv = outputs[1].data<float>()]() {
      std::vector<std::vector<char>> copies(in.size());
      auto input = [&](size_t i) { return floats(in[i], copies[i]); };
      const float *x = input(0), *norm = input(1), *cos = input(5), *sin = input(6);
      const float* bias = s.bias ? input(7) : nullptr;
      const float* q_norm = s.head_norms ? input(in.size() - 2) : nullptr;
      const float* k_norm = s.head_norms ? input(in.size() - 1) : nullptr;
      int d = s.head_dim, width = w.rows;
      std::vector<float> normed(static_cast<size_t>(rows) * hidden);
      std::vector<float> y(static_cast<size_t>(rows) * width);
      for (int r = 0; r < rows; r++)
        rms_norm(x + static_cast<size_t>(r) * hidden, norm, hidden, s.eps,
                 normed.data() + static_cast<size_t>(r) * hidden);
      w.times(rows, normed.data(), y.data(), s.float32_above);
      for (int r = 0; r < rows; r++) {
        float* yr = y.data() + static_cast<size_t>(r) * width;
        if (bias)
          for (int j = 0; j < width; j++) yr[j] += bias[j];
        const float* c = cos + (table_rows == 1 ? 0 : static_cast<size_t>(r) * half);
        const float* sn = sin + (table_rows == 1 ? 0 : static_cast<size_t>(r) * half);
        // One head: copied out, its norm (qwen3), RoPE unless it is a value.
        auto head = [&](const float* src, float* dst, const float* head_norm, bool rope) {
          std::copy(src, src + d, dst);
          if (head_norm) rms_norm(dst, head_norm, d, s.head_eps, dst);
          if (rope) rotate(dst, s.rope_dims, s.traditional, c, sn);
        };
        for (int h = 0; h < s.heads; h++)
          head(yr + h * d, q + (static_cast<size_t>(r) * s.heads + h) * d, q_norm, true);
        const float* keys = yr + s.heads * d;
        const float* values = keys + s.kv_heads * d;
        for (int h = 0; h < s.kv_heads; h++) {
          head(keys + h * d, kv + (static_cast<size_t>(r) * s.kv_heads + h) * d, k_norm, true);
          head(values + h * d, kv + (static_cast<size_t>(rows + r) * s.kv_heads + h) * d,
               nullptr, false);
        }
      }
    });
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    int rows = static_cast<int>(inputs[0].size() / inputs[0].shape(-1));
    return {{rows, s_.heads, 1, s_.head_dim}, {2 * rows, s_.kv_heads, 1, s_.head_dim}};
  }
};

std::tuple<mx::array, mx::array> block_qkv(
    const mx::array& x, const mx::array& norm, const CodesArg& qkv, const mx::array& cos,
    const mx::array& sin, float eps, int heads, int kv_heads, int head_dim, int rope_dims,
    bool traditional, std::optional<mx::array> bias, std::optional<mx::array> q_norm,
    std::optional<mx::array> k_norm, float head_eps, int float32_above,
    mx::StreamOrDevice s) {
  auto stream = cpu_stream(s, "block_qkv");
  require(x.ndim() >= 1 && x.ndim() <= Strided::kMaxDims,
          "block_qkv: x must have 1 to 8 dimensions");
  int hidden = x.shape(-1), rows = static_cast<int>(x.size() / hidden);
  int width = (heads + 2 * kv_heads) * head_dim;
  require(heads > 0 && kv_heads > 0 && head_dim > 0,
          "block_qkv: heads, kv_heads and head_dim must be positive");
  require(rope_dims > 0 && rope_dims % 2 == 0 && rope_dims <= head_dim,
          "block_qkv: rope_dims must be even and at most head_dim");
  require(norm.size() == static_cast<size_t>(hidden),
          "block_qkv: the norm's weight must have x's " + std::to_string(hidden) + " values");
  require(std::get<0>(qkv).ndim() == 2 && std::get<0>(qkv).shape(0) == width,
          "block_qkv: the q/k/v codes must have (heads + 2 kv_heads) * head_dim = " +
              std::to_string(width) + " rows");
  size_t half = rope_dims / 2;
  for (const auto* t : {&cos, &sin})
    require(t->size() == half || t->size() == rows * half,
            "block_qkv: cos and sin must hold rope_dims / 2 values, or that for each of x's " +
                std::to_string(rows) + " rows");
  require(q_norm.has_value() == k_norm.has_value(), "block_qkv: give both head norms or none");
  std::vector<mx::array> inputs{mx::astype(x, mx::float32, stream),
                                mx::astype(norm, mx::float32, stream)};
  Format format = add_weight(qkv, hidden, "block_qkv", stream, inputs);
  inputs.push_back(mx::astype(cos, mx::float32, stream));
  inputs.push_back(mx::astype(sin, mx::float32, stream));
  if (bias) {
    require(bias->size() == static_cast<size_t>(width),
            "block_qkv: the bias must have " + std::to_string(width) + " values");
    inputs.push_back(mx::astype(*bias, mx::float32, stream));
  }
  if (q_norm) {
    require(q_norm->size() == static_cast<size_t>(head_dim) &&
                k_norm->size() == static_cast<size_t>(head_dim),
            "block_qkv: head norms must have head_dim values");
    inputs.push_back(mx::astype(*q_norm, mx::float32, stream));
    inputs.push_back(mx::astype(*k_norm, mx::float32, stream));
  }
  QkvShape shape{heads, kv_heads, head_dim, rope_dims, traditional, bias.has_value(),
                 q_norm.has_value(), eps, head_eps, float32_above, format};
  auto out = mx::array::make_arrays(
      {{rows, heads, 1, head_dim}, {2 * rows, kv_heads, 1, head_dim}},
      {mx::float32, mx::float32}, std::make_shared<BlockQkv>(stream, shape), inputs);
  return {out[0], out[1]};
}

// ------------------------------------------------------------------ block_mlp

struct MlpShape {
  float eps;
  int float32_above;
  Format o, gate_up, down;
  bool operator==(const MlpShape&) const = default;
};

class BlockMlp : public CpuPrimitive<MlpShape> {
 public:
  BlockMlp(mx::Stream stream, MlpShape shape) : CpuPrimitive(stream, shape, "BlockMlp") {}

  // inputs: x, attention, o (3), norm, gate_up (3), down (3)
  void eval_cpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override {
    auto& encoder = encoder_for(inputs, outputs);
    mx::array& out = outputs[0];
    int hidden = inputs[0].shape(-1), rows = static_cast<int>(inputs[0].size() / hidden);
    Weight o(inputs[2], inputs[3], inputs[4], s_.o);
    Weight gate_up(inputs[6], inputs[7], inputs[8], s_.gate_up);
    Weight down(inputs[9], inputs[10], inputs[11], s_.down);
    encoder.dispatch([s = s_, xs = Strided(inputs[0]), as = Strided(inputs[1]),
                      ns = Strided(inputs[5]), o, gate_up, down, hidden, rows,
                      y = out.data<float>()]() {
      std::vector<char> x_copy, a_copy, n_copy;
      const float *x = floats(xs, x_copy), *attended = floats(as, a_copy);
      const float* norm = floats(ns, n_copy);
      size_t cells = static_cast<size_t>(rows) * hidden;
      int inner = down.cols;
      std::vector<float> h(cells), normed(cells);
      std::vector<float> gu(static_cast<size_t>(rows) * 2 * inner);
      o.times(rows, attended, h.data(), s.float32_above);
      for (size_t i = 0; i < cells; i++) h[i] += x[i];
      for (int r = 0; r < rows; r++)
        rms_norm(h.data() + static_cast<size_t>(r) * hidden, norm, hidden, s.eps,
                 normed.data() + static_cast<size_t>(r) * hidden);
      gate_up.times(rows, normed.data(), gu.data(), s.float32_above);
      // silu(gate) * up: the gate's columns come first in each row.
      std::vector<float> act(static_cast<size_t>(rows) * inner);
      for (int r = 0; r < rows; r++) {
        const float* g = gu.data() + static_cast<size_t>(r) * 2 * inner;
        float* a = act.data() + static_cast<size_t>(r) * inner;
        for (int j = 0; j < inner; j++) a[j] = g[j] / (1.0f + std::exp(-g[j])) * g[inner + j];
      }
      down.times(rows, act.data(), y, s.float32_above);
      for (size_t i = 0; i < cells; i++) y[i] += h[i];
    });
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }
};

mx::array block_mlp(const mx::array& x, const mx::array& attended, const CodesArg& o,
                    const mx::array& norm, const CodesArg& gate_up, const CodesArg& down,
                    float eps, int float32_above, mx::StreamOrDevice s) {
  auto stream = cpu_stream(s, "block_mlp");
  require(x.ndim() >= 1 && x.ndim() <= Strided::kMaxDims && attended.ndim() <= Strided::kMaxDims,
          "block_mlp: x and the attention must have 1 to 8 dimensions");
  int hidden = x.shape(-1), rows = static_cast<int>(x.size() / hidden);
  require(rows > 0 && attended.size() % rows == 0,
          "block_mlp: the attention must hold as many rows as x");
  int attention_width = static_cast<int>(attended.size() / rows);
  int inner = std::get<0>(down).ndim() == 2
                  ? static_cast<int>(std::get<0>(down).shape(1) * 8 / std::get<3>(down)) : 0;
  require(std::get<0>(o).ndim() == 2 && std::get<0>(o).shape(0) == hidden,
          "block_mlp: o's codes must have x's " + std::to_string(hidden) + " rows");
  require(std::get<0>(gate_up).ndim() == 2 && std::get<0>(gate_up).shape(0) == 2 * inner,
          "block_mlp: gate/up's codes must have twice down's " + std::to_string(inner) +
              " input columns as rows");
  require(std::get<0>(down).shape(0) == hidden,
          "block_mlp: down's codes must have x's " + std::to_string(hidden) + " rows");
  require(norm.size() == static_cast<size_t>(hidden),
          "block_mlp: the norm's weight must have x's " + std::to_string(hidden) + " values");
  std::vector<mx::array> inputs{mx::astype(x, mx::float32, stream),
                                mx::astype(attended, mx::float32, stream)};
  Format o_format = add_weight(o, attention_width, "block_mlp (o)", stream, inputs);
  inputs.push_back(mx::astype(norm, mx::float32, stream));
  Format gu_format = add_weight(gate_up, hidden, "block_mlp (gate/up)", stream, inputs);
  Format down_format = add_weight(down, inner, "block_mlp (down)", stream, inputs);
  MlpShape shape{eps, float32_above, o_format, gu_format, down_format};
  return mx::array(x.shape(), mx::float32, std::make_shared<BlockMlp>(stream, shape), inputs);
}

}  // namespace

void add_block_ops(nb::module_& m) {
  m.def("block_qkv", &block_qkv, nb::arg("x"), nb::arg("norm"), nb::arg("qkv"),
        nb::arg("cos"), nb::arg("sin"), nb::kw_only(), nb::arg("eps"), nb::arg("heads"),
        nb::arg("kv_heads"), nb::arg("head_dim"), nb::arg("rope_dims"),
        nb::arg("traditional") = false, nb::arg("bias") = nb::none(),
        nb::arg("q_norm") = nb::none(), nb::arg("k_norm") = nb::none(),
        nb::arg("head_eps") = 0.0f, nb::arg("float32_above") = 0,
        nb::arg("stream") = nb::none(),
        "A decode block's attention input: rms_norm(x) * norm, times the q/k/v codes "
        "(qkv = (codes, scales, biases, bits, group), + bias), per-head norms when given, "
        "RoPE by cos and sin (rope_dims / 2 values, shared or one set per row). Returns "
        "queries (rows, heads, 1, head_dim) and keys over values "
        "(2 rows, kv_heads, 1, head_dim), float32.");
  m.def("block_mlp", &block_mlp, nb::arg("x"), nb::arg("attended"), nb::arg("o"),
        nb::arg("norm"), nb::arg("gate_up"), nb::arg("down"), nb::kw_only(), nb::arg("eps"),
        nb::arg("float32_above") = 0, nb::arg("stream") = nb::none(),
        "A decode block's rest after attention: h = x + o(attended); "
        "h + down(silu(gate) * up) with gate/up = gate_up(rms_norm(h) * norm) (gate's "
        "rows first). Each weight is (codes, scales, biases, bits, group). float32, x's "
        "shape.");
}

}  // namespace veloxquant
