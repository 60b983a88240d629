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
