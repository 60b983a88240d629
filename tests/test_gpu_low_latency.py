"""Native low-latency dispatch/combine (NVLink, CUDA IPC) against the reference engine on 2 GPUs (issue 5),
or on UCCL_EP_TEST_RANKS GPUs (4 or 8 on a larger machine; each case's per-rank token counts repeat).

One NCCL group of those ranks runs every case (H 2048..8192, T 1..256 with N < T and N = 0 on one rank,
top-k 1..11, 16..288 experts, -1 entries in topk_idx; bf16, fp8 with and without round_scale, UE8M0;
plain, out=, LogFMT and zero-copy combine; hooks, async events, stats, both buffer halves, cleaning,
masking and CUDA-graph replay): each rank feeds the same fresh random inputs to a native Buffer and a
reference Buffer and compares the outputs (tests/gpu_low_latency_cases.py). Every section is its own
pytest item; run with ``-s`` to see the fp8 byte statistics. Two more groups check a peer that never
calls: a CommTimeoutError without enable_shrink, automatic masking with it.

``UCCL_EP_TEST_CANDIDATE=reference`` runs the same comparison reference-vs-reference on the GPUs (to
tell harness problems from kernel problems; the graph and missing-peer tests then skip).

The CPU test at the end runs the harness reference-vs-reference on gloo ranks, clean and with
each output corrupted on purpose, and checks that exactly the corruptions are reported.
"""

import os

import pytest

from tests import gpu_low_latency_cases as ll
from tests.multiprocess import SHARE_GPU_ENV, environment, needs_gpus, ranks_share_gpus
from tests.reference_checks import SectionCache, SectionResults, assert_section
from uccl_ep_plugin.engines.native.low_latency import COMBINE_ENV
from uccl_ep_plugin.platform_config.loader import AUTO_ATOMIC_KEY as AGGRESSIVE_ATOMIC_KEY
from uccl_ep_plugin.proxies import MODULE_LOADING_ENV

CANDIDATE = os.environ.get("UCCL_EP_TEST_CANDIDATE", "native")
MISSING_PEER_TIMEOUT_S = 3.0
RANKS = int(os.environ.get("UCCL_EP_TEST_RANKS", "2"))

needs_rank_gpus = needs_gpus(RANKS)
needs_native = pytest.mark.skipif(CANDIDATE != "native", reason="checks the native engine's own behaviour")

_GPU = SectionCache(ll.comparison_body, backend="nccl", candidate=CANDIDATE, cases=ll.GPU_CASES,
                    mask_cases=ll.GPU_MASK_CASES, graph_cases=ll.GPU_GRAPH_CASES if CANDIDATE == "native" else ())


@pytest.mark.gpu
@needs_rank_gpus
@pytest.mark.parametrize("section", ll.SECTIONS)
def test_low_latency_matches_reference(section):
    assert_section(_GPU.get(RANKS), section)


# The same comparison with every peer reached through the CPU proxy (UCCL_EP_FORCE_PROXY=1: the kernels stage
# each peer's share and push writes, the proxy moves them with the copy engines or over tcp sockets), in order
# and with the transport's reorder injection. Masking through the proxy is not covered yet.
PROXY_SECTIONS = tuple(section for section in ll.SECTIONS if section != "mask")
_PROXY = {
    name: SectionCache(ll.comparison_body, backend="nccl", candidate=CANDIDATE, cases=ll.GPU_CASES, mask_cases=(),
                       graph_cases=ll.GPU_GRAPH_CASES if CANDIDATE == "native" else (),
                       environment=dict({"UCCL_EP_FORCE_PROXY": "1", "UCCL_EP_PROXY_TRANSPORT": transport}, **extra))
    for transport in ("cuda-copy", "tcp")
    for name, extra in ((f"{transport}-in-order", {}), (f"{transport}-reorder", {"UCCL_EP_TRANSPORT_REORDER": "7"}))}


# Ranks sharing one GPU (SHARE_GPU_ENV): a cuda-copy proxy's device-to-device copy into the other process's buffer
# can wait until that process's kernel, which waits for the copy, leaves the GPU; measured on an H200 with 128 tokens
# of H 7168, it ran only when the kernel gave up at its timeout (16 tokens of H 1024 went through). The tcp
# transport's copies through the host run.
def _transports(names):
    shared_skip = pytest.mark.skipif(ranks_share_gpus(), reason=f"a cuda-copy proxy's copies wait for the other "
                                                                 f"rank's kernel on a shared GPU ({SHARE_GPU_ENV}=1)")
    return [pytest.param(name, marks=shared_skip) if name.startswith("cuda-copy") else name for name in names]


@pytest.mark.gpu
@needs_rank_gpus
@needs_native
@pytest.mark.parametrize("transport_order", _transports(_PROXY))
@pytest.mark.parametrize("section", PROXY_SECTIONS)
def test_low_latency_through_the_proxy_matches_reference(section, transport_order):
    with environment(MODULE_LOADING_ENV, "EAGER"):  # the spawned ranks inherit it (uccl_ep_plugin/proxies.py)
        results = _PROXY[transport_order].get(RANKS)
    assert_section(results, section)


# Ranks on two hosts (UCCL_EP_GPUS_PER_NODE: the first half of the GPUs one host, the second another): each half
# reaches the other half through the proxies, over tcp on loopback or over cuda-copy (the copy engines into the
# other logical host's buffers, mapped with CUDA IPC since it is the same machine); the transport
# UCCL_EP_PROXY_TRANSPORT names, or verbs where every rank has an RDMA NIC. At 2 ranks every peer is remote; at 4,
# NVLink and proxy peers mix in one launch.
_TWO_HOSTS = {transport: SectionCache(ll.comparison_body, backend="nccl", candidate=CANDIDATE, cases=ll.GPU_CASES,
                                      mask_cases=(), graph_cases=ll.GPU_GRAPH_CASES, two_hosts=True,
                                      environment=environment_of)
              for transport, environment_of in (("tcp", {"UCCL_EP_PROXY_TRANSPORT": "tcp", "UCCL_SOCKET_IFNAME": "lo"}),
                                                ("cuda-copy", {"UCCL_EP_PROXY_TRANSPORT": "cuda-copy"}))}


