// The one CUDA/HIP portability header of uccl_ep_plugin's native code.
//
// Host code may include it (it only needs the GPU runtime headers); the device helpers
// are compiled only by a GPU compiler (nvcc or hipcc). Everything defined here is used
// by some source under csrc/.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <stdexcept>
#include <string>

// HIP: hipcc compiling device code, or the host sources of a HIP build (setup.py defines UCCL_EP_WITH_HIP).
#if defined(__HIPCC__) || defined(UCCL_EP_WITH_HIP)
#define UCCL_EP_HIP 1
#endif

#if defined(__CUDACC__) || defined(__HIPCC__)
#define UCCL_EP_DEVICE_COMPILER 1
#define UCCL_EP_HOST_DEVICE __host__ __device__
#else
#define UCCL_EP_HOST_DEVICE
#endif

// The GPU runtime is there in GPU builds; CPU-only builds use only what does not need it
// (UCCL_EP_HOST_DEVICE, the host memory-order helpers).
#if defined(UCCL_EP_DEVICE_COMPILER) || defined(UCCL_EP_WITH_GPU)
#define UCCL_EP_GPU_RUNTIME 1
#if defined(UCCL_EP_HIP)
#include <hip/hip_runtime.h>
#else
#include <cuda.h>  // driver API types and enums only (its functions are looked up at run time)
#include <cuda_runtime.h>
#if defined(UCCL_EP_DEVICE_COMPILER)
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#endif
#endif
#endif

