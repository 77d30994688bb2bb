// codes_matmul: an MLX operation multiplying activations by 4- or 8-bit weight codes.
//
// The arithmetic is codes_kernel.c's; this file makes it a node of MLX's graph (a
// Primitive evaluated on the CPU stream), so a quantized Linear calls it like any other
// op: no float32 copy of the weights, nothing intercepted below MLX.
#include <array>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"
#include "mlx/version.h"

#include "codes_kernel.h"
#include "extension.h"
#include "strided.h"

namespace mx = mlx::core;
namespace nb = nanobind;

using veloxquant::Strided;

namespace veloxquant {

std::string codes_problem(int cols, const mx::array& codes, const mx::array& scales,
                          const mx::array& biases, int bits, int group) {
  std::ostringstream why;
  if (codes.ndim() != 2 || codes.dtype() != mx::uint8)
    why << "codes must be a 2-D uint8 array, got " << codes.ndim() << "-D " << codes.dtype();
  else if (scales.ndim() > Strided::kMaxDims || biases.ndim() > Strided::kMaxDims)
    why << "scales and biases may have at most " << Strided::kMaxDims << " dimensions";
  else {
    vq_codes w{codes.shape(0), cols, bits, group, nullptr, nullptr, nullptr};
    const char* shape_error = vq_codes_check(&w);
    long wanted_groups = static_cast<long>(codes.shape(0)) * (cols / (group > 0 ? group : 1));
    if (shape_error)
      why << shape_error;
    else if (static_cast<long>(codes.shape(1)) * 8 != static_cast<long>(cols) * bits)
      why << "codes hold " << codes.shape(1) * 8 / bits << " columns a row, x has " << cols;
    else if (scales.size() != static_cast<size_t>(wanted_groups) ||
             biases.size() != static_cast<size_t>(wanted_groups))
      why << "scales and biases need " << wanted_groups << " values each, got "
          << scales.size() << " and " << biases.size();
  }
  return why.str();
}

mx::Dtype params_dtype(const mx::array& scales, const mx::array& biases) {
  return scales.dtype() == mx::float16 && biases.dtype() == mx::float16 ? mx::float16
                                                                        : mx::float32;
}

int codes_path(int m, int float32_above, bool portable) {
  if (float32_above > 0 && m > float32_above) {
    if (portable && vq_codes_blas_available()) return VQ_PATH_FLOAT32_BLAS;
    if (!portable && vq_codes_float32_available()) return VQ_PATH_FLOAT32;
  }
  return portable ? VQ_PATH_PORTABLE : VQ_PATH_AUTO;
}

mx::Stream cpu_stream(mx::StreamOrDevice s, const char* op) {
  auto stream = mx::to_stream(s, mx::Device::cpu);
  if (stream.device != mx::Device::cpu)
    throw std::invalid_argument(std::string(op) + " runs on the CPU stream only");
  return stream;
}

}  // namespace veloxquant

namespace {

class CodesMatmul : public mx::Primitive {
 public:
  CodesMatmul(mx::Stream stream, int bits, int group, bool portable, int float32_above,
              bool precise)
      : mx::Primitive(stream),
        bits_(bits),
        group_(group),
        portable_(portable),
        float32_above_(float32_above),
        precise_(precise) {}

