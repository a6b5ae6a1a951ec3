"""Part 1, correctness on the device, on the tiny Llama of :mod:`grpo_core.testing`:

- ``gradient``: one update of the engine on the device (the learner ``build_learner`` makes from
  a spec; float32, micro-batches accumulating, a left-padded prompt, ragged completions, a group
  of zero advantages that is skipped) equals the textbook gradient computed in float64 on the
  CPU: one plain forward per row over its prompt and completion, ``-sum A_t log pi(o_t)`` over
  the completion tokens, divided as the aggregator says. An SGD step of learning rate 1 makes the
  update's weight change its gradient. With ``train.packing`` in this build, padded and packed.
- ``bf16_autocast``: the same with ``train.mixed_precision: bf16`` (the engine's ``autocast`` on
  the device): within bf16's rounding of the float64 gradient, and not equal to the float32 one
  (the autocast took effect).
- ``sampler_logprobs``: the ``hf`` backend's decode loop reports the log-prob of each token it
  drew; drawn from the float32 policy itself they equal the trainer's (``completion_logprobs``);
  from the bfloat16 generation copy they differ by bf16 rounding, as the rollout correction's
  ``logp_diff`` reports.
- ``checkpoint_to_cpu``: a grpo-run on the device checkpoints; its optimizer state loads on the
  CPU, and in a process that sees no GPU a resume with no step left writes the same weights bit
  for bit and one with a step left trains it.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import shutil
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import Any

import torch
from common import Record, load_run_spec, packing_available, rel_error, run_spec

P, G, T, L = 3, 4, 6, 5
#: float32 on the device against float64: summation order and float32 rounding only.
FP32_TOLERANCE = 1e-4
#: bf16 autocast against float64: bf16 keeps 8 significant bits (relative rounding 2^-9 per
#: value), and the gradient passes through a few dozen rounded products; measured 4.1e-3 to
#: 4.4e-3 on the CPU's bf16 kernels.
BF16_TOLERANCE = 3e-2
TEXTS = ["What is 3 + 4?", "Hi", "Think step by step. What is 12 * 7? Answer:"]


def run(record: Record, device: torch.device, work: Path, args: Any) -> None:
    from grpo_core.testing import build_model, build_tokenizer

    tok = build_tokenizer()
    torch.manual_seed(0)
    model = build_model(tok)
    packings = [False, True] if packing_available() else [None]
    record.note(packing=packings != [None])
    for packing in packings:
        suffix = "" if packing is None else ("_packed" if packing else "_padded")
        record.check(f"gradient{suffix}", partial(gradient_check, model, device, work, packing, "fp32"))
        record.check(f"bf16_autocast{suffix}", partial(gradient_check, model, device, work, packing, "bf16"))
    record.check("sampler_logprobs", partial(sampler_check, model, tok, device))
    record.check("checkpoint_to_cpu", partial(checkpoint_check, device, work))


# --------------------------------------------------------------------------- the gradient
def textbook_batch(seed: int = 0):
    """``P`` prompts of ``L`` tokens (the first left-padded by 2), ``G`` completions each of
    1..``T`` tokens, per-row advantages; the second group's are all 0."""
    from grpo_core.train.learner.batch import TrainBatch

    gen = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(10, 300, (P, L), generator=gen)
    prompt_mask = torch.ones(P, L, dtype=torch.bool)
    prompt_mask[0, :2] = False
    completion_ids = torch.randint(10, 300, (P * G, T), generator=gen)
    lengths = torch.randint(1, T + 1, (P * G,), generator=gen)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    adv = torch.randn(P * G, 1, generator=gen).expand(-1, T).clone()
    adv[G:2 * G] = 0.0
    return TrainBatch(prompt_ids, prompt_mask, completion_ids, mask, adv * mask)


def textbook_gradient(model64, batch, aggregation: str) -> dict[str, torch.Tensor]:
    """The gradient of the textbook loss, float64 on the CPU, one plain forward per row."""
    model = copy.deepcopy(model64)
    terms, counts = [], []
    for i in range(batch.completion_ids.shape[0]):
        p, m = i // G, batch.mask[i]
        n = int(m.sum())
        prompt = batch.prompt_ids[p][batch.prompt_mask[p]]
        seq = torch.cat([prompt, batch.completion_ids[i, :n]])
        logp = torch.log_softmax(model(seq[None]).logits[0].double(), -1)
        start = prompt.shape[0]
        picked = logp[start - 1:start - 1 + n].gather(1, seq[start:, None])[:, 0]
        terms.append((batch.advantages[i, :n].double() * picked).sum())
        counts.append(n)
    if aggregation == "seq-mean-token-mean":
        loss = -sum(x / n for x, n in zip(terms, counts)) / len(terms)
    else:  # token-mean
        loss = -sum(terms) / sum(counts)
    loss.backward()
    return {k: p.grad.detach().clone() for k, p in model.named_parameters()}


