// Python bindings of the NVLink low-latency path: PeerMemory (CUDA IPC buffers),
// LowLatencyState, LowLatencyRegion and the operations (LowLatencyOperations) with their hooks. Pointers
// and streams are plain integers.
#if defined(UCCL_EP_WITH_GPU)
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <deque>
#include <functional>
#include <string>
#include <variant>

#include "kernels/low_latency.h"
#include "kernels/low_latency_state.h"
#include "nvlink/peer_memory.h"
#include "python/arguments.h"
#include "python/torch_tensors.h"

namespace py = pybind11;

namespace {

using uccl_ep::bindings::NewTensors;
using uccl_ep::bindings::ptr;
using uccl_ep::bindings::TensorDevice;
using uccl_ep::bindings::view_boundary;

uccl_ep::LowLatencyRegion make_region(std::uintptr_t peer_bases, int64_t signal_offset, int64_t counters_offset,
                                      int64_t release_offset, int64_t recv_offset, std::uintptr_t control,
                                      std::uintptr_t other_half_control, int64_t other_half_release_offset,
                                      std::uintptr_t masked, std::uintptr_t status, int64_t timeout_ns, int32_t rank,
                                      int32_t num_ranks, bool aggressive_atomics, std::uintptr_t via_proxy,
                                      std::uintptr_t fifos, int32_t num_fifos, int64_t outbox_offset,
                                      int64_t other_half_outbox_offset, int64_t outbox_peer_bytes,
                                      int64_t outbox_index_pos, int64_t outbox_flags_pos, int64_t outbox_release_pos) {
  if (via_proxy != 0 && (fifos == 0 || num_fifos < 1)) {
    throw std::invalid_argument("LowLatencyRegion: via_proxy needs fifos and num_fifos >= 1");
  }
  return uccl_ep::LowLatencyRegion{ptr<const uint64_t>(peer_bases),
                                   signal_offset,
                                   counters_offset,
                                   release_offset,
                                   recv_offset,
                                   ptr<uint64_t>(control),
                                   ptr<const uint64_t>(other_half_control),
                                   other_half_release_offset,
                                   ptr<uint8_t>(masked),
                                   ptr<uccl_ep::LowLatencyStatus>(status),
                                   timeout_ns,
                                   rank,
                                   num_ranks,
                                   aggressive_atomics,
                                   ptr<const uint8_t>(via_proxy),
                                   ptr<const uccl_ep::FifoView>(fifos),
                                   num_fifos,
                                   outbox_offset,
                                   other_half_outbox_offset,
                                   outbox_peer_bytes,
                                   outbox_index_pos,
                                   outbox_flags_pos,
                                   outbox_release_pos};
}

void launch(int device, const uccl_ep::LowLatencyDispatchArgs& args, uccl_ep::gpuStream_t stream) {
  py::gil_scoped_release no_gil;
  const uccl_ep::CurrentDevice on_device(device);
  uccl_ep::launch_low_latency_dispatch(args, stream);
}
void launch(int device, const uccl_ep::LowLatencyCombineArgs& args, uccl_ep::gpuStream_t stream) {
  py::gil_scoped_release no_gil;
  const uccl_ep::CurrentDevice on_device(device);
  uccl_ep::launch_low_latency_combine(args, stream);
}

// Where the operations and their hooks find failures: the state's recorded status (a launch stops at one); for a hook
// also `before` (the proxy path's check, or None), run before the receive, and `on_failure` (a weak method of
// the engine: a hook must not keep a destroyed engine alive, and a strong one would close a cycle through this
// extension's objects that the collector cannot see), which raises a recorded failure, given its code.
struct FailureChecks {
  py::object state_owner;  // the Python LowLatencyState: alive as long as a hook may read its status
  const uccl_ep::LowLatencyState* state;  // state_owner's, read once
  py::object before, on_failure;

