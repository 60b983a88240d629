// Python bindings of the NVLink normal-mode path: NormalRegion, the copy engines (intranode_copy.h)
// and NormalLauncher (intranode_launcher.h), which makes each operation one call, plus the layout
// facts tests check. Pointers and streams are plain integers; 0 is null.
#if defined(UCCL_EP_WITH_GPU)
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <tuple>
#include <utility>
#include <vector>

#include "common/require.h"
#include "kernels/intranode.h"
#include "kernels/intranode_copy.h"
#include "kernels/intranode_launcher.h"
#include "kernels/low_latency_state.h"
#include "python/arguments.h"
#include "python/torch_tensors.h"

namespace py = pybind11;

namespace {

using uccl_ep::bindings::as_stream;
using uccl_ep::bindings::element_bytes;
using uccl_ep::bindings::view_boundary;
using uccl_ep::bindings::NewTensors;
using uccl_ep::bindings::ptr;
using uccl_ep::bindings::TensorDevice;
using uccl_ep::bindings::TensorDtype;

uccl_ep::NormalRegion make_region(std::uintptr_t peer_bases, std::uintptr_t control, std::uintptr_t status,
                                  int64_t data_bytes, int64_t timeout_ns, int32_t rank, int32_t num_ranks,
                                  bool aggressive_atomics) {
  return uccl_ep::NormalRegion{ptr<const uint64_t>(peer_bases), ptr<uint64_t>(control),
                               ptr<uccl_ep::LowLatencyStatus>(status), data_bytes, timeout_ns, rank, num_ranks,
                               aggressive_atomics};
}

// A dispatch's send layout and notify on their own, for normal_layout_and_notify: the first half of a
// dispatch without its rows (a test's peer that never sends them).
struct LayoutNotifyArgs {
  uccl_ep::NormalSendLayoutArgs layout;
  uccl_ep::NormalNotifyArgs notify;
};

LayoutNotifyArgs layout_notify_args(const uccl_ep::NormalRegion& region, std::uintptr_t is_token_in_rank,
                                    int64_t num_tokens, std::uintptr_t num_tokens_per_rank,
                                    std::uintptr_t num_tokens_per_expert, int32_t num_channels,
                                    int32_t num_local_experts, int32_t expert_alignment, int32_t num_worst_tokens,
                                    std::uintptr_t send_pos, std::uintptr_t channel_prefix_matrix,
                                    std::uintptr_t send_head, std::uintptr_t rank_prefix_matrix,
                                    std::uintptr_t recv_channel_prefix_matrix, std::uintptr_t recv_tokens_per_expert) {
  return LayoutNotifyArgs{uccl_ep::NormalSendLayoutArgs{ptr<const bool>(is_token_in_rank), num_tokens,
                                                        region.num_ranks, num_channels, ptr<int32_t>(send_pos),
                                                        ptr<int32_t>(channel_prefix_matrix), ptr<int32_t>(send_head)},
                          uccl_ep::NormalNotifyArgs{region,
                                                    ptr<const int32_t>(num_tokens_per_rank),
                                                    ptr<const int32_t>(channel_prefix_matrix),
                                                    ptr<const int32_t>(num_tokens_per_expert),
                                                    num_channels,
                                                    num_local_experts,
                                                    expert_alignment,
                                                    num_worst_tokens,
                                                    0,  // pull_chunks: start_dispatch sets them when it gathers
                                                    0,  // sm_push_percent: start_dispatch sets it
                                                    ptr<int32_t>(rank_prefix_matrix),
                                                    ptr<int32_t>(recv_channel_prefix_matrix),
                                                    ptr<int32_t>(recv_tokens_per_expert),
                                                    nullptr,
                                                    ptr<const int32_t>(send_pos),
                                                    num_tokens,
                                                    false,   // push_rows: start_dispatch sets it
                                                    false}};  // sends: start_dispatch sets it
}

// NormalLauncher as Python sees it: each operation one call (positional arguments; tensors as a tuple in
// the operation's order, read through torch's shim: torch_tensors.h), the outputs allocated here with torch,
// and the GIL released while the launcher works (a dispatch waits for its counts). `check` is the Buffer's
// Python checks of the call, run only for a kind of call not checked before (each operation keeps its own
// signatures). Each call returns the NormalCallStatus first; the tensors only when it is kDone.
struct BoundNormalLauncher {
  std::unique_ptr<uccl_ep::NormalLauncher> launcher;
  uccl_ep::bindings::CheckedCalls checked_dispatches, checked_cached_dispatches, checked_combines;
};

struct NormalLauncherCalls {
  using Tensors = uccl_ep::bindings::TensorArguments;