def spec_learner(model, device: torch.device, work: Path, *, aggregation: str = "token-mean", mixed: str = "no",
                 packing: bool | None = None, strategy=None):
    """The learner of ``model`` as ``build_learner`` makes it from a spec (the objective, the
    update's settings, the autocast, ``train.packing`` where this build has it), one group per
    micro-batch (the gradient accumulates over three), no clipping, then given SGD with learning
    rate 1 so that an update's weight change is its gradient. ``strategy``: the parallel
    strategy (default: one process, unsharded)."""
    from grpo_core.testing import build_tokenizer
    from grpo_core.train.distributed import Dist
    from grpo_core.train.learner.parallel import OneProcess
    from grpo_core.train.loop.assemble import build_learner

    overrides = [f"algorithm.aggregation.name={aggregation}", f"train.mixed_precision={mixed}",
                 f"train.micro_batch_size={G}", "train.max_grad_norm=null"]
    overrides += [] if packing is None else [f"train.packing={str(packing).lower()}"]
    spec = load_run_spec(work / "settings", run_spec(work / "settings", work / "unused-model", device), overrides).spec
    learner = build_learner(spec, model, build_tokenizer(), strategy or OneProcess(Dist(0, 1, device)))
    learner.optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    learner.scheduler = torch.optim.lr_scheduler.LambdaLR(learner.optimizer, lambda s: 1.0)
    return learner


def on(batch, device: torch.device):
    """``batch`` with its tensors on ``device``."""
    return dataclasses.replace(batch, **{f.name: getattr(batch, f.name).to(device) for f in dataclasses.fields(batch)
                                         if isinstance(getattr(batch, f.name), torch.Tensor)})


def engine_gradient(model, batch, device: torch.device, work: Path, **choices) -> dict[str, torch.Tensor]:
    """The weight change of one update by the engine on ``device`` (:func:`spec_learner` with
    ``choices``): its gradient."""
    from grpo_core.train.learner.update import update

    trained = copy.deepcopy(model).to(device)
    before = {k: p.detach().clone() for k, p in trained.named_parameters()}
    metrics = update(spec_learner(trained, device, work, **choices), on(batch, device))
    assert metrics["train/updates"] == 1, metrics
    return {k: (before[k] - p.detach()).cpu() for k, p in trained.named_parameters()}


def gradient_check(model, device: torch.device, work: Path, packing: bool | None, mixed: str) -> dict[str, Any]:
    batch = textbook_batch()
    model64 = copy.deepcopy(model).double()
    out: dict[str, Any] = {"device": str(device), "packing": packing, "mixed_precision": mixed,
                           "tf32_matmul": bool(torch.backends.cuda.matmul.allow_tf32)}
    ok = True
    for aggregation in ("token-mean", "seq-mean-token-mean"):
        book = textbook_gradient(model64, batch, aggregation)
        choices = {"aggregation": aggregation, "packing": packing}
        engine = engine_gradient(model, batch, device, work, mixed="no" if mixed == "fp32" else "bf16", **choices)
        err = rel_error(engine, book)
        out[f"rel_error_{aggregation}"] = err
        if mixed == "fp32":
            ok &= err < FP32_TOLERANCE
        else:  # the autocast took effect: not the float32 gradient, yet within bf16 rounding
            fp32 = engine_gradient(model, batch, device, work, mixed="no", **choices)
            out[f"rel_error_vs_fp32_{aggregation}"] = moved = rel_error(engine, fp32)
            ok &= err < BF16_TOLERANCE and moved > 1e-6
    out["tolerance"] = FP32_TOLERANCE if mixed == "fp32" else BF16_TOLERANCE
    out["ok"] = bool(ok)
    return out


# --------------------------------------------------------------------------- sampler log-probs
def sampler_check(model, tok, device: torch.device) -> dict[str, Any]:
    from grpo_plugins.rollout.decode import lean_decode
    from grpo_plugins.rollout.hf import HFRollout, HFRolloutOptions
    from transformers import DynamicCache

    from grpo_core.contracts import RolloutSetup, SamplingParams, left_pad, special_ids
    from grpo_core.train.learner.correction import rollout_correction
    from grpo_core.train.learner.logprobs import completion_logprobs

    policy = copy.deepcopy(model).to(device).eval()
    prompts = [tok(text)["input_ids"] for text in TEXTS]
    sampling = SamplingParams(max_new_tokens=12, seed=3)
    eos, pad = special_ids(policy, tok, "hf")
    ids, mask = (t.to(device) for t in left_pad(prompts, pad))
    ids, mask = ids.repeat_interleave(4, 0), mask.repeat_interleave(4, 0)
    torch.manual_seed(3)
    with torch.inference_mode():
        out, lengths, logp = lean_decode(policy, ids, mask, DynamicCache(config=policy.config), sampling, eos, pad,
                                         with_logp=True)
    width = out.shape[1]
    done = torch.where(lengths >= 0, lengths, width)
    comp_mask = torch.arange(width, device=device)[None, :] < done[:, None]
    with torch.no_grad():
        trainer, _ = completion_logprobs(policy, ids[::4], mask[::4], out.clone(), comp_mask)
    diff = (trainer - logp.clone())[comp_mask].abs()
    result: dict[str, Any] = {"self_tokens": int(comp_mask.sum()), "self_logp_diff_mean": float(diff.mean()),
                              "self_logp_diff_max": float(diff.max())}

    backend = HFRollout(HFRolloutOptions(dtype="bfloat16"))
    backend.setup(RolloutSetup(policy, tok))
    batch = backend.generate(prompts, 4, sampling)
    with torch.no_grad():
        trainer16, _ = completion_logprobs(policy, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                           batch.completion_mask)
    _, metrics = rollout_correction(trainer16, batch.sampling_logp, batch.completion_mask, level="token",
                                    mode="truncate", cap=2.0)
    gap = metrics["rollout_correction/logp_diff"][batch.completion_mask]
    result.update(bf16_tokens=int(batch.completion_mask.sum()), bf16_logp_diff_mean=float(gap.mean()),
                  bf16_logp_diff_max=float(gap.max()),
                  bf16_weight_mean=float(metrics["rollout_correction/weight"][batch.completion_mask].mean()),
                  bf16_copy_attention=backend.model.config._attn_implementation)
    # float32 sampler = trainer up to kernel rounding; the bf16 copy within bf16 rounding (and not 0)
    result["ok"] = bool(result["self_logp_diff_max"] < 1e-3 and result["bf16_logp_diff_mean"] < 0.05
                        and 0 < result["bf16_logp_diff_max"] < 0.5)
    return result


