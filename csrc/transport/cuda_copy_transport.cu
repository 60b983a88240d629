// The cuda-copy transport: see cuda_copy_transport.h for the design.
#include "transport/cuda_copy_transport.h"

#include <chrono>
#include <cstdio>
#include <stdexcept>
#include <thread>

#include "common/deadline.h"
#include "common/settings.h"
#include "transport/request_checks.h"
#include "nvlink/peer_memory.h"

namespace uccl_ep {

namespace {

using Clock = std::chrono::steady_clock;

// How long quiet() and close() sleep between two looks at the events: short next to a copy,
// long enough not to spin a core.
constexpr std::chrono::microseconds kDrainPollInterval{20};

TcpTransportOptions control_options(const CudaCopyTransportOptions& options) {
  TcpTransportOptions control;
  control.reorder_seed = options.reorder_seed;  // resolved the same way: the same seed, or the same environment
  control.timeout_s = options.timeout_s;
  return control;
}

// Splits "ip:port/region_bytes" into the control transport's address and the region size.
void split_address(const std::string& address, int rank, std::string& control_address, uint64_t& region_bytes) {
  const std::string name = "addresses[" + std::to_string(rank) + "]";
  const size_t slash = address.rfind('/');
  if (slash == std::string::npos) {
    throw std::invalid_argument(name + " = '" + address +
                                "' is not a CudaCopyTransport listen_address() ('ip:port/region_bytes')");
  }
  control_address = address.substr(0, slash);
  region_bytes = parse_setting_unsigned(name + " region_bytes", address.substr(slash + 1), 1);
}

}  // namespace

// ---------------------------------------------------------------------------------------
// Construction and bootstrap
// ---------------------------------------------------------------------------------------

CudaCopyTransport::CudaCopyTransport(int rank, int num_ranks, const PeerMemory& memory,
                                     const CudaCopyTransportOptions& options)
    : rank_(rank),
      num_ranks_(num_ranks),
      device_(memory.device()),
      local_base_(reinterpret_cast<void*>(memory.local_base())),
      timeout_s_(options.timeout_s),
      reorder_(ReorderConfig::resolve(options.reorder_seed)),
      control_(rank, num_ranks, MemoryRegion{}, control_options(options)) {  // checks rank, num_ranks, timeout_s
  peers_.resize(num_ranks);
  for (int r = 0; r < num_ranks; ++r) {
    try {
      peers_[r].base = reinterpret_cast<uint8_t*>(memory.peer_base(r));
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument("num_ranks=" + std::to_string(num_ranks) + " does not match peer_memory: " +
                                  e.what());
    }
    peers_[r].window = ReorderWindow<Request>(reorder_, static_cast<uint32_t>(rank), static_cast<uint32_t>(r));
    peers_[r].fences_waited.assign(num_ranks, 0);
  }
  if (peers_[rank].base != local_base_) {
    throw std::invalid_argument("peer_memory maps another rank's buffer as rank " + std::to_string(rank) +
                                ": its open_peers() must be called with this rank");
  }
  peers_[rank].bytes = static_cast<uint64_t>(memory.num_bytes());
  create_streams();
}

CudaCopyTransport::~CudaCopyTransport() {
  try {
    close();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "[uccl-ep] %s: close() in the destructor failed: %s\n", who().c_str(), e.what());
  }
}

void CudaCopyTransport::create_streams() {
  ScopedDevice device(device_, name(), rank_);
  load_region_ops_kernels();
  for (int r = 0; r < num_ranks_; ++r) {
    const gpuError_t status = gpu_stream_create_nonblocking(&peers_[r].stream);
    if (status != kGpuSuccess) {
      peers_[r].stream = nullptr;
      release_gpu_resources();  // the destructor does not run for a constructor that throws
      throw TransportError(who() + ": cannot create the stream for peer " + std::to_string(r) + ": " +
                           gpu_error_text(status));
    }
  }
  writer_ = std::make_unique<DeviceRegionWriter>(MemoryRegion{local_base_, peers_[rank_].bytes}, device_,
                                                 peers_[rank_].stream, name(), rank_);
}

