#include "python/torch_tensors.h"

#include <dlfcn.h>

#include <cstring>
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
using ViewDtype = TorchError (*)(void* self, int32_t dtype, void** new_tensor);
using DeleteTensor = TorchError (*)(void* tensor);
using GetDataPtr = TorchError (*)(void* tensor, void** data);
using GetInt64 = TorchError (*)(void* tensor, int64_t* value);
using GetInt32 = TorchError (*)(void* tensor, int32_t* value);
using GetInt64s = TorchError (*)(void* tensor, int64_t** values);
using GetStream = TorchError (*)(int32_t device_index, void** stream);
using Code = int32_t (*)();

struct TorchShim {
  EmptyStrided empty_strided = nullptr;
  Reinterpret reinterpret = nullptr;
  ViewDtype view_dtype = nullptr;
  DeleteTensor delete_tensor = nullptr;
  GetDataPtr data_ptr = nullptr;
  GetInt64 dim = nullptr;
  GetInt64s sizes = nullptr;
  GetInt64s strides = nullptr;
  GetInt32 dtype = nullptr;
  GetInt32 device_type = nullptr;
  GetInt32 device_index = nullptr;
  GetStream current_stream = nullptr;  // the GPU library's, where it has one
  int32_t dtypes[7] = {};   // by TensorDtype
  int32_t devices[2] = {};  // by TensorDevice
  // torch._C._aoti.alloc_tensors_by_stealing_from_void_ptrs and unsafe_alloc_void_ptrs_from_tensors,
  // torch.Tensor. Never destroyed: torch's module outlives us, and a static py::object's destructor
  // would run after the interpreter is gone.
  py::object* to_tensors = nullptr;
  py::object* from_tensors = nullptr;
  PyObject* tensor_type = nullptr;
  py::object* python_current_stream = nullptr;  // torch's Python reader, or None
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

constexpr int kElementBytes[7] = {1, 1, 4, 8, 4, 2, 1};  // by TensorDtype

int32_t code_of(int32_t raw, const int32_t* codes, int count) {
  for (int i = 0; i < count; ++i) {
    if (codes[i] == raw) return i;
  }
  return -1;
}

void* open_loaded(const std::string& path) {
  // The library is loaded already (by `import torch`): this finds it; it never loads a second copy.
  void* library = dlopen(path.c_str(), RTLD_NOW | RTLD_NOLOAD);
  if (library == nullptr) library = dlopen(path.c_str(), RTLD_NOW);
  if (library == nullptr) throw std::runtime_error("cannot open torch's library " + path + ": " + dlerror());
  return library;
}

}  // namespace

void use_torch_shim(const std::string& libtorch_path, const py::object& to_tensors, const py::object& from_tensors,
                    const py::object& tensor_type, const std::string& gpu_library_path,
                    const py::object& current_stream) {
  if (shim.to_tensors != nullptr) return;
  void* library = open_loaded(libtorch_path);
  TorchShim found;
  found.empty_strided = lookup<EmptyStrided>(library, "aoti_torch_empty_strided", libtorch_path);
  found.reinterpret = lookup<Reinterpret>(library, "aoti_torch__reinterpret_tensor", libtorch_path);
  // The per-device name is current; the plain one (deprecated since) is what older torch has. view.dtype is
  // one composite kernel for every device, so the CPU entry serves CUDA tensors too.
  found.view_dtype = dlsym(library, "aoti_torch_cpu_view_dtype") != nullptr
                         ? lookup<ViewDtype>(library, "aoti_torch_cpu_view_dtype", libtorch_path)
                         : lookup<ViewDtype>(library, "aoti_torch_view_dtype", libtorch_path);
  found.delete_tensor = lookup<DeleteTensor>(library, "aoti_torch_delete_tensor_object", libtorch_path);
  found.data_ptr = lookup<GetDataPtr>(library, "aoti_torch_get_data_ptr", libtorch_path);
  found.dim = lookup<GetInt64>(library, "aoti_torch_get_dim", libtorch_path);
  found.sizes = lookup<GetInt64s>(library, "aoti_torch_get_sizes", libtorch_path);
  found.strides = lookup<GetInt64s>(library, "aoti_torch_get_strides", libtorch_path);
  found.dtype = lookup<GetInt32>(library, "aoti_torch_get_dtype", libtorch_path);
  found.device_type = lookup<GetInt32>(library, "aoti_torch_get_device_type", libtorch_path);
  found.device_index = lookup<GetInt32>(library, "aoti_torch_get_device_index", libtorch_path);
  const char* dtype_names[] = {"aoti_torch_dtype_bool",    "aoti_torch_dtype_uint8",    "aoti_torch_dtype_int32",
                               "aoti_torch_dtype_int64",   "aoti_torch_dtype_float32",  "aoti_torch_dtype_bfloat16",
                               "aoti_torch_dtype_float8_e4m3fn"};
  for (int i = 0; i < 7; ++i) found.dtypes[i] = lookup<Code>(library, dtype_names[i], libtorch_path)();
  found.devices[static_cast<int>(TensorDevice::kCpu)] =
      lookup<Code>(library, "aoti_torch_device_type_cpu", libtorch_path)();
  found.devices[static_cast<int>(TensorDevice::kCuda)] =
      lookup<Code>(library, "aoti_torch_device_type_cuda", libtorch_path)();
  if (!gpu_library_path.empty()) {
    // A torch without it (an older one, or another GPU build) reads the stream in Python.
    found.current_stream = reinterpret_cast<GetStream>(
        dlsym(open_loaded(gpu_library_path), "aoti_torch_get_current_cuda_stream"));
  }
  found.to_tensors = new py::object(to_tensors);
  found.from_tensors = new py::object(from_tensors);
  found.tensor_type = tensor_type.inc_ref().ptr();
  found.python_current_stream = new py::object(current_stream);
  shim = found;
}

