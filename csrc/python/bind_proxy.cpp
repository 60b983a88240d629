// Python binding of the CPU proxy (csrc/proxy/): uccl_ep_plugin._C.HostFifo, ProxyConfig, Proxy,
// ReceiverOrdering, encode_immediate, decode_immediate.
//
// Drives the proxy without a GPU: HostFifo owns a FIFO in host memory that Python pushes encoded
// commands into (standing in for the GPU producer), and Proxy owns its transport: tcp over a host (or,
// in CUDA builds, device) memory region, cuda-copy, or verbs over a host region (the transport
// bindings' classes are private to bind_transport.cpp, so the proxy constructs its own transport and
// exposes listen_address()/connect()). Argument errors raise ValueError naming the argument; proxy,
// transport and ordering failures RuntimeError.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <variant>
#include <vector>

#include "channel/command.h"
#include "channel/fifo.h"
#include "channel/fifo_host.h"
#include "proxy/immediate.h"
#include "proxy/ordering.h"
#include "proxy/proxy.h"
#include "transport/tcp_transport.h"
#if defined(UCCL_EP_WITH_GPU)
#include "channel/mapped_fifos.h"
#include "nvlink/peer_memory.h"
#include "transport/cuda_copy_transport.h"
#endif
#if defined(UCCL_EP_WITH_VERBS)
#include "transport/verbs_transport.h"
#endif

#include "python/arguments.h"

namespace py = pybind11;

namespace {

using uccl_ep::bindings::region_at;
using uccl_ep::bindings::require;

// Encodes one command (checking every field, ValueError naming it) and pushes it as a host producer
// (the GIL released while the FIFO is full, up to timeout_s).
void push_command(const uccl_ep::FifoView& view, int kind, int64_t dst_rank, int64_t length_bytes,
                  int64_t local_offset, int64_t remote_offset, int64_t counter_index, int64_t value, int64_t flags,
                  double timeout_s) {
  require(kind >= 1 && kind <= 15, "kind must be in [1, 15] (got " + std::to_string(kind) + ")");
  require(dst_rank >= 0 && dst_rank < uccl_ep::kMaxRanks,
          "dst_rank must be in [0, " + std::to_string(uccl_ep::kMaxRanks) + ") (got " + std::to_string(dst_rank) + ")");
  require(flags >= 0 && flags < uccl_ep::kMaxFlags, "flags must be in [0, 16) (got " + std::to_string(flags) + ")");
  require(counter_index >= 0 && counter_index < uccl_ep::kMaxCounterIndex,
          "counter_index must be in [0, 2**20) (got " + std::to_string(counter_index) + ")");
  const uint64_t unit = uccl_ep::kCommandUnitBytes;
  auto units = [&](const char* name, int64_t bytes, uint64_t limit_units) {
    require(bytes >= 0 && static_cast<uint64_t>(bytes) % unit == 0,
            std::string(name) + " must be a non-negative multiple of 16 (got " + std::to_string(bytes) + ")");
    require(static_cast<uint64_t>(bytes) / unit < limit_units,
            std::string(name) + " " + std::to_string(bytes) + " does not fit the command format");
    return static_cast<uint64_t>(bytes) / unit;
  };
  const uint64_t lo = units("local_offset", local_offset, 1ull << 32);
  const uint64_t ro = units("remote_offset", remote_offset, 1ull << 32);
  uint64_t length_units;
  if (kind == static_cast<int>(uccl_ep::CommandKind::kAtomicAdd)) {
    require(length_bytes == 0, "length_bytes must be 0 for an atomic add (the value travels in its place)");
    require(value >= -(1ll << 23) && value < (1ll << 23),
            "value must be in [-2**23, 2**23) (got " + std::to_string(value) + ")");
    length_units = static_cast<uint64_t>(value) & 0xFFFFFF;
  } else {
    require(value == 0, "value is only for kAtomicAdd (got " + std::to_string(value) + ")");
    length_units = units("length_bytes", length_bytes, uccl_ep::kMaxLengthUnits);
  }
  const uccl_ep::Command c = uccl_ep::encode_command(static_cast<uccl_ep::CommandKind>(kind),
                                                     static_cast<uint32_t>(dst_rank), static_cast<uint32_t>(flags),
                                                     length_units, static_cast<uint32_t>(counter_index), lo, ro);
  require(timeout_s > 0, "timeout_s must be > 0");
  uccl_ep::PushResult result;
  {
    py::gil_scoped_release no_gil;
    uccl_ep::HostFifoOps ops(std::chrono::steady_clock::now() +
                             std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                 std::chrono::duration<double>(timeout_s)));
    result = uccl_ep::fifo_push(view, c, ops);
  }
  if (result != uccl_ep::PushResult::kPushed) {
    throw std::runtime_error("push timed out after " + std::to_string(timeout_s) +
                             " s: the FIFO stayed full (is a proxy consuming it?); the FIFO is unusable now");
  }
}

