// The tcp transport: see tcp_transport.h for the design and the wire format.
#include "transport/tcp_transport.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "common/deadline.h"
#include "common/portability.h"
#include "common/settings.h"
#include "transport/request_checks.h"

namespace uccl_ep {

namespace {

using Clock = std::chrono::steady_clock;
using tcp_wire::FrameHeader;

constexpr uint32_t kWakeToken = 0xFFFFFFFFu;
constexpr int kMaxTransportRanks = 4096;
constexpr uint64_t kMaxReasonBytes = 4096;
constexpr size_t kMaxIov = 64;
constexpr const char* kIfnameEnv = "UCCL_SOCKET_IFNAME";

// Staging of a device region: a quarter receives, the rest is cut into at least kMinSendChunks chunks
// of at most kMaxChunkBytes for sending.
constexpr const char* kStagingEnv = "UCCL_EP_TCP_STAGING_BYTES";
constexpr uint64_t kDefaultStagingBytes = 64ull << 20;
constexpr uint64_t kMinStagingBytes = 64ull << 10;
constexpr uint64_t kMaxChunkBytes = 1ull << 20;
constexpr uint64_t kMinSendChunks = 8;
// What one connection stages ahead of its socket, at most: more than a socket buffer takes, little
// enough that the I/O thread's wait for the copies does not hold up the other connections for long.
constexpr uint64_t kMaxStagedAheadBytes = 8ull << 20;

int remaining_ms(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return left <= 0 ? 0 : static_cast<int>(std::min<int64_t>(left, 1000 * 1000));
}

// The IPv4 address to listen on: UCCL_SOCKET_IFNAME's, else loopback.
std::string resolve_listen_ip(const std::string& who) {
  const char* env = std::getenv(kIfnameEnv);
  if (env == nullptr || *env == '\0') return "127.0.0.1";
  const std::string want(env);
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) {
    throw TransportError(who + ": getifaddrs failed while resolving " + kIfnameEnv + "=" + want + ": " +
                         errno_text(errno));
  }
  std::string found;
  std::string available;
  for (ifaddrs* it = list; it != nullptr; it = it->ifa_next) {
    if (it->ifa_addr == nullptr || it->ifa_addr->sa_family != AF_INET) continue;
    char text[INET_ADDRSTRLEN] = {0};
    inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(it->ifa_addr)->sin_addr, text, sizeof(text));
    if (found.empty() && want == it->ifa_name) found = text;
    available += std::string(available.empty() ? "" : ", ") + it->ifa_name + " " + text;
  }
  freeifaddrs(list);
  if (found.empty()) {
    throw TransportError(who + ": " + kIfnameEnv + "=" + want +
                         " names no interface with an IPv4 address (interfaces with one: " +
                         (available.empty() ? std::string("none") : available) + ")");
  }
  return found;
}

bool parse_address(const std::string& text, sockaddr_in& out) {
  const size_t colon = text.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == text.size()) return false;
  const std::string host = text.substr(0, colon);
  const std::string port_text = text.substr(colon + 1);
  if (port_text.find_first_not_of("0123456789") != std::string::npos || port_text.size() > 5) return false;
  const int port = std::stoi(port_text);
  if (port <= 0 || port > 65535) return false;
  std::memset(&out, 0, sizeof(out));
  out.sin_family = AF_INET;
  out.sin_port = htons(static_cast<uint16_t>(port));
  return inet_pton(AF_INET, host.c_str(), &out.sin_addr) == 1;
}

void set_nodelay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

// Blocking-with-deadline helpers on non-blocking sockets, for the handshake only.
// They return an empty string on success, else what went wrong.
std::string send_all(int fd, const void* data, size_t n, Clock::time_point deadline) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t sent = ::send(fd, p, n, MSG_NOSIGNAL);
    if (sent > 0) {
      p += sent;
      n -= static_cast<size_t>(sent);
      continue;
    }
    if (sent < 0 && errno == EINTR) continue;
    if (sent < 0 && errno != EAGAIN && errno != EWOULDBLOCK) return "send failed: " + errno_text(errno);
    pollfd pfd{fd, POLLOUT, 0};
    const int ms = remaining_ms(deadline);
    if (ms == 0) return "timed out sending";
    if (::poll(&pfd, 1, ms) < 0 && errno != EINTR) return "poll failed: " + errno_text(errno);
  }
  return "";
}

std::string recv_all(int fd, void* data, size_t n, Clock::time_point deadline) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    const ssize_t got = ::recv(fd, p, n, 0);
    if (got > 0) {
      p += got;
      n -= static_cast<size_t>(got);
      continue;
    }
    if (got == 0) return "the connection was closed during the handshake";
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) return "recv failed: " + errno_text(errno);
    pollfd pfd{fd, POLLIN, 0};
    const int ms = remaining_ms(deadline);
    if (ms == 0) return "timed out waiting for its hello";
    if (::poll(&pfd, 1, ms) < 0 && errno != EINTR) return "poll failed: " + errno_text(errno);
  }
  return "";
}

FrameHeader make_header(uint8_t type, uint64_t id, uint64_t offset, uint64_t length) {
  FrameHeader h{};
  h.magic = tcp_wire::kMagic;
  h.type = type;
  h.request_id = id;
  h.offset = offset;
  h.length = length;
  return h;
}

uint64_t payload_bytes(const FrameHeader& h) {
  return (h.type == tcp_wire::kWrite || h.type == tcp_wire::kNack) ? h.length : 0;
}

// The staging size: the option, else the environment, else the default.
uint64_t resolve_staging_bytes(uint64_t option) {
  if (option != 0) {
    if (option < kMinStagingBytes) {
      throw std::invalid_argument("staging_bytes must be >= " + std::to_string(kMinStagingBytes) + " (got " +
                                  std::to_string(option) + ")");
    }
    return option;
  }
  const char* env = std::getenv(kStagingEnv);
  if (env != nullptr && *env != '\0') return parse_setting_unsigned(kStagingEnv, env, kMinStagingBytes);
  return kDefaultStagingBytes;
}

