// specviz_rows::layer(x, number) and group(x, numbers): a compiled graph's packed linear layers, their kernel rule
// run in C++ (core/packing.py's ``_packs``), so a forward's two hundred layer calls pay no Python.
//
// Why: the Python operator (``specviz::packed_linear``) costs several microseconds a call around a product of
// tens; a 30-layer forward makes 120 to 200 of them.
//
// Rules:
// - A layer is registered once (``register_layer``: its dense weight, packed weight, bias and plain_rows) under the
//   number core/packing.py gave it, and dropped with its module (``drop_layer``, which drops its groups too).
// - A call with at most plain_rows rows (plain_rows > 0) or another dtype than the packed weight's runs the plain
//   product: the rows kernel where it fits (rows.cpp), else at::linear. Otherwise oneDNN's packed product.
// - ``group`` is the layers' products side by side along the last dimension, each column as its own layer's call
//   computes it: the plain path reads the separate weights (no stacked copy), the packed path one stacked packed
//   weight, made on its first packed call and kept while its layers are.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/linear.h>
#include <torch/library.h>

#include <algorithm>

#include <map>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <vector>

#include "rows.h"

namespace {
struct Layer {
  at::Tensor weight, packed;
  std::optional<at::Tensor> bias;
  int64_t plain_rows = 0;
};
struct Group {
  at::Tensor packed;
  std::optional<at::Tensor> bias;
};

std::mutex lock_;  // registrations come from Python threads; every call reads under it (uncontended: nanoseconds)
std::unordered_map<int64_t, Layer> layers_;
std::map<std::vector<int64_t>, Group> groups_;

Layer find(int64_t number) {
  auto it = layers_.find(number);
  TORCH_CHECK(it != layers_.end(), "specviz_rows: packed layer ", number, " is not registered");
  return it->second;
}

void register_layer(const at::Tensor& weight, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                    int64_t number, int64_t plain_rows) {
  std::lock_guard<std::mutex> hold(lock_);
  layers_[number] = Layer{weight, packed, bias, plain_rows};
}

void set_plain_rows(int64_t number, int64_t plain_rows) {
  std::lock_guard<std::mutex> hold(lock_);
  auto it = layers_.find(number);
  if (it != layers_.end()) it->second.plain_rows = plain_rows;
}

void drop_layer(int64_t number) {
  std::lock_guard<std::mutex> hold(lock_);
  layers_.erase(number);
  for (auto it = groups_.begin(); it != groups_.end();) {
    bool member = std::find(it->first.begin(), it->first.end(), number) != it->first.end();
    it = member ? groups_.erase(it) : std::next(it);
  }
}

int64_t registered() {
  std::lock_guard<std::mutex> hold(lock_);
  return static_cast<int64_t>(layers_.size());
}

bool plain(const at::Tensor& x, const Layer& first) {
  const int64_t rows = x.numel() / x.size(-1);
  return (first.plain_rows > 0 && rows <= first.plain_rows) || x.scalar_type() != first.packed.scalar_type();
}

bool rows_fit(const at::Tensor& x, const std::vector<Layer>& ls) {
  if (x.scalar_type() != at::kFloat || x.size(-1) % specviz_rows_width() != 0) return false;
  for (const Layer& l : ls)
    if (l.weight.scalar_type() != at::kFloat || !l.weight.is_contiguous()) return false;
  return true;
}

at::Tensor plain_product(const at::Tensor& x, const std::vector<Layer>& ls) {
  if (!rows_fit(x, ls)) {
    std::vector<at::Tensor> outs;
    for (const Layer& l : ls) outs.push_back(at::linear(x, l.weight, l.bias));
    return outs.size() == 1 ? outs[0] : at::cat(outs, -1);
  }
  std::vector<at::Tensor> ws;
  for (const Layer& l : ls) ws.push_back(l.weight);
  at::Tensor out = specviz_rows_product(x.reshape({-1, x.size(-1)}).contiguous(), ws);
  int64_t col = 0;
  for (const Layer& l : ls) {
    const int64_t n = l.weight.size(0);
    if (l.bias) out.narrow(1, col, n).add_(*l.bias);
    col += n;
  }
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
  shape.push_back(col);
  return out.view(shape);
}

at::Tensor packed_product(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, packed, bias ? c10::IValue(*bias) : c10::IValue(), std::string("none"),
                          c10::List<std::optional<at::Scalar>>(), c10::IValue(std::string(""))};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

at::Tensor pack(const at::Tensor& dense) {  // what core/packing.py's ``_pack`` makes
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_reorder_linear_weight", "");
  torch::jit::Stack stack{dense, c10::IValue(static_cast<int64_t>(64))};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

at::Tensor layer(const at::Tensor& x, int64_t number) {
  Layer l;
  {
    std::lock_guard<std::mutex> hold(lock_);
    l = find(number);
  }
  if (plain(x, l)) return plain_product(x, {l});
  return packed_product(x, l.packed, l.bias);
}

at::Tensor group(const at::Tensor& x, std::vector<int64_t> numbers) {
  std::vector<Layer> ls;
  std::optional<Group> g;
  {
    std::lock_guard<std::mutex> hold(lock_);
    for (int64_t n : numbers) ls.push_back(find(n));
    if (!plain(x, ls[0])) {
      auto it = groups_.find(numbers);
      if (it == groups_.end()) {
        std::vector<at::Tensor> ws, bs;
        for (const Layer& l : ls) {
          ws.push_back(l.weight);
          if (l.bias) bs.push_back(*l.bias);
        }
        Group made{pack(at::cat(ws)), bs.empty() ? std::nullopt : std::optional<at::Tensor>(at::cat(bs))};
        it = groups_.emplace(numbers, made).first;
      }
      g = it->second;
    }
  }
  if (!g) return plain_product(x, ls);
  return packed_product(x, g->packed, g->bias);
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(specviz_rows, m) {
  m.def("register_layer(Tensor weight, Tensor packed, Tensor? bias, int number, int plain_rows) -> ()");
  m.def("set_plain_rows(int number, int plain_rows) -> ()");
  m.def("drop_layer(int number) -> ()");
  m.def("registered() -> int");
  m.def("layer(Tensor x, int number) -> Tensor");
  m.def("group(Tensor x, int[] numbers) -> Tensor");
  m.impl("register_layer", c10::DispatchKey::CatchAll, TORCH_FN(register_layer));
  m.impl("set_plain_rows", c10::DispatchKey::CatchAll, TORCH_FN(set_plain_rows));
  m.impl("drop_layer", c10::DispatchKey::CatchAll, TORCH_FN(drop_layer));
  m.impl("registered", c10::DispatchKey::CatchAll, TORCH_FN(registered));
  m.impl("layer", c10::DispatchKey::CPU, TORCH_FN(layer));
  m.impl("group", c10::DispatchKey::CPU, TORCH_FN(group));
}
