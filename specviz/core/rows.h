// What rows.cpp gives the other sources of the specviz_rows extension (layers.cpp).
#pragma once
#include <ATen/core/Tensor.h>

// x [M, K] @ (ws stacked along their rows)^T, fp32, contiguous, K a multiple of the vector width (rows.cpp)
at::Tensor specviz_rows_product(const at::Tensor& x, at::TensorList ws);

// the vector width in floats: an inner size must be a multiple of it
int64_t specviz_rows_width();
