// CpuPrimitive: what the extension's operations share as MLX Primitives. Each runs on the
// CPU stream only, and two nodes of one operation are equivalent when their attributes
// (one comparable struct) are equal.
#ifndef VELOXQUANT_CPU_PRIMITIVE_H
#define VELOXQUANT_CPU_PRIMITIVE_H

#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"

namespace veloxquant {

template <class Attributes>
class CpuPrimitive : public mlx::core::Primitive {
 public:
  CpuPrimitive(mlx::core::Stream stream, Attributes attributes, const char* name)
      : mlx::core::Primitive(stream), s_(attributes), name_(name) {}

  void eval_gpu(const std::vector<mlx::core::array>&,
                std::vector<mlx::core::array>&) override {
    throw std::runtime_error(std::string(name_) + " runs on the CPU");
  }

  const char* name() const override { return name_; }

  // MLX compares only nodes of one primitive class.
  bool is_equivalent(const mlx::core::Primitive& other) const override {
    return s_ == static_cast<const CpuPrimitive&>(other).s_;
  }

 protected:
  // The stream's encoder with every input and output registered, the outputs allocated:
  // what eval_cpu does before it dispatches its work.
  mlx::core::cpu::CommandEncoder& encoder_for(const std::vector<mlx::core::array>& inputs,
                                              std::vector<mlx::core::array>& outputs) {
    auto& encoder = mlx::core::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) encoder.set_input_array(a);
    for (auto& out : outputs) {
      out.set_data(mlx::core::allocator::malloc(out.nbytes()));
      encoder.set_output_array(out);
    }
    return encoder;
  }

  Attributes s_;

 private:
  const char* name_;
};

}  // namespace veloxquant

#endif
