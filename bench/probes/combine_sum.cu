// Probe: how fast can a few SMs sum two bf16 row sets, as the normal-mode combine does at EP2 (each token's
// row from this rank and from its peer), and copy one (the dispatch's gather)? One GPU, no library code: the
// kernels here copy the library's loop shapes. Every variant's output is checked bit for bit against a host
// reference (exit status 1 on a mismatch). The inputs are multiples of 1/256, so their sums are exact: the check
// catches rows missed or misplaced, not rounding (the library's GPU tests compare that with the reference engine).
// Results and the choice they led to: docs/KERNEL_NOTES.md ("Combine sums").
//   nvcc -O3 -std=c++17 -gencode arch=compute_90,code=sm_90 bench/probes/combine_sum.cu -o combine_sum && ./combine_sum
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <algorithm>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <vector>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e)); exit(1); } } while (0)

__device__ __forceinline__ int4 ld_cg(const void* p) {
  int4 v;
  asm volatile("ld.global.cg.v4.s32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ void add8(float (&s)[8], int4 v) {
  const auto* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) { float2 f = __bfloat1622float2(h[i]); s[2 * i] += f.x; s[2 * i + 1] += f.y; }
}
__device__ __forceinline__ int4 pack8(const float (&s)[8]) {
  int4 p; auto* o = reinterpret_cast<__nv_bfloat162*>(&p);
#pragma unroll
  for (int i = 0; i < 4; ++i) o[i] = __floats2bfloat162_rn(s[2 * i], s[2 * i + 1]);
  return p;
}

struct Args {
  const uint8_t* src[2];   // rows of source 0 and 1
  const int32_t* pos;      // [tokens, 2]
  const bool* in_rank;     // [tokens, 2]
  uint8_t* out;
  int64_t tokens;
  int hidden;
};

// Each warp of the grid takes tokens t = its index, + the grid's warps, ...: body(t, lane, vectors, row_bytes).
template <int THREADS, typename Body>
__device__ __forceinline__ void for_each_token(const Args& a, Body body) {
  const int64_t warps = int64_t(gridDim.x) * (THREADS / 32);
  const int64_t vectors = a.hidden / 8, row_bytes = int64_t(a.hidden) * 2;
  for (int64_t t = blockIdx.x * (THREADS / 32) + threadIdx.x / 32; t < a.tokens; t += warps) {
    body(t, int(threadIdx.x % 32), vectors, row_bytes);
  }
}

// The shape before 2026-11-23: a warp per token, one row at a time, UNROLL vectors per lane in flight.
template <int THREADS, int UNROLL>
__global__ void __launch_bounds__(THREADS, 1) sum_regs(Args a) {
  for_each_token<THREADS>(a, [&](int64_t t, int lane, int64_t vectors, int64_t row_bytes) {
    const bool* in = a.in_rank + t * 2; const int32_t* pos = a.pos + t * 2;
    for (int64_t v0 = lane; v0 < vectors; v0 += UNROLL * 32) {
      float s[UNROLL][8] = {};
      for (int d = 0; d < 2; ++d) {
        if (!in[d]) continue;
        const uint8_t* row = a.src[d] + pos[d] * row_bytes;
        int4 v[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) if (v0 + u * 32 < vectors) v[u] = ld_cg(row + (v0 + u * 32) * 16);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) if (v0 + u * 32 < vectors) add8(s[u], v[u]);
      }
#pragma unroll
      for (int u = 0; u < UNROLL; ++u)
        if (v0 + u * 32 < vectors) reinterpret_cast<int4*>(a.out + t * row_bytes)[v0 + u * 32] = pack8(s[u]);
    }
  });
}

// Per lane, UNROLL vectors of two rows (either may be null), every load issued before any use.
template <int UNROLL>
__device__ __forceinline__ void load_two_rows(int4 (&v)[2][UNROLL], const uint8_t* r0, const uint8_t* r1, int64_t v0,
                                              int64_t vectors) {
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) {
    const bool ok = v0 + u * 32 < vectors;
    if (ok && r0) v[0][u] = ld_cg(r0 + (v0 + u * 32) * 16);
    if (ok && r1) v[1][u] = ld_cg(r1 + (v0 + u * 32) * 16);
  }
}

