"""``uccl-ep bench`` reports no kernel figure for a graph-timed step whose kernels, timed by DeepEP's eager
procedure, took far longer than the step's graph replay: the kernels then waited for a rank's late host, and
the figure says nothing about them. The raw value stays in a note, printed and in the JSON."""

from uccl_ep_plugin.benchmark import runner
from uccl_ep_plugin.benchmark.report import progress_line


def test_kernel_time_within_the_graph_replay_is_kept():
    kernels = {"low_latency_dispatch_send": 14.1, "low_latency_dispatch_recv": 9.8}
    assert runner._trusted_kernel_us(kernels, 25.7, "cuda-graph") == (kernels, None)


def test_kernel_time_far_above_the_graph_replay_is_dropped_with_a_note():
    kernel_us, note = runner._trusted_kernel_us({"low_latency_dispatch": 113.0}, 27.6, "cuda-graph")
    assert kernel_us is None
    assert "113.0 us" in note and "27.6 us" in note and "host fell behind" in note


def test_eager_steps_have_no_graph_to_compare_with():
    kernels = {"notify_dispatch_send": 300.0}
    assert runner._trusted_kernel_us(kernels, 100.0, "eager") == (kernels, None)


def test_no_kernels_gives_no_figure_and_no_note():
    assert runner._trusted_kernel_us({}, 25.0, "cuda-graph") == (None, None)


def test_the_progress_line_carries_the_note():
    result = {"mode": "low_latency", "op": "dispatch", "dtype": "fp8", "median_us": 27.6, "correct": True,
              "kernel_us": None, "gbps": 272.2, "kernel_note": "kernel time not reported: example"}
    line = progress_line(1, 7, result)
    assert line.endswith("ok; kernel time not reported: example")
    assert "kernels" not in line
