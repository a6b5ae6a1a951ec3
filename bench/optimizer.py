"""Time of one AdamW step: torch's fused AdamW (float32 moments) against grpo-core's
BF16StateAdamW (bfloat16 moments), on one flat tensor of ``--params`` parameters.

    python bench/optimizer.py [--params 8388608] [--threads 1] [--reps 5]

Prints the median step time of each and the bytes of optimizer state they hold.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch


def step_time(optimizer, reps: int) -> float:
    optimizer.step()  # the state is created on the first step
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    from grpo_core.train.learner.lean_adamw import BF16StateAdamW

    parser = argparse.ArgumentParser(description="AdamW step time, float32 vs bfloat16 moments")
    parser.add_argument("--params", type=int, default=8 * 2**20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=5)
    a = parser.parse_args()
    torch.set_num_threads(a.threads)
    for name, make in (("torch AdamW (fused, float32 moments)", lambda ps: torch.optim.AdamW(ps, fused=True)),
                       ("BF16StateAdamW (bfloat16 moments)", BF16StateAdamW)):
        p = torch.nn.Parameter(torch.randn(a.params))
        p.grad = torch.randn(a.params)
        optimizer = make([p])
        seconds = step_time(optimizer, a.reps)
        state = sum(t.numel() * t.element_size() for s in optimizer.state.values()
                    for k, t in s.items() if k != "step")
        print(f"{name:<40} {seconds * 1000:8.1f} ms   state {state / 2**20:8.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
