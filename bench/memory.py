"""Where grpo-core's peak memory goes, phase by phase, on SmolLM2-135M-Instruct.

    python bench/memory.py [--steps 3] [--threads 1] [--set KEY=VALUE ...]
    python bench/memory.py --lean            # the lean settings of bench/vs_trl.py --grpo-lean
    python bench/memory.py --prompts 2 --group 12 --tokens 128 --beta 0.02 --steps 2   # issue 60's setting
    python bench/memory.py ... --precision fp32     # float32 throughout (no bf16 autocast)
    python bench/memory.py ... --trim               # malloc_trim(0) after each phase: what glibc holds

Runs the quickstart spec on the plain float32 copy of the model that ``vs_trl.py`` writes,
with ``vs_trl.py``'s bf16 settings (TRL's defaults: bf16 autocast), for ``--steps`` steps. A
thread samples this process's resident memory (``/proc/self/statm``) every 2 ms and keeps the
highest value seen in each phase (loading, generate, score, logprobs, update = forward and
backward, optimizer, sync). Next to it, the bytes the tensors themselves hold at the
optimizer step: weights, gradients, optimizer state, the rollout backend's copy and the
reference model. The rest of a phase's peak is the Python/torch runtime, activations and the
allocator's slack; to tell those apart, each phase's peak also gives glibc's own count at that
moment (``mallinfo2``): bytes malloc has handed out and not had back (``in use``: torch's CPU
tensors are malloc'd) and bytes freed but still held by the process (``held free``), which
resident memory includes and no tensor owns. The training phase is split into each
micro-batch's forward and its backward.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import resource
import sys
import threading
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

PAGE = os.sysconf("SC_PAGE_SIZE")
GB = 1024**3



def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


_LIBC = ctypes.CDLL(None)
_MALLINFO2 = getattr(_LIBC, "mallinfo2", None)
if _MALLINFO2 is not None:
    _MALLINFO2.restype = _MallInfo2


def malloc_counts() -> tuple[int, int]:
    """glibc's ``(in use, held free)`` bytes: handed out (heap and mmapped chunks), and freed
    but kept by the process; ``(0, 0)`` where ``mallinfo2`` is missing (not glibc 2.33+)."""
    if _MALLINFO2 is None:
        return 0, 0
    info = _MALLINFO2()
    return info.uordblks + info.hblkhd, info.fordblks


class Sampler:
    """Highest resident memory per phase label, sampled every ``every`` seconds, with glibc's
    counts (:func:`malloc_counts`) at each new peak."""

    def __init__(self, every: float = 0.002):
        self.label, self.peaks, self.every = "startup", {}, every
        self.malloc: dict[str, tuple[int, int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _see(self, label: str) -> None:
        now = rss()
        if now > self.peaks.get(label, 0):
            self.peaks[label] = now
            self.malloc[label] = malloc_counts()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._see(self.label)
            time.sleep(self.every)

    @contextlib.contextmanager
    def phase(self, name: str):
        outer, self.label = self.label, name
        try:
            yield
        finally:
            self._see(name)
            self.label = outer

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def tensor_bytes(run) -> dict[str, int]:
    """Bytes held by the weights, gradients, optimizer state and the backend's own copy."""
    params = {id(p): p for p in run.learner.model.parameters()}.values()
    state = [t for s in run.learner.optimizer.state.values() for t in s.values() if hasattr(t, "element_size")]
    backend_model = getattr(run.actor.backend, "model", None)
    copy = 0
    if backend_model is not None and backend_model is not run.learner.model:
        copy = sum(p.numel() * p.element_size() for p in backend_model.parameters())
    kl = run.learner.kl
    reference = None if kl is None else kl.reference.model  # None: no KL term, or LoRA's adapter off
    return {
        "weights": sum(p.numel() * p.element_size() for p in params),
        "gradients": sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None),
        "optimizer state": sum(t.numel() * t.element_size() for t in state),
        "generation copy (resident)": copy,
        "reference model": 0 if reference is None else sum(
            t.numel() * t.element_size() for t in [*reference.parameters(), *reference.buffers()]),
    }


def malloc_trim() -> None:
    """Hand glibc's free memory back to the system (``malloc_trim(0)``); nothing elsewhere."""
    trim = getattr(_LIBC, "malloc_trim", None)
    if trim is not None:
        trim(0)


