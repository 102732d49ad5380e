"""PNG charts of a benchmark summary (what ``python -m benchmarks.run`` writes).

    python -m benchmarks.charts                                  # benchmarks/results/summary.json
    python -m benchmarks.charts path/to/summary.json --out-dir somewhere/

Charts (each only when its part of the summary is present):

    throughput.png  times faster than torch per workload (median ratio, per-repeat
                    range as error bar) against its budget
    scaling.png     samples/s by worker count, one panel per batch size, both loaders
    memory.png      per-worker USS over one tiny-workload epoch, both loaders
    startup.png     seconds to the first batch under spawn and forkserver, first
                    and next epoch, torch + list vs fastloader + packed names

Needs matplotlib (``pip install -r requirements-bench.txt``); renders with the
Agg backend, so no display is needed.
"""

import argparse
import json
import os
import sys

FASTLOADER = "fastloader"
TORCH = "torch"
DEFAULT_RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

_COLORS = {FASTLOADER: "#1f77b4", TORCH: "#d62728"}
_VERDICT_COLORS = {"met": "#2ca02c", "within noise": "#ff7f0e", "missed": "#d62728"}


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        sys.exit("matplotlib is needed for the charts: pip install -r requirements-bench.txt")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _subtitle(summary):
    env = summary.get("environment", {})
    settings = summary.get("settings", {})
    parts = [
        f"fastloader {env.get('fastloader', '?')} vs torch {env.get('torch', '?')}",
        f"Python {env.get('python', '?')}",
        f"{env.get('cpus', '?')} CPUs",
        f"start method {settings.get('context', '?')}",
        "quick run" if settings.get("quick") else "full run",
    ]
    if summary.get("time"):
        parts.append(summary["time"][:16].replace("T", " "))
    return ", ".join(parts)


def _verdict_color(workload):
    if workload["met"]:
        return _VERDICT_COLORS["met"]
    return _VERDICT_COLORS["missed" if workload["clearly_missed"] else "within noise"]