// Closes the fds it holds unless released.
struct FdGuard {
  std::vector<int> fds;
  ~FdGuard() {
    for (int fd : fds)
      if (fd >= 0) ::close(fd);
  }
};

}  // namespace

// ---------------------------------------------------------------------------------------
// Construction and bootstrap
// ---------------------------------------------------------------------------------------

TcpTransport::TcpTransport(int rank, int num_ranks, MemoryRegion region, const TcpTransportOptions& options)
    : rank_(rank),
      num_ranks_(num_ranks),
      region_(region),
      device_(options.device),
      timeout_s_(options.timeout_s),
      reorder_(ReorderConfig::resolve(options.reorder_seed)) {
  if (num_ranks < 1 || num_ranks > kMaxTransportRanks) {
    throw std::invalid_argument("num_ranks must be in [1, " + std::to_string(kMaxTransportRanks) + "] (got " +
                                std::to_string(num_ranks) + ")");
  }
  if (rank < 0 || rank >= num_ranks) {
    throw std::invalid_argument("rank must be in [0, num_ranks=" + std::to_string(num_ranks) + ") (got " +
                                std::to_string(rank) + ")");
  }
  if (region.base == nullptr && region.bytes != 0) {
    throw std::invalid_argument("region_ptr is null but region_bytes is " + std::to_string(region.bytes));
  }
  if (!(options.timeout_s > 0)) {
    throw std::invalid_argument("timeout_s must be > 0 (got " + std::to_string(options.timeout_s) + ")");
  }
  if (options.listen_port < 0 || options.listen_port > 65535) {
    throw std::invalid_argument("listen_port must be in [0, 65535] (got " + std::to_string(options.listen_port) + ")");
  }
  if (options.device < -1) {
    throw std::invalid_argument("device must be >= 0, or -1 for host memory (got " + std::to_string(options.device) +
                                ")");
  }
  if (options.device >= 0 && options.stage_host_region_for_test) {
    throw std::invalid_argument("stage_host_region_for_test stages a host region: device must be -1");
  }
  if (options.device >= 0 || options.stage_host_region_for_test) stage_region(options);
  const std::string ip = resolve_listen_ip(who());

  FdGuard guard;
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) throw TransportError(who() + ": socket() failed: " + errno_text(errno));
  guard.fds.push_back(fd);
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(options.listen_port));
  inet_pton(AF_INET, ip.c_str(), &addr.sin_addr);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    const int err = errno;
    throw TransportError(who() + ": cannot listen on " + ip + ":" + std::to_string(options.listen_port) + ": bind: " +
                         errno_text(err) + (err == EADDRINUSE ? " (the port is in use)" : ""));
  }
  if (::listen(fd, std::min(num_ranks + 16, 4096)) != 0) {
    throw TransportError(who() + ": listen on " + ip + " failed: " + errno_text(errno));
  }
  socklen_t len = sizeof(addr);
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    throw TransportError(who() + ": getsockname failed: " + errno_text(errno));
  }
  listen_address_ = ip + ":" + std::to_string(ntohs(addr.sin_port));
  guard.fds.clear();
  listen_fd_ = fd;

  peers_.reserve(num_ranks);
  for (int r = 0; r < num_ranks; ++r) {
    auto p = std::make_unique<Peer>();
    p->rank = r;
    p->window = ReorderWindow<OutFrame>(reorder_, static_cast<uint32_t>(rank), static_cast<uint32_t>(r));
    if (r == rank) {
      p->region_bytes = region.bytes;
      p->out_done = p->in_done = true;
    }
    peers_.push_back(std::move(p));
  }
}

TcpTransport::~TcpTransport() {
  try {
    close();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "[uccl-ep] %s: close() in the destructor failed: %s\n", who().c_str(), e.what());
  }
}

void TcpTransport::stage_region(const TcpTransportOptions& options) {
  staging_bytes_ = resolve_staging_bytes(options.staging_bytes);
  if (options.stage_host_region_for_test) {
    staged_ = make_host_staged_region(region_, staging_bytes_);
  } else {
#if defined(UCCL_EP_GPU_RUNTIME)
    staged_ = make_device_staged_region(options.device, region_, staging_bytes_, rank_, options.timeout_s);
#else
    throw std::invalid_argument("device=" + std::to_string(options.device) +
                                " needs GPU support, and this build has none (built without CUDA): the tcp "
                                "transport serves host memory only");
#endif
  }
  arena_bytes_ = staging_bytes_ / 4;
  const uint64_t send_bytes = staging_bytes_ - arena_bytes_;
  const uint64_t chunk_bytes = std::min(kMaxChunkBytes, send_bytes / kMinSendChunks) / 64 * 64;
  pool_.reset(staged_->staging() + arena_bytes_, send_bytes, chunk_bytes);
  // Several connections share the pool: none may take it all and starve the others.
  const size_t share = num_ranks_ > 2 ? std::max<size_t>(1, pool_.chunks() / 2) : pool_.chunks();
  peer_chunks_ = std::min<size_t>(share, std::max<uint64_t>(1, kMaxStagedAheadBytes / chunk_bytes));
}

std::string TcpTransport::who() const { return "tcp transport rank " + std::to_string(rank_); }

std::string TcpTransport::peer_label(const Peer& p) const { return "peer " + std::to_string(p.rank); }

