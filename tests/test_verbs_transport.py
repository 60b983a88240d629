"""The verbs transport (csrc/transport/verbs_transport.*) against a real verbs provider: in CI, soft-RoCE (two
rxe devices over a veth pair) inside the qemu guest of tests/soft_roce/guest.sh, which tests/soft_roce/run_tests.sh
starts. Outside such a guest (no RDMA device) only the error of a host without one runs.

The multi-rank exchange with immediates and atomics is tests/test_transport_exchange.py's (kind "verbs"); here:
argument errors, requests to itself, four ranks, several queue pairs per peer, a wrong device or GID index, and what
a host without RDMA says.
"""

import errno
import os

import pytest
import torch

from tests.multiprocess import run_ranks
from tests.transport_exchange import (POISON, assert_local_requests, assert_requests_checked, atomics_body,
                                      exchange_body, rdma_devices, skip_without)
from uccl_ep_plugin import _C

pytestmark = pytest.mark.skipif("verbs_transport" not in _C.build_info()["features"],
                                reason="the extension was built without the verbs transport (no rdma-core headers)")


def _one_rank(region, **kwargs):
    transport = _C.VerbsTransport(0, 1, region.data_ptr(), region.numel(), device=rdma_devices()[0], **kwargs)
    transport.connect([transport.listen_address()])
    return transport


def test_without_an_rdma_device_the_error_says_what_to_do():
    if rdma_devices():
        pytest.skip("this host has RDMA devices")
    region = torch.zeros(4096, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="no RDMA device found.*UCCL_EP_PROXY_TRANSPORT=tcp"):
        _C.VerbsTransport(0, 1, region.data_ptr(), region.numel())


@pytest.mark.parametrize("peer_errno,advice", [
    (errno.EINVAL, ["nvidia_peermem", "efa_nv_peermem", "amdgpu", "DMA-BUF (CUDA 11.7+"]),
    (errno.EFAULT, ["nvidia_peermem"]),
    (errno.ENOMEM, ["ulimit -l"]),
    (errno.EIO, ["peer-to-peer"]),
])
def test_gpu_memory_that_cannot_be_registered_is_explained(peer_errno, advice):
    """What each way said (DMA-BUF, peer memory with the errno in words) and what to do about it."""
    dmabuf = "the GPU driver does not export DMA-BUF (it needs CUDA 11.7+ with the open kernel modules)"
    message = _C.verbs_gpu_registration_failure(1 << 20, dmabuf, peer_errno)
    assert "1048576 bytes of GPU memory" in message and dmabuf in message
    assert f"{os.strerror(peer_errno)} (errno {peer_errno})" in message
    assert all(words in message for words in advice), message
    assert message.endswith("or choose UCCL_EP_PROXY_TRANSPORT=tcp")


def test_a_gpu_region_must_be_that_gpus_memory():
    """gpu >= 0 names the GPU whose memory the region is: host memory is refused before any device is opened."""
    region = torch.zeros(4096, dtype=torch.uint8)
    with pytest.raises((ValueError, RuntimeError), match="no GPU support|no GPU can be used|not memory of device=0"):
        _C.VerbsTransport(0, 1, region.data_ptr(), region.numel(), gpu=0)
    with pytest.raises(ValueError, match="gpu must be >= 0, or -1"):
        _C.VerbsTransport(0, 1, region.data_ptr(), region.numel(), gpu=-2)


def test_bad_arguments_name_the_argument():
    skip_without("verbs", gpus=0)
    region = torch.full((4096,), POISON, dtype=torch.uint8)
    transport = _one_rank(region)
    assert transport.device_name == rdma_devices()[0] and transport.port == 1 and transport.gid_index >= 0
    assert_requests_checked(transport, 4096)
    transport.close()
    with pytest.raises(RuntimeError, match="after close"):
        transport.listen_address()


@pytest.mark.parametrize("reorder_seed", [-1, 5], ids=["in-order", "reorder"])
def test_requests_to_itself(reorder_seed):
    skip_without("verbs", gpus=0)
    region = torch.full((1 << 16,), POISON, dtype=torch.uint8)
    assert_local_requests(region, lambda: _one_rank(region, reorder_seed=reorder_seed))


