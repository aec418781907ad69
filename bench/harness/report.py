"""Write a benchmark's results: raw JSON, a markdown table and PNG plots."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

from trillm.bench.harness.run import RunResult


def write_json(path: Path, runs: list[RunResult], extra: dict[str, object] | None = None) -> Path:
    """Every run's raw per-request records and summary."""
    doc = {"runs": [r.to_json() for r in runs], **(extra or {})}
    path.write_text(json.dumps(doc, indent=1, default=str))
    return path


def _errors(errors: dict[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in errors.items()) or "-"


def markdown_table(runs: list[RunResult]) -> str:
    """One row per run: throughput, latency percentiles (ms), cached tokens and errors."""
    head = (
        "| server | workload | arrival | ok/total | req/s | out tok/s | TTFT mean | TTFT p50 | TTFT p90 | TTFT p99 "
        "| TPOT mean | TPOT p90 | ITL p50 | ITL p99 | E2E p50 | E2E p90 | goodput req/s | cached tok | errors |"
    )
    sep = "|" + "---|" * (head.count("|") - 1)
    rows = [head, sep]
    for r in runs:
        s = r.summary
        good = "-" if s.goodput is None else f"{s.goodput:.2f}"
        rows.append(
            f"| {r.target.name} | {r.workload} | {r.arrival.label} | {s.completed}/{s.completed + s.failed} "
            f"| {s.request_throughput:.2f} | {s.output_throughput:.1f} | {s.ttft.mean:.0f} | {s.ttft.p50:.0f} "
            f"| {s.ttft.p90:.0f} | {s.ttft.p99:.0f} | {s.tpot.mean:.1f} | {s.tpot.p90:.1f} | {s.itl.p50:.1f} "
            f"| {s.itl.p99:.1f} | {s.e2e.p50:.0f} | {s.e2e.p90:.0f} | {good} | {s.cached_tokens} "
            f"| {_errors(s.errors)} |"
        )
    return "\n".join(rows) + "\n\nLatencies in ms. Tokens from server usage where reported, else counted deltas.\n"


def plot_throughput_vs_concurrency(path: Path, runs: list[RunResult]) -> Path | None:
    """Output tok/s against max concurrency, one line per (server, workload); all servers on one plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for r in runs:
        if r.arrival.max_concurrency and r.arrival.mode == "concurrency":
            lines.setdefault((r.target.name, r.workload), []).append(
                (r.arrival.max_concurrency, r.summary.output_throughput)
            )
    if not lines:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (server, workload), pts in sorted(lines.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{server} ({workload})")
    ax.set_xscale("log", base=2)
    return _save(fig, ax, path, "max concurrency", "output tokens / s", "Output throughput vs concurrency")


def plot_ttft_cdf(path: Path, runs: list[RunResult]) -> Path | None:
    """Empirical CDF of TTFT per server (all of its runs pooled); all servers on one plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per_server: dict[str, list[float]] = {}
    for r in runs:
        per_server.setdefault(r.target.name, []).extend(
            rec.ttft * 1000 for rec in r.records if rec.success and rec.ttft is not None
        )
    if not any(per_server.values()):
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for server, ttfts in sorted(per_server.items()):
        if ttfts:
            xs = sorted(ttfts)
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=server)
    return _save(fig, ax, path, "TTFT (ms)", "fraction of requests", "TTFT CDF")


def _save(fig: Any, ax: Any, path: Path, xlabel: str, ylabel: str, title: str) -> Path:
    import matplotlib.pyplot as plt

    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_all(out_dir: Path, runs: list[RunResult], stem: str = "serve", extra: dict[str, object] | None = None) -> dict[str, Path]:
    """JSON, markdown and both plots under out_dir; returns what was written."""
    written = {"json": write_json(out_dir / f"{stem}.json", runs, extra)}
    md = out_dir / f"{stem}.md"
    md.write_text(markdown_table(runs))
    written["markdown"] = md
    if importlib.util.find_spec("matplotlib") is None:
        print("no plots: matplotlib is missing (pip install 'trillm[bench]')", file=sys.stderr)
        return written
    for key, fn, name in (
        ("throughput_plot", plot_throughput_vs_concurrency, "throughput_vs_concurrency.png"),
        ("ttft_cdf_plot", plot_ttft_cdf, "ttft_cdf.png"),
    ):
        if (p := fn(out_dir / f"{stem}_{name}", runs)) is not None:
            written[key] = p
    return written