// ---------------------------------------------------------------------------------------
// HostFifo
// ---------------------------------------------------------------------------------------
class HostFifo {
 public:
  explicit HostFifo(int64_t capacity) {
    uccl_ep::check_fifo_capacity(capacity);
    const size_t slot_bytes = static_cast<size_t>(capacity) * sizeof(uccl_ep::Command);
    memory_ = static_cast<uint8_t*>(std::aligned_alloc(64, slot_bytes + 128));
    if (!memory_) throw std::bad_alloc();
    std::memset(memory_, 0, slot_bytes + 128);
    view_.slots = reinterpret_cast<uccl_ep::Command*>(memory_);
    view_.head = reinterpret_cast<uint64_t*>(memory_ + slot_bytes);
    view_.tail = reinterpret_cast<uint64_t*>(memory_ + slot_bytes + 64);
    view_.capacity = static_cast<uint64_t>(capacity);
  }
  ~HostFifo() { std::free(memory_); }
  HostFifo(const HostFifo&) = delete;
  HostFifo& operator=(const HostFifo&) = delete;

  void push(int kind, int64_t dst_rank, int64_t length_bytes, int64_t local_offset, int64_t remote_offset,
            int64_t counter_index, int64_t value, int64_t flags, double timeout_s) {
    push_command(view_, kind, dst_rank, length_bytes, local_offset, remote_offset, counter_index, value, flags,
                 timeout_s);
  }

  uint64_t pushed() const { return uccl_ep::host_load_acquire(view_.head); }
  uint64_t taken() const { return uccl_ep::host_load_acquire(view_.tail); }
  const uccl_ep::FifoView& view() const { return view_; }

 private:
  uint8_t* memory_ = nullptr;
  uccl_ep::FifoView view_{};
};

#if defined(UCCL_EP_WITH_GPU)
// FIFOs in pinned mapped host memory (channel/mapped_fifos.h): GPU kernels push, a proxy pops;
// with host_producers, Python pushes (tests of the proxy over device memory).
class PyMappedFifos {
 public:
  PyMappedFifos(int num_fifos, int64_t capacity, int device, bool host_producers)
      : impl_(std::make_unique<uccl_ep::MappedFifos>(num_fifos, capacity, device, host_producers)) {}

  uccl_ep::MappedFifos& impl() {
    if (!impl_) throw std::runtime_error("MappedFifos is released");
    return *impl_;
  }

  void push(int fifo, int kind, int64_t dst_rank, int64_t length_bytes, int64_t local_offset, int64_t remote_offset,
            int64_t counter_index, int64_t value, int64_t flags, double timeout_s) {
    require(impl().host_producers(), "these FIFOs are for GPU producers (host_producers=False): the host cannot push");
    push_command(impl().host_view(fifo), kind, dst_rank, length_bytes, local_offset, remote_offset, counter_index,
                 value, flags, timeout_s);
  }

  // Commands claimed by the (host) producers and taken by the consumer, of FIFO `fifo`.
  uint64_t pushed(int fifo) {
    require(impl().host_producers(), "pushed() counts host producers' commands (host_producers=True)");
    return uccl_ep::host_load_acquire(impl().host_view(fifo).head);
  }
  uint64_t taken(int fifo) { return uccl_ep::host_load_acquire(impl().host_view(fifo).tail); }

  std::vector<uccl_ep::FifoView> host_views() {
    std::vector<uccl_ep::FifoView> views;
    for (int f = 0; f < impl().num_fifos(); ++f) views.push_back(impl().host_view(f));
    return views;
  }

  void release() { impl_.reset(); }

 private:
  std::unique_ptr<uccl_ep::MappedFifos> impl_;
};
#endif  // UCCL_EP_WITH_GPU

// The consumer views of `fifos`: a list of HostFifo objects, or (GPU builds) a MappedFifos.
std::vector<uccl_ep::FifoView> consumer_views(const py::object& fifos) {
#if defined(UCCL_EP_WITH_GPU)
  if (py::isinstance<PyMappedFifos>(fifos)) return fifos.cast<PyMappedFifos&>().host_views();
#endif
  require(py::isinstance<py::list>(fifos), "fifos must be a list of HostFifo objects or a MappedFifos");
  py::list items = fifos;
  require(py::len(items) >= 1, "fifos must list at least one HostFifo");
  std::vector<uccl_ep::FifoView> views;
  for (size_t i = 0; i < py::len(items); ++i) {
    py::object item = items[i];
    require(py::isinstance<HostFifo>(item), "fifos[" + std::to_string(i) + "] is not a HostFifo");
    views.push_back(item.cast<HostFifo&>().view());
  }
  return views;
}

