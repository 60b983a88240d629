"""Dispatch + combine through vLLM's own DeepEP prepare/finalize classes, bound to uccl_ep_plugin.Buffer.

2 spawned ranks over gloo on CPU, reference engine; stand-ins are listed in _ranks.py.
"""


import _scenarios
from _ranks import run_ranks


def test_high_throughput_standard_format():
    results = run_ranks(_scenarios.high_throughput)
    # Every (token, expert) pair of both ranks arrives at the expert's rank exactly once.
    assert sum(sum(r["per_expert"]) for r in results) == 2 * 24 * _scenarios.TOPK


def test_low_latency_batched_format():
    results = run_ranks(_scenarios.low_latency)
    assert sum(sum(r["per_expert"]) for r in results) == 2 * 12 * _scenarios.TOPK


def test_high_throughput_single_token_per_rank():
    """One token per rank (vLLM's dummy batch): a one-row receive whose row is not a multiple of 8 bytes."""
    results = run_ranks(_scenarios.high_throughput, 1)
    assert sum(sum(r["per_expert"]) for r in results) == 2 * 1 * _scenarios.TOPK


def test_traffic_counters_written_after_finalize(tmp_path, monkeypatch):
    """UCCL_EP_TRAFFIC_DIR: each rank's Buffer writes its counters after vLLM's finalize (traffic_export)."""
    import json

    monkeypatch.setenv("UCCL_EP_TRAFFIC_DIR", str(tmp_path))      # inherited by the spawned ranks
    results = run_ranks(_scenarios.high_throughput)
    files = sorted(tmp_path.glob("buffer-*.json"))
    counters = {c["rank"]: c for c in (json.loads(path.read_text()) for path in files)}
    assert len(files) == 2 and sorted(counters) == [0, 1]
    for rank, result in enumerate(results):
        mine, other = counters[rank], counters[1 - rank]
        assert mine["backend"] == "uccl_high_throughput" and mine["num_ranks"] == 2
        assert mine["calls"]["dispatch"] == 1
        assert sum(mine["dispatch_rows_received"]) == result["received"]
        assert mine["dispatch_rows_sent"][1 - rank] == other["dispatch_rows_received"][rank] > 0
