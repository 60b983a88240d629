"""`uccl-ep bench --mode transport` over tcp on this host: every case runs, is checked, and reports its figure
(verbs rows come from the soft-RoCE guest: tests/test_verbs_transport.py)."""

import pytest

from uccl_ep_plugin import _C
from uccl_ep_plugin.benchmark import transport


@pytest.mark.skipif("tcp_transport" not in _C.build_info()["features"], reason="no tcp transport in this build")
def test_tcp_rows_are_checked_and_complete():
    seen = []
    results = transport.run_transport_benchmark("test", 10, seen.append)
    tcp = [row for row in results if row["transport"] == "tcp"]
    assert seen == results
    assert [(row["op"], row["bytes"]) for row in tcp] == (
        [("write latency", size) for size in transport.LATENCY_SIZES] +
        [("write bandwidth", size) for size in transport.BANDWIDTH_SIZES] + [("atomic add", 8)])
    assert all(row["correct"] and row["median_us"] > 0 for row in tcp)
    assert all(row["gbps"] > 0 for row in tcp if row["op"] == "write bandwidth")
    assert tcp[-1]["mops"] > 0 and tcp[-1]["count"] == 100


def test_a_host_without_rdma_leaves_verbs_out_and_says_why(monkeypatch):
    monkeypatch.setattr(transport, "_rdma_devices", lambda: [])
    reasons = dict(transport.available_transports())
    assert reasons["verbs"] is not None and ("RDMA device" in reasons["verbs"] or "verbs" in reasons["verbs"])