namespace uccl_ep {

// ---------------------------------------------------------------------------------------
// Host-side atomics on words that a GPU (or another host thread) also reads or writes.
// ---------------------------------------------------------------------------------------
inline uint64_t host_load_acquire(const uint64_t* addr) { return __atomic_load_n(addr, __ATOMIC_ACQUIRE); }
inline void host_store_release(uint64_t* addr, uint64_t value) { __atomic_store_n(addr, value, __ATOMIC_RELEASE); }
inline void host_store_relaxed(uint64_t* addr, uint64_t value) { __atomic_store_n(addr, value, __ATOMIC_RELAXED); }
inline uint64_t host_fetch_add_relaxed(uint64_t* addr, uint64_t value) {
  return __atomic_fetch_add(addr, value, __ATOMIC_RELAXED);
}

// ---------------------------------------------------------------------------------------
// Number formats in software (host and device), where a GPU's compiler has no conversion
// instruction for them (ROCm before fp8 support); CUDA's device code uses its intrinsics.
// ---------------------------------------------------------------------------------------
UCCL_EP_HOST_DEVICE inline uint32_t float_bits(float value) {
  uint32_t bits;
  __builtin_memcpy(&bits, &value, sizeof(bits));
  return bits;
}

UCCL_EP_HOST_DEVICE inline float float_from_bits(uint32_t bits) {
  float value;
  __builtin_memcpy(&value, &bits, sizeof(value));
  return value;
}

// bf16 bits of `value`, rounded to nearest even (NaN: the quiet NaN 0x7fc0 with its sign).
UCCL_EP_HOST_DEVICE inline uint16_t bf16_bits_from_float(float value) {
  const uint32_t bits = float_bits(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>(((bits >> 16) & 0x8000u) | 0x7fc0u);
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

// fp8 e4m3 (the OCP "fn" variant: no infinities, largest 448, NaN 0x7f) bits of `value`, rounded to
// nearest even and saturated to +-448 (as CUDA's __NV_SATFINITE).
UCCL_EP_HOST_DEVICE inline uint8_t fp8_e4m3_bits_from_float(float value) {
  const uint32_t bits = float_bits(value);
  const uint32_t sign = (bits >> 24) & 0x80u;
  const uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return static_cast<uint8_t>(sign | 0x7fu);
  if (magnitude < 0x3c800000u) {  // below 2^-6: a subnormal m * 2^-9 (m = 8 is the smallest normal)
    const float scaled = float_from_bits(magnitude) * 512.0f;
    uint32_t m = static_cast<uint32_t>(scaled);
    const float rest = scaled - static_cast<float>(m);
    if (rest > 0.5f || (rest == 0.5f && (m & 1u))) ++m;
    return static_cast<uint8_t>(sign | m);
  }
  if (magnitude >= 0x43e00000u) return static_cast<uint8_t>(sign | 0x7eu);  // 448 and above
  const uint32_t exponent = (magnitude >> 23) - 127 + 7;                     // 1..8 + 7
  uint32_t code = (exponent << 3) | ((magnitude >> 20) & 7u);
  const uint32_t dropped = magnitude & 0xfffffu;
  if (dropped > 0x80000u || (dropped == 0x80000u && (code & 1u))) ++code;
  return static_cast<uint8_t>(sign | (code > 0x7eu ? 0x7eu : code));
}

#if defined(UCCL_EP_GPU_RUNTIME)
// Where a pointer lives (gpu_pointer_kind): host memory (or memory the runtime does not know), a
// device's memory, or managed memory.
enum class GpuMemory { kHost, kDevice, kManaged };

// ---------------------------------------------------------------------------------------
// Runtime API names that differ between CUDA and HIP.
// ---------------------------------------------------------------------------------------
#if defined(UCCL_EP_HIP)
using gpuStream_t = hipStream_t;
using gpuEvent_t = hipEvent_t;
using gpuError_t = hipError_t;
constexpr gpuError_t kGpuSuccess = hipSuccess;
constexpr const char* kGpuApiName = "HIP";
inline gpuError_t gpu_last_error() { return hipGetLastError(); }
inline const char* gpu_error_name(gpuError_t err) { return hipGetErrorName(err); }
inline const char* gpu_error_string(gpuError_t err) { return hipGetErrorString(err); }
inline gpuError_t gpu_set_device(int device) { return hipSetDevice(device); }
inline gpuError_t gpu_get_device(int* device) { return hipGetDevice(device); }
inline gpuError_t gpu_multiprocessor_count(int* count, int device) {
  return hipDeviceGetAttribute(count, hipDeviceAttributeMultiprocessorCount, device);
}
inline gpuError_t gpu_stream_create_nonblocking(gpuStream_t* stream) {
  return hipStreamCreateWithFlags(stream, hipStreamNonBlocking);
}
inline gpuError_t gpu_stream_destroy(gpuStream_t stream) { return hipStreamDestroy(stream); }
inline gpuError_t gpu_event_create(gpuEvent_t* event) { return hipEventCreateWithFlags(event, hipEventDisableTiming); }
inline gpuError_t gpu_event_destroy(gpuEvent_t event) { return hipEventDestroy(event); }
inline gpuError_t gpu_event_record(gpuEvent_t event, gpuStream_t stream) { return hipEventRecord(event, stream); }
inline gpuError_t gpu_stream_wait_event(gpuStream_t stream, gpuEvent_t event) {
  return hipStreamWaitEvent(stream, event, 0);
}
// Between any two pointers of this process: device memory, a peer's IPC mapping, pinned host memory
// (the runtime tells them apart; a copy engine moves the bytes).
inline gpuError_t gpu_copy_async(void* dst, const void* src, size_t bytes, gpuStream_t stream) {
  return hipMemcpyAsync(dst, src, bytes, hipMemcpyDefault, stream);
}
inline gpuError_t gpu_relax_stream_capture() {
  hipStreamCaptureMode mode = hipStreamCaptureModeRelaxed;
  return hipThreadExchangeStreamCaptureMode(&mode);
}
inline gpuError_t gpu_host_free(void* pointer) { return hipHostFree(pointer); }
// Pinned host memory that kernels write through `device` (free with gpu_host_free(host)).
inline gpuError_t gpu_host_alloc_mapped(void** host, void** device, size_t bytes) {
  const gpuError_t status = hipHostMalloc(host, bytes, hipHostMallocMapped);
  return status != hipSuccess ? status : hipHostGetDevicePointer(device, *host, 0);
}
inline gpuError_t gpu_device_alloc(void** pointer, size_t bytes) { return hipMalloc(pointer, bytes); }
inline gpuError_t gpu_device_free(void* pointer) { return hipFree(pointer); }
inline gpuError_t gpu_memset(void* pointer, int value, size_t bytes) { return hipMemset(pointer, value, bytes); }
inline gpuError_t gpu_memset_async(void* pointer, int value, size_t bytes, gpuStream_t stream) {
  return hipMemsetAsync(pointer, value, bytes, stream);
}
inline gpuError_t gpu_stream_synchronize(gpuStream_t stream) { return hipStreamSynchronize(stream); }
inline gpuError_t gpu_device_synchronize() { return hipDeviceSynchronize(); }
inline gpuError_t gpu_device_count(int* count) { return hipGetDeviceCount(count); }
inline gpuError_t gpu_event_query(gpuEvent_t event) { return hipEventQuery(event); }
constexpr gpuError_t kGpuErrorNotReady = hipErrorNotReady;
// A blocking copy between any two pointers of this process (the runtime tells them apart).
inline gpuError_t gpu_copy(void* dst, const void* src, size_t bytes) {
  return hipMemcpy(dst, src, bytes, hipMemcpyDefault);
}
// Pinned host memory the copy engines read and write (free with gpu_host_free).
inline gpuError_t gpu_host_alloc(void** host, size_t bytes) { return hipHostMalloc(host, bytes, hipHostMallocDefault); }
inline gpuError_t gpu_device_pci_bus_id(char* id, int length, int device) {
  return hipDeviceGetPCIBusId(id, length, device);
}
inline gpuError_t gpu_pointer_kind(const void* pointer, GpuMemory* kind, int* device) {
  hipPointerAttribute_t attributes{};
  const gpuError_t status = hipPointerGetAttributes(&attributes, pointer);
  *kind = GpuMemory::kHost;
  *device = -1;
  if (status != hipSuccess) return status;
  if (attributes.isManaged) {
    *kind = GpuMemory::kManaged;
  } else if (attributes.memoryType == hipMemoryTypeDevice) {
    *kind = GpuMemory::kDevice;
    *device = attributes.device;
  }
  return status;
}
using gpuIpcMemHandle_t = hipIpcMemHandle_t;
inline gpuError_t gpu_ipc_get_handle(gpuIpcMemHandle_t* handle, void* pointer) {
  return hipIpcGetMemHandle(handle, pointer);
}
inline gpuError_t gpu_ipc_open_handle(void** pointer, gpuIpcMemHandle_t handle) {
  return hipIpcOpenMemHandle(pointer, handle, hipIpcMemLazyEnablePeerAccess);
}
inline gpuError_t gpu_ipc_close_handle(void* pointer) { return hipIpcCloseMemHandle(pointer); }
template <typename Kernel>
gpuError_t gpu_set_max_dynamic_shared(Kernel kernel, int bytes) {
  return hipFuncSetAttribute(reinterpret_cast<const void*>(kernel), hipFuncAttributeMaxDynamicSharedMemorySize, bytes);
}
// How many blocks of `kernel` (of `threads` threads, `shared` bytes of dynamic shared memory) one SM holds at once.
template <typename Kernel>
gpuError_t gpu_resident_blocks_per_sm(int* blocks, Kernel kernel, int threads, size_t shared) {
  return hipOccupancyMaxActiveBlocksPerMultiprocessor(blocks, reinterpret_cast<const void*>(kernel), threads, shared);
}
inline bool gpu_stream_waits_supported(int /*device*/) { return true; }
// `stream` stops until the device word reaches `value` (>=, for words that never wrap), with no
// kernel and no timeout: whoever gives up on the writer must raise the word itself.
inline gpuError_t gpu_stream_wait_at_least(gpuStream_t stream, uint64_t* word, uint64_t value) {
  return hipStreamWaitValue64(stream, word, value, hipStreamWaitValueGte, ~0ull);
}
inline gpuError_t gpu_stream_write_word(gpuStream_t stream, uint64_t* word, uint64_t value) {
  return hipStreamWriteValue64(stream, word, value, 0);
}
inline gpuError_t gpu_stream_capturing(gpuStream_t stream, bool* capturing) {
  hipStreamCaptureStatus status = hipStreamCaptureStatusNone;
  const gpuError_t error = hipStreamIsCapturing(stream, &status);
  *capturing = status != hipStreamCaptureStatusNone;
  return error;
}
// A NIC registers GPU memory here through peer memory (amdgpu's peer-memory client): no DMA-BUF
// export from this build, and the GPU sees a NIC's writes in order.
inline bool gpu_exports_dmabuf(int /*device*/) { return false; }
inline int gpu_dmabuf_fd(void* /*pointer*/, size_t /*bytes*/, int /*device*/, std::string* why) {
  *why = "this build (HIP) exports no DMA-BUF";
  return -1;
}
inline bool gpu_nic_writes_ordered(int /*device*/) { return true; }
inline gpuError_t gpu_flush_nic_writes() { return hipSuccess; }
inline gpuError_t gpu_load_kernel(const void* kernel) {
  hipFuncAttributes attributes;
  return hipFuncGetAttributes(&attributes, kernel);
}
#else
using gpuStream_t = cudaStream_t;
using gpuEvent_t = cudaEvent_t;
using gpuError_t = cudaError_t;
constexpr gpuError_t kGpuSuccess = cudaSuccess;
constexpr const char* kGpuApiName = "CUDA";
inline gpuError_t gpu_last_error() { return cudaGetLastError(); }
inline const char* gpu_error_name(gpuError_t err) { return cudaGetErrorName(err); }
inline const char* gpu_error_string(gpuError_t err) { return cudaGetErrorString(err); }
inline gpuError_t gpu_set_device(int device) { return cudaSetDevice(device); }
inline gpuError_t gpu_get_device(int* device) { return cudaGetDevice(device); }
inline gpuError_t gpu_multiprocessor_count(int* count, int device) {
  return cudaDeviceGetAttribute(count, cudaDevAttrMultiProcessorCount, device);
}
inline gpuError_t gpu_stream_create_nonblocking(gpuStream_t* stream) {
  return cudaStreamCreateWithFlags(stream, cudaStreamNonBlocking);
}
inline gpuError_t gpu_stream_destroy(gpuStream_t stream) { return cudaStreamDestroy(stream); }
inline gpuError_t gpu_event_create(gpuEvent_t* event) { return cudaEventCreateWithFlags(event, cudaEventDisableTiming); }
inline gpuError_t gpu_event_destroy(gpuEvent_t event) { return cudaEventDestroy(event); }
inline gpuError_t gpu_event_record(gpuEvent_t event, gpuStream_t stream) { return cudaEventRecord(event, stream); }
inline gpuError_t gpu_stream_wait_event(gpuStream_t stream, gpuEvent_t event) {
  return cudaStreamWaitEvent(stream, event, 0);
}
// Between any two pointers of this process: device memory, a peer's IPC mapping, pinned host memory
// (the runtime tells them apart; a copy engine moves the bytes).
inline gpuError_t gpu_copy_async(void* dst, const void* src, size_t bytes, gpuStream_t stream) {
  return cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream);
}
// Lets the calling thread (a proxy's) query events and copy while another thread captures a graph
// in the default global mode, which otherwise makes those calls fail and invalidates the capture.
inline gpuError_t gpu_relax_stream_capture() {
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  return cudaThreadExchangeStreamCaptureMode(&mode);
}
inline gpuError_t gpu_host_free(void* pointer) { return cudaFreeHost(pointer); }
// Pinned host memory that kernels write through `device` (free with gpu_host_free(host)).
inline gpuError_t gpu_host_alloc_mapped(void** host, void** device, size_t bytes) {
  const gpuError_t status = cudaHostAlloc(host, bytes, cudaHostAllocMapped);
  return status != cudaSuccess ? status : cudaHostGetDevicePointer(device, *host, 0);
}
inline gpuError_t gpu_device_alloc(void** pointer, size_t bytes) { return cudaMalloc(pointer, bytes); }
inline gpuError_t gpu_device_free(void* pointer) { return cudaFree(pointer); }
inline gpuError_t gpu_memset(void* pointer, int value, size_t bytes) { return cudaMemset(pointer, value, bytes); }
inline gpuError_t gpu_memset_async(void* pointer, int value, size_t bytes, gpuStream_t stream) {
  return cudaMemsetAsync(pointer, value, bytes, stream);
}
inline gpuError_t gpu_stream_synchronize(gpuStream_t stream) { return cudaStreamSynchronize(stream); }
inline gpuError_t gpu_device_synchronize() { return cudaDeviceSynchronize(); }
inline gpuError_t gpu_device_count(int* count) { return cudaGetDeviceCount(count); }
inline gpuError_t gpu_event_query(gpuEvent_t event) { return cudaEventQuery(event); }
constexpr gpuError_t kGpuErrorNotReady = cudaErrorNotReady;
// A blocking copy between any two pointers of this process (the runtime tells them apart).
inline gpuError_t gpu_copy(void* dst, const void* src, size_t bytes) {
  return cudaMemcpy(dst, src, bytes, cudaMemcpyDefault);
}
// Pinned host memory the copy engines read and write (free with gpu_host_free).
inline gpuError_t gpu_host_alloc(void** host, size_t bytes) { return cudaHostAlloc(host, bytes, cudaHostAllocDefault); }
inline gpuError_t gpu_device_pci_bus_id(char* id, int length, int device) {
  return cudaDeviceGetPCIBusId(id, length, device);
}
inline gpuError_t gpu_pointer_kind(const void* pointer, GpuMemory* kind, int* device) {
  cudaPointerAttributes attributes{};
  const gpuError_t status = cudaPointerGetAttributes(&attributes, pointer);
  *kind = GpuMemory::kHost;
  *device = -1;
  if (status != cudaSuccess) return status;
  if (attributes.type == cudaMemoryTypeManaged) {
    *kind = GpuMemory::kManaged;
  } else if (attributes.type == cudaMemoryTypeDevice) {
    *kind = GpuMemory::kDevice;
    *device = attributes.device;
  }
  return status;
}
using gpuIpcMemHandle_t = cudaIpcMemHandle_t;
inline gpuError_t gpu_ipc_get_handle(gpuIpcMemHandle_t* handle, void* pointer) {
  return cudaIpcGetMemHandle(handle, pointer);
}
inline gpuError_t gpu_ipc_open_handle(void** pointer, gpuIpcMemHandle_t handle) {
  return cudaIpcOpenMemHandle(pointer, handle, cudaIpcMemLazyEnablePeerAccess);
}
inline gpuError_t gpu_ipc_close_handle(void* pointer) { return cudaIpcCloseMemHandle(pointer); }
template <typename Kernel>
gpuError_t gpu_set_max_dynamic_shared(Kernel kernel, int bytes) {
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
}
template <typename Kernel>
gpuError_t gpu_resident_blocks_per_sm(int* blocks, Kernel kernel, int threads, size_t shared) {
  return cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks, kernel, threads, shared);
}
// Stream memory operations come from the driver API, looked up at run time: the extension links
// only the static runtime.
namespace detail {
template <typename Function>
Function driver_function(const char* name) {
  void* function = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  if (cudaGetDriverEntryPointByVersion(name, &function, 12000, cudaEnableDefault, &found) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  return reinterpret_cast<Function>(function);
}
inline int device_attribute(CUdevice_attribute attribute, int device) {
  using GetAttribute = CUresult (*)(int*, CUdevice_attribute, CUdevice);
  static const GetAttribute get = driver_function<GetAttribute>("cuDeviceGetAttribute");
  int value = 0;
  return get != nullptr && get(&value, attribute, device) == CUDA_SUCCESS ? value : 0;
}
}  // namespace detail
// Whether gpu_stream_wait_at_least works on `device` (64-bit stream waits).
inline bool gpu_stream_waits_supported(int device) {
  return detail::device_attribute(CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS, device) != 0;
}
// `stream` stops until the device word reaches `value` (>=, for words that never wrap), with no
// kernel and no timeout: whoever gives up on the writer must raise the word itself.
inline gpuError_t gpu_stream_wait_at_least(gpuStream_t stream, uint64_t* word, uint64_t value) {
  using WaitValue64 = CUresult (*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
  static const WaitValue64 wait = detail::driver_function<WaitValue64>("cuStreamWaitValue64");
  if (wait == nullptr) return cudaErrorNotSupported;
  return wait(stream, reinterpret_cast<CUdeviceptr>(word), value, CU_STREAM_WAIT_VALUE_GEQ) == CUDA_SUCCESS
             ? cudaSuccess
             : cudaErrorUnknown;
}
// `stream` writes `value` into the device word once the work before it is done (no kernel).
inline gpuError_t gpu_stream_write_word(gpuStream_t stream, uint64_t* word, uint64_t value) {
  using WriteValue64 = CUresult (*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
  static const WriteValue64 write = detail::driver_function<WriteValue64>("cuStreamWriteValue64");
  if (write == nullptr) return cudaErrorNotSupported;
  return write(stream, reinterpret_cast<CUdeviceptr>(word), value, CU_STREAM_WRITE_VALUE_DEFAULT) == CUDA_SUCCESS
             ? cudaSuccess
             : cudaErrorUnknown;
}
// A DMA-BUF file descriptor of the device memory [pointer, pointer + bytes) (both multiples of the
// host page size), for a NIC to register (ibv_reg_dmabuf_mr); the caller closes it. -1, and `why`,
// where the GPU or its driver export none (DMA-BUF needs CUDA 11.7+ and the open kernel modules).
inline bool gpu_exports_dmabuf(int device) {
  return detail::device_attribute(CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, device) != 0;
}
inline int gpu_dmabuf_fd(void* pointer, size_t bytes, int device, std::string* why) {
  if (!gpu_exports_dmabuf(device)) {
    *why = "the GPU driver does not export DMA-BUF (it needs CUDA 11.7+ with the open kernel modules)";
    return -1;
  }
  using GetHandle = CUresult (*)(void*, CUdeviceptr, size_t, CUmemRangeHandleType, unsigned long long);
  static const GetHandle get = detail::driver_function<GetHandle>("cuMemGetHandleForAddressRange");
  int fd = -1;
  const CUresult status = get == nullptr ? CUDA_ERROR_NOT_SUPPORTED
                                         : get(&fd, reinterpret_cast<CUdeviceptr>(pointer), bytes,
                                               CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0);
  if (status != CUDA_SUCCESS) {
    *why = "cuMemGetHandleForAddressRange failed (CUresult " + std::to_string(static_cast<int>(status)) + ")";
    return -1;
  }
  return fd;
}
// Whether the GPU sees a NIC's writes into its memory in the order the NIC made them; where it does
// not, gpu_flush_nic_writes must come between the data and the flag that announces it.
inline bool gpu_nic_writes_ordered(int device) {
  return detail::device_attribute(CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING, device) >=
         CU_GPU_DIRECT_RDMA_WRITES_ORDERING_OWNER;
}
// Makes the NIC writes into the current device's memory that have completed visible to its later work.
inline gpuError_t gpu_flush_nic_writes() {
  using Flush = CUresult (*)(CUflushGPUDirectRDMAWritesTarget, CUflushGPUDirectRDMAWritesScope);
  static const Flush flush = detail::driver_function<Flush>("cuFlushGPUDirectRDMAWrites");
  if (flush == nullptr) return cudaErrorNotSupported;
  return flush(CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX, CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_OWNER) ==
                 CUDA_SUCCESS
             ? cudaSuccess
             : cudaErrorUnknown;
}
// Whether work queued on `stream` now goes into a graph being captured rather than running.
inline gpuError_t gpu_stream_capturing(gpuStream_t stream, bool* capturing) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  const gpuError_t error = cudaStreamIsCapturing(stream, &status);
  *capturing = status != cudaStreamCaptureStatusNone;
  return error;
}
// Loads `kernel` into the current device's context now (see gpu_load_kernels).
inline gpuError_t gpu_load_kernel(const void* kernel) {
  cudaFuncAttributes attributes;
  return cudaFuncGetAttributes(&attributes, kernel);
}
#endif

// Several copies in stream order; they may run in any order among themselves. One call where the
// runtime has it (CUDA 13; 12.8's cudaMemcpyBatchAsync takes other arguments), else one after another.
inline gpuError_t gpu_copy_batch_async(void* const* dsts, const void* const* srcs, const size_t* sizes, size_t count,
                                       gpuStream_t stream) {
#if !defined(UCCL_EP_HIP) && CUDART_VERSION >= 13000
  if (count == 0) return kGpuSuccess;
  cudaMemcpyAttributes attributes{};
  attributes.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  size_t first_copy = 0;  // the attributes apply from the first copy on
  return cudaMemcpyBatchAsync(dsts, srcs, sizes, count, &attributes, &first_copy, 1, stream);
#else
  for (size_t i = 0; i < count; ++i) {
    const gpuError_t status = gpu_copy_async(dsts[i], srcs[i], sizes[i], stream);
    if (status != kGpuSuccess) return status;
  }
  return kGpuSuccess;
#endif
}

// Threads per warp (NVIDIA) or wavefront (AMD). AMD's compiler tells the device pass the
// wavefront size; the host pass assumes CDNA's 64.
#if defined(UCCL_EP_HIP)
#if defined(__AMDGCN_WAVEFRONT_SIZE)
constexpr int kWarpSize = __AMDGCN_WAVEFRONT_SIZE;
#else
constexpr int kWarpSize = 64;
#endif
#else
constexpr int kWarpSize = 32;
#endif

// ---------------------------------------------------------------------------------------
// Host error handling: a failed runtime call becomes a C++ exception that carries where it
// happened. It derives from std::runtime_error, so pybind11 turns it into RuntimeError.
// ---------------------------------------------------------------------------------------
class GpuError : public std::runtime_error {
 public:
  GpuError(gpuError_t code, const char* expr, const char* file, int line)
      : std::runtime_error(std::string(kGpuApiName) + " error " + gpu_error_name(code) + " (" +
                           std::to_string(static_cast<int>(code)) + "): " +
                           gpu_error_string(code) + " [" + expr + " at " + file + ":" +
                           std::to_string(line) + "]") {}
};

// Evaluates a runtime call (or an error value) and throws GpuError unless it succeeded.
#define UCCL_EP_GPU_CHECK(expr)                                              \
  do {                                                                       \
    const ::uccl_ep::gpuError_t uccl_ep_status_ = (expr);                    \
    if (uccl_ep_status_ != ::uccl_ep::kGpuSuccess) {                         \
      throw ::uccl_ep::GpuError(uccl_ep_status_, #expr, __FILE__, __LINE__); \
    }                                                                        \
  } while (0)

// Loads each of `kernels` into the current device's context now; throws GpuError if one cannot be.
// Under lazy module loading (CUDA's default) a kernel's first launch loads it, and a load may wait
// for every running kernel to finish. Our kernels spin on peers and on the CPU proxy, whose copies
// the runtime may hold behind such a load: a first launch then waits for the spinning kernel, which
// waits for it, until a timeout. So a module loads what it launches before its first kernel runs.
template <typename... Kernels>
void gpu_load_kernels(Kernels... kernels) {
  for (const void* kernel : {reinterpret_cast<const void*>(kernels)...}) UCCL_EP_GPU_CHECK(gpu_load_kernel(kernel));
}

// Makes `device` current for its lifetime and restores the caller's device after: a call from
// Python runs on whatever device the caller's thread has current, and must not change it.
class CurrentDevice {
 public:
  explicit CurrentDevice(int device) {
    UCCL_EP_GPU_CHECK(gpu_get_device(&previous_));
    if (previous_ != device) UCCL_EP_GPU_CHECK(gpu_set_device(device));
    changed_ = previous_ != device;
  }
  ~CurrentDevice() {
    if (changed_) (void)gpu_set_device(previous_);
  }
  CurrentDevice(const CurrentDevice&) = delete;
  CurrentDevice& operator=(const CurrentDevice&) = delete;

 private:
  int previous_ = 0;
  bool changed_ = false;
};

#endif  // UCCL_EP_GPU_RUNTIME

// ---------------------------------------------------------------------------------------
// Device helpers.
// ---------------------------------------------------------------------------------------
#if defined(UCCL_EP_DEVICE_COMPILER)

// Loads and stores on memory that the CPU (or a peer GPU) reads: system scope, so they are
// ordered with respect to the host's accesses to mapped pinned memory.
__device__ __forceinline__ uint64_t load_acquire_system(const uint64_t* addr) {
#if defined(UCCL_EP_HIP)
  return __hip_atomic_load(addr, __ATOMIC_ACQUIRE, __HIP_MEMORY_SCOPE_SYSTEM);
#else
  uint64_t value;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(addr) : "memory");
  return value;
#endif
}

__device__ __forceinline__ void store_release_system(uint64_t* addr, uint64_t value) {
#if defined(UCCL_EP_HIP)
  __hip_atomic_store(addr, value, __ATOMIC_RELEASE, __HIP_MEMORY_SCOPE_SYSTEM);
#else
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(addr), "l"(value) : "memory");
#endif
}

__device__ __forceinline__ void store_relaxed_system(uint64_t* addr, uint64_t value) {
#if defined(UCCL_EP_HIP)
  __hip_atomic_store(addr, value, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
#else
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(addr), "l"(value) : "memory");
#endif
}

__device__ __forceinline__ uint64_t load_relaxed_system(const uint64_t* addr) {
#if defined(UCCL_EP_HIP)
  return __hip_atomic_load(addr, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
#else
  uint64_t value;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(addr) : "memory");
  return value;
#endif
}

// Flags that another agent polls (a peer GPU, the CPU), in one of two styles chosen at run time by
// UCCL_EP_ENABLE_AGGRESSIVE_ATOMIC (`aggressive`; the platform config's default: on for AMD GPUs).
// Off: a release store publishes, every poll is an acquire load. On: relaxed stores and polls, with
// an explicit wait before the store (this thread's earlier writes complete first) and one acquire
// fence after the poll that saw the flag. UCCL-EP reports CDNA receivers that, polling with acquire
// loads, missed a producer's updates over XGMI and hung at scale; on CUDA both styles are correct and
// the default keeps the release/acquire pair.
__device__ __forceinline__ void publish_flag(uint64_t* addr, uint64_t value, bool aggressive) {
  if (!aggressive) {
    store_release_system(addr, value);
    return;
  }
#if defined(UCCL_EP_HIP)
  asm volatile("s_waitcnt vmcnt(0)" ::: "memory");
#else
  asm volatile("fence.acq_rel.sys;" ::: "memory");
#endif
  store_relaxed_system(addr, value);
}

__device__ __forceinline__ uint64_t poll_flag(const uint64_t* addr, bool aggressive) {
  return aggressive ? load_relaxed_system(addr) : load_acquire_system(addr);
}

// After poll_flag saw what it waited for: the writes the flag announced are visible from here on.
__device__ __forceinline__ void acquire_polled_flag(bool aggressive) {
  if (!aggressive) return;
#if defined(UCCL_EP_HIP)
  __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "");  // system scope
#else
  asm volatile("fence.acq_rel.sys;" ::: "memory");
#endif
}

// Nanoseconds of a device-wide clock (for deadlines, not for comparing with the host).
__device__ __forceinline__ uint64_t device_time_ns() {
#if defined(UCCL_EP_HIP)
  return __builtin_amdgcn_s_memrealtime() * 10;  // the 100 MHz constant clock of CDNA
#else
  uint64_t ns;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
  return ns;
#endif
}

__device__ __forceinline__ void device_pause() {
#if defined(UCCL_EP_HIP)
  __builtin_amdgcn_s_sleep(1);
#else
  __nanosleep(64);
#endif
}

__device__ __forceinline__ uint64_t fetch_add_device_relaxed(uint64_t* addr, uint64_t value) {
#if defined(UCCL_EP_HIP)
  return __hip_atomic_fetch_add(addr, value, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT);
#else
  return atomicAdd(reinterpret_cast<unsigned long long*>(addr), static_cast<unsigned long long>(value));
#endif
}

// Relaxed atomic add whose scope is the thread block: enough for shared-memory counters,
// and cheaper than device scope where the hardware distinguishes them.
__device__ __forceinline__ void atomic_add_block_relaxed(int* addr, int value) {
#if defined(UCCL_EP_HIP)
  __hip_atomic_fetch_add(addr, value, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_WORKGROUP);
#else
  atomicAdd_block(addr, value);
#endif
}

// Relaxed atomic add visible device-wide (global counters summed over thread blocks).
__device__ __forceinline__ void atomic_add_device_relaxed(int* addr, int value) {
#if defined(UCCL_EP_HIP)
  __hip_atomic_fetch_add(addr, value, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT);
#else
  atomicAdd(addr, value);
#endif
}

// Relaxed atomic OR on a word the thread block shares; returns the previous value.
__device__ __forceinline__ uint32_t atomic_or_block_relaxed(uint32_t* addr, uint32_t bits) {
#if defined(UCCL_EP_HIP)
  return __hip_atomic_fetch_or(addr, bits, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_WORKGROUP);
#else
  return atomicOr_block(addr, bits);
#endif
}

// Barrier among `num_threads` threads (whole warps) of the block that use barrier `id`
// (1..15; 0 is __syncthreads'), so independent warp groups of one block sync separately.
__device__ __forceinline__ void group_barrier(int id, int num_threads) {
#if defined(UCCL_EP_HIP)
  (void)id;
  (void)num_threads;
  __syncthreads();  // HIP has no named barriers: a block that needs them has one group there
#else
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(num_threads) : "memory");
#endif
}