// ---------------------------------------------------------------------------------------
// Proxy (with the transport it owns: tcp over a host region, cuda-copy over a PeerMemory, or verbs
// over a host region)
// ---------------------------------------------------------------------------------------
class PyProxy {
 public:
  // The transports a proxy may own; each bootstraps the same way (listen_address, connect).
  using OwnedTransport = std::variant<std::unique_ptr<uccl_ep::TcpTransport>
#if defined(UCCL_EP_WITH_GPU)
                                      ,
                                      std::unique_ptr<uccl_ep::CudaCopyTransport>
#endif
#if defined(UCCL_EP_WITH_VERBS)
                                      ,
                                      std::unique_ptr<uccl_ep::VerbsTransport>
#endif
                                      >;

  // Starts a proxy over `transport` (constructed by the caller, not connected yet).
  PyProxy(OwnedTransport owned, py::object fifos, int num_threads, std::optional<uccl_ep::ProxyConfig> config,
          py::object memory = py::none())
      : transport_(std::move(owned)), memory_(std::move(memory)) {
    require(num_threads >= 1 && num_threads <= 256,
            "num_threads must be in [1, 256] (got " + std::to_string(num_threads) + ")");
    std::vector<uccl_ep::FifoView> views = consumer_views(fifos);
    fifos_ = fifos;  // keeps the FIFOs alive as long as the proxy
    uccl_ep::ProxyConfig c = config ? *config : uccl_ep::ProxyConfig{};
    c.num_threads = static_cast<uint32_t>(num_threads);
    proxy_ = std::make_unique<uccl_ep::Proxy>(transport(), std::move(views), c);
  }

  ~PyProxy() {
    try {
      shutdown(false);
    } catch (...) {
    }
  }

  uccl_ep::Proxy& proxy() {
    if (!proxy_) throw std::runtime_error("Proxy is closed");
    return *proxy_;
  }

  // Calls f on the concrete transport.
  template <typename F>
  decltype(auto) with_transport(F f) {
    return std::visit(
        [&](auto& owned) -> decltype(auto) {
          if (!owned) throw std::runtime_error("Proxy is closed");
          return f(*owned);
        },
        transport_);
  }

  uccl_ep::Transport& transport() {
    return with_transport([](auto& t) -> uccl_ep::Transport& { return t; });
  }

  // The int64 at `offset` of this rank's region (read through the GPU for device memory).
  int64_t read_word(uint64_t offset) {
    uccl_ep::Transport& t = transport();
    const auto* address = static_cast<const uint8_t*>(t.region().base) + offset;
    if (t.region_is_host_memory()) return __atomic_load_n(reinterpret_cast<const int64_t*>(address), __ATOMIC_ACQUIRE);
#if defined(UCCL_EP_WITH_GPU)
    int64_t value = 0;
    UCCL_EP_GPU_CHECK(uccl_ep::gpu_copy(&value, address, sizeof(value)));
    return value;
#else
    throw std::runtime_error("the region is not host memory");
#endif
  }

  void stop() {
    if (!proxy_) return;
    py::gil_scoped_release no_gil;
    proxy_->stop();
  }

  // Stops the threads (raising their error if `raise`), then closes the transport.
  void shutdown(bool raise) {
    std::string error;
    {
      py::gil_scoped_release no_gil;
      if (proxy_) {
        try {
          proxy_->stop();
        } catch (const std::exception& e) {
          error = e.what();
        }
        proxy_.reset();
      }
      std::visit(
          [](auto& owned) {
            if (owned) {
              owned->close();
              owned.reset();
            }
          },
          transport_);
    }
    memory_ = py::none();
    if (raise && !error.empty()) throw uccl_ep::ProxyError(error);
  }

