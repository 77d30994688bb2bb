// What the files of the one extension module share: the checks of a weight's codes, the
// choice of a product's path, the CPU stream, and the functions that add codes_block.cpp's
// and decode_attention.cpp's operations to it.
#ifndef VELOXQUANT_EXTENSION_H
#define VELOXQUANT_EXTENSION_H

#include <string>

#include <nanobind/nanobind.h>

#include "mlx/array.h"
#include "mlx/utils.h"

namespace veloxquant {

// Empty when codes, scales and biases hold a weight of ``cols`` columns the kernel serves,
// else what is wrong with them.
std::string codes_problem(int cols, const mlx::core::array& codes,
                          const mlx::core::array& scales, const mlx::core::array& biases,
                          int bits, int group);

// float16 when both scales and biases are (GGUF's Q4_0, Q4_1, Q8_0 hold them so), else
// float32: the type an operation reads them in.
mlx::core::Dtype params_dtype(const mlx::core::array& scales, const mlx::core::array& biases);

// The codes kernel's path (codes_kernel.h's VQ_PATH_*) for a product of ``m`` rows: float32
// above ``float32_above`` rows (0: never) where it can run, else int8; ``portable`` picks
// what a CPU without AVX2 runs (the BLAS for float32, the plain C loop for int8).
int codes_path(int m, int float32_above, bool portable);

// The CPU stream ``s`` names; an invalid_argument saying ``op`` runs there only otherwise.
mlx::core::Stream cpu_stream(mlx::core::StreamOrDevice s, const char* op);

// Adds codes_block.cpp's operations (block_qkv, block_mlp) to the module.
void add_block_ops(nanobind::module_& m);

// Adds decode_attention.cpp's operation (decode_attention) to the module.
void add_attention_op(nanobind::module_& m);

}  // namespace veloxquant

#endif