// ---------------------------------------------------------------------------------------
// Whole-warp (NVIDIA, 32 lanes) or whole-wavefront (CDNA, 64 lanes) operations: every lane of
// the warp takes part. A lane mask has a bit per lane.
// ---------------------------------------------------------------------------------------
#if defined(UCCL_EP_HIP)
using LaneMask = uint64_t;
#else
using LaneMask = uint32_t;
#endif

__device__ __forceinline__ void warp_sync() {
#if defined(UCCL_EP_HIP)
  __builtin_amdgcn_wave_barrier();
#else
  __syncwarp();
#endif
}

// `value` as lane `lane` holds it.
template <typename T>
__device__ __forceinline__ T warp_shuffle(T value, int lane) {
#if defined(UCCL_EP_HIP)
  return __shfl(value, lane);
#else
  return __shfl_sync(0xffffffffu, value, lane);
#endif
}

// `value` as the lane `delta` below holds it (its own where there is none).
template <typename T>
__device__ __forceinline__ T warp_shuffle_up(T value, unsigned delta) {
#if defined(UCCL_EP_HIP)
  return __shfl_up(value, delta);
#else
  return __shfl_up_sync(0xffffffffu, value, delta);
#endif
}

// `value` as the lane whose index differs from this one's by the bits of `mask` holds it.
template <typename T>
__device__ __forceinline__ T warp_shuffle_xor(T value, int mask) {
#if defined(UCCL_EP_HIP)
  return __shfl_xor(value, mask);
#else
  return __shfl_xor_sync(0xffffffffu, value, mask);
#endif
}

