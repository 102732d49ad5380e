"""PNG charts of a benchmark summary (what ``python -m benchmarks.run`` writes).

    python -m benchmarks.charts                                  # benchmarks/results/summary.json
    python -m benchmarks.charts path/to/summary.json --out-dir somewhere/

Charts (each only when its part of the summary is present):

    throughput.png  per workload, every loader (fastloader and the peers) as times
                    better than torch (median ratio, per-repeat range as error bar),
                    fastloader's budget dashed, where a peer is ahead in the label
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


_PEER_COLORS = ["#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#ff7f0e",
                "#7f7f7f"]


def _loader_ratios(workload):
    """name -> {"median", "low", "high", "valid"}: every loader's ratio to torch.

    Summaries from before the peers were added have only fastloader's ratio."""
    loaders = workload.get("loaders")
    if not loaders:
        return {FASTLOADER: {**workload["paired_ratios"], "median": workload["ratio"],
                             "valid": workload["data_agrees"]}}
    return {name: {**entry["ratio_to_torch"], "valid": bool(entry.get("data_agrees"))}
            for name, entry in loaders.items() if name not in (TORCH, "in-process")}


def throughput_chart(summary, path):
    """Per workload, a bar per loader: how many times better than torch, with the
    per-repeat range, fastloader's budget (dashed) and its verdict colour on the label."""
    plt = _pyplot()
    workloads = summary["throughput"]["workloads"]
    names = []
    for workload in workloads:
        for name in _loader_ratios(workload):
            if name not in names:
                names.append(name)
    names.sort(key=lambda n: (n != FASTLOADER, n))
    colors = {FASTLOADER: _COLORS[FASTLOADER]}
    for k, name in enumerate(n for n in names if n != FASTLOADER):
        colors[name] = _PEER_COLORS[k % len(_PEER_COLORS)]
    group = 0.84
    width = group / max(1, len(names))
    fig, ax = plt.subplots(figsize=(min(16.0, max(7.5, (0.2 * len(names) + 0.6) * len(workloads) + 2)),
                                    5.6))
    lows, highs = [1.0], [1.0]
    for x, workload in enumerate(workloads):
        ratios = _loader_ratios(workload)
        present = [n for n in names if n in ratios]
        for k, name in enumerate(present):
            r = ratios[name]
            pos = x + (k - (len(present) - 1) / 2) * width
            ax.bar(pos, r["median"], width=width * 0.92, color=colors[name],
                   yerr=[[max(0.0, r["median"] - r["low"])], [max(0.0, r["high"] - r["median"])]],
                   capsize=2, ecolor="#333333", zorder=2, hatch=None if r["valid"] else "xx",
                   alpha=1.0 if r["valid"] else 0.4)
            if len(present) <= 8:
                ax.annotate(f"{r['median']:.1f}" if r["median"] >= 10 else f"{r['median']:.2f}",
                            (pos, r["high"]), xytext=(0, 3), textcoords="offset points",
                            ha="center", va="bottom", fontsize=6, rotation=90)
            lows.append(r["low"])
            highs.append(r["high"])
        budget = workload["budget"]
        half = len(present) * width / 2
        ax.hlines(budget, x - half, x + half, colors="black", linestyles="--",
                  linewidth=1.2, zorder=3)
        highs.append(budget)
    ax.axhline(1.0, color="#d62728", linewidth=1, zorder=1)
    ax.set_yscale("log")
    low, high = min(lows) / 1.6, max(highs) * 2.5
    ax.set_ylim(low, high)
    ticks = [t for t in (0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100, 200) if low <= t <= high]
    ax.set_yticks(ticks)
    ax.set_yticklabels([f"{t:g}x" for t in ticks])
    ax.minorticks_off()
    ax.set_xticks(range(len(workloads)))
    labels = ax.set_xticklabels([
        f"{w['name']}\n{'us/batch (time)' if w.get('lower_is_better') else w['unit']}\n"
        f"fastloader: {'met' if w['met'] else 'missed'}"
        + (f"\npeer ahead: {', '.join(w['peers_ahead'])}" if w.get("peers_ahead") else "")
        for w in workloads], fontsize=8)
    for label, workload in zip(labels, workloads):
        label.set_color(_verdict_color(workload))
    ax.set_ylabel("times better than torch's DataLoader (log; red line = torch)")
    ax.set_title("every loader / torch, same run: median of per-repeat ratios (bar), range "
                 "(whisker)\ndashed: fastloader's budget; hatched: data differs (invalid)",
                 fontsize=9)
    fig.suptitle(_subtitle(summary.get("throughput", summary)), fontsize=8, y=0.995, color="#555555")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[n]) for n in names]
    ax.legend(handles, names, fontsize=7, loc="upper left", ncol=min(4, len(names)))
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