  void eval_cpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override {
    const mx::array& x = inputs[0];
    const mx::array& codes = inputs[1];
    const mx::array& scales = inputs[2];
    const mx::array& biases = inputs[3];
    mx::array& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    // float16 or float32 scales and biases (codes_matmul makes both one of the two).
    vq_codes w{codes.shape(0), x.shape(-1), bits_, group_, nullptr, nullptr, nullptr,
               scales.dtype() == mx::float16};
    int m = static_cast<int>(x.size() / x.shape(-1));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) encoder.set_input_array(a);
    encoder.set_output_array(out);
    int path = veloxquant::codes_path(m, float32_above_, portable_);
    encoder.dispatch([w, m, path, precise = precise_, xs = Strided(x), cs = Strided(codes),
                      ss = Strided(scales), bs = Strided(biases),
                      out_ptr = out.data<float>()]() mutable {
      std::vector<char> x_copy, c_copy, s_copy, b_copy;  // only for inputs that are views
      w.codes = static_cast<const uint8_t*>(cs.packed(c_copy));
      w.scales = ss.packed(s_copy);
      w.biases = bs.packed(b_copy);
      const float* x_rows = static_cast<const float*>(xs.packed(x_copy));
      if (vq_codes_matmul(&w, m, x_rows, out_ptr, path, precise) != 0)
        throw std::runtime_error("codes_matmul: out of memory for the quantized rows");
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("codes_matmul runs on the CPU; on a GPU use MLX's quantized_matmul");
  }

  const char* name() const override { return "CodesMatmul"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const CodesMatmul&>(other);
    return bits_ == o.bits_ && group_ == o.group_ && portable_ == o.portable_ &&
           float32_above_ == o.float32_above_ && precise_ == o.precise_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    auto shape = inputs[0].shape();
    shape.back() = inputs[1].shape(0);
    return {shape};
  }

 private:
  int bits_, group_;
  bool portable_;
  int float32_above_;
  bool precise_;
};

void check_inputs(const mx::array& x, const mx::array& codes, const mx::array& scales,
                  const mx::array& biases, int bits, int group) {
  std::string why;
  if (x.ndim() < 1 || x.ndim() > Strided::kMaxDims)
    why = "x must have 1 to " + std::to_string(Strided::kMaxDims) + " dimensions, got " +
          std::to_string(x.ndim());
  else
    why = veloxquant::codes_problem(x.shape(-1), codes, scales, biases, bits, group);
  if (!why.empty()) throw std::invalid_argument("codes_matmul: " + why);
}

mx::array codes_matmul(const mx::array& x, const mx::array& codes, const mx::array& scales,
                       const mx::array& biases, int bits, int group, bool portable,
                       int float32_above, bool precise, mx::StreamOrDevice s) {
  check_inputs(x, codes, scales, biases, bits, group);
  auto stream = veloxquant::cpu_stream(s, "codes_matmul");
  // Scales and biases stay float16 when both are (GGUF's Q4_0, Q4_1, Q8_0 hold them so);
  // anything else is computed with in float32.
  auto params = veloxquant::params_dtype(scales, biases);
  auto shape = x.shape();
  shape.back() = codes.shape(0);
  return mx::array(shape, mx::float32,
                   std::make_shared<CodesMatmul>(stream, bits, group, portable, float32_above,
                                                 precise),
                   {mx::astype(x, mx::float32, stream), codes,
                    mx::astype(scales, params, stream), mx::astype(biases, params, stream)});
}

}  // namespace

NB_MODULE(_codes_matmul, m) {
  m.doc() = "Activations times 4/8-bit weight codes as an MLX operation (CPU).";
  m.def("codes_matmul", &codes_matmul, nb::arg("x"), nb::arg("codes"), nb::arg("scales"),
        nb::arg("biases"), nb::kw_only(), nb::arg("bits"), nb::arg("group"),
        nb::arg("portable") = false, nb::arg("float32_above") = 0, nb::arg("precise") = false,
        nb::arg("stream") = nb::none(),
        "x (..., cols) times the weight (rows x cols) the codes stand for, transposed: "
        "(..., rows) float32, with int8 activations; scales and biases float16 when both "
        "are, else float32. portable=True forces what a CPU without AVX2 runs (plain C); "
        "products of more than float32_above rows (0: none) multiply float32 x by the "
        "dequantized weights instead (with AVX2 in the kernel, else where a BLAS is "
        "loaded); precise=True then "
        "recomputes each row's exact_top largest results in float32 (an LM head's).");
  veloxquant::add_block_ops(m);
  veloxquant::add_attention_op(m);
  m.attr("exact_top") = VQ_EXACT_TOP;
  m.def("float32_available",
        [](bool portable) {
          return (portable ? vq_codes_blas_available() : vq_codes_float32_available()) != 0;
        },
        nb::arg("portable") = false,
        "Whether products past float32_above rows run in float32 here (AVX2, or a loaded "
        "BLAS; with portable=True, the BLAS).");
  m.def("kernel_path", []() { return std::string(vq_codes_path()); },
        "The path this CPU takes: 'avx2' or 'portable'.");
  // The MLX headers this was compiled against: its Primitive must match the loaded libmlx.
  m.attr("mlx_version") = std::to_string(MLX_VERSION_MAJOR) + "." +
      std::to_string(MLX_VERSION_MINOR) + "." + std::to_string(MLX_VERSION_PATCH);
}
