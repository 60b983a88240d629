"""The runs' results: one JSON per run, a table with each backend's ratio to the first, and a plot."""

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from .client import Metrics


@dataclass
class Run:
    backend: str
    engine: str
    engine_version: str
    settings: Dict
    metrics: Optional[Metrics] = None
    error: Optional[str] = None          # why it did not serve (with the log's last lines)
    logs: Dict[str, str] = field(default_factory=dict)

    @property
    def served(self) -> bool:
        return self.metrics is not None

    def as_dict(self) -> Dict:
        return {"backend": self.backend, "engine": self.engine, "engine_version": self.engine_version,
                "settings": self.settings, "metrics": self.metrics.as_dict() if self.metrics else None,
                "error": self.error, "logs": self.logs}


def write_json(run: Run, out_dir: Path, index: int) -> Path:
    path = out_dir / f"{index:02d}-{run.backend}.json"
    path.write_text(json.dumps(run.as_dict(), indent=2) + "\n")
    return path


def _ms(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.1f}"


def table(runs: List[Run]) -> str:
    """One row per run; the ratio is each backend's output-token throughput over the first served run's."""
    first = next((run for run in runs if run.served), None)
    header = ("backend", "req/s", "out tok/s", "ratio", "TTFT med/p99 ms", "TPOT med ms", "ITL med ms", "failed")
    rows = [header]
    for run in runs:
        m = run.metrics
        if m is None:
            reason = (run.error or "did not serve").splitlines()[0]
            rows.append((run.backend, "-", "-", "-", "-", "-", "-", f"not served: {reason}"))
            continue
        ratio = m.output_throughput / first.metrics.output_throughput if first.metrics.output_throughput else 0.0
        rows.append((run.backend, f"{m.request_throughput:.2f}", f"{m.output_throughput:.1f}", f"{ratio:.2f}x",
                     f"{_ms(m.ttft_median_ms)} / {_ms(m.ttft_p99_ms)}", _ms(m.tpot_median_ms), _ms(m.itl_median_ms),
                     str(m.failed)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header) - 1)]   # the last column is free text
    lines = []
    for row in rows:
        cells = [cell.ljust(width) if i == 0 else cell.rjust(width) for i, (cell, width) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells + [row[-1]]))
    return "\n".join(lines)


def plot(runs: List[Run], path: Path, title: str) -> Path:
    """Output-token throughput and median TTFT per backend (a backend that did not serve: an empty bar)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [run.backend for run in runs]
    throughput = [run.metrics.output_throughput if run.served else 0.0 for run in runs]
    ttft = [(run.metrics.ttft_median_ms or 0.0) if run.served else 0.0 for run in runs]
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for axis, values, label in ((left, throughput, "output tokens/s (higher is better)"),
                                (right, ttft, "median TTFT, ms (lower is better)")):
        bars = axis.bar(names, values, color=["#4c72b0" if run.served else "#cccccc" for run in runs])
        axis.set_title(label, fontsize=10)
        axis.tick_params(axis="x", labelrotation=20, labelsize=8)
        for bar, value, run in zip(bars, values, runs):
            axis.annotate(f"{value:.1f}" if run.served else "not served", (bar.get_x() + bar.get_width() / 2, value),
                          ha="center", va="bottom", fontsize=8)
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
