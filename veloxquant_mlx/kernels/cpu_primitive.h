// CpuPrimitive: what the extension's operations share as MLX Primitives. Each runs on the
// CPU stream only, and two nodes of one operation are equivalent when their attributes
// (one comparable struct) are equal.
#ifndef VELOXQUANT_CPU_PRIMITIVE_H
#define VELOXQUANT_CPU_PRIMITIVE_H

#include <stdexcept>
#include <string>
#include <vector>

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
  Attributes s_;

 private:
  const char* name_;
};

}  // namespace veloxquant

#endif
