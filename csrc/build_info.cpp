#include "build_info.h"

#if defined(UCCL_EP_WITH_GPU)
#include "common/portability.h"
#endif

// setup.py passes these; the fallbacks keep a hand-made build compiling.
#ifndef UCCL_EP_VERSION
#define UCCL_EP_VERSION "unknown"
#endif
#ifndef UCCL_EP_CUDA_ARCH_LIST
#define UCCL_EP_CUDA_ARCH_LIST ""
#endif
#ifndef UCCL_EP_HIP_ARCH_LIST
#define UCCL_EP_HIP_ARCH_LIST ""
#endif

namespace uccl_ep {
namespace {

std::vector<std::string> split_commas(const std::string& text) {
  std::vector<std::string> parts;
  std::string current;
  for (char c : text) {
    if (c == ',') {
      if (!current.empty()) parts.push_back(current);
      current.clear();
    } else if (c != ' ') {
      current.push_back(c);
    }
  }
  if (!current.empty()) parts.push_back(current);
  return parts;
}

std::string compiler_name() {
#if defined(__clang__)
  return std::string("clang ") + __clang_version__;
#elif defined(__GNUC__)
  return std::string("gcc ") + __VERSION__;
#else
  return "unknown";
#endif
}

}  // namespace

BuildInfo get_build_info() {
  BuildInfo info;
  info.version = UCCL_EP_VERSION;
#if defined(UCCL_EP_WITH_CUDA)
  info.cuda = true;
  info.cuda_runtime_version = CUDART_VERSION;
#endif
  info.cuda_archs = split_commas(UCCL_EP_CUDA_ARCH_LIST);  // "" without CUDA
#if defined(UCCL_EP_WITH_HIP)
  info.hip = true;
#endif
  info.hip_archs = split_commas(UCCL_EP_HIP_ARCH_LIST);  // "" without HIP
#if defined(UCCL_EP_WITH_VERBS)
  info.verbs = true;
  info.features.push_back("verbs_transport");
#endif
#if defined(UCCL_EP_WITH_GPU)
  info.features.push_back("dispatch_layout");
  info.features.push_back("gpu_channel");
  info.features.push_back("low_latency_nvlink");
  info.features.push_back("cuda_copy_transport");
  info.features.push_back("tcp_device_memory");
  info.features.push_back("normal_nvlink");
  info.features.push_back("device_rail");
#endif
  info.features.push_back("host_channel");
  info.features.push_back("tcp_transport");
  info.features.push_back("proxy");
  info.compiler = compiler_name();
  return info;
}

}  // namespace uccl_ep
