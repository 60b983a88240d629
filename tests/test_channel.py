"""The GPU->CPU command FIFO: many producers, one consumer per FIFO, rings that wrap around many
times; every command must arrive exactly once, untorn, and in its producer's order."""

import pytest
import torch

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
