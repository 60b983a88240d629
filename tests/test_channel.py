"""The GPU->CPU command FIFO: many producers, one consumer per FIFO, rings that wrap around many
times; every command must arrive exactly once, untorn, and in its producer's order."""

import json
import statistics
import types

import pytest
import torch

from uccl_ep_plugin.benchmark import channel
from uccl_ep_plugin.cli.main import main

_C = pytest.importorskip("uccl_ep_plugin._C", reason="the native extension is not built")


def _assert_clean(result, expected):
    assert result["expected"] == expected
    assert result["pushed"] == expected, result
    assert result["popped"] == expected, result
    assert (result["lost"], result["out_of_order"], result["torn"]) == (0, 0, 0), result


@pytest.mark.parametrize("producers,per_producer,capacity", [
    (1, 20000, 2),        # one producer, ring of two slots: wraps 10000 times
    (3, 20000, 8),        # contention for every slot
    (8, 4000, 4),         # more producers than slots and than cores
    (2, 50000, 1024),     # a roomy ring
])
def test_host_producers_lose_nothing(producers, per_producer, capacity):
    result = _C.channel_stress_host(producers, per_producer, capacity, 60.0)
    _assert_clean(result, producers * per_producer)
    assert result["popped"] > 2 * capacity  # the ring wrapped around


@pytest.mark.parametrize("producers,per_producer,capacity,message", [
    (0, 10, 8, "num_producers"),
    (2, 0, 8, "commands per producer"),
    (2, 10, 6, "capacity"),
])
def test_bad_sizes_name_the_argument(producers, per_producer, capacity, message):
    with pytest.raises(ValueError, match=message):
        _C.channel_stress_host(producers, per_producer, capacity, 1.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fifos,blocks,threads,per_thread,capacity", [
    (1, 1, 1, 20000, 4),       # one GPU pusher through a tiny ring
    (4, 8, 32, 200, 64),       # 1024 GPU pushers, four consumers
    (2, 132, 128, 20, 1024),   # every SM pushing
])
def test_gpu_producers_lose_nothing(fifos, blocks, threads, per_thread, capacity):
    if "gpu_channel" not in _C.build_info()["features"]:
        pytest.skip("built without CUDA")
    result = _C.channel_stress_gpu(fifos, blocks, threads, per_thread, capacity, 60.0)
    _assert_clean(result, fifos * blocks * threads * per_thread)
    rate = result["expected"] / result["seconds"] / 1e6
    print(f"\n{fifos} FIFOs x {blocks * threads} GPU pushers, capacity {capacity}: {rate:.2f} M commands/s")


# ---------------------------------------------------------------------------------------------
# Latency (ping-pong) and the channel benchmark behind ``uccl-ep bench --mode channel``.
# ---------------------------------------------------------------------------------------------
def _needs_gpu_channel():
    if "gpu_channel" not in _C.build_info()["features"]:
        pytest.skip("built without CUDA")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("capacity", [2, 1024])
def test_gpu_latency_times_every_round_trip(capacity):
    _needs_gpu_channel()
    iterations = 2000
    result = _C.channel_latency_gpu(iterations, capacity, 60.0)
    assert result["error"] is None, result["error"]
    _assert_clean(result, result["warmup"] + iterations)
    samples = result["round_trip_ns"]
    assert len(samples) == iterations
    assert min(samples) > 0
    assert statistics.median(samples) < 1_000_000  # 1 ms: generous, a round trip takes a few us
    assert result["loop_ns"] >= sum(samples)      # the loop's span holds every round trip
    print(f"\nround trip median {statistics.median(samples) / 1e3:.2f} us, "
          f"loop mean {result['loop_ns'] / iterations / 1e3:.2f} us (capacity {capacity})")


@pytest.mark.parametrize("iterations,capacity,timeout_s,message", [
    (0, 64, 1.0, "iterations"),
    (-1, 64, 1.0, "iterations"),
    (1 << 24, 64, 1.0, "iterations"),
    (10, 6, 1.0, "capacity"),
    (10, -2, 1.0, "capacity"),
    (10, 64, 0.0, "timeout_s"),
    (10, 64, float("nan"), "timeout_s"),
])
def test_latency_bad_arguments_name_the_argument(iterations, capacity, timeout_s, message):
    if not hasattr(_C, "channel_latency_gpu"):
        pytest.skip("built without CUDA: no GPU channel")
    with pytest.raises(ValueError, match=message):  # checked before any GPU work: runs without a GPU
        _C.channel_latency_gpu(iterations, capacity, timeout_s)


