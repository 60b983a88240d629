// The pybind11 module uccl_ep_plugin._C. It links neither libtorch nor the Python side's
// tensor types: callers pass device pointers, sizes and the stream as plain integers.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "build_info.h"
#include "common/portability.h"
#include "channel/stress.h"
#include "python/arguments.h"
#include "python/torch_tensors.h"
#if defined(UCCL_EP_WITH_GPU)
#include "kernels/intranode.h"
#include "kernels/intranode_copy.h"
#include "kernels/layout.h"
#include "kernels/low_latency.h"
#endif

namespace py = pybind11;
void bind_transport(py::module_& m);  // bind_transport.cpp
void bind_proxy(py::module_& m);      // bind_proxy.cpp
void bind_rail(py::module_& m);       // bind_rail.cpp
#if defined(UCCL_EP_WITH_GPU)
void bind_low_latency(py::module_& m);  // bind_low_latency.cpp
void bind_normal(py::module_& m);       // bind_normal.cpp
#endif

namespace {

py::dict build_info_dict() {
  const uccl_ep::BuildInfo info = uccl_ep::get_build_info();
  py::dict out;
  out["version"] = info.version;
  out["cuda"] = info.cuda;
  out["cuda_runtime_version"] =
      info.cuda ? py::object(py::int_(info.cuda_runtime_version)) : py::object(py::none());
  out["cuda_archs"] = py::cast(info.cuda_archs);
  out["cuda_static_runtime"] = info.cuda;
  out["hip"] = info.hip;
  out["hip_archs"] = py::cast(info.hip_archs);
  out["verbs"] = info.verbs;
  out["features"] = py::cast(info.features);
  out["compiler"] = info.compiler;
  return out;
}

// Each value's bits in a number format, converted by `convert`.
template <typename Bits, Bits (*convert)(float)>
std::vector<Bits> bits_of_each(const std::vector<float>& values) {
  std::vector<Bits> bits;
  bits.reserve(values.size());
  for (float value : values) bits.push_back(convert(value));
  return bits;
}

py::dict stress_result_dict(const uccl_ep::ChannelStressResult& r) {
  py::dict out;
  out["expected"] = r.expected;
  out["pushed"] = r.pushed;
  out["popped"] = r.popped;
  out["lost"] = r.lost;
  out["out_of_order"] = r.out_of_order;
  out["torn"] = r.torn;
  out["capacity"] = r.capacity;
  out["num_fifos"] = r.num_fifos;
  out["seconds"] = r.seconds;
  return out;
}

py::dict channel_stress_host(uint32_t num_producers, uint64_t commands_per_producer, uint64_t capacity,
                             double timeout_s) {
  uccl_ep::ChannelStressResult result;
  {
    py::gil_scoped_release no_gil;
    result = uccl_ep::run_host_channel_stress(num_producers, commands_per_producer, capacity, timeout_s);
  }
  return stress_result_dict(result);
}

#if defined(UCCL_EP_WITH_GPU)
py::dict channel_stress_gpu(uint32_t num_fifos, uint32_t blocks_per_fifo, uint32_t threads_per_block,
                            uint64_t commands_per_thread, uint64_t capacity, double timeout_s) {
  uccl_ep::ChannelStressResult result;
  {
    py::gil_scoped_release no_gil;
    result = uccl_ep::run_gpu_channel_stress(num_fifos, blocks_per_fifo, threads_per_block, commands_per_thread,
                                             capacity, timeout_s);
  }
  return stress_result_dict(result);
}

py::dict channel_latency_gpu(int64_t iterations, int64_t capacity, double timeout_s) {
  uccl_ep::ChannelLatencyResult result;
  {
    py::gil_scoped_release no_gil;
    result = uccl_ep::run_gpu_channel_latency(iterations, capacity, timeout_s);
  }
  py::dict out = stress_result_dict(result.commands);
  out["warmup"] = result.warmup;
  out["iterations"] = result.iterations;
  out["round_trip_ns"] = py::cast(result.round_trip_ns);
  out["loop_ns"] = result.loop_ns;
  out["error"] = result.error.empty() ? py::object(py::none()) : py::object(py::str(result.error));
  return out;
}

template <typename T>
T* as_pointer(std::uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

void dispatch_layout(std::uintptr_t topk_idx_ptr, int64_t num_tokens, int64_t num_topk,
                     int64_t num_ranks, int64_t num_experts, std::uintptr_t num_tokens_per_rank_ptr,
                     std::uintptr_t num_tokens_per_expert_ptr, std::uintptr_t is_token_in_rank_ptr,
                     std::uintptr_t stream, int device) {
  // Argument errors surface as std::invalid_argument (ValueError) before any CUDA call,
  // launch errors as uccl_ep::GpuError (RuntimeError).
  py::gil_scoped_release no_gil;
  std::optional<uccl_ep::CurrentDevice> on_device;
  if (device >= 0) on_device.emplace(device);
  uccl_ep::launch_dispatch_layout(
      as_pointer<const int64_t>(topk_idx_ptr), num_tokens, num_topk, num_ranks, num_experts,
      as_pointer<int32_t>(num_tokens_per_rank_ptr), as_pointer<int32_t>(num_tokens_per_expert_ptr),
      as_pointer<bool>(is_token_in_rank_ptr), reinterpret_cast<uccl_ep::gpuStream_t>(stream));
}

// Buffer.get_dispatch_layout as one call: tensors (topk_idx,), values (num_experts,) read as every operation
// reads its arguments (torch_tensors.h: `check` runs only for a kind of call `checked` has not seen pass), the
// outputs allocated here on the current stream -> [num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank].
py::list get_dispatch_layout(const py::tuple& tensors, const py::tuple& values, int64_t num_ranks,
                             std::uintptr_t stream, int device, uccl_ep::bindings::CheckedCalls& checked,
                             const py::object& check) {
  using uccl_ep::bindings::TensorDtype;
  const uccl_ep::bindings::TensorArguments in(tensors, values, checked, [&check] { check(); });
  const uccl_ep::bindings::TensorArgument& topk_idx = in[0];
  const int64_t num_tokens = topk_idx.size(0), num_experts = in.value(0);
  uccl_ep::bindings::NewTensors outputs(uccl_ep::bindings::TensorDevice::kCuda, device);
  const std::uintptr_t per_rank = reinterpret_cast<std::uintptr_t>(outputs.add({num_ranks}, TensorDtype::kInt32));
  const std::uintptr_t per_expert = reinterpret_cast<std::uintptr_t>(outputs.add({num_experts}, TensorDtype::kInt32));
  const std::uintptr_t in_rank =
      reinterpret_cast<std::uintptr_t>(outputs.add({num_tokens, num_ranks}, TensorDtype::kBool));
  dispatch_layout(topk_idx.address(), num_tokens, topk_idx.size(1), num_ranks, num_experts, per_rank, per_expert,
                  in_rank, stream, device);
  return outputs.release();
}

void load_engine_kernels() {
  py::gil_scoped_release no_gil;
  uccl_ep::load_dispatch_layout_kernels();
  uccl_ep::load_normal_kernels();
  uccl_ep::load_normal_copy_kernels();
  uccl_ep::load_low_latency_kernels();
}
#endif

// Tensors made by the mechanism the operations use (torch_tensors.h), from Python's description: each
// entry None, (sizes, dtype, strides or None), a storage block that only its views return, (elements, dtype),
// or a view of an earlier entry, (entry, sizes, strides, offset) or as another dtype (..., offset, dtype).
py::list torch_shim_tensors(const py::list& entries, int32_t device_type, int device_index) {
  using uccl_ep::bindings::NewTensors;
  NewTensors tensors(static_cast<uccl_ep::bindings::TensorDevice>(device_type), device_index);
  if (static_cast<int>(entries.size()) > NewTensors::kMaxTensors) {
    throw std::invalid_argument("entries: at most " + std::to_string(NewTensors::kMaxTensors) + " tensors");
  }
  for (const py::handle entry : entries) {
    if (entry.is_none()) {
      tensors.add_none();
      continue;
    }
    const py::tuple spec = entry.cast<py::tuple>();
    if (spec.size() == 2) {
      tensors.add_storage(spec[0].cast<int64_t>(), static_cast<uccl_ep::bindings::TensorDtype>(spec[1].cast<int>()));
    } else if (py::isinstance<py::int_>(spec[0]) && spec.size() == 5) {
      tensors.add_view(spec[0].cast<int>(), spec[1].cast<std::vector<int64_t>>(),
                       spec[2].cast<std::vector<int64_t>>(), spec[3].cast<int64_t>(),
                       static_cast<uccl_ep::bindings::TensorDtype>(spec[4].cast<int>()));
    } else if (py::isinstance<py::int_>(spec[0])) {
      tensors.add_view(spec[0].cast<int>(), spec[1].cast<std::vector<int64_t>>(),
                       spec[2].cast<std::vector<int64_t>>(), spec[3].cast<int64_t>());
    } else {
      tensors.add(spec[0].cast<std::vector<int64_t>>(), static_cast<uccl_ep::bindings::TensorDtype>(spec[1].cast<int>()),
                  spec[2].is_none() ? std::vector<int64_t>{} : spec[2].cast<std::vector<int64_t>>());
    }
  }
  return tensors.release();
}

// Tensor arguments read the way the operations read theirs (torch_tensors.h): each None, or (address,
// dtype, device_type, device_index, sizes, strides) with the codes of torch_tensors.py (-1: another).
py::list torch_shim_arguments(const py::tuple& tensors, const py::tuple& values,
                              uccl_ep::bindings::CheckedCalls& checked, const py::object& check) {
  const uccl_ep::bindings::TensorArguments arguments(tensors, values, checked, [&check] { check(); });
  py::list described;
  for (int i = 0; i < arguments.size(); ++i) {
    const uccl_ep::bindings::TensorArgument& a = arguments[i];
    if (!a.present) {
      described.append(py::none());
      continue;
    }
    const int kept = a.dim < uccl_ep::bindings::TensorArgument::kMaxDims ? a.dim
                                                                          : uccl_ep::bindings::TensorArgument::kMaxDims;
    described.append(py::make_tuple(a.address(), a.dtype, a.device_type, a.device_index,
                                    std::vector<int64_t>(a.sizes, a.sizes + kept),
                                    std::vector<int64_t>(a.strides, a.strides + kept)));
  }
  return described;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "Native part of uccl_ep_plugin (no libtorch; raw device pointers as ints).";

  m.def("build_info", &build_info_dict,
        "Compile-time facts: version, cuda, cuda_runtime_version, cuda_archs, "
        "cuda_static_runtime, hip, hip_archs, verbs, features, compiler.");
  // The software number formats the HIP kernels use (portability.h), for tests against torch's.
  m.def("float_to_bf16_bits", &bits_of_each<uint16_t, uccl_ep::bf16_bits_from_float>, py::arg("values"),
        "bf16 bits of each value (round to nearest even), as the HIP kernels compute them.");
  m.def("float_to_fp8_e4m3_bits", &bits_of_each<uint8_t, uccl_ep::fp8_e4m3_bits_from_float>, py::arg("values"),
        "fp8 e4m3 (fn) bits of each value (round to nearest even, saturated to +-448), as the HIP kernels compute "
        "them.");
  bind_transport(m);
  bind_proxy(m);
  bind_rail(m);
  m.def("use_torch_shim", &uccl_ep::bindings::use_torch_shim, py::arg("libtorch_path"), py::arg("to_tensors"),
        py::arg("from_tensors"), py::arg("tensor_type"), py::arg("gpu_library_path") = "",
        py::arg("current_stream") = py::none(),
        "Let the extension allocate its outputs and read its tensor arguments with torch: find torch's C shim in "
        "the loaded libtorch at libtorch_path; to_tensors is torch._C._aoti.alloc_tensors_by_stealing_from_void_ptrs, "
        "from_tensors torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors, tensor_type torch.Tensor; "
        "gpu_library_path torch's GPU library (its shim reads the current stream), current_stream "
        "torch._C._cuda_getCurrentRawStream where that library lacks the reader. Once per process.");
  m.def("torch_shim_current_stream",
        [](int device) { return reinterpret_cast<std::uintptr_t>(uccl_ep::bindings::current_gpu_stream(device)); },
        py::arg("device"),
        "torch's current stream of GPU `device` as the operations read it (a handle, as "
        "torch.cuda.Stream.cuda_stream).");
  py::class_<uccl_ep::bindings::CheckedCalls>(
      m, "CheckedCalls", "The signatures of calls whose arguments passed their operation's checks (bounded).")
      .def(py::init<>())
      .def("__len__", &uccl_ep::bindings::CheckedCalls::size);
  m.def("torch_shim_arguments", &torch_shim_arguments, py::arg("tensors"), py::arg("values"), py::arg("checked"),
        py::arg("check"),
        "Tensor arguments read the way the operations read theirs: each None or (address, dtype, device_type, "
        "device_index, sizes, strides); check() runs when a tensor is not a tensor or None or a value not an int, or "
        "when the call's signature (the tensors' and the values) is not in checked yet.");
  m.def("torch_shim_tensors", &torch_shim_tensors, py::arg("entries"), py::arg("device_type"), py::arg("device_index"),
        "Tensors made the way the operations make their outputs: each entry None, (sizes, dtype, strides or None), "
        "a storage block only its views return, (elements, dtype), or a view of an earlier entry, (entry, sizes, "
        "strides, offset[, dtype]); dtype and device_type are the codes of "
        "uccl_ep_plugin.engines.native.torch_tensors.");

  m.def("channel_stress_host", &channel_stress_host, py::arg("num_producers"), py::arg("commands_per_producer"),
        py::arg("capacity"), py::arg("timeout_s"),
        "Host threads push numbered commands through one FIFO while this thread takes and checks them; "
        "returns counts of lost, out-of-order and torn commands and the elapsed seconds.");

#if defined(UCCL_EP_WITH_GPU)
  bind_low_latency(m);
  bind_normal(m);
  m.def(
      "copy_async",
      [](std::uintptr_t dst, std::uintptr_t src, int64_t bytes, std::uintptr_t stream) {
        using namespace uccl_ep::bindings;
        UCCL_EP_GPU_CHECK(uccl_ep::gpu_copy_async(ptr<void>(dst), ptr<const void>(src), non_negative("bytes", bytes),
                                                  as_stream(stream)));
      },
      py::arg("dst"), py::arg("src"), py::arg("bytes"), py::arg("stream"),
      "Queue a copy of `bytes` from address src to address dst (device memory, or a peer's mapped into this "
      "process) on `stream`: the copy engines' path over NVLink, which the bench's NVLink floor measures.");
  m.def("gpu_exports_dmabuf", &uccl_ep::gpu_exports_dmabuf, py::arg("device"),
        "Whether the GPU's driver exports its memory as DMA-BUF, the way the verbs transport registers GPU memory "
        "with a NIC first (else peer memory).");
  m.def("load_kernels", &load_engine_kernels,
        "Loads every kernel of the native engine into the current device's context now, so that no first "
        "launch (under CUDA's lazy module loading) waits behind kernels that spin on peers or the proxy.");
  m.def("channel_stress_gpu", &channel_stress_gpu, py::arg("num_fifos"), py::arg("blocks_per_fifo"),
        py::arg("threads_per_block"), py::arg("commands_per_thread"), py::arg("capacity"), py::arg("timeout_s"),
        "GPU threads push numbered commands into FIFOs in pinned mapped host memory, one checking host "
        "consumer per FIFO; same result dict as channel_stress_host.");
  m.def("channel_latency_gpu", &channel_latency_gpu, py::arg("iterations"), py::arg("capacity"),
        py::arg("timeout_s"),
        R"doc(Round trips through one FIFO in pinned mapped host memory on the current device: one GPU
thread pushes a command, the calling host thread takes it and stores an acknowledgement in mapped host
memory, the GPU thread times push-to-acknowledgement with its globaltimer. A fixed number of
warm-up round trips go first, untimed.

Returns the channel_stress_host dict for every command (warm-up included; seconds: the whole
run on the host clock) plus: warmup, iterations, round_trip_ns (a list of ints, one per timed
round trip completed, in order), loop_ns (GPU time of all timed round trips together, 0 unless
all completed) and error (None, or what the GPU waited for in vain; the whole run is bounded by
timeout_s). Statistics are left to the caller.

Raises ValueError naming the argument (iterations, capacity: a power of two, timeout_s) before
any GPU work, RuntimeError with the CUDA error text if a runtime call fails.)doc");
  m.attr("DISPATCH_LAYOUT_MAX_TOPK") = uccl_ep::kDispatchLayoutMaxTopk;
  m.attr("DISPATCH_LAYOUT_MAX_RANKS") = uccl_ep::kDispatchLayoutMaxRanks;
  m.def("get_dispatch_layout", &get_dispatch_layout, py::arg("tensors"), py::arg("values"), py::arg("num_ranks"),
        py::arg("stream"), py::arg("device"), py::arg("checked"), py::arg("check"),
        "Buffer.get_dispatch_layout in one call: tensors (topk_idx,), values (num_experts,); check (the Buffer's "
        "argument checks) runs only for a kind of call `checked` has not seen pass. -> [num_tokens_per_rank, "
        "num_tokens_per_expert, is_token_in_rank], allocated on the current stream, the layout queued on `stream`.");
  m.def("dispatch_layout", &dispatch_layout, py::arg("topk_idx_ptr"), py::arg("num_tokens"),
        py::arg("num_topk"), py::arg("num_ranks"), py::arg("num_experts"),
        py::arg("num_tokens_per_rank_ptr"), py::arg("num_tokens_per_expert_ptr"),
        py::arg("is_token_in_rank_ptr"), py::arg("stream"), py::arg("device") = -1,
        R"doc(Enqueue the dispatch layout on `stream` (a cudaStream_t as int; 0 is the
legacy default stream) of `device` (-1: the current device): one or two kernels named
dispatch_layout_*. Asynchronous; releases the GIL.

topk_idx_ptr: int64 [num_tokens, num_topk] contiguous, entries in [-1, num_experts).
num_tokens_per_rank_ptr: int32 [num_ranks]; num_tokens_per_expert_ptr: int32
[num_experts]; is_token_in_rank_ptr: bool [num_tokens, num_ranks] contiguous. All
outputs are fully overwritten. A token listing an expert twice counts twice for that
expert and once for its rank.

Raises ValueError naming the argument for bad sizes or pointers (before any CUDA
call) and RuntimeError with the CUDA error text if the launch fails.)doc");
#endif
}
