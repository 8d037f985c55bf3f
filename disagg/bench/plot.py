"""Latency vs QPS plots from `disagg bench serve --save-json` files: TTFT and TPOT, p50 and p99."""

import json
import math
from pathlib import Path


def rate_value(qps) -> float:
    return float(qps)  # "inf" -> inf


def plot_results(results: list[dict], out: str | Path, labels: list[str] | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if labels and len(labels) != len(results):
        raise ValueError(f"{len(labels)} --label for {len(results)} result files: give one per file")
    rates = sorted({rate_value(run["qps"]) for result in results for run in result["runs"]})
    finite = [r for r in rates if math.isfinite(r)]
    # inf is drawn one step right of the largest finite rate, labelled "inf".
    inf_x = (max(finite) * 2 if finite else 1.0)

    def x_of(qps) -> float:
        value = rate_value(qps)
        return value if math.isfinite(value) else inf_x

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    panels = [("ttft", "TTFT (ms)"), ("tpot", "TPOT (ms)"), (None, "output tokens/s")]
    for i, result in enumerate(results):
        label = labels[i] if labels else result.get("label", f"run {i}")
        runs = sorted(result["runs"], key=lambda run: rate_value(run["qps"]))
        xs = [x_of(run["qps"]) for run in runs]
        color = f"C{i}"
        for ax, (metric, title) in zip(axes, panels):
            if metric is None:
                ax.plot(xs, [run["output_throughput"] for run in runs], "o-", color=color, label=label)
            else:
                ax.plot(xs, [run[f"median_{metric}_ms"] for run in runs], "o-", color=color, label=f"{label} p50")
                ax.plot(xs, [run[f"p99_{metric}_ms"] for run in runs], "s--", color=color, label=f"{label} p99")
            ax.set_title(title)
    has_inf = any(not math.isfinite(r) for r in rates)
    ticks = finite + ([inf_x] if has_inf else [])
    tick_labels = [f"{t:g}" for t in finite] + (["inf"] if has_inf else [])
    for ax in axes:
        ax.set_xlabel("request rate (QPS)")
        ax.set_xticks(ticks, tick_labels)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def plot_files(paths: list[str], out: str | Path, labels: list[str] | None = None) -> None:
    plot_results([json.loads(Path(p).read_text()) for p in paths], out, labels)