// Both sources' loads issued before any add (one source's loads no longer wait on the other's adds).
template <int THREADS, int UNROLL>
__global__ void __launch_bounds__(THREADS, 1) sum_regs_both(Args a) {
  for_each_token<THREADS>(a, [&](int64_t t, int lane, int64_t vectors, int64_t row_bytes) {
    const bool* in = a.in_rank + t * 2; const int32_t* pos = a.pos + t * 2;
    const uint8_t* r0 = in[0] ? a.src[0] + pos[0] * row_bytes : nullptr;
    const uint8_t* r1 = in[1] ? a.src[1] + pos[1] * row_bytes : nullptr;
    for (int64_t v0 = lane; v0 < vectors; v0 += UNROLL * 32) {
      int4 v[2][UNROLL];
      load_two_rows<UNROLL>(v, r0, r1, v0, vectors);
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        if (v0 + u * 32 >= vectors) continue;
        float s[8] = {};
        if (r0) add8(s, v[0][u]);
        if (r1) add8(s, v[1][u]);
        reinterpret_cast<int4*>(a.out + t * row_bytes)[v0 + u * 32] = pack8(s);
      }
    }
  });
}

// Bulk copies (TMA, 1-D) of each token's piece from both sources into a warp's shared-memory stages,
// STAGES deep, completing on an mbarrier per stage; the warp sums from shared memory.
__device__ __forceinline__ uint32_t smem_addr(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void mbar_init(uint64_t* b) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(smem_addr(b)));
}
__device__ __forceinline__ void mbar_expect(uint64_t* b, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(smem_addr(b)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* b) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               :: "r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(b)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* b, uint32_t parity) {
  asm volatile("{\n .reg .pred p;\n W: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra W;\n}"
               :: "r"(smem_addr(b)), "r"(parity) : "memory");
}

template <int WARPS, int STAGES, int PIECE>
__global__ void __launch_bounds__(WARPS * 32, 1) sum_bulk(Args a) {
  extern __shared__ __align__(128) uint8_t smem[];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  uint8_t* buf = smem + warp * STAGES * 2 * PIECE;
  __shared__ uint64_t bars[WARPS][STAGES];
  if (lane == 0) for (int s = 0; s < STAGES; ++s) mbar_init(&bars[warp][s]);
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  __syncwarp();
  const int64_t row_bytes = int64_t(a.hidden) * 2;
  const int64_t pieces_per_row = (row_bytes + PIECE - 1) / PIECE;
  const int64_t warps = int64_t(gridDim.x) * WARPS;
  const int64_t first = blockIdx.x * WARPS + warp;
  // work item i of this warp: token first + (i / pieces_per_row) * warps, piece i % pieces_per_row
  const int64_t my_tokens = first < a.tokens ? (a.tokens - first + warps - 1) / warps : 0;
  const int64_t items = my_tokens * pieces_per_row;
  auto issue = [&](int64_t i) {
    const int64_t t = first + (i / pieces_per_row) * warps, p = i % pieces_per_row;
    const int64_t off = p * PIECE;
    const uint32_t bytes = static_cast<uint32_t>((row_bytes - off < PIECE ? row_bytes - off : int64_t(PIECE)));
    const int s = i % STAGES;
    uint32_t total = 0;
    for (int d = 0; d < 2; ++d) if (a.in_rank[t * 2 + d]) total += bytes;
    mbar_expect(&bars[warp][s], total);
    for (int d = 0; d < 2; ++d)
      if (a.in_rank[t * 2 + d]) bulk_load(buf + (s * 2 + d) * PIECE, a.src[d] + a.pos[t * 2 + d] * row_bytes + off, bytes, &bars[warp][s]);
  };
  if (lane == 0) for (int64_t i = 0; i < STAGES && i < items; ++i) issue(i);
  for (int64_t i = 0; i < items; ++i) {
    const int s = i % STAGES;
    mbar_wait(&bars[warp][s], (i / STAGES) & 1);
    const int64_t t = first + (i / pieces_per_row) * warps, p = i % pieces_per_row;
    const int64_t off = p * PIECE;
    const int vecs = static_cast<int>((row_bytes - off < PIECE ? row_bytes - off : int64_t(PIECE)) / 16);
    const bool in0 = a.in_rank[t * 2], in1 = a.in_rank[t * 2 + 1];
    for (int v = lane; v < vecs; v += 32) {
      float sum[8] = {};
      if (in0) add8(sum, reinterpret_cast<const int4*>(buf + (s * 2) * PIECE)[v]);
      if (in1) add8(sum, reinterpret_cast<const int4*>(buf + (s * 2 + 1) * PIECE)[v]);
      reinterpret_cast<int4*>(a.out + t * row_bytes + off)[v] = pack8(sum);
    }
    __syncwarp();  // every lane has read stage s before it is filled again
    if (lane == 0 && i + STAGES < items) issue(i + STAGES);
  }
}

