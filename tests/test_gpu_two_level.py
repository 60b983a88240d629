"""Normal mode across hosts in two hops on GPUs: the ranks of one machine split into logical hosts, the rail hop
over NCCL or driven by the GPU through the proxies' transports, and the forward hop through the native intranode
Buffer of each host, against the reference engine (tests/test_two_level.py's body, there on CPU ranks). The
GPU-driven rail alone: blocks in pieces back to back, and a silent peer."""

import os

import pytest
import torch
import torch.distributed as dist

from tests.multiprocess import environment, needs_feature, needs_gpus, rank_device, run_ranks
from tests.test_two_level import two_hops_body
from uccl_ep_plugin.engines.reference.collectives import CommTimeoutError
from uccl_ep_plugin.proxies import MODULE_LOADING_ENV

RANKS = int(os.environ.get("UCCL_EP_TEST_RANKS", "2"))
# hosts of 1 GPU each, and (with 4 or more) of 2
SPLITS = [1] + ([2] if RANKS >= 4 else [])

pytestmark = [pytest.mark.gpu, needs_gpus(RANKS)]
TRANSPORTS = [pytest.param("tcp", marks=needs_feature("tcp_device_memory")),
              pytest.param("cuda-copy", marks=needs_feature("cuda_copy_transport"))]