bool torch_shim_ready() { return shim.to_tensors != nullptr; }

void* current_gpu_stream(int device) {
  if (!torch_shim_ready()) throw std::logic_error("use_torch_shim was not called");
  void* stream = nullptr;
  if (shim.current_stream != nullptr) {
    check_torch(shim.current_stream(device, &stream), "read the current stream");
    return stream;
  }
  if (shim.python_current_stream->is_none()) throw std::runtime_error("this torch has no GPU streams");
  return reinterpret_cast<void*>((*shim.python_current_stream)(device).cast<std::uintptr_t>());
}

NewTensors::NewTensors(TensorDevice device, int device_index) : device_(device), device_index_(device_index) {
  if (!torch_shim_ready()) throw std::logic_error("use_torch_shim was not called");
}

NewTensors::~NewTensors() {
  for (int i = 0; i < count_; ++i) {
    if (handles_[i] != nullptr) shim.delete_tensor(handles_[i]);
  }
  drop_typed_base();
}

void NewTensors::drop_typed_base() {
  if (typed_base_ != nullptr) shim.delete_tensor(typed_base_);
  typed_base_ = nullptr;
  typed_base_entry_ = -1;
}

void* NewTensors::push(void* handle, TensorDtype dtype) {
  returned_[count_] = true;
  dtypes_[count_] = dtype;
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
  return push(handle, dtype);
}

void NewTensors::add_none() {
  if (count_ == kMaxTensors) throw std::logic_error("NewTensors::add_none: too many tensors");
  returned_[count_] = true;
  handles_[count_++] = nullptr;
}

int NewTensors::add_storage(int64_t elements, TensorDtype dtype) {
  add({elements}, dtype);
  returned_[count_ - 1] = false;
  return count_ - 1;
}

void* NewTensors::data(int entry) const {
  if (entry < 0 || entry >= count_ || handles_[entry] == nullptr) {
    throw std::logic_error("NewTensors::data: no such tensor");
  }
  void* data = nullptr;
  check_torch(shim.data_ptr(handles_[entry], &data), "read a new tensor's address");
  return data;
}

void* NewTensors::add_view(int entry, const std::vector<int64_t>& sizes, const std::vector<int64_t>& strides,
                           int64_t offset) {
  if (entry < 0 || entry >= count_) throw std::logic_error("NewTensors::add_view: no such tensor");
  return add_view(entry, sizes, strides, offset, dtypes_[entry]);
}

