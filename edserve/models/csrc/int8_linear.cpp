// fbgemm's dynamic int8 linear as one native op, for compiled CPU decode steps.
//
// edserve_int8::keep(packed) stores a prepacked weight (the ScriptObject an int8 linear holds)
// and returns its handle; edserve_int8::linear(x, handle, out_features) computes that linear
// (what quantized::linear_dynamic(x, packed, reduce_range=True) computes, bit for bit);
// edserve_int8::drop(handle) releases the weight. Built and loaded by
// edserve/models/int8_native.py; a graph's op call then costs a dispatcher call instead of a
// trip through a Python kernel.
#include <ATen/native/quantized/PackedParams.h>
#include <torch/library.h>

#include <mutex>
#include <vector>

namespace {

std::mutex table_mutex;
std::vector<c10::intrusive_ptr<LinearPackedParamsBase>> table;  // by handle; null: dropped

int64_t keep(const c10::intrusive_ptr<LinearPackedParamsBase>& packed) {
  std::lock_guard<std::mutex> lock(table_mutex);
  table.push_back(packed);
  return static_cast<int64_t>(table.size()) - 1;
}

c10::intrusive_ptr<LinearPackedParamsBase> lookup(int64_t handle) {
  std::lock_guard<std::mutex> lock(table_mutex);
  TORCH_CHECK(handle >= 0 && handle < static_cast<int64_t>(table.size()) && table[handle],
              "edserve_int8: no int8 linear with handle ", handle);
  return table[handle];
}

void drop(int64_t handle) {
  std::lock_guard<std::mutex> lock(table_mutex);
  if (handle >= 0 && handle < static_cast<int64_t>(table.size())) {
    table[handle].reset();
  }
}

at::Tensor linear(const at::Tensor& x, int64_t handle, int64_t out_features) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "edserve_int8::linear takes float32 input, got ",
              x.scalar_type());
  at::Tensor out = lookup(handle)->apply_dynamic(x, /*reduce_range=*/true);
  TORCH_CHECK(out.size(-1) == out_features, "edserve_int8::linear: handle ", handle, " has ",
              out.size(-1), " outputs, the caller expects ", out_features);
  return out;
}

}  // namespace

TORCH_LIBRARY(edserve_int8, m) {
  m.def("keep(__torch__.torch.classes.quantized.LinearPackedParamsBase packed) -> int", &keep);
  m.def("drop(int handle) -> ()", &drop);
  m.def("linear(Tensor x, int handle, int out_features) -> Tensor");
  m.impl("linear", c10::DispatchKey::CPU, TORCH_FN(linear));
}
