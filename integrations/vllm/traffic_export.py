"""Each uccl Buffer's traffic counters written to a directory, so tests and diagnostics can read them
from outside vLLM's worker processes.

``UCCL_EP_TRAFFIC_DIR=DIR`` (set for the vLLM server, inherited by its workers): the Buffers the
plugin builds count their traffic (as ``UCCL_EP_TRAFFIC_COUNTERS=1`` does, see
uccl_ep_plugin.traffic), and after every finalize (combine) through the uccl prepare/finalize the
Buffer's counters replace ``DIR/buffer-<pid>-<n>.json`` atomically. Once the engine is idle the
files hold every Buffer's totals. Each write reads the counters (a host sync on GPUs) and rewrites a
small file: for tests and diagnostics, not for production serving.
"""

import contextlib
import itertools
import json
import os
import tempfile
import weakref
from pathlib import Path
from typing import Optional

from uccl_ep_plugin.traffic import TRAFFIC_ENV, enabled_by_env

TRAFFIC_DIR_ENV = "UCCL_EP_TRAFFIC_DIR"
_file_numbers = itertools.count()
_paths: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def directory() -> Optional[Path]:
    raw = os.environ.get(TRAFFIC_DIR_ENV, "").strip()
    return Path(raw) if raw else None


@contextlib.contextmanager
def counters_for_new_buffers():
    """While a Buffer is built: counters on if UCCL_EP_TRAFFIC_DIR is set (and not turned off explicitly)."""
    if directory() is None:
        yield
        return
    if TRAFFIC_ENV in os.environ:
        if not enabled_by_env():
            raise ValueError(f"{TRAFFIC_DIR_ENV} is set but {TRAFFIC_ENV}={os.environ[TRAFFIC_ENV]!r} turns the "
                             f"counters off: unset one of them")
        yield
        return
    os.environ[TRAFFIC_ENV] = "1"
    try:
        yield
    finally:
        os.environ.pop(TRAFFIC_ENV, None)


def record(buffer, backend: str) -> None:
    """Rewrite ``buffer``'s counters file (no-op unless UCCL_EP_TRAFFIC_DIR is set)."""
    target_dir = directory()
    if target_dir is None:
        return
    counters = buffer.traffic_counters()
    if counters is None:
        raise RuntimeError(f"{TRAFFIC_DIR_ENV} is set but this Buffer was built without traffic counters "
                           f"(it was not built by the uccl vLLM plugin's all2all manager)")
    path = _paths.get(buffer)
    if path is None:
        target_dir.mkdir(parents=True, exist_ok=True)
        path = _paths[buffer] = target_dir / f"buffer-{os.getpid()}-{next(_file_numbers)}.json"
    payload = dict(counters, backend=backend, pid=os.getpid(), num_ranks=buffer.group_size)
    handle, temporary = tempfile.mkstemp(dir=target_dir, prefix=".", suffix=".tmp")
    with os.fdopen(handle, "w") as out:
        json.dump(payload, out)
    os.replace(temporary, path)
