"""vLLM serves a tiny MoE with expert parallelism on CPU through uccl_ep_plugin.

Two real OpenAI-compatible servers on the same local weights, one after the other:

* reference: TP=1, vLLM's own single-rank MoE path, greedy tokens with top-2 logprobs;
* candidate: DP=2 + expert parallelism with ``--all2all-backend uccl_high_throughput``: every MoE
  layer's dispatch and combine go through ``uccl_ep_plugin.Buffer`` (reference engine on the
  engine's gloo group), and the Buffers write their traffic counters to UCCL_EP_TRAFFIC_DIR.

The candidate's greedy tokens must equal the reference's, except where the reference's top two
logprobs are exactly equal; the counters must show tokens sent to and received from the other rank.
"""

import random

import pytest

from completions import concurrent_greedy_completions
from greedy_match import compare
from uccl_ep_plugin.bench_serving.server import ServerError
from traffic_files import read_settled

MODEL_NAME = "tiny-qwen3-moe"
NUM_PROMPTS = 8
MAX_TOKENS = 16
COMMON_ARGS = ["--served-model-name", MODEL_NAME, "--dtype", "bfloat16", "--max-model-len", "256", "--seed", "0"]
#: TP=1 runs eager, as the plugin makes the expert-parallel server run on CPU (its start-up without
#: --enforce-eager is covered here): the same kernels on both, and no inductor compile on 2 cores.
REFERENCE_ARGS = ["--enforce-eager"]
#: KV cache per engine in GiB (vLLM's CPU default is sized for real models).
COMMON_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
EXPERT_PARALLEL_ARGS = ["--data-parallel-size", "2", "--enable-expert-parallel"]


def prompts():
    """Seeded token-id prompts of different lengths (byte tokens 0..255 of the tiny tokenizer)."""
    generator = random.Random(1234)
    return [[generator.randrange(256) for _ in range(generator.randint(3, 24))] for _ in range(NUM_PROMPTS)]


@pytest.fixture(scope="module")
def reference(start_server, tiny_model):
    server = start_server("tp1", ["--model", str(tiny_model), *COMMON_ARGS, *REFERENCE_ARGS], env=COMMON_ENV)
    try:
        return concurrent_greedy_completions(server.url(), MODEL_NAME, prompts(), MAX_TOKENS, top_logprobs=2)
    finally:
        server.stop()


@pytest.fixture(scope="module")
def expert_parallel(start_server, tiny_model, tmp_path_factory):
    """``(completions, traffic counter files, server)`` of the DP=2 + EP server (stopped once read)."""
    traffic_dir = tmp_path_factory.mktemp("traffic")
    server = start_server("dp2-ep-uccl", ["--model", str(tiny_model), *COMMON_ARGS, *EXPERT_PARALLEL_ARGS,
                                          "--all2all-backend", "uccl_high_throughput"],
                          env={**COMMON_ENV, "UCCL_EP_TRAFFIC_DIR": str(traffic_dir)})
    try:
        completions = concurrent_greedy_completions(server.url(), MODEL_NAME, prompts(), MAX_TOKENS)
        # One request alone: one rank serves it while the other runs vLLM's one-token dummy batches,
        # so dispatch and combine also move single rows.
        lone = concurrent_greedy_completions(server.url(), MODEL_NAME, prompts()[:1], MAX_TOKENS)
        traffic = read_settled(traffic_dir, expected_files=2, timeout=60)
    finally:
        server.stop()
    return completions + lone, traffic, server


def test_moe_layers_run_through_uccl_buffer(expert_parallel):
    _, _, server = expert_parallel
    assert not server.running(), "a process of the stopped server's group is still alive"
    log = server.log_text()
    assert len(server.log_lines_with("using UcclHTAll2AllManager all2all manager")) == 2, server.log_tail()
    assert len(server.log_lines_with("Using UcclHTPrepareAndFinalize")) == 2, server.log_tail()
    assert "Buffer uses the reference engine on cpu" in log
    assert "--enforce-eager on CPU for --all2all-backend uccl_high_throughput" in log
    assert "allgather_reducescatter" not in log       # vLLM's CPU fallback manager was not built


def test_greedy_tokens_match_tp1_up_to_exact_ties(reference, expert_parallel):
    candidate, _, server = expert_parallel
    report = compare(reference + reference[:1], candidate)     # the lone request repeats prompt 0
    print(report.summary())
    for divergence in report.ties:
        print(f"  exact tie: {divergence}")
    assert report.tokens_compared >= NUM_PROMPTS
    assert not report.mismatches, f"{report.summary()}: {report.mismatches} (log: {server.log_path})"


def test_tokens_crossed_ranks(expert_parallel):
    _, traffic, _ = expert_parallel
    by_rank = {counters["rank"]: counters for counters in traffic}
    assert sorted(by_rank) == [0, 1], traffic
    for rank, counters in by_rank.items():
        other = 1 - rank
        print(f"rank {rank}: {counters}")
        assert counters["backend"] == "uccl_high_throughput" and counters["num_ranks"] == 2
        assert counters["calls"]["dispatch"] > 0
        assert counters["dispatch_rows_sent"][other] > 0 and counters["dispatch_rows_received"][other] > 0
        assert counters["crossed_ranks"] == (counters["dispatch_rows_sent"][other]
                                             + counters["dispatch_rows_received"][other])
        # What one rank sent the other received (both ranks run every dispatch together).
        assert counters["dispatch_rows_sent"][other] == by_rank[other]["dispatch_rows_received"][rank]
    assert by_rank[0]["calls"] == by_rank[1]["calls"]


def test_low_latency_stops_with_the_reason(start_server, tiny_model, log_dir):
    """vLLM's CPU experts cannot take the BatchedExperts format: start-up stops saying so."""
    with pytest.raises(ServerError):
        start_server("dp2-ep-uccl-ll", ["--model", str(tiny_model), *COMMON_ARGS, *EXPERT_PARALLEL_ARGS,
                                        "--all2all-backend", "uccl_low_latency"], env=COMMON_ENV)
    log = (log_dir / "dp2-ep-uccl-ll.log").read_text()
    assert "--all2all-backend uccl_low_latency cannot run on this platform" in log
    assert "take the Standard format only" in log
