"""Run N steps of a spec and print where the time goes.

    python bench/run_spec.py specs/quickstart.yaml --steps 10 [--set key=value ...]

Prints, per phase (generate, score, logprobs, advantage, forward_backward, optimizer,
sync) and for the whole step, the median over steps (the first step excluded, it pays
for warm-up), generated tokens per second and the process's peak resident memory.
Nothing here is part of the test run.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time

from grpo_core.spec import load_spec
from grpo_core.train.loop.assemble import build_run
from grpo_core.train.loop.step import train_step

PHASES = ("generate", "score", "logprobs", "advantage", "forward_backward", "optimizer", "sync")


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2  # KiB on Linux


def rss_gb() -> float:
    """Resident memory now (Linux /proc; NaN elsewhere)."""
    try:
        pages = int(open("/proc/self/statm").read().split()[1])
    except OSError:
        return float("nan")
    return pages * resource.getpagesize() / 1024**3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("spec")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args(argv)
    overrides = ["tracking=[]", "train.progress=false", *args.overrides]
    print(f"memory after imports: {rss_gb():.2f} GB resident", flush=True)
    t0 = time.perf_counter()
    run = build_run(load_spec(args.spec, overrides))
    print(f"build: {time.perf_counter() - t0:.1f} s, {rss_gb():.2f} GB resident (peak so far "
          f"{peak_rss_gb():.2f} GB)", flush=True)
    rows = []
    for step in range(args.steps):
        metrics = train_step(run.feed, run.learner, step).metrics
        rows.append(metrics)
        print(f"step {step + 1}: {metrics['time/step']:.2f} s, reward {metrics.get('reward', float('nan')):.3f}, "
              f"skipped rows {metrics['perf/skipped_rows_frac']:.2f}, {rss_gb():.2f} GB resident after it "
              f"(peak {peak_rss_gb():.2f} GB)", flush=True)
    body = rows[1:] or rows
    print(f"\nmedian over steps 2..{len(rows)} (seconds):")
    for phase in (*PHASES, "step"):
        values = [r.get(f"time/{phase}", 0.0) for r in body]
        print(f"  {phase:<17} {statistics.median(values):7.3f}")
    tps = statistics.median(r["perf/tokens_per_second"] for r in body)
    print(f"  generated tokens/s {tps:7.1f}")
    print(f"  peak RSS          {peak_rss_gb():7.2f} GB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
