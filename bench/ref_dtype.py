"""What ``algorithm.kl.reference_dtype: bfloat16`` does to the reference forward on SmolLM2.

    python bench/ref_dtype.py [--prompts 2] [--group 16] [--tokens 128] [--threads 1]

Samples one batch with the ``hf`` backend (float32 policy), then computes the reference
log-probs of its completion tokens with a float32 copy and with a bfloat16 copy of the same
weights (the engine's no-grad path, :func:`grpo_core.train.learner.batch.batch_logprobs`, prompt
shared by the group). Prints the time of each (median of ``--reps`` after a warm-up), the
largest and mean absolute difference of the log-probs, and the k3 KL estimate per token of
the float32 policy against each reference: against the float32 copy it is 0 (the same
weights), against the bf16 copy it is the bias bf16 rounding adds to the KL the loss sees.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from contextlib import nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--group", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--model-dir", default=str(Path(tempfile.gettempdir()) / "grpo-bench-smollm2"))
    parser.add_argument("--tiny", action="store_true", help="grpo_core.testing's tiny random model (a smoke run)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    from floor import timed
    from grpo_plugins.rollout.hf import HFRollout
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vs_trl import bench_model, task_rows

    from grpo_core.contracts import SamplingParams
    from grpo_core.train.learner.batch import TrainBatch, batch_logprobs
    from grpo_core.train.learner.kl import Reference
    from grpo_core.train.learner.parallel import forward_of

    folder = bench_model(Path(args.model_dir), args.tiny)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    policy = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    rows, _ = task_rows(10)
    texts = [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False)
             for r in rows[: args.prompts]]
    prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    backend = HFRollout()
    from grpo_core.contracts import RolloutSetup

    backend.setup(RolloutSetup(policy, tokenizer))
    out = backend.generate(prompts, args.group, SamplingParams(max_new_tokens=args.tokens, seed=0))
    mask = out.completion_mask.bool()
    batch = TrainBatch(out.prompt_ids, out.prompt_mask.bool(), out.completion_ids, mask, torch.zeros(mask.shape))
    rows_n = mask.shape[0]

    def logp(model):
        return batch_logprobs(forward_of(model), batch, rows_n, 1.0, nullcontext)

    results = {}
    for dtype in (None, "bfloat16"):
        ref = Reference(policy, dtype)
        results[dtype or "float32"] = (timed(lambda r=ref: logp(r.model), args.reps), logp(ref.model))
    policy_logp = logp(policy)
    estimator = lambda ref_logp: (torch.exp(ref_logp - policy_logp) - (ref_logp - policy_logp) - 1)[mask]  # noqa: E731
    print(f"SmolLM2-135M, {rows_n} rows, {int(mask.sum())} completion tokens, {args.threads} threads")
    for name, (seconds, ref_logp) in results.items():
        diff = (ref_logp - results["float32"][1])[mask].abs()
        print(f"  reference {name:8s}: {seconds:6.2f} s; |logp - float32| max {float(diff.max()):.2e} "
              f"mean {float(diff.mean()):.2e}; k3 KL per token vs the float32 policy "
              f"{float(estimator(ref_logp).mean()):.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