// The library's shape (intranode_device.cuh, sum_token_rows): lane i holds the address of the token's i-th row
// (ballot + shuffles); the first two rows' addresses are taken before the vector loop, as two nullable pointers
// with predicated loads; rows 3.. two at a time.
template <int UNROLL>
__device__ __forceinline__ void add_two_rows(float (&sum)[UNROLL][8], const uint8_t* r0, const uint8_t* r1, int64_t v0,
                                             int64_t vectors) {
  int4 v[2][UNROLL];
  load_two_rows<UNROLL>(v, r0, r1, v0, vectors);
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) {
    if (v0 + u * 32 >= vectors) continue;
    if (r0) add8(sum[u], v[0][u]);
    if (r1) add8(sum[u], v[1][u]);
  }
}
template <int THREADS, int UNROLL>
__global__ void __launch_bounds__(THREADS, 1) sum_library(Args a) {
  for_each_token<THREADS>(a, [&](int64_t t, int lane, int64_t vectors, int64_t row_bytes) {
    const bool has = lane < 2 && a.in_rank[t * 2 + lane];
    const uint32_t present = __ballot_sync(0xffffffffu, has);
    const uint8_t* row = has ? a.src[lane] + a.pos[t * 2 + lane] * row_bytes : nullptr;
    const uint8_t* my_row = nullptr; int count = 0;
    for (uint32_t left = present; left != 0; left &= left - 1, ++count) {
      const auto address = __shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(row), __ffs(left) - 1);
      if (lane == count) my_row = reinterpret_cast<const uint8_t*>(address);
    }
    auto row_at = [&](int i) {
      const auto address = __shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(my_row), i % 32);
      return i < count ? reinterpret_cast<const uint8_t*>(address) : nullptr;
    };
    const uint8_t* r0 = row_at(0);
    const uint8_t* r1 = row_at(1);
    for (int64_t v0 = lane; v0 < vectors; v0 += UNROLL * 32) {
      float sum[UNROLL][8] = {};
      add_two_rows<UNROLL>(sum, r0, r1, v0, vectors);
      for (int i = 2; i < count; i += 2) add_two_rows<UNROLL>(sum, row_at(i), row_at(i + 1), v0, vectors);
#pragma unroll
      for (int u = 0; u < UNROLL; ++u)
        if (v0 + u * 32 < vectors) reinterpret_cast<int4*>(a.out + t * row_bytes)[v0 + u * 32] = pack8(sum[u]);
    }
  });
}

// A warp per row copies source 0 into out (the dispatch gather's shape), UNROLL loads per lane before their stores.
template <int THREADS, int UNROLL>
__global__ void __launch_bounds__(THREADS, 1) copy_rows(Args a) {
  for_each_token<THREADS>(a, [&](int64_t t, int lane, int64_t vectors, int64_t row_bytes) {
    const int4* from = reinterpret_cast<const int4*>(a.src[0] + a.pos[t * 2] * row_bytes);
    int4* to = reinterpret_cast<int4*>(a.out + t * row_bytes);
    int64_t i = lane;
    for (; i + (UNROLL - 1) * 32 < vectors; i += UNROLL * 32) {
      int4 v[UNROLL];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) v[u] = ld_cg(from + i + u * 32);
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) to[i + u * 32] = v[u];
    }
    for (; i < vectors; i += 32) to[i] = ld_cg(from + i);
  });
}

template <typename K>
float time_kernel(K kernel, int blocks, int threads, size_t smem, std::vector<Args>& sets, int reps) {
  if (smem > 48 * 1024) CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
  std::vector<float> ms;
  for (int r = 0; r < reps + 3; ++r) {
    CK(cudaEventRecord(e0));
    kernel<<<blocks, threads, smem>>>(sets[r % sets.size()]);
    CK(cudaEventRecord(e1)); CK(cudaEventSynchronize(e1)); CK(cudaGetLastError());
    float t; CK(cudaEventElapsedTime(&t, e0, e1));
    if (r >= 3) ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2] * 1000.0f;
}

__global__ void fill(uint16_t* p, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed; h ^= h >> 13; h *= 0x5bd1e995u; h ^= h >> 15;
    __nv_bfloat16 v = __float2bfloat16((int(h % 2001) - 1000) / 256.0f);
    p[i] = *reinterpret_cast<uint16_t*>(&v);
  }
}