def throughput_chart(summary, path):
    """Bar per workload: how many times better than torch, with its budget."""
    plt = _pyplot()
    workloads = summary["throughput"]["workloads"]
    fig, ax = plt.subplots(figsize=(max(6.5, 1.7 * len(workloads) + 2), 5))
    positions = range(len(workloads))
    ratios = [w["ratio"] for w in workloads]
    errors = [[max(0.0, w["ratio"] - w["paired_ratios"]["low"]) for w in workloads],
              [max(0.0, w["paired_ratios"]["high"] - w["ratio"]) for w in workloads]]
    ax.bar(positions, ratios, width=0.6, color=[_verdict_color(w) for w in workloads],
           yerr=errors, capsize=4, ecolor="#333333", zorder=2)
    for x, workload in zip(positions, workloads):
        budget = workload["budget"]
        ax.hlines(budget, x - 0.42, x + 0.42, colors="black", linestyles="--", linewidth=1.5, zorder=3)
        # Budget text under its line, the ratio above both the error bar and
        # the budget line, so neither collides with the other.
        ax.annotate(f"budget {budget:g}x", (x + 0.42, budget), xytext=(0, -2),
                    textcoords="offset points", fontsize=7, ha="right", va="top")
        top = max(workload["paired_ratios"]["high"], workload["ratio"], budget)
        ax.annotate(f"{workload['ratio']:.2f}x", (x, top), xytext=(0, 4),
                    textcoords="offset points", ha="center", fontsize=9, fontweight="bold")
    ax.axhline(1.0, color="#777777", linewidth=1, zorder=1)
    ax.set_yscale("log")
    highest = max(max(w["paired_ratios"]["high"], w["budget"]) for w in workloads)
    lowest = min(min(w["paired_ratios"]["low"], 1.0) for w in workloads)
    ax.set_ylim(lowest / 1.6, highest * 2.0)
    ticks = [t for t in (0.5, 1, 1.5, 2, 3, 5, 10, 20, 50, 100, 200) if lowest / 1.6 <= t <= highest * 2]
    ax.set_yticks(ticks)
    ax.set_yticklabels([f"{t:g}x" for t in ticks])
    ax.minorticks_off()
    ax.set_xticks(list(positions))
    ax.set_xticklabels([
        f"{w['name']}\n{'us/batch (time)' if w.get('lower_is_better') else w['unit']}" for w in workloads
    ], fontsize=9)
    ax.set_ylabel("times better than torch's DataLoader (log)")
    ax.set_title("fastloader / torch, same run: median ratio, per-repeat range, budget (dashed)",
                 fontsize=10)
    fig.suptitle(_subtitle(summary.get("throughput", summary)), fontsize=8, y=0.995, color="#555555")
    handles = [plt.Rectangle((0, 0), 1, 1, color=color) for color in _VERDICT_COLORS.values()]
    ax.legend(handles, ["budget met", "missed within noise", "missed"], fontsize=8, loc="upper left")
    ax.grid(axis="y", alpha=0.3, zorder=0)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def scaling_chart(summary, path):
    """samples/s against worker count, one panel per batch size."""
    plt = _pyplot()
    cells = summary["scaling"]["cells"]
    batch_sizes = sorted({cell["batch_size"] for cell in cells})
    fig, axes = plt.subplots(1, len(batch_sizes), figsize=(4.2 * len(batch_sizes), 4.4), squeeze=False)
    for ax, batch_size in zip(axes[0], batch_sizes):
        row = sorted((c for c in cells if c["batch_size"] == batch_size), key=lambda c: c["num_workers"])
        workers = [c["num_workers"] for c in row]
        for name in (FASTLOADER, TORCH):
            medians = [c["samples_per_s"][name]["median"] for c in row]
            errors = [[m - c["samples_per_s"][name]["low"] for m, c in zip(medians, row)],
                      [c["samples_per_s"][name]["high"] - m for m, c in zip(medians, row)]]
            ax.errorbar(workers, medians, yerr=errors, marker="o", capsize=3, label=name,
                        color=_COLORS[name])
        for c in row:
            ax.annotate(f"{c['ratio']:.1f}x", (c["num_workers"], c["samples_per_s"][FASTLOADER]["high"]),
                        xytext=(0, 5), textcoords="offset points", ha="center", fontsize=8,
                        color="#d62728" if c["ratio"] < 1.0 else "#333333")
        ax.set_yscale("log")
        low = min(c["samples_per_s"][TORCH]["low"] for c in row)
        high = max(c["samples_per_s"][FASTLOADER]["high"] for c in row)
        ax.set_ylim(low / 1.5, high * 2.2)
        ax.set_xticks(workers)
        ax.set_xlabel("num_workers")
        ax.set_title(f"batch size {batch_size}", fontsize=10)
        ax.grid(alpha=0.3, which="both")
    axes[0][0].set_ylabel("samples/s (log), median and min-max")
    axes[0][0].legend(fontsize=8, loc="best")
    fig.suptitle("tiny samples: samples/s by workers and batch size (labels: fastloader/torch)\n"
                 + _subtitle(summary["scaling"]), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def memory_chart(summary, path):
    """Per-worker USS over one epoch, both loaders."""
    plt = _pyplot()
    traces = summary["memory"]["traces"]
    settings = summary["memory"].get("settings", {})
    fig, ax = plt.subplots(figsize=(8, 4.6))
    styles = ["-", "--", ":", "-."]
    for name, trace in traces.items():
        per_worker = list(zip(*trace["uss_mib"]))
        for worker, values in enumerate(per_worker):
            points = [(b, v) for b, v in zip(trace["batches"], values) if v is not None]
            if not points:
                continue
            ax.plot([p[0] for p in points], [p[1] for p in points], styles[worker % len(styles)],
                    color=_COLORS.get(name, None), label=f"{name} worker {worker}", linewidth=1.6)
    all_values = [v for trace in traces.values() for sample in trace["uss_mib"] for v in sample
                  if v is not None]
    if all_values:
        span = max(all_values) - min(all_values)
        pad = max(2.0, 0.15 * span)
        ax.set_ylim(max(0.0, min(all_values) - pad), max(all_values) + pad)
    ax.set_xlabel("batches consumed in the epoch")
    ax.set_ylabel("worker USS, MiB (memory only that worker maps)")
    ax.set_title(f"per-worker private memory over one epoch: tiny samples, batch "
                 f"{settings.get('batch_size', '?')}, {settings.get('num_workers', '?')} workers",
                 fontsize=10)
    fig.suptitle(_subtitle(summary["memory"]), fontsize=8, y=0.995, color="#555555")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def startup_chart(summary, path):
    """Grouped bars: seconds to the first batch, per start method and epoch."""
    import statistics

    plt = _pyplot()
    results = summary["startup"]["results"]
    groups = [(method, epoch) for method in results for epoch in ("first", "next")]
    configs = ("torch + list", "fastloader + packed")
    colors = {"torch + list": _COLORS[TORCH], "fastloader + packed": _COLORS[FASTLOADER]}
    fig, ax = plt.subplots(figsize=(7.5, 4.4))
    width = 0.38
    for k, config in enumerate(configs):
        xs, heights, errors = [], [], [[], []]
        for g, (method, epoch) in enumerate(groups):
            values = results[method][config][epoch]
            median = statistics.median(values)
            xs.append(g + (k - 0.5) * width)
            heights.append(median)
            errors[0].append(median - min(values))
            errors[1].append(max(values) - median)
        ax.bar(xs, heights, width=width, color=colors[config], yerr=errors, capsize=3,
               label=config, zorder=2)
        for x, h in zip(xs, heights):
            ax.annotate(f"{h:.2f} s", (x, h), xytext=(0, 3), textcoords="offset points",
                        ha="center", fontsize=8)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([f"{method}\n{epoch} epoch" for method, epoch in groups], fontsize=9)
    ax.set_ylabel("seconds to the first batch (median, min-max)")
    ax.set_title(f"time to first batch, {summary['startup']['names']:,} names, 2 workers "
                 "(budget: first epoch <= 0.5x torch)", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3, zorder=0)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_charts(summary, out_dir):
    """Write every chart the summary has data for; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    if summary.get("throughput", {}).get("workloads"):
        paths.append(throughput_chart(summary, os.path.join(out_dir, "throughput.png")))
    if summary.get("scaling", {}).get("cells"):
        paths.append(scaling_chart(summary, os.path.join(out_dir, "scaling.png")))
    if summary.get("memory", {}).get("traces"):
        paths.append(memory_chart(summary, os.path.join(out_dir, "memory.png")))
    if summary.get("startup", {}).get("results"):
        paths.append(startup_chart(summary, os.path.join(out_dir, "startup.png")))
    return paths


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.charts",
                                     description="PNG charts from a benchmarks.run summary.json.")
    parser.add_argument("summary", nargs="?", default=os.path.join(DEFAULT_RESULTS_DIR, "summary.json"))
    parser.add_argument("--out-dir", default=None, help="default: the summary's folder")
    args = parser.parse_args(argv)
    with open(args.summary) as stream:
        summary = json.load(stream)
    out_dir = args.out_dir or os.path.dirname(os.path.abspath(args.summary))
    for path in write_charts(summary, out_dir):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