  // tensors: (x, x_scales, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_rank,
  // num_tokens_per_expert); values: (expert_alignment, num_worst_tokens).
  // -> (status, [send_pos, channel_prefix_matrix, send_head, recv_channel_prefix_matrix, rank_prefix_matrix,
  //     recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights, recv_src_idx] or None, tokens per local
  //     expert, NormalHostCounts or None, what does not fit)
  static py::tuple dispatch(BoundNormalLauncher& self, const py::tuple& tensors, const py::tuple& values,
                            int32_t num_channels, std::uintptr_t stream, const py::object& check) {
    const Tensors in(tensors, values, self.checked_dispatches, [&check] { check(); });
    const auto &x = in[0], &x_scales = in[1], &topk_idx = in[2], &topk_weights = in[3];
    const auto &is_token_in_rank = in[4], &num_tokens_per_rank = in[5], &num_tokens_per_expert = in[6];
    uccl_ep::NormalLauncher& launcher = *self.launcher;
    const int64_t r = launcher.region().num_ranks;
    const int32_t num_tokens = static_cast<int32_t>(x.size(0));
    const int64_t hidden = x.size(1);
    const int32_t num_topk = topk_idx.present ? static_cast<int32_t>(topk_idx.size(1)) : 0;
    const int32_t num_local_experts = static_cast<int32_t>(num_tokens_per_expert.size(0) / r);
    const int64_t token_ints = num_tokens * r;
    const int64_t channel_ints = r * num_channels;
    NewTensors tensors_out(TensorDevice::kCuda, launcher.device());
    // One int32 block for what the layout and notify write (NormalDispatchRequest's handle_ints), and its views.
    const int handle_block =
        tensors_out.add_storage(2 * (token_ints + channel_ints) + r * r + num_local_experts, TensorDtype::kInt32);
    void* handle_ints = tensors_out.data(handle_block);
    int64_t offset = 0;
    for (const auto& [rows, columns] : {std::pair<int64_t, int64_t>{num_tokens, r}, {r, num_channels}, {num_tokens, r},
                                        {r, num_channels}, {r, r}}) {
      tensors_out.add_view(handle_block, {rows, columns}, {columns, 1}, offset);
      offset += rows * columns;
    }
    const uccl_ep::NormalDispatchRequest request{x.data,
                                                 x.row_bytes(),
                                                 x_scales.data,
                                                 x_scales.row_bytes(),
                                                 static_cast<const int64_t*>(topk_idx.data),
                                                 static_cast<const float*>(topk_weights.data),
                                                 num_topk,
                                                 static_cast<const bool*>(is_token_in_rank.data),
                                                 num_tokens,
                                                 static_cast<const int32_t*>(num_tokens_per_rank.data),
                                                 static_cast<const int32_t*>(num_tokens_per_expert.data),
                                                 num_local_experts,
                                                 num_channels,
                                                 static_cast<int32_t>(in.value(0)),
                                                 static_cast<int32_t>(in.value(1)),
                                                 static_cast<int32_t*>(handle_ints),
                                                 2 * hidden};
    // Called once the rows are known, on this thread, without the GIL.
    const uccl_ep::NormalOutputsAllocator allocate{
        [&](int64_t rows) { return tensors_out.add({rows, hidden}, static_cast<TensorDtype>(x.dtype)); },
        [&](int64_t rows, uccl_ep::NormalDispatchOutputs& outputs) {
          // The smaller outputs are views of one float32 block, each from a 128-byte boundary: an allocation
          // costs several views.
          const bool with_topk = num_topk > 0;  // a top-k of 0 columns returns None, as the reference does
          const int64_t scale_columns = x_scales.present ? x_scales.size(1) : 0;
          const int64_t topk_columns = with_topk ? num_topk : 0;
          const int64_t topk_idx_at = view_boundary(rows * scale_columns * x_scales.element_bytes());
          const int64_t weights_at =
              topk_idx_at + view_boundary(rows * topk_columns * element_bytes(TensorDtype::kInt64));
          const int64_t src_idx_at =
              weights_at + view_boundary(rows * topk_columns * element_bytes(TensorDtype::kFloat32));
          const int64_t block_bytes = view_boundary(src_idx_at + rows * element_bytes(TensorDtype::kInt32));
          const int block =
              tensors_out.add_storage(block_bytes / element_bytes(TensorDtype::kFloat32), TensorDtype::kFloat32);
          const auto rows_of = [&](bool present, int64_t at, int64_t columns, TensorDtype dtype) -> void* {
            if (!present) {
              tensors_out.add_none();
              return nullptr;
            }
            return tensors_out.add_view(block, {rows, columns}, {columns, 1}, at / element_bytes(dtype), dtype);
          };
          outputs.recv_x_scales =
              rows_of(x_scales.present, 0, scale_columns, static_cast<TensorDtype>(x_scales.dtype));
          outputs.recv_topk_idx =
              static_cast<int64_t*>(rows_of(with_topk, topk_idx_at, topk_columns, TensorDtype::kInt64));
          outputs.recv_topk_weights =
              static_cast<float*>(rows_of(with_topk, weights_at, topk_columns, TensorDtype::kFloat32));
          outputs.recv_src_idx = static_cast<int32_t*>(tensors_out.add_view(
              block, {rows}, {1}, src_idx_at / element_bytes(TensorDtype::kInt32), TensorDtype::kInt32));
        }};
    uccl_ep::NormalDispatchResult result;
    {
      py::gil_scoped_release no_gil;
      result = launcher.dispatch(request, allocate, as_stream(stream));
    }
    py::object host_counts =
        result.host_counts ? py::cast(std::const_pointer_cast<uccl_ep::NormalHostCounts>(result.host_counts)) : py::none();
    py::object outputs = py::none();
    if (result.status == uccl_ep::NormalCallStatus::kDone) outputs = tensors_out.release();
    return py::make_tuple(static_cast<int32_t>(result.status), outputs, py::cast(result.expert_counts), host_counts,
                          result.too_large);
  }

