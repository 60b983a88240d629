// The one-thread kernels of device_region_ops.h.
#include "transport/device_region_ops.h"

namespace uccl_ep {

namespace {

__global__ void atomic_add_system_kernel(unsigned long long* target, unsigned long long value) {
  atomicAdd_system(target, value);
}

__global__ void store_release_system_kernel(uint64_t* target, uint64_t value) { store_release_system(target, value); }

}  // namespace

void load_region_ops_kernels() {
  gpu_load_kernels(atomic_add_system_kernel, store_release_system_kernel);
}

gpuError_t launch_atomic_add_system(void* target, int64_t value, gpuStream_t stream) {
  // Two's complement: adding the value as unsigned is the signed add.
  atomic_add_system_kernel<<<1, 1, 0, stream>>>(static_cast<unsigned long long*>(target),
                                                static_cast<unsigned long long>(value));
  return gpu_last_error();
}

gpuError_t launch_store_release_system(void* target, int64_t value, gpuStream_t stream) {
  store_release_system_kernel<<<1, 1, 0, stream>>>(static_cast<uint64_t*>(target), static_cast<uint64_t>(value));
  return gpu_last_error();
}

}  // namespace uccl_ep