void TcpTransport::connect(const std::vector<std::string>& addresses) {
  if (closed_) throw TransportError(who() + ": connect() after close()");
  if (connected_) throw TransportError(who() + ": connect() called twice");
  if (static_cast<int>(addresses.size()) != num_ranks_) {
    throw std::invalid_argument("addresses must list num_ranks=" + std::to_string(num_ranks_) +
                                " addresses, one per rank (got " + std::to_string(addresses.size()) + ")");
  }
  std::vector<sockaddr_in> resolved(num_ranks_);
  for (int r = 0; r < num_ranks_; ++r) {
    if (!parse_address(addresses[r], resolved[r])) {
      throw std::invalid_argument("addresses[" + std::to_string(r) + "] = '" + addresses[r] +
                                  "' is not an IPv4 'ip:port'");
    }
  }
  const Clock::time_point deadline = deadline_after(timeout_s_);
  FdGuard guard;
  std::vector<int> fds(num_ranks_, -1);

  FrameHeader hello = make_header(tcp_wire::kHello, static_cast<uint64_t>(rank_), region_.bytes,
                                  static_cast<uint64_t>(num_ranks_));
  hello.imm = tcp_wire::kProtocolVersion;

  auto check_hello = [&](const FrameHeader& h, int expected, const std::string& where) -> int {
    if (h.magic != tcp_wire::kMagic || h.type != tcp_wire::kHello) {
      throw TransportError(who() + ": " + where + " sent something that is not a uccl-ep tcp hello");
    }
    if (h.imm != tcp_wire::kProtocolVersion) {
      throw TransportError(who() + ": " + where + " speaks protocol version " + std::to_string(h.imm) + ", not " +
                           std::to_string(tcp_wire::kProtocolVersion));
    }
    if (h.length != static_cast<uint64_t>(num_ranks_)) {
      throw TransportError(who() + ": " + where + " has num_ranks " + std::to_string(h.length) + ", we have " +
                           std::to_string(num_ranks_));
    }
    const int claimed = h.request_id < static_cast<uint64_t>(num_ranks_) ? static_cast<int>(h.request_id) : -1;
    if (claimed < 0 || (expected >= 0 && claimed != expected)) {
      throw TransportError(who() + ": " + where + " says it is rank " + std::to_string(h.request_id) +
                           (expected >= 0 ? ", expected " + std::to_string(expected) : std::string()));
    }
    return claimed;
  };

  // 1. Dial every higher rank and send our hello (the listener's backlog completes the TCP
  //    handshake before the peer accepts, so this never waits on a peer's progress).
  for (int r = rank_ + 1; r < num_ranks_; ++r) {
    const std::string where = "peer " + std::to_string(r) + " at " + addresses[r];
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) throw TransportError(who() + ": socket() for " + where + " failed: " + errno_text(errno));
    guard.fds.push_back(fd);
    fds[r] = fd;
    if (::connect(fd, reinterpret_cast<sockaddr*>(&resolved[r]), sizeof(sockaddr_in)) != 0) {
      if (errno != EINPROGRESS) throw TransportError(who() + ": connect to " + where + " failed: " + errno_text(errno));
      pollfd pfd{fd, POLLOUT, 0};
      int rc;
      do {
        rc = ::poll(&pfd, 1, remaining_ms(deadline));
      } while (rc < 0 && errno == EINTR);
      if (rc == 0) {
        throw TransportError(who() + ": connect to " + where + " timed out after " + format_seconds(timeout_s_));
      }
      int err = 0;
      socklen_t len = sizeof(err);
      getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
      if (err != 0) throw TransportError(who() + ": connect to " + where + " failed: " + errno_text(err));
    }
    set_nodelay(fd);
    const std::string why = send_all(fd, &hello, sizeof(hello), deadline);
    if (!why.empty()) throw TransportError(who() + ": handshake with " + where + ": " + why);
  }

  // 2. Accept every lower rank, read its hello, answer with ours.
  for (int accepted = 0; accepted < rank_; ++accepted) {
    int fd = -1;
    while (fd < 0) {
      fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd >= 0) break;
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) throw TransportError(who() + ": accept failed: " + errno_text(errno));
      pollfd pfd{listen_fd_, POLLIN, 0};
      const int ms = remaining_ms(deadline);
      std::string missing;
      for (int r = 0; r < rank_; ++r)
        if (fds[r] < 0) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      if (ms == 0) {
        throw TransportError(who() + ": timed out after " + format_seconds(timeout_s_) +
                             " waiting for connections from ranks [" + missing + "] on " + listen_address_);
      }
      ::poll(&pfd, 1, ms);
    }
    guard.fds.push_back(fd);
    FrameHeader theirs{};
    std::string why = recv_all(fd, &theirs, sizeof(theirs), deadline);
    if (!why.empty()) throw TransportError(who() + ": handshake with an incoming connection: " + why);
    const int r = check_hello(theirs, -1, "an incoming connection");
    if (r >= rank_ || fds[r] >= 0) {
      throw TransportError(who() + ": an incoming connection claims rank " + std::to_string(r) +
                           (fds[r] >= 0 ? ", which is already connected" : ", which should be dialled by us instead"));
    }
    fds[r] = fd;
    peers_[r]->region_bytes = theirs.offset;
    set_nodelay(fd);
    why = send_all(fd, &hello, sizeof(hello), deadline);
    if (!why.empty()) throw TransportError(who() + ": handshake with peer " + std::to_string(r) + ": " + why);
  }

  // 3. Read the hello of every rank we dialled.
  for (int r = rank_ + 1; r < num_ranks_; ++r) {
    const std::string where = "peer " + std::to_string(r) + " at " + addresses[r];
    FrameHeader theirs{};
    const std::string why = recv_all(fds[r], &theirs, sizeof(theirs), deadline);
    if (!why.empty()) throw TransportError(who() + ": handshake with " + where + ": " + why);
    check_hello(theirs, r, where);
    peers_[r]->region_bytes = theirs.offset;
  }

  // 4. The I/O thread's epoll set.
  const int ep = ::epoll_create1(EPOLL_CLOEXEC);
  if (ep < 0) throw TransportError(who() + ": epoll_create1 failed: " + errno_text(errno));
  guard.fds.push_back(ep);
  const int wake = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (wake < 0) throw TransportError(who() + ": eventfd failed: " + errno_text(errno));
  guard.fds.push_back(wake);
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u32 = kWakeToken;
  if (::epoll_ctl(ep, EPOLL_CTL_ADD, wake, &ev) != 0) throw TransportError(who() + ": epoll_ctl: " + errno_text(errno));
  for (int r = 0; r < num_ranks_; ++r) {
    if (r == rank_) continue;
    ev.events = EPOLLIN;
    ev.data.u32 = static_cast<uint32_t>(r);
    if (::epoll_ctl(ep, EPOLL_CTL_ADD, fds[r], &ev) != 0) {
      throw TransportError(who() + ": epoll_ctl: " + errno_text(errno));
    }
  }

  // Committed: the fds now belong to the transport.
  guard.fds.clear();
  for (int r = 0; r < num_ranks_; ++r) {
    peers_[r]->fd = fds[r];
    peers_[r]->registered = (r != rank_);
  }
  epoll_fd_ = ep;
  wake_fd_ = wake;
  ::close(listen_fd_);
  listen_fd_ = -1;
  io_thread_ = std::thread([this] { io_loop(); });
  connected_ = true;
}