  // Before a launch: runs `before`, then raises a failure recorded before it, through the engine while it lives.
  void check(const char* what) const {
    if (!before.is_none()) before();
    const int32_t code = state->status().code;
    if (code == uccl_ep::kLowLatencyOk) return;
    const py::object raise_failure = on_failure();
    if (!raise_failure.is_none()) raise_failure(code);
    throw std::runtime_error(std::string(what) + ": a kernel recorded failure code " + std::to_string(code));
  }
};

// The hook of a send launched without its receive (return_recv_hook): calling it launches the receive on the
// send's stream, as DeepEP's hooks do; later calls do nothing, as the reference engine's. One extension object,
// so a hook call is one call into the extension, with no Python of ours around it.
struct LowLatencyHook {
  std::variant<uccl_ep::LowLatencyDispatchArgs, uccl_ep::LowLatencyCombineArgs> args;
  uccl_ep::gpuStream_t stream;
  int device;
  FailureChecks failures;
  bool received = false;

  void operator()() {
    if (received) return;
    if (failures.state->released()) {
      throw std::runtime_error("this Buffer was destroyed: its low-latency hooks cannot receive");
    }
    failures.check("low-latency hook");
    std::visit([&](auto receive) {
      receive.phases = uccl_ep::kLowLatencyRecv;
      launch(device, receive, stream);
    }, args);
    received = true;
  }
};

// The native engine's low-latency operations, one extension call each: a call reads its tensor arguments and
// runs the Buffer's checks only for a new kind of call (TensorArguments), finds the region of its sizes and
// buffer half (the engine's Python makes it the first time), runs the proxy path's check and stops at a
// failure recorded before it (FailureChecks), and launches on the current stream. `call` is the Buffer
// operation's arguments in the order of buffer.py's tuple, `check(call)` its checks.
// The engine's callbacks are weak methods: this object is the engine's, and a strong one would close a cycle the
// collector cannot see.
class LowLatencyOperations {
 public:
  LowLatencyOperations(const py::object& state, int device, bool prereduce, int32_t num_sms, py::object before,
                       py::object on_failure, py::object make_region, py::object positions_for)
      : failures_{state, &state.cast<const uccl_ep::LowLatencyState&>(), std::move(before), std::move(on_failure)},
        device_(device),
        prereduce_(prereduce),
        num_sms_(num_sms),
        make_region_(std::move(make_region)),
        positions_for_(std::move(positions_for)) {}

  py::tuple dispatch(const py::tuple& call, const py::object& masked_ranks, int buffer_idx, const py::object& check) {
    const std::function<void()> checks = [&] { check(call); };
    const auto item = [&call](int i) { return py::handle(PyTuple_GET_ITEM(call.ptr(), i)); };
    const uccl_ep::bindings::TensorArguments in({item(0), item(1), item(4), item(5)},
                                                {item(2), item(3), item(6), item(7), item(8), item(9), item(10)},
                                                checked_dispatches_, checks);
    const uccl_ep::LowLatencyRegion& region =
        region_for(in.value(0), in[0].size(1), in.value(1), buffer_idx, masked_ranks, checks);
    failures_.check("low_latency_dispatch");
    return launch_dispatch(region, in, phases(in.value(6)), stream());
  }

  py::tuple combine(const py::tuple& call, const py::object& masked_ranks, int buffer_idx, const py::object& check) {
    const std::function<void()> checks = [&] { check(call); };
    const auto item = [&call](int i) { return py::handle(PyTuple_GET_ITEM(call.ptr(), i)); };
    py::object positions = py::reinterpret_borrow<py::object>(item(8));
    if (positions.is_none()) {  // a handle rebuilt as a plain tuple lost the dispatch's record
      checks();
      positions = positions_for_(call[1], call[7], py::arg("masked_ranks") = masked_ranks);
    }
    const bool zero_copy = PyObject_IsTrue(item(10).ptr()) == 1;
    // x as given only where it is not x (with zero_copy): a tensor argument costs a read.
    const uccl_ep::bindings::TensorArguments in(
        {item(0), item(1), item(2), item(3), item(4), positions, item(13), item(14),
         zero_copy ? item(15) : py::handle(Py_None)},
        {item(5), item(6), item(7), item(9), item(10), item(11), item(12)}, checked_combines_, checks);
    const uccl_ep::LowLatencyRegion& region =
        region_for(in.value(0), in.value(1), in.value(2), buffer_idx, masked_ranks, checks);
    failures_.check("low_latency_combine");
    return launch_combine(region, in, item(13), phases(in.value(6)), stream());
  }