int main() {
  int device_sms = 0;
  CK(cudaDeviceGetAttribute(&device_sms, cudaDevAttrMultiProcessorCount, 0));
  const int64_t tokens = 4096; const int hidden = 7168; const int64_t row_bytes = hidden * 2;
  const int64_t bytes = tokens * row_bytes;
  const int kSets = 3;
  std::vector<Args> sets(kSets);
  std::vector<int32_t> pos(tokens * 2); std::vector<uint8_t> in(tokens * 2, 1);
  for (int64_t t = 0; t < tokens; ++t) { pos[t * 2] = int32_t(t); pos[t * 2 + 1] = int32_t(t); }
  for (int64_t t = 0; t < tokens; t += 250) in[t * 2 + 1] = 0;  // a few tokens only on this rank
  int32_t* dpos; bool* din; CK(cudaMalloc(&dpos, pos.size() * 4)); CK(cudaMalloc(&din, in.size()));
  CK(cudaMemcpy(dpos, pos.data(), pos.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(din, in.data(), in.size(), cudaMemcpyHostToDevice));
  for (int s = 0; s < kSets; ++s) {
    uint8_t *a, *b, *o; CK(cudaMalloc(&a, bytes)); CK(cudaMalloc(&b, bytes)); CK(cudaMalloc(&o, bytes));
    fill<<<512, 256>>>(reinterpret_cast<uint16_t*>(a), bytes / 2, 11 + s); fill<<<512, 256>>>(reinterpret_cast<uint16_t*>(b), bytes / 2, 97 + s);
    sets[s] = Args{{a, b}, dpos, din, o, tokens, hidden};
  }
  CK(cudaDeviceSynchronize());
  // What each variant must write, worked out on the host from set 0: the sums in float, rounded to bf16 (to
  // nearest, ties to even), and, for the copies, source 0's rows.
  std::vector<uint16_t> src0(bytes / 2), src1(bytes / 2), want_sum(bytes / 2);
  CK(cudaMemcpy(src0.data(), sets[0].src[0], bytes, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(src1.data(), sets[0].src[1], bytes, cudaMemcpyDeviceToHost));
  auto to_float = [](uint16_t h) { uint32_t u = uint32_t(h) << 16; float f; memcpy(&f, &u, 4); return f; };
  auto to_bf16 = [](float f) { uint32_t u; memcpy(&u, &f, 4); return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16); };
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t i = 0; i < hidden; ++i) {
      const int64_t e = t * hidden + i;
      want_sum[e] = to_bf16(to_float(src0[e]) + (in[t * 2 + 1] ? to_float(src1[e]) : 0.0f));
    }
  }
  std::vector<uint16_t> got(bytes / 2);
  const int reps = 30;
  bool all_same = true;

  printf("%-28s %6s %10s %10s %8s\n", "variant", "SMs", "us", "GB/s", "GB/s/SM");
  auto run = [&](const char* name, auto kernel, int threads, size_t smem, bool copy = false) {
    const double moved = (copy ? 2.0 : 3.0) * bytes;  // sums: two rows read, one written (a few tokens have one)
    CK(cudaMemset(sets[0].out, 0xff, bytes));
    if (smem > 48 * 1024) CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    kernel<<<device_sms, threads, smem>>>(sets[0]); CK(cudaDeviceSynchronize()); CK(cudaGetLastError());
    CK(cudaMemcpy(got.data(), sets[0].out, bytes, cudaMemcpyDeviceToHost));
    const bool same = got == (copy ? src0 : want_sum);
    all_same = all_same && same;
    for (int sms : {8, 16, 24, device_sms}) {
      const float us = time_kernel(kernel, sms, threads, smem, sets, reps);
      printf("%-28s %6d %10.1f %10.1f %8.1f %s\n", name, sms, us, moved / us / 1e3, moved / us / 1e3 / sms, same ? "" : "MISMATCH");
    }
  };
  run("one row at a time x2", sum_regs<1024, 2>, 1024, 0);
  run("one row at a time x4", sum_regs<1024, 4>, 1024, 0);
  run("both rows first x2", sum_regs_both<1024, 2>, 1024, 0);
  run("both rows first x4", sum_regs_both<1024, 4>, 1024, 0);
  run("library shape x2", sum_library<1024, 2>, 1024, 0);
  run("bulk 16 warps x2 x3584 B", sum_bulk<16, 2, 3584>, 512, 16 * 2 * 2 * 3584);
  run("bulk 16 warps x3 x2048 B", sum_bulk<16, 3, 2048>, 512, 16 * 3 * 2 * 2048);
  run("copy x4 (gather)", copy_rows<1024, 4>, 1024, 0, true);
  run("copy x8", copy_rows<1024, 8>, 1024, 0, true);
  // copy ceiling for context: D2D memcpy of one row set (read + write)
  cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1)); std::vector<float> ms;
  for (int r = 0; r < 13; ++r) { CK(cudaEventRecord(e0)); CK(cudaMemcpyAsync(sets[r % kSets].out, sets[(r + 1) % kSets].src[0], bytes, cudaMemcpyDeviceToDevice)); CK(cudaEventRecord(e1)); CK(cudaEventSynchronize(e1)); float t; CK(cudaEventElapsedTime(&t, e0, e1)); if (r >= 3) ms.push_back(t); }
  std::sort(ms.begin(), ms.end());
  printf("memcpy D2D %.1f us, %.1f GB/s (read + write)\n", ms[ms.size() / 2] * 1000, 2.0 * bytes / (ms[ms.size() / 2] * 1e6));
  return all_same ? 0 : 1;
}