// ---------------------------------------------------------------------------------------
// Posting
// ---------------------------------------------------------------------------------------

void TcpTransport::check_usable(int peer, const char* op) const {
  uccl_ep::check_usable(who(), closed_, connected_, peer, num_ranks_, op);
}

void TcpTransport::post_write(int peer, uint64_t local_offset, uint64_t remote_offset, uint64_t length,
                              std::optional<uint32_t> imm, uint64_t request_id) {
  check_usable(peer, "post_write");
  check_range("local_offset", local_offset, length, region_.bytes, "the local region");
  check_range("remote_offset", remote_offset, length, peers_[peer]->region_bytes,
              "peer " + std::to_string(peer) + "'s region");
  post_write_unchecked_for_test(peer, local_offset, remote_offset, length, imm, request_id);
}

void TcpTransport::post_write_unchecked_for_test(int peer, uint64_t local_offset, uint64_t remote_offset,
                                                 uint64_t length, std::optional<uint32_t> imm, uint64_t request_id) {
  check_usable(peer, "post_write");
  check_range("local_offset", local_offset, length, region_.bytes, "the local region");
  OutFrame f;
  f.header = make_header(tcp_wire::kWrite, request_id, remote_offset, length);
  if (imm) {
    f.header.flags |= tcp_wire::kHasImm;
    f.header.imm = *imm;
  }
  f.payload = static_cast<const uint8_t*>(region_.base) + local_offset;
  f.staged = staged_ != nullptr;
  post(peer, std::move(f));
}

void TcpTransport::post_atomic_add(int peer, uint64_t remote_offset, int64_t value, uint64_t request_id) {
  check_usable(peer, "post_atomic_add");
  if (remote_offset % 8 != 0) {
    throw std::invalid_argument("remote_offset " + std::to_string(remote_offset) +
                                " of an atomic add is not a multiple of 8");
  }
  check_range("remote_offset", remote_offset, 8, peers_[peer]->region_bytes,
              "peer " + std::to_string(peer) + "'s region");
  OutFrame f;
  f.header = make_header(tcp_wire::kAtomicAdd, request_id, remote_offset, static_cast<uint64_t>(value));
  post(peer, std::move(f));
}

void TcpTransport::post(int peer, OutFrame&& frame) {
  Peer& p = *peers_[peer];
  {
    std::lock_guard<std::mutex> lock(state_mu_);
    if (p.failed) throw TransportError(who() + ": cannot post to " + peer_label(p) + ": " + p.failure);
    ++p.posted;
  }
  bool refused = false;
  {
    std::lock_guard<std::mutex> lock(p.mu);
    if (p.rank != rank_ && p.send_closed) {
      refused = true;
    } else {
      p.window.push(std::move(frame), Clock::now(), [&](OutFrame&& f) { release_locked(p, std::move(f)); });
    }
  }
  if (refused) {
    std::lock_guard<std::mutex> lock(state_mu_);
    --p.posted;
    throw TransportError(who() + ": cannot post to " + peer_label(p) + ": " +
                         (p.failure.empty() ? std::string("its connection is closing") : p.failure));
  }
  if (p.rank != rank_) wake();
}

void TcpTransport::release_locked(Peer& p, OutFrame&& frame) {
  if (p.rank == rank_) {
    apply_local(frame);
    return;
  }
  if (p.send_closed) return;  // the connection is gone; fail_peer accounted for the request
  p.queue.push_back(std::move(frame));
}

void TcpTransport::apply_local(const OutFrame& frame) {
  const FrameHeader& h = frame.header;
  uint8_t* target = static_cast<uint8_t*>(region_.base) + h.offset;
  std::string failure;
  if (h.type == tcp_wire::kWrite) {
    if (h.length > 0 && staged_) {
      failure = staged_->copy_local(target, frame.payload, h.length);
    } else if (h.length > 0) {
      std::memmove(target, frame.payload, h.length);
    }
  } else if (staged_) {
    failure = staged_->add_local(target, static_cast<int64_t>(h.length));
  } else {
    __atomic_fetch_add(reinterpret_cast<int64_t*>(target), static_cast<int64_t>(h.length), __ATOMIC_ACQ_REL);
  }
  std::lock_guard<std::mutex> lock(state_mu_);
  ++peers_[rank_]->finished;
  if (!failure.empty()) {
    errors_.push_back(who() + ": request " + std::to_string(h.request_id) + " to itself failed: " + failure);
  } else {
    if (h.type == tcp_wire::kWrite && (h.flags & tcp_wire::kHasImm)) {
      immediates_.push_back(ImmediateEvent{static_cast<uint32_t>(rank_), h.imm});
    }
    completions_.push_back(h.request_id);
  }
  state_cv_.notify_all();
}

void TcpTransport::wake() {
  if (wake_fd_ < 0) return;
  const uint64_t one = 1;
  ssize_t rc;
  do {
    rc = ::write(wake_fd_, &one, sizeof(one));
  } while (rc < 0 && errno == EINTR);
}

void TcpTransport::flush_windows() {
  for (auto& pp : peers_) {
    Peer& p = *pp;
    std::lock_guard<std::mutex> lock(p.mu);
    p.window.flush([&](OutFrame&& f) { release_locked(p, std::move(f)); });
  }
  wake();
}