def test_latency_stats_use_nearest_rank():
    stats = channel.latency_stats([3000, 1000, 2000, 4000, 5000, 6000, 7000, 8000, 9000, 10000])
    assert (stats["min_us"], stats["p10_us"], stats["median_us"], stats["p90_us"], stats["p99_us"]) == \
        (1.0, 1.0, 5.0, 9.0, 10.0)
    assert stats["timer_step_ns_at_most"] == 1000
    assert channel.latency_stats([])["median_us"] is None


def test_throughput_sizing_fills_the_sms():
    assert [channel.blocks_per_fifo(132, n) for n in (1, 2, 4, 8)] == [132, 66, 33, 16]
    assert channel.commands_per_thread_for(10e6, 132 * 128) == 45  # 75 ms at 10 M/s
    assert channel.commands_per_thread_for(1.0, 132 * 128) == channel.PROBE_COMMANDS_PER_THREAD


@pytest.mark.parametrize("argv,hidden_gpu,message", [
    (["--device", "cpu"], False, "--device cpu"),
    ([], True, "no CUDA GPU"),
])
def test_bench_channel_without_a_gpu_exits_2(argv, hidden_gpu, message, monkeypatch, capsys):
    if hidden_gpu:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "--mode", "channel"] + argv) == 2
    err = capsys.readouterr().err
    assert "cannot run" in err and message in err


def _fake_latency(iterations, capacity, timeout_s):
    samples = [2000 + 10 * (i % 7) for i in range(iterations)]
    return {"expected": 1000 + iterations, "pushed": 1000 + iterations, "popped": 1000 + iterations, "lost": 0,
            "out_of_order": 0, "torn": 0, "capacity": capacity, "num_fifos": 1, "seconds": 0.1, "warmup": 1000,
            "iterations": iterations, "round_trip_ns": samples, "loop_ns": sum(samples) + iterations,
            "error": None}


def _fake_stress(num_fifos, blocks, threads, per_thread, capacity, timeout_s):
    expected = num_fifos * blocks * threads * per_thread
    torn = 1 if capacity == 64 else 0  # one broken row: it must be marked WRONG
    return {"expected": expected, "pushed": expected, "popped": expected, "lost": 0, "out_of_order": 0,
            "torn": torn, "capacity": capacity, "num_fifos": num_fifos, "seconds": expected / 20e6}


def test_bench_channel_reports_and_writes_json_with_a_fake_channel(tmp_path, monkeypatch, capsys):
    """The benchmark's Python side end to end, with the native runs replaced by fakes (no GPU needed)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: types.SimpleNamespace(name="Fake GPU", multi_processor_count=132))
    monkeypatch.setattr(channel, "build_info", lambda: {"features": ["gpu_channel"]})
    monkeypatch.setattr(_C, "channel_latency_gpu", _fake_latency, raising=False)
    monkeypatch.setattr(_C, "channel_stress_gpu", _fake_stress, raising=False)
    path = tmp_path / "channel.json"
    assert main(["bench", "--mode", "channel", "--json", str(path)]) == 1  # the small-ring row is wrong
    out, err = capsys.readouterr()
    assert "[6/6] channel throughput" in err and "WRONG" in err
    assert "median us" in out and "M cmd/s" in out and "1 result(s) WRONG" in out
    assert "throughput goal >= 10 M commands/s per GPU: best 20.00" in out and ": met" in out
    assert "push-to-pop is at most the round trip" in out
    results = json.loads(path.read_text())
    assert [r["op"] for r in results] == ["latency"] + ["throughput"] * 5
    assert all(r["device"] == "Fake GPU" and r["commit"] and r["date"] for r in results)
    assert results[0]["median_us"] == 2.03 and results[0]["correct"]
    assert [r["correct"] for r in results[1:]] == [True, True, True, True, False]
