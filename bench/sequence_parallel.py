"""Activation memory per process of one long sequence, split over N processes by sequence
parallelism (``train.parallel.sequence: N``) against one process holding it whole.

For each N of ``--nproc`` the script starts N processes (``torchrun``; gloo on the CPU, NCCL on
GPUs). Process 0 holds one row: a prompt then a completion, ``--tokens`` in all (``--completion``
of them trained); the others join its group's forward with no row of their own, as the learner's
turns have them do (:mod:`grpo_core.train.learner.sequence_parallel`). Each runs the log-prob
forward and a backward of ``sum(logp)`` on a random model (Llama-shaped: hidden ``--hidden``,
``--layers`` layers, 8 attention heads and 4 key/value heads, so N up to 4), with N = 1 the plain
one-process forward (:func:`~grpo_core.train.learner.logprobs.completion_logprobs`). Every
process reports:

- ``saved_MB``: bytes of the tensors autograd keeps for backward (``saved_tensors_hooks``, each
  storage counted once): the activation memory proper, exact and independent of the allocator;
- ``peak_MB``: the highest memory above the start of the forward until the end of the backward:
  on a GPU ``torch.cuda.max_memory_allocated``; on the CPU the resident memory
  (``/proc/self/statm``) sampled every millisecond, which also counts attention's temporaries;
- ``seconds`` of the forward and backward; the table prints the largest figure over the
  processes of each N, and each figure over N = 1's.

    python bench/sequence_parallel.py --tokens 16384 --nproc 1 2          # the measured run
    python bench/sequence_parallel.py --layout packed --tokens 16384       # the packed forward
    python bench/sequence_parallel.py --tiny                               # 256 tokens (the test run)

``--layout padded`` (default) attends with one causal ``sdpa`` call per row; ``packed`` with the
packed layout's per-segment attention, whose mask for a completion of ``c`` tokens after ``p`` is
``c x (p + c)`` booleans (keep ``--completion`` short for long packed sequences).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=16384, help="prompt + completion tokens of the one row")
    p.add_argument("--completion", type=int, default=1024, help="of them, completion tokens (log-probs, loss)")
    p.add_argument("--nproc", type=int, nargs="+", default=[1, 2], help="sequence-parallel sizes to run")
    p.add_argument("--layout", choices=["padded", "packed"], default="padded")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--backend", choices=["gloo", "nccl"], help="the group's backend: default nccl on GPUs, gloo on "
                   "the CPU; gloo lets several processes share one GPU (NCCL refuses two ranks on one device)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process (CPU)")
    p.add_argument("--tiny", action="store_true", help="256 tokens, hidden 32, N in 1 2 (seconds)")
    p.add_argument("--json", type=Path, help="also write the records here")
    p.add_argument("--worker", type=Path, help=argparse.SUPPRESS)  # a process of one N: its record's folder
    args = p.parse_args(argv)
    if args.tiny:
        args.tokens, args.completion, args.hidden, args.nproc = 256, 32, 32, [1, 2]
    if not 0 < args.completion < args.tokens:
        p.error("--completion must be between 0 and --tokens")
    return args


class PeakSampler:
    """The highest resident memory seen (``/proc/self/statm``), sampled every ``every`` seconds."""

    def __init__(self, every: float = 0.001):
        self.every, self.peak, self._stop = every, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss())
            time.sleep(self.every)

    def __enter__(self):
        self.start = self.rss()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.rss())


def build(args, torch):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=args.tokens + 8, attn_implementation="sdpa")
    return LlamaForCausalLM(config).to(args.device)


def worker(args) -> None:
    """One process of one N: forward and backward of the row (process 0's), measured."""
    import torch

    from grpo_core.train.learner.logprobs import completion_logprobs
    from grpo_core.train.learner.sequence_parallel import SequenceGroup, split_logprobs

    torch.set_num_threads(args.threads)
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    if world > 1:
        torch.distributed.init_process_group(args.backend or ("nccl" if args.device == "cuda" else "gloo"))
    model = build(args, torch)
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(1)
    prompt_len = args.tokens - args.completion
    prompt = torch.randint(0, 512, (1, prompt_len), generator=gen).to(device)
    completion = torch.randint(0, 512, (1, args.completion), generator=gen).to(device)
    mask = torch.full(completion.shape, rank == 0, dtype=torch.bool, device=device)
    group = SequenceGroup.of(rank, world, world) if world > 1 else None
    p_mask, packed = torch.ones_like(prompt, dtype=torch.bool), args.layout == "packed"

    def run():
        if group is None:
            return completion_logprobs(model, prompt, p_mask, completion, mask, packed=packed, share_prompt=False)
        return split_logprobs(model, prompt, p_mask, completion, mask, sequence=group, packed=packed)
    saved: dict[int, int] = {}

    def pack(t):
        saved.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t

    if args.device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    with PeakSampler() as sampler:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logp, _ = run()
        logp.sum().backward()
        if args.device == "cuda":
            torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    peak = (torch.cuda.max_memory_allocated() - base) if args.device == "cuda" else sampler.peak - sampler.start
    record = {"rank": rank, "nproc": world, "tokens_per_process": args.tokens // world,
              "saved_MB": sum(saved.values()) / 2**20, "peak_MB": peak / 2**20, "seconds": seconds,
              "logp_sum": float(logp.detach().sum())}
    (args.worker / f"rank{rank}.json").write_text(json.dumps(record))
    if world > 1:
        torch.distributed.destroy_process_group()


def run_n(args, n: int, folder: Path) -> dict:
    """Start the ``n`` processes of one configuration; the largest figure of each over them."""
    folder.mkdir(parents=True, exist_ok=True)
    forwarded = ["--tokens", args.tokens, "--completion", args.completion, "--layout", args.layout,
                 "--hidden", args.hidden, "--layers", args.layers, "--device", args.device,
                 "--threads", args.threads, "--worker", folder, *(["--backend", args.backend] if args.backend else [])]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    env.pop("WORLD_SIZE", None)
    done = subprocess.run([*launcher, str(HERE), *map(str, forwarded)], env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"N = {n} failed:\n{done.stderr[-3000:]}")
    ranks = [json.loads(p.read_text()) for p in sorted(folder.glob("rank*.json"))]
    out = {k: max(r[k] for r in ranks) for k in ("saved_MB", "peak_MB", "seconds")}
    out.update(nproc=n, tokens_per_process=ranks[0]["tokens_per_process"], logp_sum=ranks[0]["logp_sum"])
    return out


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if args.worker is not None:
        worker(args)
        return []
    records = []
    with tempfile.TemporaryDirectory() as scratch:
        for n in args.nproc:
            records.append(run_n(args, n, Path(scratch) / f"n{n}"))
    first = records[0]
    print(f"{args.tokens} tokens ({args.completion} trained), {args.layout}, hidden {args.hidden}, "
          f"{args.layers} layers, {args.device}")
    print(f"{'N':>3} {'tokens/proc':>11} {'saved MB':>9} {'x N=1':>6} {'peak MB':>8} {'x N=1':>6} {'seconds':>8} "
          f"{'sum logp':>12}")
    for r in records:
        print(f"{r['nproc']:>3} {r['tokens_per_process']:>11} {r['saved_MB']:>9.1f} "
              f"{r['saved_MB'] / first['saved_MB']:>6.2f} {r['peak_MB']:>8.1f} "
              f"{r['peak_MB'] / max(first['peak_MB'], 1e-9):>6.2f} {r['seconds']:>8.2f} {r['logp_sum']:>12.4f}")
    if args.json:
        args.json.write_text(json.dumps({"settings": {k: str(v) for k, v in vars(args).items()}, "records": records},
                                        indent=1))
    return records


if __name__ == "__main__":
    main()