// ---------------------------------------------------------------------------------------
// Completion side
// ---------------------------------------------------------------------------------------

size_t TcpTransport::poll_completions(uint64_t* out, size_t max) {
  std::lock_guard<std::mutex> lock(state_mu_);
  if (!errors_.empty()) {
    std::string e = std::move(errors_.front());
    errors_.pop_front();
    throw TransportError(e);
  }
  size_t n = 0;
  while (n < max && !completions_.empty()) {
    out[n++] = completions_.front();
    completions_.pop_front();
  }
  return n;
}

size_t TcpTransport::poll_immediates(ImmediateEvent* out, size_t max) {
  std::lock_guard<std::mutex> lock(state_mu_);
  size_t n = 0;
  while (n < max && !immediates_.empty()) {
    out[n++] = immediates_.front();
    immediates_.pop_front();
  }
  return n;
}

uint64_t TcpTransport::outstanding() const {
  std::lock_guard<std::mutex> lock(state_mu_);
  uint64_t total = 0;
  for (const auto& p : peers_) total += p->posted - p->finished;
  return total;
}

std::string TcpTransport::oldest_outstanding() const {
  std::string detail;
  for (const auto& peer : peers_) {
    Peer& p = *peer;
    uint64_t unfinished = 0;
    {
      std::lock_guard<std::mutex> lock(state_mu_);
      unfinished = p.posted - p.finished;
    }
    if (unfinished == 0) continue;
    size_t held = 0, queued = 0, staged = 0, front_sent = 0;
    {
      std::lock_guard<std::mutex> lock(p.mu);  // not nested with state_mu_: no lock order to keep
      held = p.window.size();
      queued = p.queue.size();
      staged = p.staged_frames;
      front_sent = p.front_sent;
    }
    detail += (detail.empty() ? "" : "; ") + peer_label(p) + ": " + std::to_string(unfinished) +
              " unacknowledged, " + std::to_string(held) + " frames held in the reorder window, " +
              std::to_string(queued) + " queued to send (" + std::to_string(staged) + " staged, " +
              std::to_string(front_sent) + " bytes of the first sent)";
  }
  return detail;
}

void TcpTransport::finish_request(Peer& p, uint64_t id, bool ok, const std::string& error) {
  std::lock_guard<std::mutex> lock(state_mu_);
  if (p.finished >= p.posted) return;  // already abandoned (the connection failed meanwhile)
  ++p.finished;
  if (ok) {
    completions_.push_back(id);
  } else {
    errors_.push_back(who() + ": " + peer_label(p) + " rejected request " + std::to_string(id) + ": " + error);
  }
  state_cv_.notify_all();
}

void TcpTransport::quiet() {
  if (closed_) throw TransportError(who() + ": quiet() after close()");
  if (!connected_) {
    if (outstanding() == 0) return;
    throw TransportError(who() + ": quiet() before connect()");
  }
  flush_windows();
  const Clock::time_point deadline = deadline_after(timeout_s_);
  std::unique_lock<std::mutex> lock(state_mu_);
  for (;;) {
    if (!errors_.empty()) {
      std::string e = std::move(errors_.front());
      errors_.pop_front();
      throw TransportError(e);
    }
    uint64_t total = 0;
    for (const auto& p : peers_) total += p->posted - p->finished;
    if (total == 0) return;
    if (state_cv_.wait_until(lock, deadline) == std::cv_status::timeout) {
      total = 0;
      const Peer* first = nullptr;
      std::string detail;
      for (const auto& p : peers_) {
        const uint64_t n = p->posted - p->finished;
        if (n == 0) continue;
        total += n;
        if (first == nullptr) first = p.get();
        detail += (detail.empty() ? "" : ", ") + peer_label(*p) + ": " + std::to_string(n);
      }
      if (total == 0) return;
      throw TransportError(who() + ": quiet() timed out after " + format_seconds(timeout_s_) + " with " +
                           std::to_string(first->posted - first->finished) + " requests outstanding to " +
                           peer_label(*first) + " (" + std::to_string(total) + " in total: " + detail + ")");
    }
  }
}

// ---------------------------------------------------------------------------------------
// Shutdown
// ---------------------------------------------------------------------------------------

void TcpTransport::close() {
  if (closed_) return;
  closed_ = true;
  if (io_thread_.joinable()) {
    // Release what the windows hold, then say goodbye after it.
    for (auto& pp : peers_) {
      Peer& p = *pp;
      std::lock_guard<std::mutex> lock(p.mu);
      p.window.flush([&](OutFrame&& f) { release_locked(p, std::move(f)); });
      if (p.rank != rank_ && !p.send_closed) {
        OutFrame bye;
        bye.header = make_header(tcp_wire::kBye, 0, 0, 0);
        p.queue.push_back(std::move(bye));
      }
    }
    closing_ = true;
    wake();
    // Wait (bounded) until every bye went out and every peer ended its stream, so no
    // socket is closed with unread data (which would reset the connection under the peer).
    const Clock::time_point deadline = deadline_after(timeout_s_);
    {
      std::unique_lock<std::mutex> lock(state_mu_);
      state_cv_.wait_until(lock, deadline, [&] {
        for (const auto& p : peers_)
          if (!p->out_done || !p->in_done) return false;
        return true;
      });
    }
    stopping_ = true;
    wake();
    io_thread_.join();
  }
  for (auto& p : peers_) {
    if (p->fd >= 0) ::close(p->fd);
    p->fd = -1;
  }
  for (int* fd : {&epoll_fd_, &wake_fd_, &listen_fd_}) {
    if (*fd >= 0) ::close(*fd);
    *fd = -1;
  }
  if (staged_) staged_->release();  // the I/O thread, the one user of the staging, is gone
}

// ---------------------------------------------------------------------------------------
// The I/O thread
// ---------------------------------------------------------------------------------------

