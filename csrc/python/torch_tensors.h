// Tensors between Python and C++ without linking torch (one build serves every torch): torch's C
// shim, the aoti_torch_* functions torch keeps ABI-stable across releases, looked up at run time in
// the libtorch that `import torch` loaded, and torch's own converters (torch._C._aoti), one call for
// all of an operation's tensors each way.
// - Outputs (NewTensors) come from torch's allocator (on CUDA its caching allocator, on the current
//   stream, as torch.empty would). A Python torch.empty costs several microseconds of argument
//   parsing per tensor; this costs well under one.
// - Arguments (TensorArguments) are read through the shim: address, dtype, device, sizes, strides,
//   with no Python call per tensor, and the operation's checks run only for a new kind of call.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <string>
#include <unordered_set>
#include <vector>

namespace uccl_ep {
namespace bindings {

// The dtypes the operations return; Python passes them as these integers (torch_tensors.py).
enum class TensorDtype : int32_t { kBool, kUint8, kInt32, kInt64, kFloat32, kBfloat16, kFloat8E4M3 };
enum class TensorDevice : int32_t { kCpu, kCuda };

int64_t element_bytes(TensorDtype dtype);
// Where the next view of a storage block starts after `bytes` of it: each view from a 128-byte boundary.
inline int64_t view_boundary(int64_t bytes) { return (bytes + 127) / 128 * 128; }

// Finds the shim in the libtorch at `libtorch_path` (already loaded) and keeps torch's converters:
// `to_tensors` from shim handles to tensors, `from_tensors` from tensors to new handles, and
// `tensor_type` (torch.Tensor). Throws, naming what is missing. `gpu_library_path` ("" without a GPU
// torch) is torch's GPU library, whose shim reads the current stream; `current_stream` (torch's Python
// reader of it, or None) serves where that library lacks the reader.
void use_torch_shim(const std::string& libtorch_path, const pybind11::object& to_tensors,
                    const pybind11::object& from_tensors, const pybind11::object& tensor_type,
                    const std::string& gpu_library_path, const pybind11::object& current_stream);
bool torch_shim_ready();

// torch's current stream of GPU `device` (what torch's own kernels launch on), with the GIL held. Throws
// where torch has no GPU.
void* current_gpu_stream(int device);

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
  // The same as `dtype` (as Tensor.view(dtype).as_strided): `offset` counts `dtype` elements, and a 1-D
  // entry's bytes must be a multiple of its size. Outputs of several dtypes then share one allocation.
  void* add_view(int entry, const std::vector<int64_t>& sizes, const std::vector<int64_t>& strides,
                 int64_t offset, TensorDtype dtype);
  // A 1-D block of `elements` that only the views of it made with add_view return: several outputs then cost
  // one allocation (a view costs a fraction of one, a view as another dtype half of one). Returns its entry.
  int add_storage(int64_t elements, TensorDtype dtype);
  void* data(int entry) const;  // the address of an entry (a storage block's too)
  int size() const { return count_; }
  // The tensors (None where add_none), in order, without the storage blocks; this object then holds none.
  pybind11::list release();

 private:
  void* push(void* handle, TensorDtype dtype);
  void drop_typed_base();

  TensorDevice device_;
  int device_index_;
  void* handles_[kMaxTensors] = {};  // null: None
  bool returned_[kMaxTensors] = {};  // false: a storage block
  TensorDtype dtypes_[kMaxTensors] = {};
  int count_ = 0;
  // The last entry viewed as another dtype, as that dtype (a handle this object owns), or none.
  void* typed_base_ = nullptr;
  int typed_base_entry_ = -1;
  TensorDtype typed_base_dtype_ = TensorDtype::kBool;
};

// A tensor argument as torch's shim describes it.
struct TensorArgument {
  static constexpr int kMaxDims = 8;
  bool present = false;      // else None
  void* data = nullptr;
  int32_t dtype = -1;        // TensorDtype; -1: one the operations never take
  int32_t device_type = -1;  // TensorDevice; -1: another device
  int32_t device_index = -1;
  int32_t dim = 0;           // sizes and strides hold the first kMaxDims
  int64_t sizes[kMaxDims] = {};
  int64_t strides[kMaxDims] = {};