@pytest.mark.parametrize("per_host", SPLITS, ids=lambda n: f"{n}-per-host")
@pytest.mark.parametrize("use_fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("num_worst_tokens", [0, 160], ids=["exact", "worst-tokens"])
def test_two_hops_on_gpus_match_the_reference(per_host, use_fp8, num_worst_tokens):
    run_ranks(RANKS, two_hops_body, backend="nccl", per_host=per_host, use_fp8=use_fp8,
              num_worst_tokens=num_worst_tokens, num_nvl_bytes=1 << 26)


@pytest.fixture(autouse=True)
def eager_module_loading():
    """The rail's kernel waits on the proxies, whose stand-in transports copy through the CUDA runtime: kernels load
    at start-up (uccl_ep_plugin/proxies.py); the spawned ranks inherit it."""
    with environment(MODULE_LOADING_ENV, "EAGER"):
        yield


@pytest.mark.parametrize("rail", TRANSPORTS)
@pytest.mark.parametrize("per_host", SPLITS, ids=lambda n: f"{n}-per-host")
@pytest.mark.parametrize("reorder_seed", [None, 3], ids=["in-order", "reordered"])
def test_two_hops_over_a_transport_on_gpus_match_the_reference(rail, per_host, reorder_seed):
    """The hop between hosts driven by the GPU through a proxies' transport over a region in GPU memory: tcp, or
    cuda-copy (copy engines into the other logical hosts' regions, mapped with CUDA IPC: one machine stands for
    several)."""
    run_ranks(RANKS, two_hops_body, backend="nccl", per_host=per_host, use_fp8=True, num_worst_tokens=0,
              num_nvl_bytes=1 << 26, rail=rail, reorder_seed=reorder_seed)


@pytest.mark.parametrize("rail", TRANSPORTS)
def test_two_hops_in_pieces_over_a_transport_on_gpus(rail):
    """A rail region of a few rows per slot in GPU memory: every block crosses in pieces, each after the receiver
    freed its slot."""
    run_ranks(RANKS, two_hops_body, backend="nccl", per_host=1, use_fp8=True, num_worst_tokens=0,
              num_nvl_bytes=1 << 26, rail=rail, reorder_seed=7, rail_bytes=8192)


WIDTH, SLOT_ROWS = 48, 3


def _device_rail(group, rank, num_ranks, rail, timeout_s=20.0, slot_bytes=SLOT_ROWS * WIDTH):
    from uccl_ep_plugin import _C
    from uccl_ep_plugin.engines.rail import DeviceRail, rail_control_bytes
    num_bytes = rail_control_bytes(num_ranks) + 2 * num_ranks * slot_bytes
    device_rail = DeviceRail(group, rank, num_ranks, rank_device(rank), num_bytes, rail, timeout_s, _C)
    assert device_rail.native.slot_bytes == slot_bytes
    return device_rail


def _device_rail_exchanges_body(rank, num_ranks, group, rail, reorder_seed, widths, max_rows, slot_bytes,
                                between):
    if reorder_seed is not None:
        os.environ["UCCL_EP_TRANSPORT_REORDER"] = str(reorder_seed + rank)
    device = rank_device(rank)
    device_rail = _device_rail(group, rank, num_ranks, rail, slot_bytes=slot_bytes)

    def block(source, host, step):   # what ``source`` sends ``host`` in exchange ``step``: random, seeded by all 3
        count = (7 * source + 5 * host + 3 * step) % (max_rows + 1) if (source + host + step) % 4 else 0
        gen = torch.Generator().manual_seed(1000 * step + 100 * source + host)
        width = widths[step % len(widths)]
        return torch.randint(0, 256, (count, width), generator=gen, dtype=torch.uint8).to(device)

    results = []
    for step in range(8):
        blocks = [block(rank, host, step) for host in range(num_ranks)]
        expected = [block(source, rank, step) for source in range(num_ranks)]
        rows = sum(b.size(0) for b in expected)
        width = widths[step % len(widths)]
        torch.full((rows + 64, width), 0xA5, dtype=torch.uint8, device=device)   # freed at once: the output reuses it
        received = device_rail.exchange(torch.cat(blocks), [b.size(0) for b in blocks], [b.size(0) for b in expected],
                                        f"exchange {step}")
        results.append((received, torch.cat(expected)))
        if between:   # other work between exchanges, as the two hops have: a collective and a host wait
            total = torch.ones(1, device=device)
            dist.all_reduce(total, group=group)
            assert int(total.item()) == num_ranks
    torch.cuda.synchronize(device)
    device_rail.check()
    for step, (received, expected) in enumerate(results):
        assert torch.equal(received, expected), f"rank {rank}, exchange {step}"
    device_rail.close(wait_for_peers=True)


@pytest.mark.parametrize("rail", TRANSPORTS)
@pytest.mark.parametrize("reorder_seed", [None, 17], ids=["in-order", "reordered"])
def test_a_device_rail_sends_blocks_larger_than_a_slot_in_pieces_back_to_back(rail, reorder_seed):
    """Blocks of 0 to 10 rows through slots of 3, eight exchanges back to back: every row arrives once, in order,
    into poisoned outputs."""
    run_ranks(RANKS, _device_rail_exchanges_body, backend="nccl", rail=rail, reorder_seed=reorder_seed,
              widths=[WIDTH], max_rows=10, slot_bytes=SLOT_ROWS * WIDTH, between=False)


@pytest.mark.parametrize("rail", TRANSPORTS)
@pytest.mark.parametrize("reorder_seed", [None, 17], ids=["in-order", "reordered"])
def test_a_device_rail_changes_row_widths_between_exchanges_with_other_work_between(rail, reorder_seed):
    """As the two hops use it: each exchange's rows of another width (a dispatch's, a cached dispatch's, a
    combine's), blocks of up to 40 rows in one piece, and a collective and a host wait between exchanges."""
    run_ranks(RANKS, _device_rail_exchanges_body, backend="nccl", rail=rail, reorder_seed=reorder_seed,
              widths=[320, 272, 528], max_rows=40, slot_bytes=40 * 528, between=True)


def _silent_peer_body(rank, num_ranks, group, rail):
    device = rank_device(rank)
    device_rail = _device_rail(group, rank, num_ranks, rail, timeout_s=3.0)
    if rank == 0:   # the others never exchange
        rows = torch.randint(0, 256, (2 * num_ranks, WIDTH), dtype=torch.uint8, device=device)
        with pytest.raises(CommTimeoutError, match=r"rank 0: dispatch across hosts \(rail over .*, GPU-driven\): "
                                                   r"timed out after 3s waiting for piece 1 of host \d's rows"):
            # over a stand-in transport the exchange waits for its kernel and raises; over a NIC the check does
            device_rail.exchange(rows, [2] * num_ranks, [2] * num_ranks, "dispatch across hosts")
            torch.cuda.synchronize(device)   # the kernel gives up after the timeout
            device_rail.check()
        with pytest.raises(CommTimeoutError, match="dispatch across hosts"):   # and so does every later exchange
            device_rail.exchange(rows, [2] * num_ranks, [2] * num_ranks, "combine across hosts")
    dist.barrier(group=group)
    device_rail.close()


@pytest.mark.parametrize("rail", TRANSPORTS)
def test_a_silent_rail_peer_raises_naming_the_rank_phase_and_piece(rail):
    run_ranks(RANKS, _silent_peer_body, backend="nccl", rail=rail)


def _captured_body(rank, num_ranks, group, rail):
    device = rank_device(rank)
    device_rail = _device_rail(group, rank, num_ranks, rail)
    rows = torch.randint(0, 256, (2 * num_ranks, WIDTH), dtype=torch.uint8, device=device)
    stream = torch.cuda.Stream(device)
    with torch.cuda.stream(stream):
        with pytest.raises(ValueError, match="a CUDA graph could not replay it"):
            with torch.cuda.graph(torch.cuda.CUDAGraph(), stream=stream):
                device_rail.exchange(rows, [2] * num_ranks, [2] * num_ranks, "combine across hosts")
    dist.barrier(group=group)
    device_rail.close()


@pytest.mark.parametrize("rail", TRANSPORTS)
def test_a_device_rail_refuses_graph_capture(rail):
    """Its pieces are numbered on the host: a replay would reuse the numbers, so capturing it is an error."""
    run_ranks(RANKS, _captured_body, backend="nccl", rail=rail)
