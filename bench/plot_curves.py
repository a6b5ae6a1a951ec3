"""Curves of the long side by side (``long_vs_trl.py``) from the runs' ``metrics.jsonl``:
held-out accuracy (mean over seeds, shaded from the lowest to the highest seed), training
reward and completion length, one colour per tool.

    python bench/plot_curves.py bench/runs/long --out docs/curves.png

Also prints the held-out tables: mean, min and max over seeds at each evaluated step, every
seed's own row, and for each seed the two checks of a run that climbs and holds (points gained
by step 20; the largest fall below the best earlier evaluation, from step 20 on).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

#: Panel -> the metric's name in each tool's log (the first one present is used).
PANELS = {
    "held-out greedy accuracy": ("eval/accuracy",),
    "training accuracy (the step's sampled completions)": ("rewards/accuracy/mean", "reward"),
    "completion length (tokens)": ("completions/mean_length",),
    "truncated share (cut off at max_new_tokens)": ("completions/clipped_ratio",),
}
COLOURS = {"grpo-core": "tab:blue", "trl": "tab:orange"}


def read_runs(folder: Path) -> dict[str, dict[int, list[dict]]]:
    """tool -> seed -> the run's rows, in step order."""
    runs: dict[str, dict[int, list[dict]]] = defaultdict(dict)
    for path in sorted(folder.glob("*/metrics.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if rows:
            runs[rows[0]["tool"]][rows[0]["seed"]] = rows
    return runs


def series(rows: list[dict], keys: tuple[str, ...]) -> dict[int, float]:
    out = {}
    for row in rows:
        key = next((k for k in keys if k in row), None)
        if key is not None:
            out[row["step"]] = row[key]
    return out


def band(per_seed: list[dict[int, float]], every: bool = False
         ) -> tuple[list[int], list[float], list[float], list[float], list[int]]:
    """Steps every seed has (``every``: any seed has), with the mean, min and max over the
    seeds that have it, and how many those are (a run stopped early has fewer steps)."""
    sets = [set(s) for s in per_seed]
    steps = sorted((set.union if every else set.intersection)(*sets)) if per_seed else []
    values = [[s[t] for s in per_seed if t in s] for t in steps]
    return (steps, [statistics.fmean(v) for v in values], [min(v) for v in values], [max(v) for v in values],
            [len(v) for v in values])


def smooth(values: list[float], width: int = 5) -> list[float]:
    return [statistics.fmean(values[max(0, i - width + 1):i + 1]) for i in range(len(values))]


def table(runs) -> str:
    lines = ["| step | " + " | ".join(f"{t} mean (min-max)" for t in runs) + " |",
             "|---|" + "---|" * len(runs)]
    bands = {t: band([series(r, PANELS["held-out greedy accuracy"]) for r in seeds.values()], every=True)
             for t, seeds in runs.items()}
    steps = sorted(set.union(*(set(b[0]) for b in bands.values())))
    for step in steps:
        cells = []
        for tool, b in bands.items():
            if step not in b[0]:
                cells.append("")
                continue
            i = b[0].index(step)
            fewer = f", {b[4][i]} of {len(runs[tool])} seeds" if b[4][i] < len(runs[tool]) else ""
            cells.append(f"{100 * b[1][i]:.0f}% ({100 * b[2][i]:.0f}-{100 * b[3][i]:.0f}{fewer})")
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def per_seed(runs, by: int = 20) -> str:
    """Every seed's held-out accuracy, with its gain by step ``by`` and, from step ``by`` on,
    its largest fall below the best evaluation before it (points)."""
    keys = PANELS["held-out greedy accuracy"]
    lines = []
    for tool, seeds in runs.items():
        curves = {seed: series(rows, keys) for seed, rows in sorted(seeds.items())}
        steps = sorted(set().union(*curves.values()))
        lines += [f"| {tool} seed | " + " | ".join(map(str, steps)) + f" | gain by {by} | worst fall after {by} |",
                  "|---|" + "---|" * (len(steps) + 2)]
        for seed, curve in curves.items():
            cells = [f"{100 * curve[t]:.0f}%" if t in curve else "" for t in steps]
            gain = max((curve[t] for t in curve if t <= by), default=0.0) - curve.get(0, 0.0)
            falls = [max(curve[u] for u in curve if u < t) - curve[t] for t in curve if t > by]
            lines.append(f"| {seed} | " + " | ".join(cells)
                         + f" | {100 * gain:+.0f} | {100 * max([0.0, *falls]):.0f} |")
        lines.append("")
    return "\n".join(lines)


def plot(runs, out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PANELS), figsize=(4.5 * len(PANELS), 4))
    for ax, (panel, keys) in zip(axes, PANELS.items(), strict=True):
        for tool, seeds in runs.items():
            steps, mean, low, high, _ = band([series(r, keys) for r in seeds.values()], every=True)
            if not steps:
                continue
            if panel != "held-out greedy accuracy":
                mean, low, high = smooth(mean), smooth(low), smooth(high)
            ends = sorted({rows[-1]["step"] for rows in seeds.values()})
            stopped = f", stopped at steps {'/'.join(map(str, ends))}" if len(ends) > 1 else ""
            label = f"{tool} ({len(seeds)} seeds{stopped})"
            ax.plot(steps, mean, color=COLOURS.get(tool), label=label, marker="o" if "accuracy" in panel else None)
            ax.fill_between(steps, low, high, color=COLOURS.get(tool), alpha=0.2)
        ax.set_title(panel, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description="plot the long side by side")
    p.add_argument("folder")
    p.add_argument("--out", default="docs/curves.png")
    p.add_argument("--title", default="SmolLM2-135M-Instruct, two-digit additions: mean over seeds, band = min-max")
    a = p.parse_args()
    runs = read_runs(Path(a.folder))
    if not runs:
        sys.exit(f"no */metrics.jsonl under {a.folder}")
    print(table(runs))
    print()
    print(per_seed(runs))
    plot(runs, Path(a.out), a.title)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
