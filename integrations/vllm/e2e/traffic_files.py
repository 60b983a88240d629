"""Reading the traffic counter files the plugin writes to UCCL_EP_TRAFFIC_DIR (see traffic_export)."""

import json
import time
from pathlib import Path
from typing import Dict, List


def read_all(directory: Path) -> List[Dict]:
    return [json.loads(path.read_text()) for path in sorted(Path(directory).glob("buffer-*.json"))]


def read_settled(directory: Path, expected_files: int, timeout: float, quiet: float = 2.0) -> List[Dict]:
    """The files once ``expected_files`` exist and none changed for ``quiet`` seconds (an idle engine
    still finishes its last step after the last answer). Raises TimeoutError after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    last, stable_since = None, time.monotonic()
    while True:
        current = read_all(directory)
        now = time.monotonic()
        if current != last:
            last, stable_since = current, now
        elif len(current) == expected_files and now - stable_since >= quiet:
            return current
        if now > deadline:
            raise TimeoutError(f"{directory}: {len(current)} traffic file(s) (expected {expected_files}) "
                               f"not settled after {timeout:.0f}s: {current}")
        time.sleep(0.25)