def test_unknown_device_is_named_with_the_ones_there_are():
    skip_without("verbs", gpus=0)
    region = torch.zeros(4096, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match=f"no RDMA device named 'nosuch9'.*{rdma_devices()[0]}"):
        _C.VerbsTransport(0, 1, region.data_ptr(), region.numel(), device="nosuch9")


def test_wrong_gid_index_is_refused():
    skip_without("verbs", gpus=0)
    region = torch.zeros(4096, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="GID index 4000 .UCCL_IB_GID_INDEX."):
        _C.VerbsTransport(0, 1, region.data_ptr(), region.numel(), device=rdma_devices()[0], gid_index=4000)


def test_four_ranks_exchange_with_reordering():
    skip_without("verbs", gpus=0)
    run_ranks(4, exchange_body, kind="verbs", reorder_seed=2024, env_seed=None)


QPS_ENV = "UCCL_IB_QPS_PER_PEER"


@pytest.mark.parametrize("num_ranks,qps,body", [(2, 3, atomics_body), (4, 2, exchange_body)],
                         ids=["2-ranks-3-qps-atomics", "4-ranks-2-qps-writes"])
def test_several_queue_pairs_per_peer(monkeypatch, num_ranks, qps, body):
    """UCCL_IB_QPS_PER_PEER queue pairs to each peer, taken in turn: the exchange with reorder injection (writes and
    immediates from every rank) and the atomic adds still land exactly."""
    skip_without("verbs", gpus=0)
    monkeypatch.setenv(QPS_ENV, str(qps))
    extra = {} if body is atomics_body else {"env_seed": None}
    run_ranks(num_ranks, body, kind="verbs", reorder_seed=77, **extra)


def _qps_differ_body(rank, num_ranks, group):
    region = torch.full((1 << 16,), POISON, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"rank \d has \d queue pairs per peer, this rank \d; every rank must use "
                                         r"the same UCCL_IB_QPS_PER_PEER"):
        _connected(rank, num_ranks, group, region, qps_per_peer=1 + rank)


