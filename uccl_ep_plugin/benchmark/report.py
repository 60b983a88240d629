"""Printing benchmark figures: a progress line per case as it finishes, a table at the end, JSON."""

import json
import sys
from typing import Dict, List, TextIO

def time_cell(us: float) -> str:
    """A time with the unit that fits: microseconds below 10 ms, else milliseconds."""
    return f"{us:.1f} us" if us < 10_000 else f"{us / 1000:.1f} ms"


# (key, title, format string or function) per column; the workload is printed above the table, per mode.
COLUMNS = (("mode", "mode", "{}"), ("op", "op", "{}"), ("dtype", "dtype", "{}"), ("engine", "engine", "{}"),
           ("path", "path", "{}"), ("median_us", "median", time_cell), ("kernel_us", "kernel", time_cell),
           ("host_us", "host", time_cell), ("host_back_to_back_us", "host b2b", time_cell),
           ("host_loop_us", "host loop", time_cell),
           ("gbps", "GB/s", "{:.2f}"), ("nvlink_floor_us", "NVLink floor", time_cell),
           ("back_to_back_us", "b2b", time_cell),
           ("back_to_back_gbps", "b2b GB/s", "{:.2f}"), ("rail_us", "rail", time_cell),
           ("rail_gbps", "rail GB/s", "{:.2f}"), ("rail_writes", "rail writes", "{:.0f}"),
           ("forward_us", "forward", time_cell), ("correct", "correct", "{}"))


def progress_line(index: int, total: int, result: Dict) -> str:
    status = "ok" if result["correct"] else "WRONG"
    bandwidth = f", {result['gbps']:.2f} GB/s" if result.get("gbps") is not None else ""
    details = [f"{name} {result[key]:.1f} us" for key, name in (("kernel_us", "kernels"), ("host_us", "host"),
                                                                 ("host_beyond_count_wait_us",
                                                                  "host beyond the count wait"),
                                                                 ("host_back_to_back_us", "host back to back"),
                                                                 ("host_loop_us", "host's Python loop"),
                                                                 ("back_to_back_us", "back to back"),
                                                                 ("nvlink_floor_us", "NVLink floor"),
                                                                 ("rail_us", "rail"), ("forward_us", "forward"))
               if result.get(key) is not None]
    kernel = f" ({', '.join(details)})" if details else ""
    note = f"; {result['kernel_note']}" if result.get("kernel_note") else ""
    return (f"[{index}/{total}] {result['mode']} {result['op']} {result['dtype']}: "
            f"{result['median_us']:.1f} us{kernel}{bandwidth}, {status}{note}")


def table(results: List[Dict], columns=COLUMNS) -> str:
    """Right-aligned ``columns`` ((key, title, format) each) under their titles; "-" where a value is None; a
    column with no value in any row is left out."""
    def cell(result, key, fmt):
        value = result.get(key)
        if value is None:
            return "-"
        return fmt(value) if callable(fmt) else fmt.format(value)

    columns = [c for c in columns if any(r.get(c[0]) is not None for r in results)] or list(columns)
    rows = [[cell(r, key, fmt) for key, _, fmt in columns] for r in results]
    headers = [title for _, title, _ in columns]
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    out = [line(headers), line(["-" * w for w in widths])]
    out += [line(row) for row in rows]
    return "\n".join(out)


def workloads(results: List[Dict]) -> List[str]:
    """One line per mode: the ranks and the workload its cases ran."""
    seen = {}
    for r in results:
        seen.setdefault(r["mode"], r)
    return [f"{mode}: {r['ranks']} ranks, {r['tokens']} tokens per rank, hidden {r['hidden']}, top-{r['topk']} of "
            f"{r['experts']} experts" for mode, r in seen.items()]


def write_json(results: List[Dict], path: str) -> None:
    with open(path, "w") as handle:
        json.dump(results, handle, indent=2)
        handle.write("\n")


def print_summary(results: List[Dict], stream: TextIO = sys.stdout) -> None:
    print("\n".join(workloads(results)) + "\n", file=stream)
    print(table(results), file=stream)
    wrong = [r for r in results if not r["correct"]]
    verdict = "all results correct" if not wrong else f"{len(wrong)} result(s) WRONG"
    print(f"\n{len(results)} cases, {verdict} (checked against the reference semantics on every case)", file=stream)