  // tensors: (x, x_scales, topk_idx, topk_weights (None: the checks refuse them with a handle), send_pos, and
  // the handle's rank_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx, is_token_in_rank); values:
  // (expert_alignment, num_worst_tokens). num_channels: the call's, num_sms / 2 (the handle's dispatch's are
  // the columns of its recv_channel_prefix_matrix). host_counts: the handle's NormalHostCounts or None.
  // -> (status, [recv_x, recv_x_scales or None] or None)
  static py::tuple cached_dispatch(BoundNormalLauncher& self, const py::tuple& tensors, const py::tuple& values,
                                   int32_t num_channels, const uccl_ep::NormalHostCounts* host_counts,
                                   std::uintptr_t stream, const py::object& check) {
    const Tensors in(tensors, values, self.checked_cached_dispatches, [&check] { check(); });
    const auto &x = in[0], &x_scales = in[1], &send_pos = in[4], &rank_prefix_matrix = in[5];
    const auto &recv_channel_prefix_matrix = in[6], &recv_src_idx = in[7];
    uccl_ep::NormalLauncher& launcher = *self.launcher;
    const int64_t hidden = x.size(1);
    const int64_t num_rows_out = recv_src_idx.size(0);
    NewTensors tensors_out(TensorDevice::kCuda, launcher.device());
    void* recv_x = tensors_out.add({num_rows_out, hidden}, static_cast<TensorDtype>(x.dtype));
    void* recv_x_scales = optional_rows(tensors_out, num_rows_out, x_scales);
    const uccl_ep::NormalDispatchArgs args{launcher.region(),
                                           x.data,
                                           x.row_bytes(),
                                           x_scales.data,
                                           x_scales.row_bytes(),
                                           nullptr,  // no top-k: a cached dispatch moves x (and its scales)
                                           nullptr,
                                           0,
                                           0,
                                           static_cast<const int32_t*>(send_pos.data),
                                           static_cast<const int32_t*>(rank_prefix_matrix.data),
                                           static_cast<int32_t>(x.size(0)),
                                           static_cast<int32_t>(num_rows_out),
                                           recv_x,
                                           recv_x_scales,
                                           nullptr,
                                           nullptr,
                                           nullptr,  // the handle keeps its recv_src_idx
                                           2 * num_channels,
                                           static_cast<int32_t>(recv_channel_prefix_matrix.size(1)),
                                           static_cast<const int32_t*>(recv_channel_prefix_matrix.data)};
    uccl_ep::NormalCallStatus status;
    {
      py::gil_scoped_release no_gil;
      status = launcher.cached_dispatch(args, 2 * hidden, host_counts, as_stream(stream));
    }
    return finish(status, tensors_out);
  }