  // The regions go (the engine's destroy); hooks keep what they need.
  void clear() { regions_.clear(); }

 private:
  struct KnownRegion {
    int64_t num_max_tokens, hidden, num_experts;
    int buffer_idx;
    py::object masked_ranks;  // kept: its identity is part of the key
    uccl_ep::LowLatencyRegion region;
  };

  // The send alone with return_recv_hook (its hook receives), else both.
  static int32_t phases(int64_t return_recv_hook) {
    return return_recv_hook != 0 ? uccl_ep::kLowLatencySend : uccl_ep::kLowLatencySend | uccl_ep::kLowLatencyRecv;
  }

  uccl_ep::gpuStream_t stream() const {
    return static_cast<uccl_ep::gpuStream_t>(uccl_ep::bindings::current_gpu_stream(device_));
  }

  // The half's region for these sizes: made once, and only for sizes that pass the checks.
  const uccl_ep::LowLatencyRegion& region_for(int64_t num_max_tokens, int64_t hidden, int64_t num_experts,
                                              int buffer_idx, const py::object& masked_ranks,
                                              const std::function<void()>& checks) {
    for (const KnownRegion& known : regions_) {
      if (known.num_max_tokens == num_max_tokens && known.hidden == hidden && known.num_experts == num_experts &&
          known.buffer_idx == buffer_idx && known.masked_ranks.is(masked_ranks)) {
        return known.region;
      }
    }
    checks();
    const py::object make_region = make_region_();
    if (make_region.is_none()) throw std::runtime_error("this Buffer was destroyed");
    const auto region =
        make_region(num_max_tokens, hidden, num_experts, buffer_idx, masked_ranks).cast<uccl_ep::LowLatencyRegion>();
    regions_.push_back(KnownRegion{num_max_tokens, hidden, num_experts, buffer_idx, masked_ranks, region});
    return regions_.back().region;
  }