std::string CudaCopyTransport::who() const { return transport_label(name(), rank_); }

std::string CudaCopyTransport::failure(int peer, uint64_t request_id, const std::string& what,
                                       gpuError_t status) const {
  return who() + ": request " + std::to_string(request_id) + " to peer " + std::to_string(peer) + ": " + what +
         " failed: " + gpu_error_text(status);
}

std::string CudaCopyTransport::listen_address() const {
  return control_.listen_address() + "/" + std::to_string(peers_[rank_].bytes);
}

void CudaCopyTransport::connect(const std::vector<std::string>& addresses) {
  if (closed_) throw TransportError(who() + ": connect() after close()");
  if (connected_) throw TransportError(who() + ": connect() called twice");
  if (static_cast<int>(addresses.size()) != num_ranks_) {
    throw std::invalid_argument("addresses must list num_ranks=" + std::to_string(num_ranks_) +
                                " addresses, one per rank (got " + std::to_string(addresses.size()) + ")");
  }
  std::vector<std::string> control_addresses(num_ranks_);
  std::vector<uint64_t> region_bytes(num_ranks_);
  for (int r = 0; r < num_ranks_; ++r) split_address(addresses[r], r, control_addresses[r], region_bytes[r]);
  if (region_bytes[rank_] != peers_[rank_].bytes) {
    throw std::invalid_argument("addresses[" + std::to_string(rank_) + "] = '" + addresses[rank_] + "' announces " +
                                std::to_string(region_bytes[rank_]) + " region bytes, but this rank's region has " +
                                std::to_string(peers_[rank_].bytes));
  }
  control_.connect(control_addresses);
  // Posting starts only after connect() returns, so the sizes need no lock.
  for (int r = 0; r < num_ranks_; ++r) peers_[r].bytes = region_bytes[r];
  connected_ = true;
}

// ---------------------------------------------------------------------------------------
// Posting
// ---------------------------------------------------------------------------------------

void CudaCopyTransport::check_usable(int peer, const char* op) const {
  uccl_ep::check_usable(who(), closed_, connected_, peer, num_ranks_, op);
}

void CudaCopyTransport::post_write(int peer, uint64_t local_offset, uint64_t remote_offset, uint64_t length,
                                   std::optional<uint32_t> imm, uint64_t request_id) {
  check_usable(peer, "post_write");
  check_range("local_offset", local_offset, length, peers_[rank_].bytes, "the local region");
  check_range("remote_offset", remote_offset, length, peers_[peer].bytes,
              "peer " + std::to_string(peer) + "'s region");
  Request request;
  request.op = Op::kWrite;
  request.id = request_id;
  request.local_offset = local_offset;
  request.remote_offset = remote_offset;
  request.length = length;
  request.imm = imm;
  post(peer, std::move(request));
}

void CudaCopyTransport::post_atomic_add(int peer, uint64_t remote_offset, int64_t value, uint64_t request_id) {
  check_usable(peer, "post_atomic_add");
  if (remote_offset % 8 != 0) {
    throw std::invalid_argument("remote_offset " + std::to_string(remote_offset) +
                                " of an atomic add is not a multiple of 8");
  }
  check_range("remote_offset", remote_offset, 8, peers_[peer].bytes, "peer " + std::to_string(peer) + "'s region");
  Request request;
  request.op = Op::kAtomicAdd;
  request.id = request_id;
  request.remote_offset = remote_offset;
  request.value = value;
  post(peer, std::move(request));
}

void CudaCopyTransport::post(int peer, Request&& request) {
  std::lock_guard<std::mutex> lock(mu_);
  if (request.imm || request.op == Op::kAtomicAdd) ++unordered_requests_;
  ScopedDevice device(device_, name(), rank_);
  peers_[peer].window.push(std::move(request), Clock::now(), [&](Request&& released) { issue(peer, released); });
}