void TcpTransport::set_epoll(Peer& p) {
  // p.mu held by the caller (want_out) or the I/O thread alone touches `registered`.
  if (!p.registered) return;
  epoll_event ev{};
  ev.events = EPOLLIN | (p.want_out ? EPOLLOUT : 0);
  ev.data.u32 = static_cast<uint32_t>(p.rank);
  ::epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, p.fd, &ev);
}

void TcpTransport::io_loop() {
  bind_thread();
  epoll_event events[64];
  while (!stopping_) {
    const bool short_wait = reorder_.enabled || poll_soon_.exchange(false);
    const int n = ::epoll_wait(epoll_fd_, events, 64, short_wait ? 1 : 50);
    for (int i = 0; i < n; ++i) {
      const uint32_t token = events[i].data.u32;
      if (token == kWakeToken) {
        uint64_t value;
        while (::read(wake_fd_, &value, sizeof(value)) > 0) {
        }
        continue;
      }
      Peer& p = *peers_[token];
      if (events[i].events & (EPOLLIN | EPOLLHUP | EPOLLERR)) {
        if (p.registered) io_receive(p);
      }
      if (events[i].events & EPOLLOUT) {
        std::lock_guard<std::mutex> lock(p.mu);
        p.want_out = false;
        set_epoll(p);
      }
    }
    const Clock::time_point now = Clock::now();
    for (auto& pp : peers_) {
      Peer& p = *pp;
      if (reorder_.enabled) {
        std::lock_guard<std::mutex> lock(p.mu);
        if (p.window.expired(now)) p.window.flush([&](OutFrame&& f) { release_locked(p, std::move(f)); });
      }
      if (p.rank != rank_) io_send(p);
    }
  }
}

void TcpTransport::io_send(Peer& p) {
  std::string failure;
  bool bye_sent = false;
  {
    std::lock_guard<std::mutex> lock(p.mu);
    if (p.want_out || p.send_closed) return;
    while (!p.queue.empty()) {
      if (staged_) {
        const std::string error = stage_queue(p);
        if (!error.empty()) {
          failure = "cannot be sent to any more: " + error;
          break;
        }
      }
      iovec iov[kMaxIov * 2];
      const size_t count = gather_sendable(p, iov, kMaxIov * 2);
      if (count == 0) {  // the front payload waits for staging chunks that other connections hold
        poll_soon_ = true;
        break;
      }
      msghdr msg{};
      msg.msg_iov = iov;
      msg.msg_iovlen = count;
      const ssize_t sent = ::sendmsg(p.fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (sent < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
          p.want_out = true;
          if (p.registered) {
            set_epoll(p);
          } else {
            p.want_out = false;
            poll_soon_ = true;
          }
          break;
        }
        failure = "send failed: " + errno_text(errno);
        break;
      }
      if (consume_sent(p, static_cast<size_t>(sent))) {
        ::shutdown(p.fd, SHUT_WR);
        p.send_closed = true;
        clear_queue(p);
        bye_sent = true;
        break;
      }
    }
  }
  if (!failure.empty()) {
    fail_peer(p, failure);
  } else if (bye_sent) {
    std::lock_guard<std::mutex> lock(state_mu_);
    p.out_done = true;
    state_cv_.notify_all();
  }
}

std::string TcpTransport::stage_queue(Peer& p) {
  // Payloads are staged in queue order, each contiguous in the peer's StagingFifo, as far as the
  // chunks lent to this connection go; the rest waits until sent bytes give chunks back.
  bool copied = false;
  for (; p.staged_frames < p.queue.size(); ++p.staged_frames) {
    OutFrame& f = p.queue[p.staged_frames];
    if (!f.staged) continue;
    if (f.staged_bytes == 0) f.stage_at = p.staging.end();
    while (f.staged_bytes < f.header.length) {
      const auto [at, room] = p.staging.room(pool_, peer_chunks_);
      if (room == 0) return copied ? staged_->wait_staged() : std::string();
      const uint64_t n = std::min(room, f.header.length - f.staged_bytes);
      const std::string error = staged_->stage(at, f.payload + f.staged_bytes, n);
      if (!error.empty()) return error;
      p.staging.commit(n);
      f.staged_bytes += n;
      copied = true;
    }
  }
  return copied ? staged_->wait_staged() : std::string();
}

size_t TcpTransport::gather_sendable(Peer& p, iovec* iov, size_t max) {
  // From front_sent on, whole frames, up to the first payload not wholly staged yet (its staged
  // part included): bytes after it would overtake it on the wire.
  size_t count = 0;
  size_t skip = p.front_sent;
  for (auto it = p.queue.begin(); it != p.queue.end() && count + 2 <= max; ++it) {
    const size_t header_bytes = sizeof(FrameHeader);
    const uint64_t body = payload_bytes(it->header);
    if (skip < header_bytes) {
      iov[count++] = {reinterpret_cast<char*>(&it->header) + skip, header_bytes - skip};
      skip = 0;
    } else {
      skip -= header_bytes;
    }
    if (it->staged) {
      if (it->staged_bytes > skip) {
        p.staging.gather(pool_, it->stage_at + skip, it->stage_at + it->staged_bytes, iov, count, max);
      }
      if (it->staged_bytes < body) break;
    } else if (body > skip) {
      const uint8_t* src = it->payload != nullptr ? it->payload : reinterpret_cast<const uint8_t*>(it->owned.data());
      iov[count++] = {const_cast<uint8_t*>(src) + skip, static_cast<size_t>(body - skip)};
    }
    skip = 0;
  }
  return count;
}

bool TcpTransport::consume_sent(Peer& p, size_t sent) {
  // Frames wholly sent leave the queue and give their staging back; so do the sent bytes of a
  // staged payload that is partly sent.
  while (sent > 0 && !p.queue.empty()) {
    OutFrame& front = p.queue.front();
    const size_t left = sizeof(FrameHeader) + payload_bytes(front.header) - p.front_sent;
    if (sent < left) {
      p.front_sent += sent;
      if (front.staged && p.front_sent > sizeof(FrameHeader)) {
        p.staging.release_before(front.stage_at + (p.front_sent - sizeof(FrameHeader)), pool_);
      }
      return false;
    }
    sent -= left;
    p.front_sent = 0;
    if (front.header.type == tcp_wire::kBye) return true;
    if (front.staged) p.staging.release_before(front.stage_at + front.header.length, pool_);
    p.queue.pop_front();
    if (p.staged_frames > 0) --p.staged_frames;
  }
  return false;
}