  int64_t size(int d) const { return sizes[d]; }
  int64_t element_bytes() const;  // 0 when dtype is -1
  // Bytes of one row of a 2-D tensor (size(1) elements); 0 for None.
  int64_t row_bytes() const { return present ? sizes[1] * element_bytes() : 0; }
  std::uintptr_t address() const { return reinterpret_cast<std::uintptr_t>(data); }
};

// The signatures of calls whose arguments passed their operation's checks (bounded: cleared when full). A
// signature is a run of words; the last one that passed is compared first, as a serving loop repeats its calls.
class CheckedCalls {
 public:
  static constexpr size_t kMaxCalls = 1024;
  bool contains(const int64_t* words, int count) const;
  void add(const int64_t* words, int count);
  size_t size() const { return calls_.size(); }

 private:
  std::unordered_set<std::string> calls_;
  std::string last_;
};

// Borrowed Python objects given as an operation's arguments (a tuple's items, or a list of them): no tuple is
// built to pass them.
class ArgumentItems {
 public:
  static constexpr int kMaxItems = 12;
  ArgumentItems(const pybind11::tuple& items);  // NOLINT: a tuple is the usual form
  ArgumentItems(std::initializer_list<pybind11::handle> items);
  int size() const { return count_; }
  PyObject* operator[](int i) const { return items_[i]; }

 private:
  PyObject* items_[kMaxItems] = {};
  int count_ = 0;
};

// An operation's arguments as its checks see them: `tensors` holds Tensors and Nones in the operation's
// order, `values` the ints and bools the checks read besides. `check` (the binding's call of the operation's
// Python checks: they raise, naming a bad argument) runs first when a tensor item is neither a Tensor nor None
// or a value neither an int nor a bool, and else when the call's signature is not in `checked`: every tensor's
// presence, dtype, device, sizes and strides, and the values (a bool told apart from the int of its value). A
// call that passes is added, so a later call of the same kind costs no Python. What `check` raises propagates.
class TensorArguments {
 public:
  static constexpr int kMaxArguments = 12;
  static constexpr int kMaxValues = 8;

  TensorArguments(const ArgumentItems& tensors, const ArgumentItems& values, CheckedCalls& checked,
                  const std::function<void()>& check);
  const TensorArgument& operator[](int i) const { return arguments_[i]; }
  int size() const { return count_; }
  int64_t value(int i) const { return values_[i]; }

 private:
  // The most words a signature takes: per tensor its presence, dtype, device, index and dims, then each
  // dimension's size and stride; per value its kind and value.
  static constexpr int kMaxSignature = kMaxArguments * (5 + 2 * TensorArgument::kMaxDims) + 2 * kMaxValues;

  // Whether every item is what it must be; the values read; `present` the tensors, as a tuple.
  bool take(const ArgumentItems& tensors, const ArgumentItems& values, pybind11::object& present);
  void read(const pybind11::object& present);
  // Writes the call's signature into `words`; returns its length.
  int signature(int64_t* words) const;

  TensorArgument arguments_[kMaxArguments];
  int count_ = 0;
  int64_t values_[kMaxValues] = {};
  bool value_is_bool_[kMaxValues] = {};
  int num_values_ = 0;
  // torch's own dtype and device codes: in the signature, those the operations never take stay told apart.
  int32_t torch_dtypes_[kMaxArguments] = {};
  int32_t torch_devices_[kMaxArguments] = {};
  bool all_dims_kept_ = true;  // else the call is checked every time
};

}  // namespace bindings
}  // namespace uccl_ep