def instrument(sampler: Sampler, held: dict, trim: bool = False) -> None:
    """Label the engine's phases: its Timer, the update and the optimizer step. With ``trim``,
    :func:`malloc_trim` after each of the Timer's phases (generate, score, logprobs, ...) and
    after each optimizer step."""
    import grpo_core.train.experience as stepmod  # the Timer every phase is timed with

    timer_call = stepmod.Timer.__call__

    @contextlib.contextmanager
    def timed(self, name):
        with sampler.phase(name), timer_call(self, name):
            yield
        if trim:
            malloc_trim()

    stepmod.Timer.__call__ = timed
    import grpo_core.train.learner.update as updatemod

    loss = updatemod.micro_batch_loss  # one micro-batch's forward (and its loss)

    def labelled_loss(*a, **k):
        with sampler.phase("micro-batch forward"):
            return loss(*a, **k)

    updatemod.micro_batch_loss = labelled_loss
    import torch

    backward = torch.Tensor.backward

    def labelled_backward(self, *a, **k):
        with sampler.phase("micro-batch backward"):
            return backward(self, *a, **k)

    torch.Tensor.backward = labelled_backward
    import grpo_core.train.learner.learner as learnermod

    update = learnermod.update  # what Learner.learn calls: update(learner, batch)

    def labelled_update(learner, batch):
        optimizer = learner.optimizer
        if not getattr(optimizer, "_bench_wrapped", False):
            step = optimizer.step

            def optimizer_step(*sa, **sk):
                with sampler.phase("optimizer"):
                    out = step(*sa, **sk)
                held.update(tensor_bytes(held["run"]))
                if trim:
                    malloc_trim()
                return out

            optimizer.step, optimizer._bench_wrapped = optimizer_step, True
        with sampler.phase("update (forward+backward)"):
            return update(learner, batch)

    learnermod.update = labelled_update


def main() -> int:
    parser = argparse.ArgumentParser(description="grpo-core's peak memory by phase")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--lean", action="store_true", help="add vs_trl.py's lean settings (--grpo-lean)")
    parser.add_argument("--set", action="append", default=[], dest="sets", help="extra spec override")
    parser.add_argument("--model-dir", default=None)
    parser.add_argument("--tiny", action="store_true", help="grpo_core.testing's tiny random model (a smoke run)")
    parser.add_argument("--prompts", type=int, default=2, help="prompts per step")
    parser.add_argument("--group", type=int, default=8, help="completions per prompt (G)")
    parser.add_argument("--tokens", type=int, default=32, help="rollout.max_new_tokens")
    parser.add_argument("--beta", type=float, default=None, help="algorithm.kl.beta (> 0 loads a reference model)")
    parser.add_argument("--no-eval", action="store_true", help="skip the greedy evaluations before and after")
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16",
                        help="train.mixed_precision: bf16 autocast (TRL's default), or float32 throughout")
    parser.add_argument("--trim", action="store_true",
                        help="malloc_trim(0) after each phase and optimizer step (what trimming would save)")
    a = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(a.threads))
    warnings.filterwarnings("ignore", message=".*optimizer.step.*")  # our label wrapper, not a misuse
    with Sampler() as sampler:
        import torch

        torch.set_num_threads(a.threads)
        import vs_trl

        from grpo_core.spec import load_spec
        from grpo_core.train.loop.assemble import build_run
        from grpo_core.train.loop.step import train_step

        held: dict = {}
        instrument(sampler, held, a.trim)
        model_dir = Path(a.model_dir) if a.model_dir else Path(vs_trl.default_model_dir())
        with sampler.phase("prepare the float32 copy"):
            model = str(vs_trl.bench_model(model_dir, a.tiny))
        overrides = vs_trl.grpo_overrides(model, a.precision, a.steps, a.threads, tokens=a.tokens, group_size=a.group,
                                          prompts=a.prompts, beta=a.beta) + (vs_trl.LEAN if a.lean else []) + a.sets
        with sampler.phase("load"):
            run = build_run(load_spec(vs_trl.DEFAULT_SPEC, overrides))
        sampler.label = "between phases"
        held["run"] = run
        _, eval_rows = vs_trl.task_rows(50)
        if not a.no_eval:
            with sampler.phase("greedy eval before"):  # as vs_trl.py's workers do
                vs_trl.greedy_accuracy(run.model, run.tokenizer, eval_rows, 32)
        times = []
        for step in range(a.steps):
            times.append(train_step(run.feed, run.learner, step).metrics["time/generate"])
        if not a.no_eval:
            with sampler.phase("greedy eval after"):
                vs_trl.greedy_accuracy(run.model, run.tokenizer, eval_rows, 32)
    print(f"setting: {a.prompts} prompts x G={a.group}, {a.tokens} tokens, beta {a.beta}, {a.precision}; CPU "
          f"{vs_trl.cpu_info()[0]}")
    print("overrides:", " ".join((vs_trl.LEAN if a.lean else []) + a.sets) or "(none)",
          "| malloc_trim after each phase" if a.trim else "")
    print(f"{'phase':<28}{'peak RSS GB':>12}{'in use GB':>11}{'held free GB':>14}")
    for name, value in sampler.peaks.items():
        used, free = sampler.malloc.get(name, (0, 0))
        print(f"{name:<28}{value / GB:>12.3f}{used / GB:>11.3f}{free / GB:>14.3f}")
    print(f"{'process peak (ru_maxrss)':<28}{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2:>12.3f}")
    print("generate seconds per step:", " ".join(f"{t:.2f}" for t in times))
    print("tensors held at the optimizer step:")
    for name, value in held.items():
        if name != "run":
            print(f"  {name:<26}{value / GB:>12.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