void TcpTransport::clear_queue(Peer& p) {
  p.queue.clear();
  p.front_sent = 0;
  p.staged_frames = 0;
  if (staged_) p.staging.release_all(pool_);
}

void TcpTransport::io_receive(Peer& p) {
  receive_frames(p);
  if (staged_) settle_landed();
}

void TcpTransport::receive_frames(Peer& p) {
  // Bounded work per call so one busy peer cannot starve the others.
  uint64_t budget = 8ull << 20;
  static thread_local uint8_t scratch[64 * 1024];
  while (budget > 0) {
    ssize_t got;
    if (!p.in_payload) {
      got = ::recv(p.fd, reinterpret_cast<char*>(&p.in_header) + p.in_header_got,
                   sizeof(FrameHeader) - p.in_header_got, MSG_DONTWAIT);
    } else {
      const size_t want = static_cast<size_t>(std::min<uint64_t>(p.in_remaining, budget));
      if (p.in_dest != nullptr) {
        got = staged_ ? receive_staged(p, want) : ::recv(p.fd, p.in_dest, want, MSG_DONTWAIT);
      } else {
        got = ::recv(p.fd, scratch, std::min(want, sizeof(scratch)), MSG_DONTWAIT);
      }
    }
    if (got == 0) {
      io_end_of_input(p);
      return;
    }
    if (got < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      if (closing_ || p.got_bye) {
        io_end_of_input(p);
      } else {
        fail_peer(p, "the connection failed: recv: " + errno_text(errno));
      }
      return;
    }
    budget -= std::min<uint64_t>(budget, static_cast<uint64_t>(got));
    if (!p.in_payload) {
      p.in_header_got += static_cast<size_t>(got);
      if (p.in_header_got < sizeof(FrameHeader)) continue;
      p.in_header_got = 0;
      const FrameHeader& h = p.in_header;
      if (h.magic != tcp_wire::kMagic) {
        fail_peer(p, "the stream is corrupt (a frame without the magic number)");
        return;
      }
      p.in_dest = nullptr;
      p.in_reject.clear();
      p.in_reason.clear();
      p.in_ignore = closing_.load();
      if (h.type == tcp_wire::kWrite) {
        if (h.offset > region_.bytes || h.length > region_.bytes - h.offset) {
          p.in_reject = "rank " + std::to_string(rank_) + " refused a write of " + std::to_string(h.length) +
                        " bytes at remote_offset " + std::to_string(h.offset) + ": its region has " +
                        std::to_string(region_.bytes) + " bytes";
        } else if (!p.in_ignore) {
          p.in_dest = static_cast<uint8_t*>(region_.base) + h.offset;
        }
        p.in_remaining = h.length;
      } else if (h.type == tcp_wire::kNack) {
        if (h.length > kMaxReasonBytes) {
          fail_peer(p, "the stream is corrupt (a rejection reason of " + std::to_string(h.length) + " bytes)");
          return;
        }
        p.in_remaining = h.length;
      } else if (h.type >= tcp_wire::kHello && h.type <= tcp_wire::kBye) {
        p.in_remaining = 0;
      } else {
        fail_peer(p, "the stream is corrupt (unknown frame type " + std::to_string(h.type) + ")");
        return;
      }
      p.in_payload = true;
    } else {
      if (p.in_dest != nullptr) {
        p.in_dest += got;
      } else if (p.in_header.type == tcp_wire::kNack) {
        p.in_reason.append(reinterpret_cast<const char*>(scratch), static_cast<size_t>(got));
      }
      p.in_remaining -= static_cast<uint64_t>(got);
    }
    if (p.in_payload && p.in_remaining == 0) {
      p.in_payload = false;
      io_frame_done(p);
      if (!p.registered) return;
    }
  }
}

ssize_t TcpTransport::receive_staged(Peer& p, size_t want) {
  if (arena_used_ == arena_bytes_) settle_landed();  // the arena is reused once its copies are done
  uint8_t* at = staged_->staging() + arena_used_;
  const ssize_t got = ::recv(p.fd, at, std::min<uint64_t>(want, arena_bytes_ - arena_used_), MSG_DONTWAIT);
  if (got <= 0) return got;
  arena_used_ += static_cast<uint64_t>(got);
  landing_ = true;
  const std::string error = staged_->land(p.in_dest, at, static_cast<uint64_t>(got));
  if (!error.empty()) {
    // Rejected once the frame is over; the rest of its payload is discarded.
    p.in_reject = device_rejection(error);
    note_device_failure(p, p.in_header.request_id, error);
    p.in_dest = nullptr;
  }
  return got;
}

void TcpTransport::settle_landed() {
  // Everything queued on the region since the last call is done (or failed) once this wait is over:
  // only then are its requests reported.
  const std::string error = landing_ ? staged_->wait_landed() : std::string();
  landing_ = false;
  arena_used_ = 0;
  if (!error.empty()) {
    for (const Landed& l : landed_) refuse_on_device(*l.peer, l.request_id, error);
    landed_.clear();
    return;
  }
  {
    std::lock_guard<std::mutex> lock(state_mu_);
    for (const Landed& l : landed_) {
      if (l.has_imm) immediates_.push_back(ImmediateEvent{static_cast<uint32_t>(l.peer->rank), l.imm});
    }
  }
  for (const Landed& l : landed_) io_reply(*l.peer, tcp_wire::kAck, l.request_id, {});
  landed_.clear();
}

