"""Throughput of the ``code_tests`` reward's local sandbox: completions scored per second.

A batch of distinct completions (each a small function, a quarter of them wrong, a few that
hang until their deadline when ``--hangs`` is given) scored against four statement tests
each, ``--workers`` at a time, ``--repeats`` times. Every completion is a fresh sandbox run
(namespaces, limits, a tmpfs working directory, an interpreter start), which dominates.

    python bench/code_tests.py --completions 32 --workers 2 --repeats 3
    python bench/code_tests.py --completions 32 --workers 2 --repeats 1 --out bench/runs/code_tests.json

Quote the CPU (lscpu), the core count and whether the machine was idle with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TESTS = ["assert add(1, 2) == 3", "assert add(2, 2) == 4", "assert add(-1, 1) == 0", "assert add(7, 8) == 15"]


def completions(count: int, hangs: int) -> list[str]:
    out = []
    for i in range(count):
        body = "while True:\n        pass" if i < hangs else ("return a + b" if i % 4 else "return a * b")
        out.append(f"Solution {i}:\n```python\ndef add(a, b):\n    # variant {i}\n    {body}\n```")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--completions", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hangs", type=int, default=0, help="completions that loop until their deadline")
    parser.add_argument("--timeout", type=float, default=4.0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    from grpo_plugins.rewards.code import CodeTests, CodeTestsOptions

    reward = CodeTests(CodeTestsOptions(workers=args.workers, timeout=args.timeout, test_timeout=2))
    batch = completions(args.completions, args.hangs)
    rates = []
    for _ in range(args.repeats):
        started = time.perf_counter()
        scores = reward(["p"] * len(batch), batch, tests=[TESTS] * len(batch))
        rates.append(len(batch) / (time.perf_counter() - started))
        expected = [0.0 if i < args.hangs else (1.0 if i % 4 else 0.25) for i in range(len(batch))]
        assert scores == expected, (scores, expected)
    result = {
        "completions": args.completions, "workers": args.workers, "hangs": args.hangs, "cpus": os.cpu_count(),
        "isolated": reward.backend.isolate, "completions_per_s": rates,
        "median_completions_per_s": statistics.median(rates),
    }
    print(json.dumps(result, indent=2))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