__device__ __forceinline__ bool warp_all(bool predicate) {
#if defined(UCCL_EP_HIP)
  return __all(predicate) != 0;
#else
  return __all_sync(0xffffffffu, predicate) != 0;
#endif
}

// The lanes whose `predicate` holds.
__device__ __forceinline__ LaneMask warp_ballot(bool predicate) {
#if defined(UCCL_EP_HIP)
  return __ballot(predicate);
#else
  return __ballot_sync(0xffffffffu, predicate);
#endif
}

// The lowest lane in a non-empty mask.
__device__ __forceinline__ int lowest_lane(LaneMask mask) {
#if defined(UCCL_EP_HIP)
  return __ffsll(static_cast<unsigned long long>(mask)) - 1;
#else
  return __ffs(mask) - 1;
#endif
}

// A 32-bit word of two bf16 values (the first in the low half, as in memory) as floats.
__device__ __forceinline__ float2 bf16x2_to_float2(uint32_t pair) {
  return make_float2(float_from_bits(pair << 16), float_from_bits(pair & 0xffff0000u));
}

// Two floats as two bf16 values in one 32-bit word (rounded to nearest even; `lo` first).
__device__ __forceinline__ uint32_t float2_to_bf16x2(float lo, float hi) {
#if defined(UCCL_EP_HIP)
  return bf16_bits_from_float(lo) | (static_cast<uint32_t>(bf16_bits_from_float(hi)) << 16);
#else
  const __nv_bfloat162 pair = __floats2bfloat162_rn(lo, hi);
  uint32_t word;
  __builtin_memcpy(&word, &pair, sizeof(word));
  return word;
#endif
}

