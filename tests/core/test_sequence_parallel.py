"""Sequence parallelism (``train.parallel.sequence``): each sequence split over two processes
(torchrun, gloo on CPU) gives one process's log-probs and gradients, packed and padded, under
ddp and fsdp2; a 2-step run with it takes one process's steps; bad sizes are refused by name."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from grpo_core.errors import RunError
from grpo_core.spec import load_spec
from grpo_core.testing import build_model, build_tokenizer
from grpo_core.train.learner.sequence_parallel import check_model

from .conftest import CHILD_ENV, load_weights, read_metrics

# The worker of the next test, one per process under torchrun. Every process holds its own rows
# (other prompt paddings, completion lengths and holes; a row with nothing to compute) and
# another number of micro-batches. For each strategy (ddp, fsdp2) and layout (padded, packed) it
# computes, with train.parallel.sequence = 2: the no-grad log-probs (the old/reference pass,
# batch_logprobs), then one optimizer step (SGD, learning rate 1: the weight change is the
# gradient) of sum(w * logp) + 0.3 * sum(entropy) over its rows. One process's reference: the
# unsplit model on the same rows, its gradient summed over the processes (what one process
# holding every row computes), padded (each prompt encoded in its rows) or packed. Float64, so
# any real difference shows far above 1e-6 (the no-grad pass keeps float32). It also counts the
# tokens its embedding layer ran: half of every pass's sequence.
WORKER = '''
import copy, json, sys
from contextlib import nullcontext
import torch
import torch.distributed as tdist
from grpo_core.spec.parallel import ParallelSection
from grpo_core.testing import build_model, build_tokenizer
from grpo_core.train.distributed import Dist
from grpo_core.train.learner.batch import TrainBatch, batch_logprobs, forward_logprobs, packed_tokens
from grpo_core.train.learner.logprobs import completion_logprobs
from grpo_core.train.learner.optim import Optimization, optimizer_step, zero_gradient_passes
from grpo_core.train.learner.parallel import SequenceDDP, SequenceFSDP2

torch.set_num_threads(1)
dist = Dist.from_env("cpu", timeout_s=60)
rank = dist.rank
tok = build_tokenizer()
base = build_model(tok).double()
gen = torch.Generator().manual_seed(30 + rank)
vocab = base.config.vocab_size
prompt = torch.randint(2, vocab, (2, 6), generator=gen)
p_mask = torch.ones_like(prompt, dtype=torch.bool)
p_mask[rank, : 2 + rank] = False  # left padding
width = 9 + 5 * rank
comp = torch.randint(2, vocab, (6, width), generator=gen)
lengths = torch.randint(1, width + 1, (6,), generator=gen)
lengths[rank] = width
mask = torch.arange(width)[None, :] < lengths[:, None]
mask[rank, 2:4] = False  # a hole: attended to, not predicted
mask[4 - rank] = False  # a row with nothing to compute
batch = TrainBatch(prompt, p_mask, comp, mask, torch.zeros(comp.shape))
rows = torch.arange(6)
micros = [rows] if rank == 0 else [rows[:3], rows[3:]]
weights = torch.linspace(0.5, 1.5, 6 * width, dtype=torch.float64).view(6, width)

references = {}
for packed in (False, True):  # one process: each prompt in its rows (padded), or the rows packed
    plain = copy.deepcopy(base)
    want, want_entropy = completion_logprobs(plain, prompt, p_mask, comp, mask, with_entropy=True,
                                             share_prompt=False, packed=packed)
    ((want * weights).sum() + 0.3 * want_entropy.sum()).backward()
    want_grads = [p.grad.clone() for p in plain.parameters()]
    for g in want_grads:
        tdist.all_reduce(g)
    references[packed] = want.detach(), want_entropy.detach(), want_grads
scale = max(float(g.abs().max()) for g in want_grads)


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


out = {}
for name, cls in (("ddp", SequenceDDP), ("fsdp2", SequenceFSDP2)):
    for packed in (False, True):
        case = f"{name}-{'packed' if packed else 'padded'}"
        want, want_entropy, want_grads = references[packed]
        model = copy.deepcopy(base)
        strategy = cls(dist, ParallelSection(strategy=name, sequence=2, reduce_dtype=None))
        strategy.setup(model)
        seen = []
        hook = model.get_input_embeddings().register_forward_hook(lambda m, a, o: seen.append(a[0].numel()))
        forward = strategy.forward(model)
        got = batch_logprobs(forward, batch, micros, 1.0, nullcontext, packed=packed, strategy=strategy)
        out[case + "/old"] = float((got - want)[mask].abs().max())  # batch_logprobs keeps float32
        out[case + "/zero_outside_mask"] = float(got[~mask].abs().max())
        if packed:  # every pass's packed sequence (its owner's micro-batch), padded to even, split in two
            sizes = sum(dist.gather([int(packed_tokens(batch, m).sum()) for m in micros]), [])
            out[case + "/tokens_embedded"] = [sum(seen), sum((s + 1) // 2 for s in sizes)]
        hook.remove()
        before = [full(p.detach()).clone() for p in model.parameters()]
        sgd = torch.optim.SGD(list(model.parameters()), lr=1.0)
        entropies = []

        def loss_of(micro, share):
            logp, entropy = forward_logprobs(forward, batch, micro, with_entropy=True, temperature=1.0,
                                             share_prompt=share, packed=packed)
            entropies.append((micro, entropy.detach()))
            return (logp * weights[micro]).sum() + 0.3 * entropy.sum(), []

        def idle(count, share):
            zero_gradient_passes(forward, batch, rows[:1], count, nullcontext, share, packed)

        optimizer_step(model, Optimization(sgd, torch.optim.lr_scheduler.LambdaLR(sgd, lambda s: 1.0)), strategy,
                       micros, loss_of, idle, shareable=True, max_grad_norm=None)
        after = [full(p.detach()) for p in model.parameters()]
        out[case + "/grads"] = max(float((b - a - g).abs().max()) for b, a, g in zip(before, after, want_grads)) / scale
        out[case + "/entropy"] = max(float((e - want_entropy[m])[mask[m]].abs().max()) for m, e in entropies)
out["grad_scale"] = scale
with open(sys.argv[1] + f"/rank{rank}.json", "w") as f:
    json.dump(out, f)
'''


def _torchrun(script: Path, *args, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, **CHILD_ENV}
    env.pop("WORLD_SIZE", None)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    done = subprocess.run([*launcher, str(script), *map(str, args)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.mark.slow
def test_two_processes_splitting_each_sequence_give_one_process_log_probs_and_gradients(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    _torchrun(script, tmp_path, cwd=tmp_path)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank in ranks:
        assert rank["grad_scale"] > 1e-3  # a gradient to compare
        for case in ("ddp-padded", "ddp-packed", "fsdp2-padded", "fsdp2-packed"):
            assert rank[f"{case}/old"] < 1e-6, (case, rank)
            assert rank[f"{case}/zero_outside_mask"] == 0.0, (case, rank)
            assert rank[f"{case}/entropy"] < 1e-6, (case, rank)
            assert rank[f"{case}/grads"] < 1e-6, (case, rank)
        for case in ("ddp-packed", "fsdp2-packed"):  # each process embedded half of every pass's sequence
            ran, half = rank[f"{case}/tokens_embedded"]
            assert ran == half, (case, rank)


SPEC = {
    "data": {"name": "arithmetic", "train_size": 16, "eval_size": 0},
    "rollout": {"group_size": 4, "max_new_tokens": 6, "prompts_per_generate": 1},
    "algorithm": {"advantage": {"name": "grpo", "std_scope": "batch"}, "kl": {"name": "low_var_kl", "beta": 0.04},
                  "aggregation": {"name": "token-mean"}},
    "train": {"steps": 2, "prompts_per_step": 4, "seed": 3, "micro_batch_size": 4, "packing": True,
              "parallel": {"strategy": "fsdp2", "sequence": 2}},
    "checkpoint": {"every": 0},
}


@pytest.mark.slow
def test_a_run_splitting_sequences_over_two_processes_takes_the_steps_of_one(tmp_path, write_spec):
    spec = write_spec(tmp_path, **SPEC)
    env = {**os.environ, **CHILD_ENV}
    env.pop("WORLD_SIZE", None)
    for nproc in (1, 2):  # one process: nothing to split, the same spec
        done = subprocess.run([sys.executable, "-m", "grpo_core.cli", "run", str(spec), "--nproc", str(nproc),
                               "--set", f"train.output_dir=n{nproc}"], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
    one, two = (load_weights(tmp_path / f"n{n}" / "final") for n in (1, 2))
    start = load_weights(Path(yaml.safe_load(spec.read_text())["model"]["path"]))
    assert max(float((one[k] - start[k]).abs().max()) for k in one) > 1e-3  # it trained
    assert max(float((one[k] - two[k]).abs().max()) for k in one) < 1e-5
    rows1, rows2 = read_metrics(tmp_path / "n1" / "metrics.jsonl"), read_metrics(tmp_path / "n2" / "metrics.jsonl")
    assert [r["step"] for r in rows2] == [1, 2]
    for r1, r2 in zip(rows1, rows2):
        for key in ("loss", "kl", "grad_norm", "policy/ratio"):
            assert r2[key] == pytest.approx(r1[key], rel=1e-3, abs=1e-6), (r1["step"], key)


def test_a_model_whose_heads_the_group_does_not_divide_is_refused_naming_the_counts():
    model = build_model(build_tokenizer())  # 4 attention heads, 2 key/value heads
    check_model(model, 2)
    with pytest.raises(RunError, match=r"num_attention_heads = 4.*num_key_value_heads = 2"):
        check_model(model, 4)
    model.gradient_checkpointing_enable()
    with pytest.raises(RunError, match="gradient_checkpointing"):
        check_model(model, 2)


def test_the_spec_refuses_a_group_size_that_does_not_divide_the_processes(tmp_path, write_spec):
    from grpo_core.spec.resolved import world_problems

    spec = load_spec(write_spec(tmp_path, train={"parallel": {"sequence": 2}})).spec
    assert world_problems(spec, 4) == [] and world_problems(spec, 2) == []
    (problem,) = world_problems(spec, 3)
    assert "sequence: 2 must divide the number of processes (3)" in problem
    with pytest.raises(Exception, match="train.parallel.sequence = 2, but model.gradient_checkpointing"):
        load_spec(write_spec(tmp_path, model={"gradient_checkpointing": True}, train={"parallel": {"sequence": 2}}))
    with pytest.raises(Exception, match="greater than or equal to 1"):
        load_spec(write_spec(tmp_path, train={"parallel": {"sequence": 0}}))