void CudaCopyTransport::issue(int peer, const Request& request) {
  Peer& p = peers_[peer];
  gpuEvent_t done = acquire_event(peer, request.id);
  gpuError_t status = wait_for_fences(peer);
  const char* what = "cudaStreamWaitEvent (after a fence)";
  if (status == kGpuSuccess) {
    status = enqueue(p, request);
    what = request.op == Op::kWrite ? "cudaMemcpyAsync" : "launching the atomic add kernel";
  }
  if (status == kGpuSuccess) {
    status = gpu_event_record(done, p.stream);
    what = "cudaEventRecord";
  }
  if (status != kGpuSuccess) {
    spare_events_.push_back(done);
    throw TransportError(failure(peer, request.id, what, status));
  }
  p.issued.push_back(Issued{request, done, Clock::now()});
  p.written_since_fence = true;
}

gpuError_t CudaCopyTransport::wait_for_fences(int peer) {
  Peer& p = peers_[peer];
  for (int r = 0; r < num_ranks_; ++r) {
    const Peer& other = peers_[r];
    if (r == peer || other.fence_number <= p.fences_waited[r]) continue;
    const gpuError_t status = gpu_stream_wait_event(p.stream, other.fence_event);
    if (status != kGpuSuccess) return status;
    p.fences_waited[r] = other.fence_number;
  }
  return kGpuSuccess;
}

gpuError_t CudaCopyTransport::enqueue(const Peer& p, const Request& request) {
  if (request.op == Op::kAtomicAdd) {
    return launch_atomic_add_system(p.base + request.remote_offset, request.value, p.stream);
  }
  if (request.length == 0) return kGpuSuccess;  // an immediate alone: only the event is recorded
  const uint8_t* source = static_cast<const uint8_t*>(local_base_) + request.local_offset;
  return gpu_copy_async(p.base + request.remote_offset, source, request.length, p.stream);
}

gpuEvent_t CudaCopyTransport::acquire_event(int peer, uint64_t request_id) {
  if (!spare_events_.empty()) {
    gpuEvent_t event = spare_events_.back();
    spare_events_.pop_back();
    return event;
  }
  gpuEvent_t event = nullptr;
  const gpuError_t status = gpu_event_create(&event);
  if (status != kGpuSuccess) throw TransportError(failure(peer, request_id, "cudaEventCreateWithFlags", status));
  return event;
}

void CudaCopyTransport::flush_windows() {
  for (int r = 0; r < num_ranks_; ++r) {
    peers_[r].window.flush([&](Request&& released) { issue(r, released); });
  }
}

// ---------------------------------------------------------------------------------------
// Progress and completion
// ---------------------------------------------------------------------------------------

void CudaCopyTransport::progress() {
  if (!connected_ || closed_) return;
  try {
    ScopedDevice device(device_, name(), rank_);
    for (int r = 0; r < num_ranks_; ++r) {
      release_expired_window(r);
      retire_finished(r);
    }
  } catch (const TransportError& e) {
    errors_.push_back(e.what());
  }
}

void CudaCopyTransport::release_expired_window(int peer) {
  Peer& p = peers_[peer];
  if (!p.window.expired(Clock::now())) return;
  try {
    p.window.flush([&](Request&& released) { issue(peer, released); });
  } catch (const TransportError& e) {
    errors_.push_back(e.what());  // that request is lost; the rest of the window stays held for the next call
  }
}

void CudaCopyTransport::retire_finished(int peer) {
  Peer& p = peers_[peer];
  while (!p.issued.empty()) {
    const gpuError_t status = gpu_event_query(p.issued.front().done);
    if (status == kGpuErrorNotReady) {
      // Not an error, but the runtime may still record it as the thread's last error, which
      // the next kernel launch's check would then report.
      (void)gpu_last_error();
      return;
    }
    const Request request = p.issued.front().request;
    spare_events_.push_back(p.issued.front().done);
    p.issued.pop_front();
    if (request.imm || request.op == Op::kAtomicAdd) --unordered_requests_;
    if (status != kGpuSuccess) {
      errors_.push_back(failure(peer, request.id, request.op == Op::kWrite ? "the copy" : "the atomic add", status));
      continue;
    }
    retire(peer, request);
  }
}