  // The launches on a call's region, its arguments read and checked; they allocate the outputs with torch.
  // in: (x, topk_idx, cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats), values (num_max_tokens,
  // num_experts, use_fp8, round_scale, use_ue8m0, async_finish, return_recv_hook).
  // -> (recv_x, recv_x_scales or None, recv_count, src_info, layout_range, hidden, the hook (a LowLatencyHook) when
  //    phases has no receive, else None, positions): the reference engine's LowLatencyDispatchResult items in order.
  py::tuple launch_dispatch(const uccl_ep::LowLatencyRegion& region, const uccl_ep::bindings::TensorArguments& in,
                            int32_t phases, uccl_ep::gpuStream_t stream) const {
    const auto &x = in[0], &topk_idx = in[1];
    const int32_t num_tokens = static_cast<int32_t>(x.size(0)), hidden = static_cast<int32_t>(x.size(1));
    const int32_t num_topk = static_cast<int32_t>(topk_idx.size(1));
    const int32_t num_max_tokens = static_cast<int32_t>(in.value(0)), num_experts = static_cast<int32_t>(in.value(1));
    const bool use_fp8 = in.value(2) != 0, round_scale = in.value(3) != 0, use_ue8m0 = in.value(4) != 0;
    const int64_t local_experts = num_experts / region.num_ranks;
    const int64_t slots = static_cast<int64_t>(region.num_ranks) * num_max_tokens;
    using uccl_ep::bindings::TensorDtype;
    NewTensors outputs(TensorDevice::kCuda, device_);
    // Two allocations: the received rows with their fp8 scales (what the experts read), and one int32 block for
    // the rest (what the handle keeps), each output from a 128-byte boundary. An allocation costs several views.
    const int64_t recv_x_bytes = local_experts * slots * hidden * (use_fp8 ? 1 : 2);
    void* recv_x = nullptr;
    void* recv_scales = nullptr;
    if (use_fp8) {  // the scales column-major in the last two dimensions, as DeepEP's
      const int64_t scales = hidden / (use_ue8m0 ? 512 : 128);
      const int rows = outputs.add_storage(view_boundary(recv_x_bytes) + local_experts * slots * scales * 4,
                                           TensorDtype::kFloat8E4M3);
      recv_x = outputs.add_view(rows, {local_experts, slots, hidden}, {slots * hidden, hidden, 1}, 0);
      const TensorDtype scales_dtype = use_ue8m0 ? TensorDtype::kInt32 : TensorDtype::kFloat32;
      recv_scales = outputs.add_view(rows, {local_experts, slots, scales}, {scales * slots, 1, slots},
                                     view_boundary(recv_x_bytes) / 4, scales_dtype);
    } else {
      recv_x = outputs.add({local_experts, slots, hidden}, TensorDtype::kBfloat16);
      outputs.add_none();
    }
    const int64_t src_info_at = view_boundary(local_experts * 4);
    const int64_t layout_at = src_info_at + view_boundary(local_experts * slots * 4);
    const int64_t positions_at = layout_at + view_boundary(local_experts * region.num_ranks * 8);
    const int ints = outputs.add_storage(positions_at / 4 + 2 * num_tokens * num_topk, TensorDtype::kInt32);
    void* recv_count = outputs.add_view(ints, {local_experts}, {1}, 0);
    void* src_info = outputs.add_view(ints, {local_experts, slots}, {slots, 1}, src_info_at / 4);
    void* layout_range = outputs.add_view(ints, {local_experts, region.num_ranks}, {region.num_ranks, 1},
                                          layout_at / 8, TensorDtype::kInt64);
    void* positions =
        outputs.add_view(ints, {2, num_tokens, num_topk}, {num_tokens * num_topk, num_topk, 1}, positions_at / 4);
    const uccl_ep::LowLatencyDispatchArgs args{
        region,          x.data,                    static_cast<const int64_t*>(topk_idx.data), num_tokens,
        num_max_tokens,  hidden,                    num_topk,                     num_experts,
        use_fp8,         round_scale,               use_ue8m0,                    recv_x,
        recv_scales,     static_cast<int32_t*>(recv_count), static_cast<int32_t*>(src_info),
        static_cast<int64_t*>(layout_range), static_cast<int32_t*>(positions), static_cast<int32_t*>(in[2].data),
        static_cast<int64_t*>(in[3].data), phases, num_sms_};
    launch(device_, args, stream);
    const py::list made = outputs.release();
    return py::make_tuple(made[0], made[1], made[2], made[3], made[4], hidden, hook(args, phases, stream), made[5]);
  }

