#include "python/torch_tensors.h"

#include <dlfcn.h>

#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;

namespace uccl_ep {
namespace bindings {

namespace {

// The shim's C signatures (torch/csrc/inductor/aoti_torch/c/shim.h): a nonzero int32 is an error;
// a tensor is an opaque heap handle the caller owns until it deletes or hands it on.
using TorchError = int32_t;
using EmptyStrided = TorchError (*)(int64_t ndim, const int64_t* sizes, const int64_t* strides, int32_t dtype,
                                    int32_t device_type, int32_t device_index, void** new_tensor);
using Reinterpret = TorchError (*)(void* self, int64_t ndim, const int64_t* sizes, const int64_t* strides,
                                   int64_t storage_offset, void** new_tensor);
using DeleteTensor = TorchError (*)(void* tensor);
using GetDataPtr = TorchError (*)(void* tensor, void** data);
using Code = int32_t (*)();

struct TorchShim {
  EmptyStrided empty_strided = nullptr;
  Reinterpret reinterpret = nullptr;
  DeleteTensor delete_tensor = nullptr;
  GetDataPtr data_ptr = nullptr;
  int32_t dtypes[7] = {};   // by TensorDtype
  int32_t devices[2] = {};  // by TensorDevice
  // torch._C._aoti.alloc_tensors_by_stealing_from_void_ptrs. Never destroyed: torch's module outlives us,
  // and a static py::object's destructor would run after the interpreter is gone.
  py::object* to_tensors = nullptr;
};

TorchShim shim;

template <typename T>
T lookup(void* library, const char* name, const std::string& path) {
  void* symbol = dlsym(library, name);
  if (symbol == nullptr) {
    throw std::runtime_error(std::string("torch's C shim has no ") + name + " in " + path +
                             " (this torch is too old for the native engine)");
  }
  return reinterpret_cast<T>(symbol);
}

int64_t row_major_stride(const int64_t* sizes, int ndim, int dim) {
  int64_t stride = 1;
  for (int d = dim + 1; d < ndim; ++d) stride *= sizes[d];
  return stride;
}

void check_torch(TorchError error, const char* what) {
  if (error != 0) {
    throw std::runtime_error(std::string("torch could not ") + what +
                             " (out of device memory? torch's own message is in its log above)");
  }
}

}  // namespace

void use_torch_shim(const std::string& libtorch_path, const py::object& to_tensors) {
  if (shim.to_tensors != nullptr) return;
  // The library is loaded already (by `import torch`): this finds it; it never loads a second copy.
  void* library = dlopen(libtorch_path.c_str(), RTLD_NOW | RTLD_NOLOAD);
  if (library == nullptr) library = dlopen(libtorch_path.c_str(), RTLD_NOW);
  if (library == nullptr) {
    throw std::runtime_error("cannot open torch's library " + libtorch_path + ": " + dlerror());
  }
  TorchShim found;
  found.empty_strided = lookup<EmptyStrided>(library, "aoti_torch_empty_strided", libtorch_path);
  found.reinterpret = lookup<Reinterpret>(library, "aoti_torch__reinterpret_tensor", libtorch_path);
  found.delete_tensor = lookup<DeleteTensor>(library, "aoti_torch_delete_tensor_object", libtorch_path);
  found.data_ptr = lookup<GetDataPtr>(library, "aoti_torch_get_data_ptr", libtorch_path);
  const char* dtype_names[] = {"aoti_torch_dtype_bool",    "aoti_torch_dtype_uint8",    "aoti_torch_dtype_int32",
                               "aoti_torch_dtype_int64",   "aoti_torch_dtype_float32",  "aoti_torch_dtype_bfloat16",
                               "aoti_torch_dtype_float8_e4m3fn"};
  for (int i = 0; i < 7; ++i) found.dtypes[i] = lookup<Code>(library, dtype_names[i], libtorch_path)();
  found.devices[static_cast<int>(TensorDevice::kCpu)] =
      lookup<Code>(library, "aoti_torch_device_type_cpu", libtorch_path)();
  found.devices[static_cast<int>(TensorDevice::kCuda)] =
      lookup<Code>(library, "aoti_torch_device_type_cuda", libtorch_path)();
  found.to_tensors = new py::object(to_tensors);
  shim = found;
}

bool torch_shim_ready() { return shim.to_tensors != nullptr; }

NewTensors::NewTensors(TensorDevice device, int device_index) : device_(device), device_index_(device_index) {
  if (!torch_shim_ready()) throw std::logic_error("use_torch_shim was not called");
}

NewTensors::~NewTensors() {
  for (int i = 0; i < count_; ++i) {
    if (handles_[i] != nullptr) shim.delete_tensor(handles_[i]);
  }
}

void* NewTensors::push(void* handle) {
  handles_[count_++] = handle;
  void* data = nullptr;
  check_torch(shim.data_ptr(handle, &data), "read a new tensor's address");
  return data;
}

void* NewTensors::add(const std::vector<int64_t>& sizes, TensorDtype dtype,
                      const std::vector<int64_t>& strides) {
  if (count_ == kMaxTensors || sizes.size() > kMaxDims || (strides.size() != 0 && strides.size() != sizes.size())) {
    throw std::logic_error("NewTensors::add: too many tensors or dimensions, or strides that do not match");
  }
  const int ndim = static_cast<int>(sizes.size());
  int64_t row_major[kMaxDims];
  for (int d = 0; d < ndim; ++d) row_major[d] = row_major_stride(sizes.data(), ndim, d);
  void* handle = nullptr;
  check_torch(shim.empty_strided(ndim, sizes.data(), strides.empty() ? row_major : strides.data(),
                                 shim.dtypes[static_cast<int>(dtype)], shim.devices[static_cast<int>(device_)],
                                 device_index_, &handle),
              "allocate an output tensor");
  return push(handle);
}

void NewTensors::add_none() {
  if (count_ == kMaxTensors) throw std::logic_error("NewTensors::add_none: too many tensors");
  handles_[count_++] = nullptr;
}

void* NewTensors::add_view(int entry, const std::vector<int64_t>& sizes, const std::vector<int64_t>& strides,
                           int64_t offset) {
  if (count_ == kMaxTensors || entry < 0 || entry >= count_ || handles_[entry] == nullptr ||
      sizes.size() != strides.size()) {
    throw std::logic_error("NewTensors::add_view: no such tensor, too many tensors, or strides that do not match");
  }
  void* handle = nullptr;
  check_torch(shim.reinterpret(handles_[entry], static_cast<int64_t>(sizes.size()), sizes.data(), strides.data(),
                               offset, &handle),
              "view an output tensor");
  return push(handle);
}

py::list NewTensors::release() {
  py::list handles;
  bool present[kMaxTensors];
  const int count = count_;
  for (int i = 0; i < count; ++i) {
    present[i] = handles_[i] != nullptr;
    if (present[i]) handles.append(py::capsule(handles_[i]));
    handles_[i] = nullptr;
  }
  count_ = 0;
  // The converter takes the handles over (it deletes them); should it fail halfway they leak rather
  // than being freed twice.
  const py::list tensors = (*shim.to_tensors)(handles);
  py::list out;
  int next = 0;
  for (int i = 0; i < count; ++i) out.append(present[i] ? py::object(tensors[next++]) : py::object(py::none()));
  return out;
}

}  // namespace bindings
}  // namespace uccl_ep