  void wait_barriers(uint64_t count, double timeout_s) {
    require(timeout_s > 0, "timeout_s must be > 0");
    uccl_ep::Proxy& p = proxy();
    const int rank = transport().rank();
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                                                  std::chrono::duration<double>(timeout_s));
    py::gil_scoped_release no_gil;
    while (p.barriers_done() < count) {
      p.check();
      if (std::chrono::steady_clock::now() > deadline) {
        throw uccl_ep::ProxyError("proxy rank " + std::to_string(rank) + ": " + std::to_string(p.barriers_done()) +
                                  " barriers done after " + std::to_string(timeout_s) + " s, waiting for " +
                                  std::to_string(count));
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    p.check();
  }

 private:
  OwnedTransport transport_;
  py::object fifos_;
  py::object memory_;  // what the transport maps (cuda-copy's PeerMemory), kept until it is closed
  std::unique_ptr<uccl_ep::Proxy> proxy_;
};

// Over a tcp transport on the region (region_ptr, region_bytes): host memory, or memory of `device`.
std::unique_ptr<PyProxy> proxy_over_tcp(int rank, int num_ranks, int64_t region_ptr, int64_t region_bytes,
                                        py::object fifos, int num_threads, std::optional<uccl_ep::ProxyConfig> config,
                                        int64_t reorder_seed, double transport_timeout_s, std::optional<int> device,
                                        bool stage_host_region) {
  const uccl_ep::MemoryRegion region = region_at(region_ptr, region_bytes);
  uccl_ep::TcpTransportOptions options;
  options.reorder_seed = reorder_seed;
  options.timeout_s = transport_timeout_s;
  if (device) options.device = static_cast<int>(uccl_ep::bindings::non_negative("device", *device));
  options.stage_host_region_for_test = stage_host_region;
  return std::make_unique<PyProxy>(std::make_unique<uccl_ep::TcpTransport>(rank, num_ranks, region, options), fifos,
                                   num_threads, config);
}

#if defined(UCCL_EP_WITH_VERBS)
// Over a verbs transport on a host region, or on memory of GPU `gpu`; the NIC's in-flight caps are the
// config's (its byte limit and the request limit of its mode).
std::unique_ptr<PyProxy> proxy_over_verbs(int rank, int num_ranks, int64_t region_ptr, int64_t region_bytes,
                                          py::object fifos, int num_threads, std::optional<uccl_ep::ProxyConfig> config,
                                          int64_t reorder_seed, double transport_timeout_s, const std::string& device,
                                          int gid_index, int service_level, int traffic_class, int qps_per_peer,
                                          int gpu) {
  const uccl_ep::ProxyConfig c = config ? *config : uccl_ep::ProxyConfig{};
  const uccl_ep::VerbsTransportOptions options{device,
                                               gid_index,
                                               service_level,
                                               traffic_class,
                                               reorder_seed,
                                               transport_timeout_s,
                                               static_cast<int64_t>(c.max_inflight_bytes),
                                               c.max_inflight_requests(),
                                               qps_per_peer,
                                               gpu};
  std::unique_ptr<uccl_ep::VerbsTransport> transport;
  {
    py::gil_scoped_release no_gil;
    transport = std::make_unique<uccl_ep::VerbsTransport>(rank, num_ranks, region_at(region_ptr, region_bytes),
                                                          options);
  }
  return std::make_unique<PyProxy>(std::move(transport), fifos, num_threads, config);
}
#endif

py::dict ordering_stats_dict(const uccl_ep::OrderingStats& s) {
  py::dict d;
  d["adds_applied"] = s.adds_applied;
  d["adds_held_now"] = s.adds_held_now;
  d["adds_held_peak"] = s.adds_held_peak;
  d["adds_applied_late"] = s.adds_applied_late;
  d["tokens_landed"] = s.tokens_landed;
  d["flags_released"] = s.flags_released;
  d["flags_held_now"] = s.flags_held_now;
  d["flags_held_peak"] = s.flags_held_peak;
  d["flags_released_late"] = s.flags_released_late;
  return d;
}

// The ordering layer alone, over a caller's buffer: unit tests feed it immediates by hand.
class PyReceiverOrdering {
 public:
  PyReceiverOrdering(int64_t region_ptr, int64_t region_bytes, const uccl_ep::OrderingConfig& config) {
    const uccl_ep::MemoryRegion region = region_at(region_ptr, region_bytes);
    require(region.base != nullptr || config.num_counters == 0, "the region is null but num_counters > 0");
    writer_ = std::make_unique<uccl_ep::HostRegionWriter>(region);
    impl_ = std::make_unique<uccl_ep::ReceiverOrdering>(*writer_, region.bytes, config);
  }
  void on_immediate(int64_t src_rank, int64_t imm) {
    require(src_rank >= 0 && src_rank < (1ll << 31), "src_rank must be >= 0");
    require(imm >= 0 && imm <= 0xFFFFFFFFll, "imm must be in [0, 2**32) (got " + std::to_string(imm) + ")");
    impl_->on_immediate(static_cast<uint32_t>(src_rank), static_cast<uint32_t>(imm));
  }
  py::dict stats() const { return ordering_stats_dict(impl_->stats()); }