def test_ranks_with_different_queue_pair_counts_are_refused():
    skip_without("verbs", gpus=0)
    region = torch.zeros(4096, dtype=torch.uint8)
    transport = _C.VerbsTransport(0, 1, region.data_ptr(), region.numel(), device=rdma_devices()[0], qps_per_peer=4)
    assert transport.qps_per_peer == 4
    transport.close()
    with pytest.raises(ValueError, match="qps_per_peer must be >= 0"):
        _C.VerbsTransport(0, 1, region.data_ptr(), region.numel(), device=rdma_devices()[0], qps_per_peer=-1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(QPS_ENV, "0")
        with pytest.raises(ValueError, match="UCCL_IB_QPS_PER_PEER=0: expected an integer >= 1"):
            _C.VerbsTransport(0, 1, region.data_ptr(), region.numel(), device=rdma_devices()[0])
    run_ranks(2, _qps_differ_body)


def _connected(rank, num_ranks, group, region, **kwargs):
    """This rank's verbs transport over ``region``, connected to every rank's and past a barrier."""
    import torch.distributed as dist

    devices = rdma_devices()
    transport = _C.VerbsTransport(rank, num_ranks, region.data_ptr(), region.numel(),
                                  device=devices[rank % len(devices)], **kwargs)
    addresses = [None] * num_ranks
    dist.all_gather_object(addresses, transport.listen_address(), group=group)
    transport.connect(addresses)
    dist.barrier(group=group)
    return transport


def _peer_gone_body(rank, num_ranks, group):
    import time

    region = torch.full((1 << 20,), POISON, dtype=torch.uint8)
    transport = _connected(rank, num_ranks, group, region, timeout_s=5.0)
    if rank == 1:
        os._exit(0)   # gone without a word: the kernel tears its queue pairs down
    time.sleep(1.0)
    for i in range(32):
        transport.write(1, 0, i * 4096, 4096, imm=i)
    start = time.monotonic()
    # The NIC's retries run out (the error completion in words), or else quiet()'s timeout names the peer.
    with pytest.raises(RuntimeError, match=r"rank 0 .*(to rank 1 failed: .*retry|timed out .* to rank 1)"):
        transport.quiet()
    assert time.monotonic() - start < 15, "the error took longer than the retries or the 5 s timeout"
    transport.close()


def test_a_peer_that_disappears_ends_in_an_error_not_a_hang():
    skip_without("verbs", gpus=0)
    run_ranks(2, _peer_gone_body)


def _capped_body(rank, num_ranks, group):
    import torch.distributed as dist

    from tests.immediates import collect_immediates

    chunk, chunks, cap_bytes, cap_requests = 16 << 10, 24, 40 << 10, 3
    region = torch.full((2 * chunk * chunks,), POISON, dtype=torch.uint8)
    region[:chunk * chunks] = torch.randint(0, 256, (chunk * chunks,), dtype=torch.uint8,
                                            generator=torch.Generator().manual_seed(rank))
    transport = _connected(rank, num_ranks, group, region, max_inflight_bytes=cap_bytes,
                           max_inflight_requests=cap_requests)
    peer = 1 - rank
    # First many 1 KiB writes (the request cap binds: 3 in flight), then 16 KiB ones (the byte cap binds: two fit
    # under 40 KiB, a third waits).
    small = 1 << 10
    for i in range(chunks):
        transport.write(peer, i * small, chunk * chunks + i * small, small)
    transport.quiet()
    assert transport.peak_inflight_requests == cap_requests and transport.peak_inflight_bytes == 3 * small
    for i in range(chunks):
        transport.write(peer, i * chunk, chunk * chunks + i * chunk, chunk, imm=i)

    def landed(src, i):
        got = region[chunk * chunks + i * chunk: chunk * chunks + (i + 1) * chunk]
        assert torch.equal(got, expected[i * chunk:(i + 1) * chunk]), f"rank {rank}: write {i} not there yet"

    expected = torch.randint(0, 256, (chunk * chunks,), dtype=torch.uint8, generator=torch.Generator().manual_seed(peer))
    collect_immediates(transport, rank, {(peer, i) for i in range(chunks)}, 60.0, landed)
    transport.quiet()
    assert transport.peak_inflight_bytes == 2 * chunk, transport.peak_inflight_bytes
    assert transport.peak_inflight_requests == cap_requests, transport.peak_inflight_requests
    dist.barrier(group=group)
    assert torch.equal(region[chunk * chunks:], expected), f"rank {rank}: the capped writes landed wrong"
    dist.barrier(group=group)
    transport.close()


def test_in_flight_caps_hold_and_the_data_still_lands():
    skip_without("verbs", gpus=0)
    run_ranks(2, _capped_body)


def test_doctor_lists_the_devices_gids_and_atomics():
    """`uccl-ep doctor --json` reports each RDMA device through libibverbs: its port's state and link layer, its
    RoCE v2 IPv4 GID (the one the transport uses) and its atomics."""
    import json
    import subprocess
    import sys

    skip_without("verbs", gpus=0)
    out = subprocess.run([sys.executable, "-m", "uccl_ep_plugin.cli.main", "doctor", "--json"], capture_output=True,
                         text=True, timeout=300, check=True).stdout
    devices = {device["name"]: device for device in json.loads(out)["verbs"]["devices"]}
    for name in rdma_devices():
        device = devices[name]
        assert device["error"] == "" and device["atomics"] in ("hca", "global")
        assert device["queue_pairs"] == "RC"   # libefa is installed and says soft-RoCE is no EFA device
        port = device["ports"][0]
        assert port["state"] == "active" and port["link_layer"] == "Ethernet"
        chosen = [g for g in port["gids"] if g["index"] == port["gid_index"]]
        assert chosen and chosen[0]["type"] == "RoCE v2" and chosen[0]["address"].startswith("10.0.0.")
        region = torch.zeros(4096, dtype=torch.uint8)
        transport = _C.VerbsTransport(0, 1, region.data_ptr(), region.numel(), device=name)
        assert transport.gid_index == port["gid_index"] and not transport.srd
        assert transport.registration == "host memory" and transport.region_is_host_memory
        transport.close()


def test_transport_bench_has_checked_verbs_rows(tmp_path):
    import json
    import subprocess
    import sys

    skip_without("verbs", gpus=0)
    out = tmp_path / "transport.json"
    subprocess.run([sys.executable, "-m", "uccl_ep_plugin.cli.main", "bench", "--mode", "transport", "--iters", "10",
                    "--json", str(out)], check=True, timeout=300, capture_output=True)
    rows = [row for row in json.loads(out.read_text()) if row["transport"] == "verbs"]
    assert len(rows) == 6 and all(row["correct"] for row in rows), rows