void CudaCopyTransport::retire(int peer, const Request& request) {
  if (!request.imm) {
    completions_.push_back(request.id);
    return;
  }
  // The bytes are in the peer's memory: the immediate may go. The control transport completes
  // the request (under its id) once the peer has acknowledged it.
  try {
    control_.post_write(peer, 0, 0, 0, request.imm, request.id);
  } catch (const TransportError& e) {
    errors_.push_back(who() + ": request " + std::to_string(request.id) + " to peer " + std::to_string(peer) +
                      ": its bytes landed but its immediate could not be sent: " + e.what());
  }
}

void CudaCopyTransport::throw_first_error() {
  if (errors_.empty()) return;
  std::string error = std::move(errors_.front());
  errors_.pop_front();
  throw TransportError(error);
}

size_t CudaCopyTransport::poll_completions(uint64_t* out, size_t max) {
  std::lock_guard<std::mutex> lock(mu_);
  progress();
  throw_first_error();
  // The control transport throws its errors before it hands out any id, so none is lost here.
  size_t n = control_.poll_completions(out, max);
  while (n < max && !completions_.empty()) {
    out[n++] = completions_.front();
    completions_.pop_front();
  }
  return n;
}

size_t CudaCopyTransport::poll_immediates(ImmediateEvent* out, size_t max) {
  {
    // A rank that only waits for immediates must still forward its own: progress here too.
    std::lock_guard<std::mutex> lock(mu_);
    progress();
  }
  return control_.poll_immediates(out, max);
}

uint64_t CudaCopyTransport::data_outstanding() const {
  uint64_t total = 0;
  for (const Peer& p : peers_) total += p.window.size() + p.issued.size();
  return total;
}

uint64_t CudaCopyTransport::outstanding() const {
  std::lock_guard<std::mutex> lock(mu_);
  return data_outstanding() + control_.outstanding();
}

bool CudaCopyTransport::drain_copies(std::unique_lock<std::mutex>& lock, Clock::time_point deadline) {
  for (;;) {
    progress();
    if (data_outstanding() == 0) return true;
    if (Clock::now() >= deadline) return false;
    lock.unlock();  // posts and polls of other threads go on meanwhile
    std::this_thread::sleep_for(kDrainPollInterval);
    lock.lock();
  }
}

std::string CudaCopyTransport::copy_timeout_message() const {
  int first = -1;
  std::string detail;
  for (int r = 0; r < num_ranks_; ++r) {
    const uint64_t n = peers_[r].window.size() + peers_[r].issued.size();
    if (n == 0) continue;
    if (first < 0) first = r;
    detail += (detail.empty() ? "" : ", ") + std::string("peer ") + std::to_string(r) + ": " + std::to_string(n);
  }
  return who() + ": quiet() timed out after " + format_seconds(timeout_s_) + " with " +
         std::to_string(peers_[first].window.size() + peers_[first].issued.size()) +
         " requests outstanding to peer " + std::to_string(first) + " on the copy engine (" +
         std::to_string(data_outstanding()) + " in total: " + detail + "); oldest: " + describe_oldest();
}

std::string CudaCopyTransport::oldest_outstanding() const {
  std::lock_guard<std::mutex> lock(mu_);
  return describe_oldest();
}

std::string CudaCopyTransport::describe_oldest() const {
  const Clock::time_point now = Clock::now();
  int oldest = -1;
  for (int r = 0; r < num_ranks_; ++r) {
    const Peer& p = peers_[r];
    if (p.issued.empty()) continue;
    if (oldest < 0 || p.issued.front().issued_at < peers_[oldest].issued.front().issued_at) oldest = r;
  }
  if (oldest < 0) {
    for (int r = 0; r < num_ranks_; ++r) {
      if (peers_[r].window.size() > 0) {
        return std::to_string(peers_[r].window.size()) + " requests to peer " + std::to_string(r) +
               " held in the reorder window";
      }
    }
    return {};
  }
  const Issued& issued = peers_[oldest].issued.front();
  const Request& request = issued.request;
  const double waited = std::chrono::duration<double>(now - issued.issued_at).count();
  std::string what = request.op == Op::kWrite
                         ? "write of " + std::to_string(request.length) + " bytes to peer " + std::to_string(oldest) +
                               " (request " + std::to_string(request.id) + ", local offset " +
                               std::to_string(request.local_offset) + " -> remote offset " +
                               std::to_string(request.remote_offset) + ")"
                         : "atomic add to peer " + std::to_string(oldest) + " (request " + std::to_string(request.id) +
                               ", remote offset " + std::to_string(request.remote_offset) + ")";
  const char* hint = request.op == Op::kWrite ? kStalledCopyHint : "";
  return what + ", on the copy engine for " + format_seconds(waited) + hint;
}