void TcpTransport::io_reply(Peer& p, uint8_t type, uint64_t request_id, std::string reason) {
  std::lock_guard<std::mutex> lock(p.mu);
  if (p.send_closed) return;
  OutFrame f;
  f.header = make_header(type, request_id, 0, 0);
  if (type == tcp_wire::kNack) {
    if (reason.size() > kMaxReasonBytes) reason.resize(kMaxReasonBytes);
    f.owned = std::move(reason);
    f.header.length = f.owned.size();
  }
  p.queue.push_back(std::move(f));
}

void TcpTransport::io_frame_done(Peer& p) {
  const FrameHeader& h = p.in_header;
  switch (h.type) {
    case tcp_wire::kWrite:
      if (!p.in_reject.empty()) {
        ++rejected_;
        io_reply(p, tcp_wire::kNack, h.request_id, p.in_reject);
      } else if (!p.in_ignore) {
        applied(p, h);
      }
      break;
    case tcp_wire::kAtomicAdd:
      if (h.offset % 8 != 0 || h.offset > region_.bytes || region_.bytes - h.offset < 8) {
        ++rejected_;
        io_reply(p, tcp_wire::kNack, h.request_id,
                 "rank " + std::to_string(rank_) + " refused an atomic add at remote_offset " +
                     std::to_string(h.offset) + ": not an 8-byte aligned int64 inside its region of " +
                     std::to_string(region_.bytes) + " bytes");
      } else if (!p.in_ignore) {
        apply_add(p, h);
      }
      break;
    case tcp_wire::kAck:
      finish_request(p, h.request_id, true, "");
      break;
    case tcp_wire::kNack:
      finish_request(p, h.request_id, false, p.in_reason);
      break;
    case tcp_wire::kBye: {
      // The peer applies nothing more: stop sending and abandon what it never acknowledged.
      p.got_bye = true;
      {
        std::lock_guard<std::mutex> lock(p.mu);
        p.window.discard();
        clear_queue(p);
        if (!p.send_closed) {
          ::shutdown(p.fd, SHUT_WR);
          p.send_closed = true;
        }
      }
      std::lock_guard<std::mutex> lock(state_mu_);
      const uint64_t lost = p.posted - p.finished;
      if (!p.failed) {
        p.failed = true;
        p.failure = peer_label(p) + " has closed its transport";
      }
      if (lost > 0) {
        errors_.push_back(who() + ": " + peer_label(p) + " closed its transport with " + std::to_string(lost) +
                          " of our requests unacknowledged");
        p.finished = p.posted;
      }
      p.out_done = true;
      state_cv_.notify_all();
      break;
    }
    default:  // a second hello
      fail_peer(p, "protocol error: unexpected frame type " + std::to_string(h.type) + " after the handshake");
      break;
  }
}

void TcpTransport::apply_add(Peer& p, const FrameHeader& h) {
  uint8_t* target = static_cast<uint8_t*>(region_.base) + h.offset;
  const auto value = static_cast<int64_t>(h.length);
  if (!staged_) {
    __atomic_fetch_add(reinterpret_cast<int64_t*>(target), value, __ATOMIC_ACQ_REL);
  } else if (const std::string error = staged_->add(target, value); !error.empty()) {
    refuse_on_device(p, h.request_id, error);
    return;
  }
  applied(p, h);
}

void TcpTransport::applied(Peer& p, const FrameHeader& h) {
  const bool has_imm = h.type == tcp_wire::kWrite && (h.flags & tcp_wire::kHasImm);
  if (staged_) {
    landed_.push_back(Landed{&p, h.request_id, has_imm, h.imm});  // reported by settle_landed()
    return;
  }
  if (has_imm) {
    std::lock_guard<std::mutex> lock(state_mu_);
    immediates_.push_back(ImmediateEvent{static_cast<uint32_t>(p.rank), h.imm});
  }
  io_reply(p, tcp_wire::kAck, h.request_id, {});
}

void TcpTransport::refuse_on_device(Peer& p, uint64_t request_id, const std::string& error) {
  ++rejected_;
  note_device_failure(p, request_id, error);
  io_reply(p, tcp_wire::kNack, request_id, device_rejection(error));
}

std::string TcpTransport::device_rejection(const std::string& error) const {
  return "rank " + std::to_string(rank_) + " could not apply it to its device memory: " + error;
}

void TcpTransport::note_device_failure(Peer& p, uint64_t request_id, const std::string& error) {
  std::lock_guard<std::mutex> lock(state_mu_);
  errors_.push_back(who() + ": request " + std::to_string(request_id) + " of " + peer_label(p) +
                    " could not be applied to device memory: " + error);
  state_cv_.notify_all();
}

void TcpTransport::io_end_of_input(Peer& p) {
  if (p.registered) {
    ::epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, p.fd, nullptr);
    p.registered = false;
  }
  if (!p.got_bye && !closing_) {
    fail_peer(p, std::string("closed the connection without saying goodbye (its process exited or crashed?)") +
                     (p.in_payload || p.in_header_got ? " in the middle of a frame" : ""));
    return;
  }
  std::lock_guard<std::mutex> lock(state_mu_);
  p.in_done = true;
  state_cv_.notify_all();
}

void TcpTransport::fail_peer(Peer& p, const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(p.mu);
    p.window.discard();
    clear_queue(p);
    if (!p.send_closed) {
      ::shutdown(p.fd, SHUT_RDWR);
      p.send_closed = true;
    }
  }
  if (p.registered) {
    ::epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, p.fd, nullptr);
    p.registered = false;
  }
  std::lock_guard<std::mutex> lock(state_mu_);
  if (!p.failed) {
    p.failed = true;
    p.failure = peer_label(p) + " " + why;
  }
  const uint64_t lost = p.posted - p.finished;
  if (lost > 0) {
    errors_.push_back(who() + ": " + peer_label(p) + " " + why + "; " + std::to_string(lost) +
                      " requests to it were never acknowledged");
    p.finished = p.posted;
  }
  p.out_done = p.in_done = true;
  state_cv_.notify_all();
}

}  // namespace uccl_ep