// Two floats as fp8 e4m3 in 16 bits (saturated to +-448, rounded to nearest even; `lo` first).
__device__ __forceinline__ uint16_t float2_to_fp8x2_e4m3(float lo, float hi) {
#if defined(UCCL_EP_HIP)
  return static_cast<uint16_t>(fp8_e4m3_bits_from_float(lo) | (fp8_e4m3_bits_from_float(hi) << 8));
#else
  return __nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3);
#endif
}

// A load that skips the SM's L1: for data a peer GPU (or the host) wrote into memory this GPU
// reads, after an acquire of the flag that announced it.
template <typename T>
__device__ __forceinline__ T load_l2(const T* addr) {
#if defined(UCCL_EP_HIP)
  return *addr;  // the acquire before it invalidated the CU's L1 already
#else
  return __ldcg(addr);
#endif
}

__device__ __forceinline__ int4 load_l2_16(const void* addr) { return load_l2(reinterpret_cast<const int4*>(addr)); }

// A byte another agent may change while this thread polls it.
__device__ __forceinline__ uint8_t load_volatile_u8(const uint8_t* addr) {
  return *reinterpret_cast<const volatile uint8_t*>(addr);
}

// Compare-and-swap visible to the host (mapped pinned memory); returns the old value.
__device__ __forceinline__ int32_t compare_and_swap_system(int32_t* addr, int32_t expected, int32_t desired) {
#if defined(UCCL_EP_HIP)
  __hip_atomic_compare_exchange_strong(addr, &expected, desired, __ATOMIC_RELAXED, __ATOMIC_RELAXED,
                                       __HIP_MEMORY_SCOPE_SYSTEM);
  return expected;
#else
  return atomicCAS_system(addr, expected, desired);
#endif
}

#endif  // UCCL_EP_DEVICE_COMPILER

}  // namespace uccl_ep
