// Facts fixed when the native extension was compiled.
#pragma once

#include <string>
#include <vector>

namespace uccl_ep {

struct BuildInfo {
  std::string version;                // package version the extension was built for
  bool cuda = false;                  // CUDA kernels compiled in (static cudart)
  int cuda_runtime_version = 0;       // CUDART_VERSION built against (e.g. 13000); 0 without CUDA
  std::vector<std::string> cuda_archs;  // SM architectures compiled, e.g. {"80", "90"}
  bool hip = false;                   // HIP kernels compiled in
  std::vector<std::string> hip_archs;  // AMD GPU architectures compiled, e.g. {"gfx90a", "gfx940"}
  bool verbs = false;                 // the RDMA verbs transport compiled in (rdma-core headers found)
  std::vector<std::string> features;  // native operations available, e.g. "dispatch_layout"
  std::string compiler;               // host C++ compiler that built this file
};

BuildInfo get_build_info();

}  // namespace uccl_ep