  // in: (x (the kernel's: with zero_copy the buffer's own view), topk_idx, topk_weights, src_info, layout_range,
  // positions, out or None, combine_wait_recv_cost_stats, with zero_copy x as the caller passed it, else None),
  // values (num_max_tokens, hidden, num_experts, use_logfmt, zero_copy, async_finish, return_recv_hook); `out`:
  // the caller's out or None. -> (the combined rows: out, or allocated; the hook or None).
  py::tuple launch_combine(const uccl_ep::LowLatencyRegion& region, const uccl_ep::bindings::TensorArguments& in,
                           py::handle out_given, int32_t phases, uccl_ep::gpuStream_t stream) const {
    const auto &topk_idx = in[1], &out = in[6];
    const int32_t num_tokens = static_cast<int32_t>(topk_idx.size(0));
    const int32_t num_topk = static_cast<int32_t>(topk_idx.size(1));
    const int32_t num_max_tokens = static_cast<int32_t>(in.value(0)), hidden = static_cast<int32_t>(in.value(1));
    const int32_t num_experts = static_cast<int32_t>(in.value(2));
    NewTensors outputs(TensorDevice::kCuda, device_);
    void* combined =
        out.present ? out.data : outputs.add({num_tokens, hidden}, uccl_ep::bindings::TensorDtype::kBfloat16);
    const uccl_ep::LowLatencyCombineArgs args{
        region,         in[0].data,             static_cast<const int64_t*>(topk_idx.data),
        static_cast<const float*>(in[2].data),  static_cast<const int32_t*>(in[3].data),
        static_cast<const int64_t*>(in[4].data), static_cast<const int32_t*>(in[5].data), num_tokens,
        num_max_tokens,
        hidden,         num_topk,               num_experts,                  in.value(3) != 0,
        combined,       static_cast<int64_t*>(in[7].data), phases,          num_sms_,
        prereduce_};
    launch(device_, args, stream);
    py::object combined_out =
        out.present ? py::reinterpret_borrow<py::object>(out_given) : py::object(outputs.release()[0]);
    return py::make_tuple(combined_out, hook(args, phases, stream));
  }

  template <typename Args>
  py::object hook(const Args& args, int32_t phases, uccl_ep::gpuStream_t stream) const {
    if (phases & uccl_ep::kLowLatencyRecv) return py::none();
    return py::cast(LowLatencyHook{args, stream, device_, failures_});
  }

  FailureChecks failures_;
  int device_;
  bool prereduce_;  // the combine pre-reduces where it fits (LowLatencyCombineArgs::prereduce)
  int32_t num_sms_;
  py::object make_region_, positions_for_;
  std::deque<KnownRegion> regions_;  // few (sizes x halves); a deque keeps each where it is
  uccl_ep::bindings::CheckedCalls checked_dispatches_, checked_combines_;
};

}  // namespace

