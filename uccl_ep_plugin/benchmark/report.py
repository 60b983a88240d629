"""Printing benchmark figures: a progress line per case as it finishes, a table at the end, JSON."""

import json
import sys
from typing import Dict, List, TextIO

COLUMNS = (("mode", "mode", "{}"), ("op", "op", "{}"), ("dtype", "dtype", "{}"), ("engine", "engine", "{}"),
           ("path", "path", "{}"), ("ranks", "EP", "{}"), ("tokens", "tokens", "{}"), ("hidden", "hidden", "{}"),
           ("topk", "topk", "{}"), ("experts", "experts", "{}"), ("median_us", "median us", "{:.1f}"),
           ("kernel_us", "kernel us", "{:.1f}"), ("host_us", "host us", "{:.1f}"),
           ("host_back_to_back_us", "host b2b us", "{:.1f}"),
           ("gbps", "GB/s", "{:.2f}"), ("back_to_back_us", "b2b us", "{:.1f}"),
           ("back_to_back_gbps", "b2b GB/s", "{:.2f}"), ("correct", "correct", "{}"))


def progress_line(index: int, total: int, result: Dict) -> str:
    status = "ok" if result["correct"] else "WRONG"
    bandwidth = f", {result['gbps']:.2f} GB/s" if result.get("gbps") is not None else ""
    details = [f"{name} {result[key]:.1f} us" for key, name in (("kernel_us", "kernels"), ("host_us", "host"),
                                                                 ("host_beyond_count_wait_us",
                                                                  "host beyond the count wait"),
                                                                 ("host_back_to_back_us", "host back to back"),
                                                                 ("back_to_back_us", "back to back"))
               if result.get(key) is not None]
    kernel = f" ({', '.join(details)})" if details else ""
    note = f"; {result['kernel_note']}" if result.get("kernel_note") else ""
    return (f"[{index}/{total}] {result['mode']} {result['op']} {result['dtype']}: "
            f"{result['median_us']:.1f} us{kernel}{bandwidth}, {status}{note}")


def table(results: List[Dict], columns=COLUMNS) -> str:
    """Right-aligned ``columns`` ((key, title, format) each) under their titles; "-" where a value is None."""
    rows = [[fmt.format(r[key]) if r.get(key) is not None else "-" for key, _, fmt in columns] for r in results]
    headers = [title for _, title, _ in columns]
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    out = [line(headers), line(["-" * w for w in widths])]
    out += [line(row) for row in rows]
    return "\n".join(out)


def write_json(results: List[Dict], path: str) -> None:
    with open(path, "w") as handle:
        json.dump(results, handle, indent=2)
        handle.write("\n")


def print_summary(results: List[Dict], stream: TextIO = sys.stdout) -> None:
    print(table(results), file=stream)
    wrong = [r for r in results if not r["correct"]]
    verdict = "all results correct" if not wrong else f"{len(wrong)} result(s) WRONG"
    print(f"\n{len(results)} cases, {verdict} (checked against the reference semantics on every case)", file=stream)