 private:
  std::unique_ptr<uccl_ep::HostRegionWriter> writer_;
  std::unique_ptr<uccl_ep::ReceiverOrdering> impl_;
};

uint32_t py_encode_immediate(int kind, int buffer, int seq, int counter, int64_t value) {
  require(kind >= 0 && kind <= 3, "kind must be in [0, 3] (got " + std::to_string(kind) + ")");
  require(buffer == 0 || buffer == 1, "buffer must be 0 or 1 (got " + std::to_string(buffer) + ")");
  require(seq >= 0 && seq < static_cast<int>(uccl_ep::kImmSeqModulus),
          "seq must be in [0, 16) (got " + std::to_string(seq) + ")");
  require(counter >= 0 && counter < static_cast<int>(uccl_ep::kImmMaxCounters),
          "counter must be in [0, 2048) (got " + std::to_string(counter) + ")");
  const auto k = static_cast<uccl_ep::ImmKind>(kind);
  if (k == uccl_ep::ImmKind::kAtomicAdd) {
    require(uccl_ep::imm_add_fits(value), "value of an atomic add must be in [-8192, 8191] (got " +
                                              std::to_string(value) + ")");
  } else {
    require(value >= 0 && uccl_ep::imm_value_fits(static_cast<uint64_t>(value)),
            "value must be in [0, 16383] (got " + std::to_string(value) + ")");
  }
  return uccl_ep::encode_immediate(k, static_cast<uint32_t>(buffer), static_cast<uint32_t>(seq),
                                   static_cast<uint32_t>(counter), static_cast<uint32_t>(value));
}

py::dict py_decode_immediate(int64_t imm) {
  require(imm >= 0 && imm <= 0xFFFFFFFFll, "imm must be in [0, 2**32) (got " + std::to_string(imm) + ")");
  const uccl_ep::ImmFields f = uccl_ep::decode_immediate(static_cast<uint32_t>(imm));
  py::dict d;
  d["kind"] = static_cast<int>(f.kind);
  d["kind_name"] = uccl_ep::imm_kind_name(f.kind);
  d["buffer"] = f.buffer;
  d["seq"] = f.seq;
  d["counter"] = f.counter;
  d["value"] = f.kind == uccl_ep::ImmKind::kAtomicAdd ? static_cast<int64_t>(uccl_ep::imm_add_value(f))
                                                      : static_cast<int64_t>(f.value);
  return d;
}

uccl_ep::ProxyConfig config_from_environ(const std::map<std::string, std::string>& env) {
  uccl_ep::ProxyConfig c;
  c.apply_environ(env);
  return c;
}

}  // namespace