  // tensors: (x, topk_weights, bias0, bias1, and the handle's rank_prefix_matrix, is_token_in_rank, send_pos,
  // recv_channel_prefix_matrix, recv_src_idx); values: (the number of biases given). The channels as in
  // cached_dispatch. -> (status, [combined_x, combined_topk_weights or None] or None)
  static py::tuple combine(BoundNormalLauncher& self, const py::tuple& tensors, const py::tuple& values,
                           int32_t num_channels, const uccl_ep::NormalHostCounts* host_counts, std::uintptr_t stream,
                           const py::object& check) {
    const Tensors in(tensors, values, self.checked_combines, [&check] { check(); });
    const auto &x = in[0], &topk_weights = in[1], &bias0 = in[2], &bias1 = in[3], &rank_prefix_matrix = in[4];
    const auto &is_token_in_rank = in[5], &send_pos = in[6], &recv_channel_prefix_matrix = in[7];
    uccl_ep::NormalLauncher& launcher = *self.launcher;
    const int32_t num_topk = topk_weights.present ? static_cast<int32_t>(topk_weights.size(1)) : 0;
    if (num_topk > uccl_ep::kNormalMaxTopk) {
      throw py::value_error("topk_weights has " + std::to_string(num_topk) +
                            " columns; the native combine sums at most " + std::to_string(uccl_ep::kNormalMaxTopk));
    }
    const int64_t num_tokens = is_token_in_rank.size(0);
    const int64_t hidden = x.size(1);
    NewTensors tensors_out(TensorDevice::kCuda, launcher.device());
    void* combined_x = tensors_out.add({num_tokens, hidden}, static_cast<TensorDtype>(x.dtype));
    void* combined_topk_weights = optional_rows(tensors_out, num_tokens, topk_weights);
    const uccl_ep::NormalCombineArgs args{launcher.region(),
                                          x.data,
                                          static_cast<int32_t>(x.size(0)),
                                          static_cast<int32_t>(hidden),
                                          static_cast<const float*>(topk_weights.data),
                                          num_topk,
                                          static_cast<const int32_t*>(rank_prefix_matrix.data),
                                          static_cast<const bool*>(is_token_in_rank.data),
                                          static_cast<const int32_t*>(send_pos.data),
                                          static_cast<int32_t>(num_tokens),
                                          bias0.data,
                                          bias1.data,
                                          combined_x,
                                          static_cast<float*>(combined_topk_weights),
                                          2 * num_channels,
                                          static_cast<int32_t>(recv_channel_prefix_matrix.size(1)),
                                          static_cast<const int32_t*>(recv_channel_prefix_matrix.data)};
    uccl_ep::NormalCallStatus status;
    {
      py::gil_scoped_release no_gil;
      status = launcher.combine(args, host_counts, as_stream(stream));
    }
    return finish(status, tensors_out);
  }

 private:
  // The rows of an output with `like`'s columns and dtype, or None (null) where `like` is absent (or not wanted).
  static void* optional_rows(NewTensors& tensors, int64_t rows, const uccl_ep::bindings::TensorArgument& like,
                             bool wanted = true) {
    if (!like.present || !wanted) {
      tensors.add_none();
      return nullptr;
    }
    return tensors.add({rows, like.size(1)}, static_cast<TensorDtype>(like.dtype));
  }
  static py::tuple finish(uccl_ep::NormalCallStatus status, NewTensors& tensors) {
    const bool done = status == uccl_ep::NormalCallStatus::kDone;
    return py::make_tuple(static_cast<int32_t>(status), done ? py::object(tensors.release()) : py::object(py::none()));
  }
};

}  // namespace

