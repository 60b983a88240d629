// Output tensors made from C++ by torch's own allocator: on CUDA its caching allocator, on the
// current stream, as torch.empty would. The extension links no torch (one build serves every
// torch): it calls torch's C shim, the aoti_torch_* functions torch keeps ABI-stable across
// releases, looked up at run time in the libtorch that `import torch` loaded, and hands the
// tensors to Python in one call of torch's own converter (torch._C._aoti). A Python
// torch.empty costs several microseconds of argument parsing per tensor; this costs well under one.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>
#include <vector>

namespace uccl_ep {
namespace bindings {

// The dtypes the operations return; Python passes them as these integers (torch_tensors.py).
enum class TensorDtype : int32_t { kBool, kUint8, kInt32, kInt64, kFloat32, kBfloat16, kFloat8E4M3 };
enum class TensorDevice : int32_t { kCpu, kCuda };

// Finds the shim in the libtorch at `libtorch_path` (already loaded) and keeps `to_tensors`, torch's
// converter from shim handles (a list of integers) to tensors. Throws, naming what is missing.
void use_torch_shim(const std::string& libtorch_path, const pybind11::object& to_tensors);
bool torch_shim_ready();

// The outputs of one call, in order; an entry may be None. Allocating needs no GIL; handing them to
// Python does. Tensors never handed over are freed with it.
class NewTensors {
 public:
  static constexpr int kMaxTensors = 12;
  static constexpr int kMaxDims = 4;

  NewTensors(TensorDevice device, int device_index);
  ~NewTensors();
  NewTensors(const NewTensors&) = delete;
  NewTensors& operator=(const NewTensors&) = delete;

  // A contiguous tensor, or with `strides` (as many as sizes) a strided one; returns its address.
  void* add(const std::vector<int64_t>& sizes, TensorDtype dtype, const std::vector<int64_t>& strides = {});
  void add_none();
  // `entry` viewed as `sizes` / `strides` from `offset` elements on (as Tensor.as_strided); returns its address.
  void* add_view(int entry, const std::vector<int64_t>& sizes, const std::vector<int64_t>& strides,
                 int64_t offset);
  int size() const { return count_; }
  // The tensors (None where add_none), in order; this object then holds none.
  pybind11::list release();

 private:
  void* push(void* handle);

  TensorDevice device_;
  int device_index_;
  void* handles_[kMaxTensors] = {};  // null: None
  int count_ = 0;
};

}  // namespace bindings
}  // namespace uccl_ep