void CudaCopyTransport::quiet() {
  if (closed_) throw TransportError(who() + ": quiet() after close()");
  if (!connected_) return;  // nothing can have been posted
  {
    std::unique_lock<std::mutex> lock(mu_);
    ScopedDevice device(device_, name(), rank_);
    flush_windows();
    const bool drained = drain_copies(lock, deadline_after(timeout_s_));
    throw_first_error();
    if (!drained) throw TransportError(copy_timeout_message());
  }
  // Every immediate is with the control transport now: release what its windows hold and wait
  // for the acknowledgements (its errors and timeout name the rank and the peer).
  control_.quiet();
}

bool CudaCopyTransport::fence() {
  if (closed_) throw TransportError(who() + ": fence() after close()");
  if (!connected_) return true;  // nothing can have been posted
  std::lock_guard<std::mutex> lock(mu_);
  // An immediate goes out through the control transport once its copy has finished, and an atomic
  // add's effect is for the peer to see: the streams order neither.
  if (unordered_requests_ > 0 || control_.outstanding() > 0) return false;
  ScopedDevice device(device_, name(), rank_);
  flush_windows();  // what the windows hold was posted before the fence
  ++fences_;
  for (int r = 0; r < num_ranks_; ++r) {
    Peer& p = peers_[r];
    if (!p.written_since_fence) continue;
    gpuError_t status = kGpuSuccess;
    if (p.fence_event == nullptr) status = gpu_event_create(&p.fence_event);
    if (status == kGpuSuccess) status = gpu_event_record(p.fence_event, p.stream);
    if (status != kGpuSuccess) {
      throw TransportError(who() + ": a fence on the stream to peer " + std::to_string(r) + " failed: " +
                           gpu_error_text(status));
    }
    p.fence_number = fences_;
    p.written_since_fence = false;
  }
  return true;
}

// ---------------------------------------------------------------------------------------
// Shutdown
// ---------------------------------------------------------------------------------------

void CudaCopyTransport::close() {
  if (closed_) return;
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (connected_) {
      // Best effort: issue what the windows hold and let the copies finish, so their
      // immediates still go out (bounded, like the control transport's own flush).
      try {
        ScopedDevice device(device_, name(), rank_);
        flush_windows();
        drain_copies(lock, deadline_after(timeout_s_));
      } catch (const TransportError&) {
        // close() abandons requests in flight (transport.h): their failures no longer matter.
      }
    }
    closed_ = true;
    release_gpu_resources();
  }
  control_.close();
}

void CudaCopyTransport::release_gpu_resources() {
  // Destroying a stream or an event with work pending is safe: the runtime frees it once the
  // work is done. Failures are ignored: the handles are gone either way (e.g. at interpreter
  // exit the runtime may be unloading already).
  ScopedDevice device(device_);
  for (Peer& p : peers_) {
    for (const Issued& issued : p.issued) (void)gpu_event_destroy(issued.done);
    p.issued.clear();
    p.window.discard();
    if (p.fence_event != nullptr) (void)gpu_event_destroy(p.fence_event);
    p.fence_event = nullptr;
    if (p.stream != nullptr) (void)gpu_stream_destroy(p.stream);
    p.stream = nullptr;
  }
  for (gpuEvent_t event : spare_events_) (void)gpu_event_destroy(event);
  spare_events_.clear();
  (void)gpu_last_error();  // none of those failures concerns later calls of this thread
}

}  // namespace uccl_ep