void bind_normal(py::module_& m) {
  py::class_<uccl_ep::NormalRegion>(m, "NormalRegion", "The normal-mode buffers of all ranks, seen from here.")
      .def(py::init(&make_region), py::arg("peer_bases"), py::arg("control"), py::arg("status"),
           py::arg("data_bytes"), py::arg("timeout_ns"), py::arg("rank"), py::arg("num_ranks"),
           py::arg("aggressive_atomics") = false);

  m.attr("NORMAL_CONTROL_BYTES") = uccl_ep::kNormalControlBytes;
  m.attr("NORMAL_CHANNEL_WORDS") = uccl_ep::kNormalChannelWords;
  m.attr("NORMAL_MAX_RANKS") = uccl_ep::kNormalMaxRanks;
  m.attr("NORMAL_MAX_COMBINE_RANKS") = uccl_ep::kNormalMaxCombineRanks;
  m.attr("NORMAL_COMBINE_CHUNKS") = uccl_ep::kNormalCombineChunksBySms;  // 0: by the combine's SMs
  m.def("normal_combine_chunks", &uccl_ep::normal_combine_chunks, py::arg("setting"), py::arg("num_sms"),
        "The pieces a combine pushes each peer's block in, for a combine_chunks setting and the combine's SMs.");
  m.attr("NORMAL_PULL_CHUNKS") = uccl_ep::kNormalPullChunks;
  m.attr("NORMAL_SM_PULL_PERCENT") = uccl_ep::kNormalSmPullPercent;
  m.attr("NORMAL_SM_PUSH_PERCENT") = uccl_ep::kNormalSmPushPercent;
  m.attr("NORMAL_MAX_CHUNKS") = uccl_ep::kNormalMaxChunks;
  m.def("normal_chunk_word", &uccl_ep::normal_chunk_word, py::arg("epoch"), py::arg("landed"), py::arg("chunks"),
        "A chunk word: `landed` of the `chunks` pieces of exchange `epoch` are there.");
  m.attr("NORMAL_CHUNK_WORDS_OPEN") = uccl_ep::kNormalChunkWordsOpen;
  m.def("normal_channel_word_offset", &uccl_ep::normal_channel_word_offset, py::arg("src"), py::arg("channel"),
        py::arg("num_channels"), "Where the SM path's word of (src, channel) lies in a rank's control area (bytes).");
  m.def("normal_channel_progress", &uccl_ep::normal_channel_progress, py::arg("epoch"), py::arg("positions"),
        "A channel word: `positions` send positions of exchange `epoch` stored.");
  m.def(
      "normal_channel_tokens",
      [](int32_t num_channels, int32_t channel, int64_t num_tokens) {
        const uccl_ep::NormalTokenRange range = uccl_ep::normal_channel_tokens(num_channels, channel, channel + 1,
                                                                               num_tokens);
        return std::make_pair(range.first, range.end);
      },
      py::arg("num_channels"), py::arg("channel"), py::arg("num_tokens"), "The tokens [first, end) of a channel.");
  m.def("normal_combine_rows_landed", &uccl_ep::normal_combine_rows_landed, py::arg("word"), py::arg("epoch"),
        py::arg("rows"), "Of the `rows` rows a combine pushes to an owner, those landed by chunk word `word`.");
  m.def(
      "normal_dispatch_area_bytes",
      [](int64_t rows, int64_t x_row_bytes, int64_t scale_row_bytes, int64_t num_topk) {
        return uccl_ep::normal_dispatch_area(rows, x_row_bytes, scale_row_bytes, num_topk).total;
      },
      py::arg("rows"), py::arg("x_row_bytes"), py::arg("scale_row_bytes"), py::arg("num_topk"),
      "Bytes of the data area a dispatch of `rows` received rows needs.");
  m.def(
      "normal_combine_area_bytes",
      [](int64_t rows, int64_t x_row_bytes, int64_t num_topk) {
        return uccl_ep::normal_combine_area(rows, x_row_bytes, num_topk).total;
      },
      py::arg("rows"), py::arg("x_row_bytes"), py::arg("num_topk"),
      "Bytes of the data area a combine returning `rows` rows needs.");
  m.def(
      "normal_send_layout",
      [](std::uintptr_t is_token_in_rank, int64_t num_tokens, int32_t num_ranks, int32_t num_channels,
         std::uintptr_t send_pos, std::uintptr_t channel_prefix_matrix, std::uintptr_t send_head, std::uintptr_t stream) {
        const uccl_ep::NormalSendLayoutArgs args{ptr<const bool>(is_token_in_rank), num_tokens, num_ranks, num_channels,
                                                 ptr<int32_t>(send_pos), ptr<int32_t>(channel_prefix_matrix),
                                                 ptr<int32_t>(send_head)};
        uccl_ep::launch_normal_send_layout(args, as_stream(stream));
      },
      py::arg("is_token_in_rank"), py::arg("num_tokens"), py::arg("num_ranks"), py::arg("num_channels"),
      py::arg("send_pos"), py::arg("channel_prefix_matrix"), py::arg("send_head"), py::arg("stream"),
      py::call_guard<py::gil_scoped_release>(),
      "Enqueue send_pos [N, R] and, when given, channel_prefix_matrix [R, C] and send_head [N, R].");
  m.def("normal_notify_area_bytes", &uccl_ep::normal_notify_area_bytes, py::arg("num_ranks"), py::arg("num_channels"),
        py::arg("num_local_experts"), "Bytes of the data area a dispatch's notify needs.");
  m.def("normal_notify_settings_word", &uccl_ep::normal_notify_settings_word, py::arg("num_channels"),
        py::arg("pull_chunks"), py::arg("sm_push_percent"), py::arg("push_rows"), py::arg("sends"),
        "The word in which a dispatch's notify checks that every rank uses the same settings.");
  m.def(
      "normal_notify_settings",
      [](int32_t word) {
        const uccl_ep::NormalNotifySettings s = uccl_ep::normal_notify_settings(word);
        return std::make_tuple(s.num_channels, s.pull_chunks, s.sm_push_percent, s.push_rows, s.sends);
      },
      py::arg("word"),
      "(num_channels, pull_chunks, sm_push_percent, push_rows, sends) of a normal_notify_settings_word.");
  m.attr("NORMAL_MAX_GAPS") = uccl_ep::kNormalMaxGaps;
  py::enum_<uccl_ep::NormalOwnRows>(m, "NormalOwnRows", "What copies a rank's dispatch rows to itself.")
      .value("auto", uccl_ep::NormalOwnRows::kAuto)
      .value("engine", uccl_ep::NormalOwnRows::kEngine)
      .value("sm", uccl_ep::NormalOwnRows::kSms);
  m.attr("NORMAL_OWN_ROWS_ENGINE_BYTES_PER_SM") = uccl_ep::kNormalOwnRowsEngineBytesPerSm;
  py::enum_<uccl_ep::NormalRowPath>(m, "NormalRowPath",
                                    "What moves a dispatch's rows between ranks (UCCL_EP_NORMAL_COPY).")
      .value("auto", uccl_ep::NormalRowPath::kAuto)
      .value("engine", uccl_ep::NormalRowPath::kEngine)
      .value("sm", uccl_ep::NormalRowPath::kSm)
      .value("sends", uccl_ep::NormalRowPath::kSends);
  m.attr("NORMAL_SM_ROWS_FROM_RANKS") = uccl_ep::kNormalSmRowsFromRanks;
  m.attr("NORMAL_SM_ROWS_FROM_SMS") = uccl_ep::kNormalSmRowsFromSms;
  m.def("normal_dispatch_by_copy_engine", &uccl_ep::normal_dispatch_by_copy_engine, py::arg("path"),
        py::arg("num_ranks"), py::arg("num_sms"), "Whether the copy engines move a fresh dispatch's rows.");
  m.def("normal_cached_dispatch_by_copy_engine", &uccl_ep::normal_cached_dispatch_by_copy_engine, py::arg("path"),
        py::arg("num_ranks"), py::arg("num_sms"),
        "Whether the copy engines move a cached dispatch's rows (where its handle's counts allow).");
  m.def("normal_rows_by_sends", &uccl_ep::normal_rows_by_sends, py::arg("path"), py::arg("num_ranks"),
        py::arg("num_sms"),
        "Whether SMs send the rows of the dispatches the copy engines serve (their copy engines copy them out).");
  m.def("normal_own_rows_by_engine", &uccl_ep::normal_own_rows_by_engine, py::arg("mode"), py::arg("own_bytes"),
        py::arg("num_sms"), "Whether a copy engine copies a rank's own dispatch rows (given runs for them).");
  m.def(
      "normal_token_runs",
      [](const std::vector<int32_t>& gaps, int64_t num_tokens) {
        std::vector<std::tuple<int64_t, int64_t, int64_t>> runs;
        for (const uccl_ep::NormalTokenRun& run :
             uccl_ep::normal_token_runs(gaps.data(), static_cast<int64_t>(gaps.size()), num_tokens)) {
          runs.emplace_back(run.token, run.row, run.count);
        }
        return runs;
      },
      py::arg("gaps"), py::arg("num_tokens"),
      "(token, row, count) of each run of consecutive tokens a rank sends one rank, given those it does not "
      "(ascending).");
  m.def(
      "normal_landing_offset",
      [](const std::vector<int32_t>& rank_prefix_matrix, int num_ranks, int64_t x_row_bytes, int64_t scale_row_bytes,
         int64_t num_topk, int64_t notify_bytes) {
        uccl_ep::require(static_cast<int64_t>(rank_prefix_matrix.size()) == static_cast<int64_t>(num_ranks) * num_ranks,
                         "rank_prefix_matrix must have num_ranks * num_ranks entries");
        return uccl_ep::normal_landing_offset(rank_prefix_matrix.data(), num_ranks,
                                              uccl_ep::NormalRowBytes{x_row_bytes, scale_row_bytes, num_topk},
                                              notify_bytes);
      },
      py::arg("rank_prefix_matrix"), py::arg("num_ranks"), py::arg("x_row_bytes"), py::arg("scale_row_bytes"),
      py::arg("num_topk"), py::arg("notify_bytes"),
      "Where pushed dispatch rows land in every rank's data area (past the staging and the notify's slots).");
  m.def("normal_sends_offset", &uccl_ep::normal_sends_offset, py::arg("num_ranks"), py::arg("num_channels"),
        py::arg("num_local_experts"), "Where rows sent by SMs lie in every rank's data area (past the notify's slots).");
  m.def(
      "normal_sends_fit",
      [](const std::vector<int32_t>& rank_prefix_matrix, int num_ranks, int64_t offset, int64_t x_row_bytes,
         int64_t scale_row_bytes, int64_t num_topk, int64_t data_bytes) {
        uccl_ep::require(static_cast<int64_t>(rank_prefix_matrix.size()) == static_cast<int64_t>(num_ranks) * num_ranks,
                         "rank_prefix_matrix must have num_ranks * num_ranks entries");
        return uccl_ep::normal_sends_fit(rank_prefix_matrix.data(), num_ranks, offset,
                                         uccl_ep::NormalRowBytes{x_row_bytes, scale_row_bytes, num_topk}, data_bytes);
      },
      py::arg("rank_prefix_matrix"), py::arg("num_ranks"), py::arg("offset"), py::arg("x_row_bytes"),
      py::arg("scale_row_bytes"), py::arg("num_topk"), py::arg("data_bytes"),
      "Whether every rank's data area of data_bytes holds, at offset, all the rows it receives by sends.");
  m.def("normal_pushes_rows", &uccl_ep::normal_pushes_rows, py::arg("push_rows"), py::arg("landing_fits"),
        py::arg("source_tokens"), py::arg("sent"),
        "Whether a source of source_tokens tokens pushes the `sent` it sends a peer (with push_rows).");
  py::class_<LayoutNotifyArgs>(m, "NormalLayoutNotifyArgs",
                               "A dispatch's send layout and notify (pointers as integers).")
      .def(py::init(&layout_notify_args), py::arg("region"), py::arg("is_token_in_rank"), py::arg("num_tokens"),
           py::arg("num_tokens_per_rank"), py::arg("num_tokens_per_expert"), py::arg("num_channels"),
           py::arg("num_local_experts"), py::arg("expert_alignment"), py::arg("num_worst_tokens"), py::arg("send_pos"),
           py::arg("channel_prefix_matrix"), py::arg("send_head"), py::arg("rank_prefix_matrix"),
           py::arg("recv_channel_prefix_matrix"), py::arg("recv_tokens_per_expert"))
      .def_property(
          "pull_chunks", [](const LayoutNotifyArgs& self) { return self.notify.pull_chunks; },
          [](LayoutNotifyArgs& self, int32_t chunks) { self.notify.pull_chunks = chunks; },
          "The pieces of the copy engines' gather the notify announces (0: none); start_dispatch sets them.")
      .def_property(
          "sends", [](const LayoutNotifyArgs& self) { return self.notify.sends; },
          [](LayoutNotifyArgs& self, bool sends) { self.notify.sends = sends; },
          "Whether the notify announces a dispatch by sends (normal_rows_by_sends); start_dispatch sets it.");
  m.def(
      "normal_layout_and_notify",
      [](const LayoutNotifyArgs& args, std::uintptr_t stream) {
        uccl_ep::launch_normal_layout_and_notify(args.layout, args.notify, as_stream(stream));
      },
      py::arg("args"), py::arg("stream"), py::call_guard<py::gil_scoped_release>(),
      "Enqueue a dispatch's send layout and notify exchange on `stream`.");
  py::enum_<uccl_ep::NormalStaging>(m, "NormalStaging")
      .value("DISPATCH", uccl_ep::NormalStaging::kDispatch)
      .value("COMBINE", uccl_ep::NormalStaging::kCombine);
  m.def(
      "normal_staging_most_bytes",
      [](uccl_ep::NormalStaging kind, const std::vector<int32_t>& rank_prefix_matrix, int num_ranks,
         int64_t x_row_bytes, int64_t scale_row_bytes, int64_t num_topk) {
        return uccl_ep::normal_staging_most_bytes(kind, rank_prefix_matrix, num_ranks,
                                                  uccl_ep::NormalRowBytes{x_row_bytes, scale_row_bytes, num_topk});
      },
      py::arg("kind"), py::arg("rank_prefix_matrix"), py::arg("num_ranks"), py::arg("x_row_bytes"),
      py::arg("scale_row_bytes"), py::arg("num_topk"),
      "Bytes of the fullest rank's data area on the copy-engine path (rank_prefix_matrix flattened, on the host): "
      "one call per path decision, with the counts converted once.");
  py::class_<uccl_ep::NormalCopyEngine>(m, "NormalCopyEngine",
                                        "Normal-mode dispatch and combine whose NVLink traffic the copy engines carry.")
      .def(py::init<int, std::vector<std::uintptr_t>, int, int, int, int, uccl_ep::NormalOwnRows, bool>(),
           py::arg("device"),
           py::arg("peer_bases"), py::arg("combine_chunks") = uccl_ep::kNormalCombineChunksBySms,
           py::arg("pull_chunks") = uccl_ep::kNormalPullChunks,
           py::arg("sm_pull_percent") = uccl_ep::kNormalSmPullPercent,
           py::arg("sm_push_percent") = uccl_ep::kNormalSmPushPercent,
           py::arg("own_rows") = uccl_ep::NormalOwnRows::kAuto, py::arg("push_rows") = false)
      .def("pull_chunks", &uccl_ep::NormalCopyEngine::pull_chunks, py::arg("num_channels"),
           "The pieces a gathered dispatch of num_channels channels is pulled in.")
      .def("pushes_rows", &uccl_ep::NormalCopyEngine::pushes_rows,
           "Whether its gathered dispatches push rows where they can (push_rows and stream waits).")
      .def("blocks_pushed", &uccl_ep::NormalCopyEngine::blocks_pushed,
           "How many blocks of rows (one per peer and dispatch) its dispatches have pushed so far.")
      .def("own_rows_by_engine", &uccl_ep::NormalCopyEngine::own_rows_by_engine,
           "How many dispatches so far copied this rank's own rows by copy engine.")
      .def("last_count_wait_ns", &uccl_ep::NormalCopyEngine::last_count_wait_ns,
           "How long the last dispatch that read its counts waited for them on the host (nanoseconds).")
      .def("release", &uccl_ep::NormalCopyEngine::release, py::call_guard<py::gil_scoped_release>());

  py::class_<uccl_ep::NormalHostCounts, std::shared_ptr<uccl_ep::NormalHostCounts>>(
      m, "NormalHostCounts", "A dispatch's rank_prefix_matrix as read on the host (kept with its handle).")
      .def_property_readonly("rank_prefix_matrix",
                             [](const uccl_ep::NormalHostCounts& self) { return self.rank_prefix_matrix; });
  py::enum_<uccl_ep::NormalCallStatus>(m, "NormalCallStatus", "What a NormalLauncher call did.")
      .value("DONE", uccl_ep::NormalCallStatus::kDone)
      .value("FAILED", uccl_ep::NormalCallStatus::kFailed)
      .value("TOO_LARGE", uccl_ep::NormalCallStatus::kTooLarge);
  py::class_<BoundNormalLauncher>(m, "NormalLauncher",
                                  "Each normal-mode operation in one call (positional arguments only; tensors as a "
                                  "tuple in the operation's order, Nones where absent). A call returns a "
                                  "NormalCallStatus value (an int): FAILED when a kernel recorded a failure (raise it "
                                  "from the state), TOO_LARGE when the exchange does not fit num_nvl_bytes (nothing "
                                  "moved rows; the same on every rank). `check` (no arguments) is the caller's checks "
                                  "of the call: run, and let raise, only for a kind of call (the tensors' dtypes, "
                                  "devices, sizes and strides, and the values) this launcher has not seen pass.")
      .def(py::init([](const uccl_ep::NormalRegion& region, uccl_ep::NormalCopyEngine& copy_engine,
                       const uccl_ep::LowLatencyState& state, int device, uccl_ep::NormalRowPath rows,
                       bool launch_thread) {
             auto bound = std::make_unique<BoundNormalLauncher>();
             bound->launcher = std::make_unique<uccl_ep::NormalLauncher>(region, &copy_engine, &state, device, rows,
                                                                         launch_thread);
             return bound;
           }),
           py::arg("region"), py::arg("copy_engine"), py::arg("state"), py::arg("device"), py::arg("rows"),
           py::arg("launch_thread") = true,
           py::keep_alive<1, 3>(), py::keep_alive<1, 4>())
      .def("dispatch", &NormalLauncherCalls::dispatch,
           "dispatch((x, x_scales, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_rank, "
           "num_tokens_per_expert), (expert_alignment, num_worst_tokens), num_channels, stream, check) -> (status, "
           "[send_pos, channel_prefix_matrix, send_head, recv_channel_prefix_matrix, rank_prefix_matrix, recv_x, "
           "recv_x_scales, recv_topk_idx, recv_topk_weights, recv_src_idx] when DONE, tokens per local expert (read on "
           "the host, else empty), NormalHostCounts or None, what does not fit). A fresh dispatch: layout, notify, the "
           "count read, the outputs allocated for the rows read, and the rows into them.")
      .def("cached_dispatch", &NormalLauncherCalls::cached_dispatch,
           "cached_dispatch((x, x_scales, topk_idx, topk_weights, send_pos, rank_prefix_matrix, "
           "recv_channel_prefix_matrix, recv_src_idx, is_token_in_rank), (expert_alignment, num_worst_tokens), "
           "num_channels, host_counts, stream, check) -> (status, [recv_x, recv_x_scales or None] when DONE): a "
           "dispatch with a handle's layout (num_channels: the call's, num_sms / 2; host_counts: the handle's "
           "NormalHostCounts or None).")
      .def("combine", &NormalLauncherCalls::combine,
           "combine((x, topk_weights, bias0, bias1, rank_prefix_matrix, is_token_in_rank, send_pos, "
           "recv_channel_prefix_matrix, recv_src_idx), (number of biases,), num_channels, host_counts, stream, check) "
           "-> (status, [combined_x, combined_topk_weights or None] when DONE), the channels as in cached_dispatch.")
      .def(
          "release", [](BoundNormalLauncher& self) { self.launcher->release(); },
          py::call_guard<py::gil_scoped_release>(),
          "Stops its launch thread once the work handed to it is queued (before the copy engine's release).");
}
#endif  // UCCL_EP_WITH_GPU