# --------------------------------------------------------------------------- checkpoint
def checkpoint_check(device: torch.device, work: Path) -> dict[str, Any]:
    """grpo-run for 2 steps on ``device`` (a checkpoint each step), then on the CPU: the
    checkpoint's weights and optimizer state load there, and in a process that sees no GPU a
    resume with no step left writes exactly those weights and a resume to step 3 trains on."""
    from safetensors.torch import load_file

    from grpo_core import checkpoint as ckpt
    from grpo_core.cli import main
    from grpo_core.testing import save_tiny_model

    folder = work / "checkpoint"
    shutil.rmtree(folder, ignore_errors=True)
    model_dir = save_tiny_model(folder / "model")
    spec = run_spec(folder, model_dir, device)
    path = folder / "spec.yaml"
    load_run_spec(folder, spec)  # writes spec.yaml
    out_dir = Path(spec["train"]["output_dir"])
    result: dict[str, Any] = {"trained_on": str(device)}
    code = main([str(path)])
    result["device_run_exit"] = code
    found = ckpt.find_resumable(out_dir / "checkpoints", None, map_location="cpu")
    assert found is not None, f"no checkpoint in {out_dir / 'checkpoints'}"
    saved = {k: v for f in sorted((found.folder / "model").glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    final = load_file(str(out_dir / "final" / "model.safetensors"))
    result["checkpoint_step"] = int(found.state.get("step", -1))
    result["checkpoint_equals_final"] = all(torch.equal(saved[k], final[k]) for k in final)
    devices = {str(t.device) for t in _tensors(found.state.get("optimizer"))}
    result["optimizer_state_devices"] = sorted(devices)

    # The resumes run where no GPU is visible, as on a CPU-only machine.
    resumes = subprocess.run([sys.executable, "-c", RESUME_ON_CPU, str(path), str(out_dir / "final")],
                             env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, capture_output=True, text=True,
                             timeout=300)
    assert resumes.returncode == 0, resumes.stderr[-3000:]
    report = json.loads(resumes.stdout.strip().splitlines()[-1])
    code_same, code_more = report["exits"]
    again = load_file(str(out_dir / "final-resumed" / "model.safetensors"))
    later = load_file(str(out_dir / "final" / "model.safetensors"))
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    result["cpu_sees_cuda"] = report["cuda"]
    result["cpu_resume_exit"] = code_same
    result["cpu_resume_bit_exact"] = all(torch.equal(saved[k], again[k]) for k in saved)
    result["cpu_continue_exit"] = code_more
    result["steps_logged"] = sorted({r["step"] for r in rows if "loss" in r})
    result["cpu_step_moved_weights"] = any(not torch.equal(saved[k], later[k]) for k in saved)
    result["ok"] = bool(code == code_same == code_more == 0 and result["checkpoint_equals_final"]
                        and result["cpu_resume_bit_exact"] and result["cpu_step_moved_weights"]
                        and devices <= {"cpu"} and result["steps_logged"] == [1, 2, 3]
                        and not result["cpu_sees_cuda"])
    return result


#: Run in a process that sees no GPU: resume the run's checkpoint with no step left (its final
#: weights copied aside), then with one more step; prints the exit codes.
RESUME_ON_CPU = """
import json, shutil, sys
import torch
from grpo_core.cli import main
spec, final = sys.argv[1], sys.argv[2]
same = main([spec, "--set", "train.device=cpu", "--resume"])
shutil.copytree(final, final + "-resumed")
more = main([spec, "--set", "train.device=cpu", "--set", "train.steps=3", "--resume"])
print(json.dumps({"exits": [same, more], "cuda": torch.cuda.is_available()}))
"""


def _tensors(value: Any):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