@pytest.mark.gpu
@needs_rank_gpus
@needs_native
@pytest.mark.parametrize("transport", _transports(sorted(_TWO_HOSTS)))
@pytest.mark.parametrize("section", PROXY_SECTIONS)
def test_low_latency_across_two_hosts_matches_reference(section, transport):
    with environment(MODULE_LOADING_ENV, "EAGER"):  # the spawned ranks inherit it (uccl_ep_plugin/proxies.py)
        results = _TWO_HOSTS[transport].get(RANKS)
    assert_section(results, section)


# The same comparison with settings other than the defaults: the kernels' flags as relaxed accesses between
# explicit fences (UCCL_EP_ENABLE_AGGRESSIVE_ATOMIC=1, AMD's default; CUDA's is the release/acquire pair), and the
# combine pre-reduced on the experts' ranks where it fits (UCCL_EP_LOW_LATENCY_COMBINE=prereduce; direct by default).
_SETTINGS = {name: SectionCache(ll.comparison_body, backend="nccl", candidate=CANDIDATE, cases=ll.GPU_CASES,
                                mask_cases=ll.GPU_MASK_CASES, graph_cases=ll.GPU_GRAPH_CASES, environment=settings)
             for name, settings in (("aggressive-atomics", {AGGRESSIVE_ATOMIC_KEY: "1"}),
                                    ("prereduced-combine", {COMBINE_ENV: "prereduce"}))}


@pytest.mark.gpu
@needs_rank_gpus
@needs_native
@pytest.mark.parametrize("setting", list(_SETTINGS))
@pytest.mark.parametrize("section", ll.SECTIONS)
def test_low_latency_with_other_settings_matches_reference(section, setting):
    assert_section(_SETTINGS[setting].get(RANKS), section)


@pytest.mark.gpu
@needs_rank_gpus
@needs_native
@pytest.mark.parametrize("enable_shrink", [False, True], ids=["raises", "masks"])
def test_missing_peer(enable_shrink):
    """Only rank 0 calls low_latency_dispatch: it raises CommTimeoutError (naming rank 0, the operation and a
    silent rank) within timeout + 5 s, or with enable_shrink masks every other rank and carries on."""
    results = SectionCache(ll.missing_peer_body, backend="nccl", deadline_s=90.0, candidate=CANDIDATE,
                           enable_shrink=enable_shrink, timeout_s=MISSING_PEER_TIMEOUT_S).get(RANKS)
    assert_section(results, "missing_peer_masked" if enable_shrink else "missing_peer_raises")


@pytest.mark.gpu
@needs_rank_gpus
@needs_native
@pytest.mark.parametrize("combine", ["direct", "prereduce"])
def test_missing_peer_in_combine(combine):
    """Every rank dispatches, then only rank 0 combines: it raises CommTimeoutError (naming rank 0, the combine
    and a silent rank) within timeout + 5 s: its receive waits for the peers' rows, or, pre-reduced, its send for
    their routing."""
    results = SectionCache(ll.missing_peer_body, backend="nccl", deadline_s=90.0, candidate=CANDIDATE,
                           enable_shrink=False, timeout_s=MISSING_PEER_TIMEOUT_S, in_combine=True,
                           settings={COMBINE_ENV: combine}).get(RANKS)
    assert_section(results, "missing_combine_peer_raises")


@pytest.mark.gpu
@needs_rank_gpus
@needs_native
def test_hook_of_a_destroyed_buffer_raises():
    """A hook kept past Buffer.destroy() raises instead of receiving into released memory."""
    results = SectionCache(ll.hook_after_destroy_body, backend="nccl", deadline_s=90.0,
                           candidate=CANDIDATE).get(RANKS)
    assert_section(results, "hook_after_destroy")


# ---------------------------------------------------------------------------------------- the harness, on CPU
_SELF_CHECK = SectionCache(ll.comparison_body, deadline_s=120.0, candidate="reference", cases=ll.SELF_CHECK_CASES,
                           mask_cases=ll.SELF_CHECK_MASK_CASES, graph_cases=(), tampers=tuple(ll.TAMPER_DETECTED_BY))


def _failed_ranks(results: SectionResults, section: str):
    return [rank for rank, record in results.per_rank.items() if record.get(section)]


@pytest.mark.parametrize("tamper", list(ll.TAMPER_DETECTED_BY), ids=lambda t: t or "untampered")
def test_harness_reports_exactly_the_corrupted_outputs(tamper):
    """Reference against reference: untampered (and with tolerated changes: one fp8 step, garbage past
    recv_count) every section passes; each corruption makes the sections that compare it fail."""
    results = _SELF_CHECK.get(2)
    assert results.crash is None, results.crash
    prefix = "" if tamper is None else f"{tamper}/"
    detected_by = ll.TAMPER_DETECTED_BY[tamper]
    for section in ll.SECTIONS:
        name = prefix + section
        for rank in range(2):
            assert name in results.per_rank.get(rank, {}), f"rank {rank} never ran {name}"
        if section in detected_by:
            assert _failed_ranks(results, name), f"{name}: the corruption went unnoticed"
        elif tamper is None or not detected_by:
            assert_section(results, name)