void* NewTensors::add_view(int entry, const std::vector<int64_t>& sizes, const std::vector<int64_t>& strides,
                           int64_t offset, TensorDtype dtype) {
  if (count_ == kMaxTensors || entry < 0 || entry >= count_ || handles_[entry] == nullptr ||
      sizes.size() != strides.size()) {
    throw std::logic_error("NewTensors::add_view: no such tensor, too many tensors, or strides that do not match");
  }
  void* base = handles_[entry];
  if (dtype != dtypes_[entry]) {
    // The entry as `dtype` (torch's view.dtype: its last dimension's bytes must divide), kept for the next
    // view of the same kind.
    if (typed_base_entry_ != entry || typed_base_dtype_ != dtype) {
      drop_typed_base();
      check_torch(shim.view_dtype(base, shim.dtypes[static_cast<int>(dtype)], &typed_base_),
                  "view an output block as another dtype");
      typed_base_entry_ = entry;
      typed_base_dtype_ = dtype;
    }
    base = typed_base_;
  }
  void* handle = nullptr;
  check_torch(shim.reinterpret(base, static_cast<int64_t>(sizes.size()), sizes.data(), strides.data(), offset, &handle),
              "view an output tensor");
  return push(handle, dtype);
}

py::list NewTensors::release() {
  drop_typed_base();
  py::list handles;
  bool present[kMaxTensors];
  const int count = count_;
  bool returned[kMaxTensors];
  for (int i = 0; i < count; ++i) {
    returned[i] = returned_[i];
    present[i] = handles_[i] != nullptr;
    if (!returned[i]) {
      shim.delete_tensor(handles_[i]);  // its views hold the memory
    } else if (present[i]) {
      handles.append(py::capsule(handles_[i]));
    }
    handles_[i] = nullptr;
  }
  count_ = 0;
  // The converter takes the handles over (it deletes them); should it fail halfway they leak rather
  // than being freed twice.
  const py::list tensors = (*shim.to_tensors)(handles);
  py::list out;
  int next = 0;
  for (int i = 0; i < count; ++i) {
    if (returned[i]) out.append(present[i] ? py::object(tensors[next++]) : py::object(py::none()));
  }
  return out;
}

int64_t element_bytes(TensorDtype dtype) { return kElementBytes[static_cast<int>(dtype)]; }

int64_t TensorArgument::element_bytes() const {
  return dtype < 0 ? 0 : bindings::element_bytes(static_cast<TensorDtype>(dtype));
}

bool CheckedCalls::contains(const int64_t* words, int count) const {
  const size_t bytes = count * sizeof(int64_t);
  if (last_.size() == bytes && std::memcmp(last_.data(), words, bytes) == 0) return true;
  return calls_.count(std::string(reinterpret_cast<const char*>(words), bytes)) != 0;
}

void CheckedCalls::add(const int64_t* words, int count) {
  if (calls_.size() >= kMaxCalls) calls_.clear();  // calls of ever new sizes: checked again
  last_.assign(reinterpret_cast<const char*>(words), count * sizeof(int64_t));
  calls_.insert(last_);
}

ArgumentItems::ArgumentItems(const py::tuple& items) : count_(static_cast<int>(items.size())) {
  if (count_ > kMaxItems) throw std::logic_error("ArgumentItems: more than " + std::to_string(kMaxItems) + " items");
  for (int i = 0; i < count_; ++i) items_[i] = PyTuple_GET_ITEM(items.ptr(), i);
}

ArgumentItems::ArgumentItems(std::initializer_list<py::handle> items) : count_(static_cast<int>(items.size())) {
  if (count_ > kMaxItems) throw std::logic_error("ArgumentItems: more than " + std::to_string(kMaxItems) + " items");
  int i = 0;
  for (const py::handle item : items) items_[i++] = item.ptr();
}

TensorArguments::TensorArguments(const ArgumentItems& tensors, const ArgumentItems& values, CheckedCalls& checked,
                                 const std::function<void()>& check) {
  if (!torch_shim_ready()) throw std::logic_error("use_torch_shim was not called");
  if (tensors.size() > kMaxArguments || values.size() > kMaxValues) {
    throw std::logic_error("TensorArguments: more than " + std::to_string(kMaxArguments) + " tensors or " +
                           std::to_string(kMaxValues) + " values");
  }
  py::object present;
  if (!take(tensors, values, present)) {
    check();  // raises, naming the argument
    throw py::type_error("an argument is not what its operation takes, and the checks let it pass");
  }
  read(present);
  if (!all_dims_kept_) {
    check();
    return;
  }
  int64_t words[kMaxSignature];
  const int count = signature(words);
  if (checked.contains(words, count)) return;
  check();
  checked.add(words, count);
}

