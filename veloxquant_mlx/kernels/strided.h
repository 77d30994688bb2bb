// Strided: an MLX array's elements as they lie at encoding time, gathered into row order
// on demand. Shared by the operations of this folder (codes_matmul.cpp, codes_block.cpp).
#ifndef VELOXQUANT_STRIDED_H
#define VELOXQUANT_STRIDED_H

#include <array>
#include <cstring>
#include <vector>

#include "mlx/array.h"

namespace veloxquant {

namespace mx = mlx::core;

// An input of the product as it is at encoding time: where its elements are, in what
// order. No input is wrapped in a Contiguous node (one each would be four of a product's
// five nodes, in every decode step); an input that is a view (a sliced last column, a
// transpose) is gathered into row-major order when the product runs.
struct Strided {
  static constexpr int kMaxDims = 8;  // codes_matmul refuses more (check_inputs)
  const char* data;
  int nd;
  std::array<int, kMaxDims> shape{};
  std::array<int64_t, kMaxDims> strides{};  // in elements
  size_t itemsize;
  bool contiguous;

  explicit Strided(const mx::array& a)
      : data(a.data<char>()),
        nd(static_cast<int>(a.ndim())),
        itemsize(a.itemsize()),
        contiguous(a.flags().row_contiguous) {
    for (int d = 0; d < nd; d++) shape[d] = a.shape(d), strides[d] = a.strides()[d];
  }

  // The elements in row-major order: the data itself, or a copy gathered into ``copy``
  // a row (the last axis) at a time.
  const void* packed(std::vector<char>& copy) const {
    if (contiguous || nd == 0) return data;
    size_t cols = shape[nd - 1], rows = 1, row_bytes = cols * itemsize;
    int64_t step = strides[nd - 1];
    for (int d = 0; d < nd - 1; d++) rows *= shape[d];
    copy.resize(rows * row_bytes);
    std::array<int, kMaxDims> at{};
    char* dst = copy.data();
    for (size_t r = 0; r < rows; r++, dst += row_bytes) {
      int64_t offset = 0;
      for (int d = 0; d < nd - 1; d++) offset += at[d] * strides[d];
      const char* row = data + offset * static_cast<int64_t>(itemsize);
      if (step == 1)
        std::memcpy(dst, row, row_bytes);
      else
        for (size_t j = 0; j < cols; j++)
          std::memcpy(dst + j * itemsize, row + j * step * itemsize, itemsize);
      for (int d = nd - 2; d >= 0 && ++at[d] == shape[d]; d--) at[d] = 0;
    }
    return copy.data();
  }
};

}  // namespace veloxquant

#endif
