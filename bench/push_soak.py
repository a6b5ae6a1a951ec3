"""Does a ``grpo-run serve`` server slow down as it takes weight pushes? One server, one
learner-side backend (the real ``vllm-server`` backend, no training): ``--pushes`` full pushes of
the policy, and every ``--every`` pushes the same generate call (fixed seed, ``--prompts`` x G)
timed, with the server's resident memory (its processes, from ``/proc``); ``--pause`` pauses the
server around each push, as partial rollouts do. Prints one row per
probe and writes them as JSON to ``--out``.

    python bench/push_soak.py --model DIR --server-python .venv-vllm/bin/python --pushes 150

Each side is pinned to a core of its own (``taskset``), as in ``bench/overlap.py``. Nothing here
is part of the test run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from overlap import SECRET, Server, group_members  # noqa: E402


def _group_rss_mib(pgid: int) -> float:
    """Resident memory (MiB) of every live process of process group ``pgid``."""
    total = 0
    for entry, _ in group_members(pgid):
        try:
            status = (entry / "status").read_text()
        except OSError:
            continue
        total += next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0)
    return total / 1024


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--server-python", default=sys.executable)
    parser.add_argument("--pushes", type=int, default=150)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--learner-core", type=int, default=0)
    parser.add_argument("--server-core", type=int, default=1)
    parser.add_argument("--pause", action="store_true",
                        help="pause (/pause?mode=abort) and resume the server around each push, as partial rollouts do")
    parser.add_argument("--out", default="bench/runs/push_soak")
    args = parser.parse_args(argv)
    if args.learner_core is not None:
        os.sched_setaffinity(0, {args.learner_core})
    os.environ["GRPO_SERVE_SECRET"] = SECRET
    import torch
    from grpo_plugins.vllm.server import VLLMServerOptions, VLLMServerRollout
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_core.contracts import SamplingParams

    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    server = Server(args.server_python, args.model, args.server_core, out / "server.log", 512)
    rows = []
    try:
        server.wait(600)
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        backend = VLLMServerRollout(VLLMServerOptions(urls=[server.url]))
        from grpo_core.contracts import RolloutSetup

        backend.setup(RolloutSetup(model, tokenizer))
        prompts = [tokenizer(f"Question {i}: what is {i} + {i + 7}?")["input_ids"] for i in range(args.prompts)]
        sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, seed=0)
        for pushes in range(args.pushes + 1):
            if pushes % args.every == 0:
                t0 = time.perf_counter()
                batch = backend.generate(prompts, args.group_size, sampling)
                generate_s = time.perf_counter() - t0
                rows.append({"pushes": pushes, "generate_s": generate_s, "tokens": int(batch.completion_mask.sum()),
                             "server_rss_mib": _group_rss_mib(server.proc.pid),
                             "server_cpu_s": server.cpu_seconds()})
                print(json.dumps(rows[-1]), flush=True)
                (out / "results.json").write_text(json.dumps({"rows": rows}, indent=2))
            if pushes < args.pushes:
                t0 = time.perf_counter()
                if args.pause:
                    backend._each(lambda c: c.call("POST", "/pause?mode=abort", retries=0), "did not pause")
                backend.sync_weights(model)
                if args.pause:
                    backend._each(lambda c: c.call("POST", "/resume", retries=0), "did not resume")
                rows[-1].setdefault("push_s", []).append(time.perf_counter() - t0)
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