void bind_low_latency(py::module_& m) {
  using uccl_ep::LowLatencyState;
  using uccl_ep::PeerMemory;

  py::class_<PeerMemory>(m, "PeerMemory",
                         "Zeroed device memory that the other ranks of this host map with CUDA IPC.")
      .def(py::init<int64_t, int>(), py::arg("num_bytes"), py::arg("device"))
      .def("ipc_handle", [](const PeerMemory& self) { return py::bytes(self.ipc_handle()); })
      .def("open_peers", &PeerMemory::open_peers, py::arg("handles"), py::arg("rank"),
           py::call_guard<py::gil_scoped_release>(),
           "Map every other rank's buffer (handles[rank] is this buffer's own handle).")
      .def("release", &PeerMemory::release, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("local_base", &PeerMemory::local_base)
      .def_property_readonly("peer_bases", &PeerMemory::peer_bases)
      .def("peer_base", &PeerMemory::peer_base, py::arg("rank"), "`rank`'s buffer as mapped here (a host integer).")
      .def_property_readonly("num_bytes", &PeerMemory::num_bytes)
      .def_property_readonly("pci_bus_id", &PeerMemory::pci_bus_id);

  py::class_<LowLatencyState>(m, "LowLatencyState",
                              "Control words of the two halves (device) and the failure status (mapped host memory).")
      .def(py::init<int>(), py::arg("device"))
      .def("control", &LowLatencyState::control, py::arg("half"))
      .def_property_readonly("status_device", &LowLatencyState::status_device)
      .def("status",
           [](const LowLatencyState& self) {
             const uccl_ep::LowLatencyStatus s = self.status();
             return py::make_tuple(s.code, s.phase, s.peer, s.detail);
           },
           "(code, phase, peer, detail) of the first failure; code 0 = none. Reads host memory, no sync.")
      .def("reset", &LowLatencyState::reset, py::call_guard<py::gil_scoped_release>())
      .def("release", &LowLatencyState::release, py::call_guard<py::gil_scoped_release>());

  py::class_<uccl_ep::LowLatencyRegion>(m, "LowLatencyRegion", "One half of the low-latency region, seen from here.")
      .def(py::init(&make_region), py::arg("peer_bases"), py::arg("signal_offset"), py::arg("counters_offset"),
           py::arg("release_offset"), py::arg("recv_offset"), py::arg("control"), py::arg("other_half_control"),
           py::arg("other_half_release_offset"), py::arg("masked"), py::arg("status"), py::arg("timeout_ns"),
           py::arg("rank"), py::arg("num_ranks"), py::arg("aggressive_atomics") = false, py::arg("via_proxy") = 0,
           py::arg("fifos") = 0, py::arg("num_fifos") = 0, py::arg("outbox_offset") = 0,
           py::arg("other_half_outbox_offset") = 0, py::arg("outbox_peer_bytes") = 0, py::arg("outbox_index_pos") = 0,
           py::arg("outbox_flags_pos") = 0, py::arg("outbox_release_pos") = 0);

  m.attr("LOW_LATENCY_MAX_TOPK") = uccl_ep::kLowLatencyMaxTopk;
  m.attr("LOW_LATENCY_MAX_RANKS") = uccl_ep::kLowLatencyMaxRanks;
  m.attr("LOW_LATENCY_SEND") = static_cast<int>(uccl_ep::kLowLatencySend);
  m.attr("LOW_LATENCY_RECV") = static_cast<int>(uccl_ep::kLowLatencyRecv);
  m.def("low_latency_dispatch_msg_bytes", &uccl_ep::low_latency_dispatch_msg_bytes, py::arg("hidden"));
  m.def("low_latency_combine_msg_bytes", &uccl_ep::low_latency_combine_msg_bytes, py::arg("hidden"));
  m.def("low_latency_flags_per_source", &uccl_ep::low_latency_flags_per_source, py::arg("local_experts"));
  m.def("low_latency_index_per_source", &uccl_ep::low_latency_index_per_source, py::arg("local_experts"),
        py::arg("num_max_tokens"));
  py::class_<LowLatencyHook>(m, "LowLatencyHook",
                             "A low-latency send's receive hook: calling it launches the receive on the send's stream "
                             "(once; later calls do nothing).")
      .def("__call__", &LowLatencyHook::operator());
  py::class_<LowLatencyOperations>(m, "LowLatencyOperations",
                                   "The native engine's low-latency dispatch and combine, one extension call each "
                                   "(positional arguments only).")
      .def(py::init<const py::object&, int, bool, int32_t, py::object, py::object, py::object, py::object>(),
           py::arg("state"), py::arg("device"), py::arg("prereduce"), py::arg("num_sms"), py::arg("before"),
           py::arg("on_failure"), py::arg("make_region"), py::arg("positions_for"),
           "`before` (None or a check) runs before each launch and hook; `on_failure` and `make_region` are weak "
           "methods of the engine: the first raises a failure recorded before a launch, given its code; the second "
           "makes the LowLatencyRegion of (num_max_tokens, hidden, num_experts, buffer_idx, masked_ranks) for "
           "sizes that passed the checks. Each call launches on torch's current stream; `positions_for("
           "topk_idx, num_experts, masked_ranks=...)` a dispatch's positions for a handle that lost them.")
      .def("dispatch", &LowLatencyOperations::dispatch,
           "dispatch(call, masked_ranks, buffer_idx, check) -> (recv_x, recv_x_scales or None, recv_count, "
           "src_info, layout_range, hidden, hook or None, positions): check(call) (the Buffer's argument checks) "
           "runs only for a kind of call not seen pass before; the outputs are allocated on the current stream and "
           "the kernel (the send alone with return_recv_hook, else send and receive) queued on it; the hook is a "
           "LowLatencyHook.")
      .def("combine", &LowLatencyOperations::combine,
           "combine(call, masked_ranks, buffer_idx, check) -> (combined (out when given), hook or None), as "
           "dispatch.")
      .def("clear", &LowLatencyOperations::clear);
}
#endif  // UCCL_EP_WITH_GPU