bool TensorArguments::take(const ArgumentItems& tensors, const ArgumentItems& values, py::object& present) {
  count_ = tensors.size();
  bool taken = true;
  PyObject* found[kMaxArguments];
  int num_found = 0;
  for (int i = 0; i < count_; ++i) {
    PyObject* item = tensors[i];
    if (item == Py_None) continue;
    const int is_tensor = Py_TYPE(item) == reinterpret_cast<PyTypeObject*>(shim.tensor_type)
                              ? 1
                              : PyObject_IsInstance(item, shim.tensor_type);
    if (is_tensor < 0) throw py::error_already_set();
    if (is_tensor == 0) {
      taken = false;
      continue;
    }
    arguments_[i].present = true;
    found[num_found++] = item;
  }
  present = py::reinterpret_steal<py::object>(PyTuple_New(num_found));
  if (!present) throw py::error_already_set();
  for (int i = 0; i < num_found; ++i) {
    Py_INCREF(found[i]);
    PyTuple_SET_ITEM(present.ptr(), i, found[i]);
  }
  num_values_ = values.size();
  for (int i = 0; i < num_values_; ++i) {
    PyObject* item = values[i];
    value_is_bool_[i] = PyBool_Check(item);
    if (!PyLong_CheckExact(item) && !value_is_bool_[i]) {  // an int subclass, a float, None: checked each time
      taken = false;
      continue;
    }
    int overflow = 0;
    values_[i] = PyLong_AsLongLongAndOverflow(item, &overflow);
    if (overflow != 0) taken = false;
  }
  return taken;
}

void TensorArguments::read(const py::object& present) {
  if (PyTuple_GET_SIZE(present.ptr()) == 0) return;
  const py::list handles = (*shim.from_tensors)(present);
  // The handles are new references to the caller's tensors: read, then deleted whatever happens.
  void* owned[kMaxArguments] = {};
  const int count = static_cast<int>(handles.size());
  for (int i = 0; i < count; ++i) owned[i] = PyCapsule_GetPointer(handles[i].ptr(), nullptr);
  struct Release {
    void** handles;
    int count;
    ~Release() {
      for (int i = 0; i < count; ++i) {
        if (handles[i] != nullptr) shim.delete_tensor(handles[i]);
      }
    }
  } release{owned, count};
  if (PyErr_Occurred()) throw py::error_already_set();
  int next = 0;
  for (int i = 0; i < count_; ++i) {
    TensorArgument& a = arguments_[i];
    if (!a.present) continue;
    void* handle = owned[next++];
    int64_t dim = 0;
    int64_t* sizes = nullptr;
    int64_t* strides = nullptr;
    int32_t dtype = 0;
    int32_t device_type = 0;
    check_torch(shim.data_ptr(handle, &a.data) | shim.dim(handle, &dim) | shim.sizes(handle, &sizes) |
                    shim.strides(handle, &strides) | shim.dtype(handle, &dtype) |
                    shim.device_type(handle, &device_type) | shim.device_index(handle, &a.device_index),
                "describe a tensor argument");
    a.dim = static_cast<int32_t>(dim);
    all_dims_kept_ = all_dims_kept_ && dim <= TensorArgument::kMaxDims;
    const int kept = dim < TensorArgument::kMaxDims ? static_cast<int>(dim) : TensorArgument::kMaxDims;
    std::memcpy(a.sizes, sizes, kept * sizeof(int64_t));
    std::memcpy(a.strides, strides, kept * sizeof(int64_t));
    a.dtype = code_of(dtype, shim.dtypes, 7);
    a.device_type = code_of(device_type, shim.devices, 2);
    torch_dtypes_[i] = dtype;
    torch_devices_[i] = device_type;
  }
}

int TensorArguments::signature(int64_t* words) const {
  int count = 0;
  const auto put = [words, &count](int64_t value) { words[count++] = value; };
  for (int i = 0; i < count_; ++i) {
    const TensorArgument& a = arguments_[i];
    put(a.present ? 1 : 0);
    if (!a.present) continue;
    put(torch_dtypes_[i]);
    put(torch_devices_[i]);
    put(a.device_index);
    put(a.dim);
    for (int d = 0; d < a.dim; ++d) {
      put(a.sizes[d]);
      put(a.strides[d]);
    }
  }
  for (int i = 0; i < num_values_; ++i) {
    put(value_is_bool_[i] ? 1 : 0);
    put(values_[i]);
  }
  return count;
}

}  // namespace bindings
}  // namespace uccl_ep