void bind_proxy(py::module_& m) {
  py::register_exception<uccl_ep::ProxyError>(m, "ProxyError", PyExc_RuntimeError);
  py::register_exception<uccl_ep::OrderingError>(m, "OrderingError", PyExc_RuntimeError);

  py::class_<HostFifo>(m, "HostFifo", R"doc(
A command FIFO in host memory, standing in for the pinned FIFO a GPU pushes into. push() encodes
one 16-byte command (channel/command.h): offsets and lengths in bytes (multiples of 16); for
kAtomicAdd `value` is the signed amount (or, with FLAG_COUNT, the announced token rows). Blocks
(without the GIL) while the FIFO is full, up to timeout_s.)doc")
      .def(py::init<int64_t>(), py::arg("capacity") = 1024)
      .def("push", &HostFifo::push, py::arg("kind"), py::arg("dst_rank") = 0, py::arg("length_bytes") = 0,
           py::arg("local_offset") = 0, py::arg("remote_offset") = 0, py::arg("counter_index") = 0,
           py::arg("value") = 0, py::arg("flags") = 0, py::arg("timeout_s") = 30.0)
      .def_property_readonly("pushed", &HostFifo::pushed, "Commands claimed by producers so far.")
      .def_property_readonly("taken", &HostFifo::taken, "Commands the consumer has taken so far.")
      .def_property_readonly("capacity", [](const HostFifo& f) { return f.view().capacity; })
      .def_property_readonly_static("WRITE", [](py::object) { return 1; })
      .def_property_readonly_static("WRITE_WITH_COUNT", [](py::object) { return 2; })
      .def_property_readonly_static("ATOMIC_ADD", [](py::object) { return 3; })
      .def_property_readonly_static("QUIET", [](py::object) { return 4; })
      .def_property_readonly_static("BARRIER", [](py::object) { return 5; })
      .def_property_readonly_static("FLAG_BUFFER", [](py::object) { return uccl_ep::kCommandFlagBuffer; })
      .def_property_readonly_static("FLAG_COUNT", [](py::object) { return uccl_ep::kCommandFlagCountFlag; });

#if defined(UCCL_EP_WITH_GPU)
  py::class_<PyMappedFifos>(m, "MappedFifos", R"doc(
num_fifos command FIFOs of `capacity` slots in pinned host memory mapped into `device`'s address
space: kernels push (device_views: the address of a device array of FifoView), a Proxy pops. With
host_producers=True the heads are in host memory and push() (HostFifo.push's arguments, plus the
FIFO index) lets Python produce, for tests of a proxy over device memory.)doc")
      .def(py::init<int, int64_t, int, bool>(), py::arg("num_fifos"), py::arg("capacity"), py::arg("device"),
           py::arg("host_producers") = false)
      .def("push", &PyMappedFifos::push, py::arg("fifo"), py::arg("kind"), py::arg("dst_rank") = 0,
           py::arg("length_bytes") = 0, py::arg("local_offset") = 0, py::arg("remote_offset") = 0,
           py::arg("counter_index") = 0, py::arg("value") = 0, py::arg("flags") = 0, py::arg("timeout_s") = 30.0)
      .def("pushed", &PyMappedFifos::pushed, py::arg("fifo"), "Commands claimed so far (host producers).")
      .def("taken", &PyMappedFifos::taken, py::arg("fifo"), "Commands the consumer has taken so far.")
      .def_property_readonly("device_views",
                             [](PyMappedFifos& f) { return reinterpret_cast<std::uintptr_t>(f.impl().device_views()); })
      .def_property_readonly("num_fifos", [](PyMappedFifos& f) { return f.impl().num_fifos(); })
      .def_property_readonly("capacity", [](PyMappedFifos& f) { return f.impl().capacity(); })
      .def("release", &PyMappedFifos::release, "Free the FIFOs (a proxy using them must be closed first).");
#endif

  py::class_<uccl_ep::ProxyConfig>(m, "ProxyConfig", R"doc(
Proxy settings. Counter layout in every rank's region: int64 counters[num_counters] at
counters_offset (atomic-add targets) and int64 flags[2][num_counters][num_ranks] at flags_offset
(low-latency count flags, -(N+1) once N rows landed). `ordering=False` applies immediates in
arrival order (a test switch); `native_atomics=False` sends every counter add as an immediate even
where the transport could use the NIC's atomics. from_environ() reads UCCL_IB_MAX_INFLIGHT_BYTES,
UCCL_IB_MAX_INFLIGHT_NORMAL, UCCL_IB_MAX_INFLIGHT_LOW_LATENCY, UCCL_RDMA_ADAPTIVE_SLEEP and
UCCL_IB_NATIVE_ATOMICS from a dict such as uccl_ep_plugin.platform_config.resolve_config().as_environ().)doc")
      .def(py::init<>())
      .def_static("from_environ", &config_from_environ, py::arg("environ"))
      .def("apply_environ", &uccl_ep::ProxyConfig::apply_environ, py::arg("environ"))
      .def_property(
          "max_inflight_bytes",
          [](const uccl_ep::ProxyConfig& c) -> py::object {
            return c.max_inflight_bytes ? py::object(py::int_(c.max_inflight_bytes)) : py::object(py::none());
          },
          [](uccl_ep::ProxyConfig& c, std::optional<int64_t> v) {
            require(!v || *v >= 1, "max_inflight_bytes must be >= 1 or None (unlimited)");
            c.max_inflight_bytes = v ? static_cast<uint64_t>(*v) : 0;
          })
      .def_readwrite("max_inflight_normal", &uccl_ep::ProxyConfig::max_inflight_normal)
      .def_readwrite("max_inflight_low_latency", &uccl_ep::ProxyConfig::max_inflight_low_latency)
      .def_readwrite("low_latency", &uccl_ep::ProxyConfig::low_latency)
      .def_readwrite("adaptive_sleep", &uccl_ep::ProxyConfig::adaptive_sleep)
      .def_readwrite("native_atomics", &uccl_ep::ProxyConfig::native_atomics)
      .def_readwrite("cpu_affinity", &uccl_ep::ProxyConfig::cpu_affinity)
      .def_readwrite("token_bytes", &uccl_ep::ProxyConfig::token_bytes)
      .def_readwrite("timeout_s", &uccl_ep::ProxyConfig::timeout_s)
      .def_readwrite("quiet_on_gpu", &uccl_ep::ProxyConfig::quiet_on_gpu)
      .def_property(
          "num_counters", [](const uccl_ep::ProxyConfig& c) { return c.ordering.num_counters; },
          [](uccl_ep::ProxyConfig& c, uint32_t v) { c.ordering.num_counters = v; })
      .def_property(
          "counters_offset", [](const uccl_ep::ProxyConfig& c) { return c.ordering.counters_offset; },
          [](uccl_ep::ProxyConfig& c, uint64_t v) { c.ordering.counters_offset = v; })
      .def_property(
          "flags_offset", [](const uccl_ep::ProxyConfig& c) { return c.ordering.flags_offset; },
          [](uccl_ep::ProxyConfig& c, uint64_t v) { c.ordering.flags_offset = v; })
      .def_property(
          "window", [](const uccl_ep::ProxyConfig& c) { return c.ordering.window; },
          [](uccl_ep::ProxyConfig& c, uint32_t v) { c.ordering.window = v; })
      .def_property(
          "ordering", [](const uccl_ep::ProxyConfig& c) { return c.ordering.enabled; },
          [](uccl_ep::ProxyConfig& c, bool v) { c.ordering.enabled = v; });

  py::class_<PyProxy>(m, "Proxy", R"doc(
A CPU proxy: num_threads threads take commands from `fifos` (HostFifo objects, or a MappedFifos;
FIFO f belongs to thread f % num_threads) and execute them through a tcp transport that the proxy
owns, over the region (region_ptr, region_bytes): host memory, or with `device` (GPU builds) memory
of that GPU, staged through pinned host memory (_stage_host_region, a test hook, stages a host
region the same way). Bootstrap: all-gather listen_address(), call
connect(addresses), then start(). stop() joins the threads and raises the proxy's error if one
was recorded; close() also closes the transport. Errors (a command that cannot be executed, a
transport or ordering failure) name the rank, the peer and the decoded command, and are raised
by check(), wait_barriers() and stop(). Blocking calls release the GIL.)doc")
      .def(py::init(&proxy_over_tcp), py::arg("rank"), py::arg("num_ranks"), py::arg("region_ptr"),
           py::arg("region_bytes"), py::arg("fifos"), py::arg("num_threads") = 1, py::arg("config") = py::none(),
           py::arg("reorder_seed") = -1, py::arg("transport_timeout_s") = 30.0, py::arg("device") = py::none(),
           py::arg("_stage_host_region") = false)
#if defined(UCCL_EP_WITH_GPU)
      .def_static(
          "over_cuda_copy",
          [](int rank, int num_ranks, py::object peer_memory, py::object fifos, int num_threads,
             std::optional<uccl_ep::ProxyConfig> config, int64_t reorder_seed, double transport_timeout_s) {
            require(py::isinstance<uccl_ep::PeerMemory>(peer_memory), "peer_memory must be a PeerMemory");
            uccl_ep::CudaCopyTransportOptions options;
            options.reorder_seed = reorder_seed;
            options.timeout_s = transport_timeout_s;
            auto transport = std::make_unique<uccl_ep::CudaCopyTransport>(
                rank, num_ranks, peer_memory.cast<uccl_ep::PeerMemory&>(), options);
            return std::make_unique<PyProxy>(std::move(transport), fifos, num_threads, config, peer_memory);
          },
          py::arg("rank"), py::arg("num_ranks"), py::arg("peer_memory"), py::arg("fifos"), py::arg("num_threads") = 1,
          py::arg("config") = py::none(), py::arg("reorder_seed") = -1, py::arg("transport_timeout_s") = 30.0,
          "A proxy over the cuda-copy transport on peer_memory's device buffer (open_peers done): the same "
          "bootstrap and methods; fifos is typically a MappedFifos.")
#endif
#if defined(UCCL_EP_WITH_VERBS)
      .def_static("over_verbs", &proxy_over_verbs, py::arg("rank"), py::arg("num_ranks"), py::arg("region_ptr"),
                  py::arg("region_bytes"), py::arg("fifos"), py::arg("num_threads") = 1, py::arg("config") = py::none(),
                  py::arg("reorder_seed") = -1, py::arg("transport_timeout_s") = 30.0, py::arg("device") = "",
                  py::arg("gid_index") = -2, py::arg("service_level") = -1, py::arg("traffic_class") = -1,
                  py::arg("qps_per_peer") = 0, py::arg("gpu") = -1,
                  "A proxy over the verbs transport (VerbsTransport's device, gid_index, service_level, "
                  "traffic_class, qps_per_peer and gpu) on a host region or, with gpu >= 0, on that GPU's memory: "
                  "the same bootstrap and methods, plus a barrier of all ranks "
                  "between connect() and the first command. The NIC's in-flight caps are the config's. Plain "
                  "atomic adds use the NIC's own atomics where the device has them (config.native_atomics).")
#endif
      .def("listen_address", [](PyProxy& p) { return p.with_transport([](auto& t) { return t.listen_address(); }); })
      .def(
          "connect",
          [](PyProxy& p, const std::vector<std::string>& addresses) {
            p.with_transport([&](auto& t) {
              py::gil_scoped_release no_gil;
              t.connect(addresses);
              return 0;
            });
          },
          py::arg("addresses"))
      .def("start", [](PyProxy& p) { p.proxy().start(); })
      .def("stop", &PyProxy::stop, "Join every proxy thread; raise the stored error, if any.")
      .def("close", [](PyProxy& p) { p.shutdown(true); },
           "stop(), then close the transport (raises the stored error after closing). Idempotent.")
      .def("check", [](PyProxy& p) { p.proxy().check(); }, "Raise the stored error, if any.")
      .def("error", [](PyProxy& p) -> py::object {
        const std::string e = p.proxy().error();
        return e.empty() ? py::object(py::none()) : py::object(py::str(e));
      })
      .def("wait_barriers", &PyProxy::wait_barriers, py::arg("count"), py::arg("timeout_s") = 30.0,
           "Wait until `count` barriers completed (raises the proxy's error, or on timeout).")
      .def_property_readonly("barriers_done", [](PyProxy& p) { return p.proxy().barriers_done(); })
      .def_property_readonly("quiets_done", [](PyProxy& p) { return p.proxy().quiets_done(); })
      .def_property_readonly("inflight_requests", [](PyProxy& p) { return p.proxy().inflight_requests(); })
      .def_property_readonly("transport_outstanding", [](PyProxy& p) { return p.transport().outstanding(); })
      .def_property_readonly("native_atomics", [](PyProxy& p) { return p.proxy().native_atomics(); },
                             "Whether plain counter adds go as the transport's own atomics (else as immediates); "
                             "every rank must agree.")
      .def_property_readonly("idle", [](PyProxy& p) { return p.proxy().idle(); },
                             "Every published command taken and executed, and every request it posted completed.")
      .def_property_readonly("reorder_seed",
                             [](PyProxy& p) -> py::object {
                               const auto c = p.with_transport([](auto& t) { return t.reorder_config(); });
                               return c.enabled ? py::object(py::int_(c.seed)) : py::object(py::none());
                             })
      .def("counter",
           [](PyProxy& p, int64_t index) {
             const auto& o = p.proxy().ordering();
             require(index >= 0 && index < o.config().num_counters, "index must be in [0, num_counters)");
             return p.read_word(o.counter_offset(static_cast<uint32_t>(index)));
           },
           py::arg("index"), "The int64 counter `index` of this rank's region.")
      .def("flag",
           [](PyProxy& p, int buffer, int64_t counter, int64_t src_rank) {
             const auto& o = p.proxy().ordering();
             require(buffer == 0 || buffer == 1, "buffer must be 0 or 1");
             require(counter >= 0 && counter < o.config().num_counters, "counter must be in [0, num_counters)");
             require(src_rank >= 0 && src_rank < o.config().num_ranks, "src_rank must be in [0, num_ranks)");
             return p.read_word(o.flag_offset(buffer, static_cast<uint32_t>(counter), static_cast<uint32_t>(src_rank)));
           },
           py::arg("buffer"), py::arg("counter"), py::arg("src_rank"),
           "The low-latency count flag of (buffer, counter, src_rank): 0, or -(N+1).")
      .def("stats", [](PyProxy& p) {
        const uccl_ep::ProxyStats s = p.proxy().stats();
        py::dict d;
        d["commands"] = s.commands;
        d["requests_posted"] = s.requests_posted;
        d["requests_completed"] = s.requests_completed;
        d["inflight_peak"] = s.inflight_peak;
        d["flow_stalls"] = s.flow_stalls;
        d["window_stalls"] = s.window_stalls;
        d["native_adds"] = s.native_adds;
        d["quiets"] = s.quiets;
        d["quiets_on_gpu"] = s.quiets_on_gpu;
        d["barriers"] = s.barriers;
        d["immediates"] = s.immediates;
        d["idle_sleeps"] = s.idle_sleeps;
        d["execute_ns"] = s.execute_ns;
        d["quiet_wait_ns"] = s.quiet_wait_ns;
        d["ordering"] = ordering_stats_dict(s.ordering);
        return d;
      })
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](PyProxy& p, py::args) { p.shutdown(false); });

  py::class_<PyReceiverOrdering>(m, "ReceiverOrdering",
                                 "The receiver-side ordering layer alone over a caller's buffer (for tests).")
      .def(py::init([](int64_t region_ptr, int64_t region_bytes, uint32_t num_ranks, uint32_t num_counters,
                       uint64_t counters_offset, uint64_t flags_offset, uint32_t window, bool enabled) {
             uccl_ep::OrderingConfig c;
             c.num_ranks = num_ranks;
             c.num_counters = num_counters;
             c.counters_offset = counters_offset;
             c.flags_offset = flags_offset;
             c.window = window;
             c.enabled = enabled;
             return std::make_unique<PyReceiverOrdering>(region_ptr, region_bytes, c);
           }),
           py::arg("region_ptr"), py::arg("region_bytes"), py::arg("num_ranks"), py::arg("num_counters"),
           py::arg("counters_offset"), py::arg("flags_offset"), py::arg("window") = uccl_ep::kMaxImmWindow,
           py::arg("enabled") = true)
      .def("on_immediate", &PyReceiverOrdering::on_immediate, py::arg("src_rank"), py::arg("imm"))
      .def("stats", &PyReceiverOrdering::stats);

  m.def("encode_immediate", &py_encode_immediate, py::arg("kind"), py::arg("buffer") = 0, py::arg("seq") = 0,
        py::arg("counter") = 0, py::arg("value") = 0,
        "Pack a proxy immediate (proxy/immediate.h): kind 0 write-landed, 1 atomic add, 2 count flag, 3 control.");
  m.def("decode_immediate", &py_decode_immediate, py::arg("imm"),
        "Unpack a proxy immediate into {kind, kind_name, buffer, seq, counter, value}.");
  py::dict layout;
  layout["kind_bits"] = py::make_tuple(30, 2);
  layout["buffer_bits"] = py::make_tuple(29, 1);
  layout["seq_bits"] = py::make_tuple(25, uccl_ep::kImmSeqBits);
  layout["counter_bits"] = py::make_tuple(14, uccl_ep::kImmCounterBits);
  layout["value_bits"] = py::make_tuple(0, uccl_ep::kImmValueBits);
  layout["max_counters"] = uccl_ep::kImmMaxCounters;
  layout["max_value"] = uccl_ep::kImmMaxUnsignedValue;
  layout["min_add"] = uccl_ep::kImmMinAdd;
  layout["max_add"] = uccl_ep::kImmMaxAdd;
  layout["max_window"] = uccl_ep::kMaxImmWindow;
  m.attr("IMMEDIATE_LAYOUT") = layout;
}
