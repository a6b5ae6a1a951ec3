"""FSDP2 (``train.parallel.strategy: fsdp2``): real multi-process runs (``grpo-run --nproc``
and ``torchrun``, gloo on CPU) against one process; resumes across process counts and
strategies; the pieces of :mod:`grpo_core.train.learner.sharding` in a one-process group."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from grpo_core import checkpoint as ckpt
from grpo_core.errors import RunError
from grpo_core.spec.parallel import ParallelSection
from grpo_core.testing import build_model, build_tokenizer, save_tiny_model
from grpo_core.train.distributed import parallel_from_launcher
from grpo_core.train.learner import sharding

from .conftest import CHILD_ENV, load_weights, read_metrics

FSDP_SPEC = {
    "data": {"name": "arithmetic", "train_size": 16, "eval_size": 0},
    "rollout": {"group_size": 4, "max_new_tokens": 6, "prompts_per_generate": 1},
    "algorithm": {
        "advantage": {"name": "grpo", "std_scope": "batch"},
        "kl": {"name": "low_var_kl", "beta": 0.04},  # a sharded reference model too
        "aggregation": {"name": "token-mean"},
    },
    # two micro-batches per process: gradients accumulate into the shards
    "train": {"steps": 2, "prompts_per_step": 4, "seed": 3, "micro_batch_size": 4,
              "parallel": {"strategy": "fsdp2"}},
    "checkpoint": {"every": 1, "keep": 5},
}
SAME = ("loss", "kl", "grad_norm", "reward", "policy/ratio", "train/updates")


def _run(args: list, cwd: Path, torchrun: bool = False, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, **CHILD_ENV}
    env.pop("WORLD_SIZE", None)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command = [*(launcher if torchrun else [sys.executable]), "-m", "grpo_core.cli", "run", *map(str, args)]
    out = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


@pytest.mark.slow
def test_fsdp2_on_two_processes_takes_the_steps_of_one_and_resumes_under_any_count_or_strategy(
    tmp_path, write_spec
):
    spec = write_spec(tmp_path, **FSDP_SPEC)
    base = load_weights(Path(yaml.safe_load(spec.read_text())["model"]["path"]))
    _run([spec, "--set", "train.output_dir=one"], tmp_path)  # one process: nothing to shard
    _run([spec, "--nproc", "2", "--set", "train.output_dir=two"], tmp_path)

    w1, w2 = load_weights(tmp_path / "one" / "final"), load_weights(tmp_path / "two" / "final")
    assert _max_diff(w1, base) > 1e-3
    assert _max_diff(w1, w2) < 1e-5
    rows1, rows2 = read_metrics(tmp_path / "one" / "metrics.jsonl"), read_metrics(tmp_path / "two" / "metrics.jsonl")
    assert [r["step"] for r in rows2] == [r["step"] for r in rows1] == [1, 2]
    for r1, r2 in zip(rows1, rows2):
        for key in SAME:
            assert r2[key] == pytest.approx(r1[key], rel=1e-3, abs=1e-6), (r1["step"], key)

    # The sharded run's checkpoint is sharded (checkpoint.format: auto): each process's shards.
    folder = ckpt.list_checkpoints(tmp_path / "two" / "checkpoints")[-1]
    assert ckpt.verify(folder) is None and not (folder / "model").exists()
    assert sorted(p.name for p in (folder / ckpt.SHARDS).glob("__*")) == ["__0_0.distcp", "__1_0.distcp"]
    assert ckpt.load_state(folder / ckpt.STATE)["optimizer_format"] == "sharded"

    # From equal states, step 3 three ways: the fsdp2 checkpoint in one process (2 -> 1) and
    # under ddp on two processes; the one-process checkpoint (gathered) under fsdp2 with
    # torchrun (1 -> 2), which writes step 3 gathered.
    for name in ("two-to-one", "two-to-ddp"):
        shutil.copytree(tmp_path / "two", tmp_path / name)
    shutil.copytree(tmp_path / "one", tmp_path / "one-to-two")
    more = ["--set", "train.steps=3", "--resume"]
    _run([spec, "--set", "train.output_dir=two-to-one", *more], tmp_path)
    _run([spec, "--nproc", "2", "--set", "train.output_dir=two-to-ddp", "--set", "train.parallel.strategy=ddp", *more],
         tmp_path)
    torchrun = _run([spec, "--set", "train.output_dir=one-to-two", "--set", "checkpoint.format=gathered", *more],
                    tmp_path, torchrun=True)
    assert "resuming from" in torchrun.stderr and "(step 2)" in torchrun.stderr
    # A gathered checkpoint of the sharded run: whole weights and the optimizer state by name.
    folder = ckpt.list_checkpoints(tmp_path / "one-to-two" / "checkpoints")[-1]
    assert folder.name == "step-000003" and ckpt.verify(folder) is None
    state = ckpt.load_state(folder / ckpt.STATE)
    assert state["optimizer_format"] == "named" and "model.layers.0.mlp.up_proj.weight" in state["optimizer"]["state"]
    assert _max_diff(load_weights(folder / "model"), load_weights(tmp_path / "one-to-two" / "final")) == 0
    finals = {n: load_weights(tmp_path / n / "final") for n in ("two-to-one", "two-to-ddp", "one-to-two")}
    assert _max_diff(finals["two-to-one"], w2) > 1e-4  # step 3 moved them
    # the same start: only the sum order differs; from one's weights (1e-5 apart), Adam's step
    # carries the difference on (the tolerance of test_distributed's resumes)
    assert _max_diff(finals["two-to-one"], finals["two-to-ddp"]) < 2e-5
    assert _max_diff(finals["two-to-one"], finals["one-to-two"]) < 5e-5


@pytest.mark.slow
def test_tied_embeddings_train_sharded_with_cpu_offload_and_gradient_checkpointing(tmp_path, write_spec):
    from transformers import AutoModelForCausalLM

    tied = save_tiny_model(tmp_path / "tied", tied=True)
    extra = ["--set", f"model.path={tied}", "--set", "model.gradient_checkpointing=true"]
    spec = write_spec(tmp_path, **FSDP_SPEC)
    _run([spec, "--set", "train.output_dir=one", *extra], tmp_path)
    _run([spec, "--nproc", "2", "--set", "train.output_dir=two", "--set", "train.parallel.offload=true", *extra],
         tmp_path)
    w1, w2 = load_weights(tmp_path / "one" / "final"), load_weights(tmp_path / "two" / "final")
    assert _max_diff(w1, load_weights(tied)) > 1e-3
    assert _max_diff(w1, w2) < 2e-5  # saved once, like the unsharded save
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "two" / "final")
    assert model.lm_head.weight is model.get_input_embeddings().weight
    assert torch.equal(model.lm_head.weight.detach(), w2["model.embed_tokens.weight"])


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp2", "ddp"])
def test_a_process_whose_rows_are_all_skipped_still_joins_every_collective(tmp_path, write_spec, strategy):
    """Rank 0 scores every completion alike (advantage 0 everywhere: no micro-batch to run),
    rank 1 does not: rank 0 runs a zero-gradient pass so that the FSDP2 gathers and
    reduce-scatters, or DDP's gradient sum, meet on both processes; no hang, the step updates."""
    (tmp_path / "uneven.py").write_text(
        "import os, random\n"
        "from grpo_core import hookimpl\n"
        "def uneven(prompts, completions, **kw):\n"
        "    if os.environ.get('RANK') == '0':\n"
        "        return [0.0] * len(completions)\n"
        "    return [random.Random(i).random() for i in range(len(completions))]\n"
        "@hookimpl\n"
        "def register_reward_functions(register):\n"
        "    register.add('uneven', uneven)\n",
        encoding="utf-8",
    )
    spec = write_spec(tmp_path, **{**FSDP_SPEC, "plugins": ["uneven.py"], "rewards": [{"name": "uneven"}],
                                   "algorithm": {"kl": {"beta": 0.0}}, "checkpoint": {"every": 0}})
    # fsdp2 also with FSDP2's mixed precision: bf16 gathered weights, float32 shards
    bf16 = ["--set", "train.parallel.param_dtype=bfloat16"] if strategy == "fsdp2" else []
    _run([spec, "--nproc", "2", "--set", "train.steps=1", "--set", f"train.parallel.strategy={strategy}", *bf16],
         tmp_path, timeout=120)
    (row,) = read_metrics(tmp_path / "out" / "metrics.jsonl")
    assert row["perf/skipped_rows_frac"] == 0.5 and row["train/updates"] == 1 and row["grad_norm"] > 0
    assert {t.dtype for t in load_weights(tmp_path / "out" / "final").values()} == {torch.float32}


UNEVEN_TURNS = """
import os
from grpo_core import hookimpl
from grpo_core.contracts import Observation


class Uneven:
    tools = []
    stop = tuple("0123456789 ")

    def reset(self, row):
        return {"turns": 0}

    def step(self, state, text):  # rank 0's episodes take one turn, rank 1's two
        state["turns"] += 1
        if state["turns"] > int(os.environ.get("RANK", "0")):
            return Observation(done=True, reward=float(len(text)))
        return Observation(messages=[{"role": "user", "content": "go on"}])


@hookimpl
def register_environments(register):
    register.add("uneven", Uneven())
"""


@pytest.mark.slow
def test_multi_turn_episodes_with_a_different_number_of_turns_per_process_run_sharded(tmp_path, write_spec):
    """Each turn is a generate call: rank 1 makes twice as many as rank 0. The sharded policy
    is gathered once per rollout phase on every process, never per call."""
    (tmp_path / "uneven.py").write_text(UNEVEN_TURNS, encoding="utf-8")
    episodes = {"environment": {"name": "uneven", "max_turns": 3, "max_total_tokens": 64}}
    spec = write_spec(tmp_path, **{**FSDP_SPEC, "plugins": ["uneven.py"], "rewards": [{"name": "env_reward"}],
                                   "checkpoint": {"every": 0}, "rollout": {**FSDP_SPEC["rollout"], **episodes}})
    _run([spec, "--nproc", "2", "--set", "train.steps=1"], tmp_path, timeout=120)
    (row,) = read_metrics(tmp_path / "out" / "metrics.jsonl")
    assert row["env/turns_per_episode"] == 1.5 and row["train/updates"] == 1


# --------------------------------------------------------------------------- launcher
def test_accelerate_fsdp2_config_selects_fsdp2_with_its_options(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    monkeypatch.setenv("FSDP_RESHARD_AFTER_FORWARD", "false")
    monkeypatch.setenv("FSDP_OFFLOAD_PARAMS", "true")
    got = parallel_from_launcher(ParallelSection(param_dtype="bfloat16"))
    assert (got.strategy, got.reshard_after_forward, got.offload, got.param_dtype) == ("fsdp2", False, True, "bfloat16")


@pytest.mark.parametrize(
    ("variables", "named"),
    [({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1"}, "FSDP version 1"),
     ({"ACCELERATE_USE_DEEPSPEED": "true"}, "DeepSpeed")],
)
def test_fsdp1_and_deepspeed_configs_are_refused_naming_fsdp2(monkeypatch, variables, named):
    for key, value in variables.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(RunError, match=f"accelerate is configured for {named}.*train.parallel.strategy: fsdp2"):
        parallel_from_launcher(ParallelSection())


def test_spec_refuses_autocast_and_lora_under_fsdp2(write_spec, tmp_path):
    from grpo_core.errors import SpecError
    from grpo_core.spec import load_spec

    spec = write_spec(tmp_path, train={"parallel": {"strategy": "fsdp2"}, "mixed_precision": "bf16"},
                      model={"lora": {"r": 4}})
    with pytest.raises(SpecError) as info:
        load_spec(spec)
    assert "train.parallel.param_dtype: bfloat16" in str(info.value) and "model.lora" in str(info.value)


def test_spec_refuses_bf16_moments_and_a_reference_dtype_under_fsdp2(write_spec, tmp_path):
    """Both hold plain tensors where fsdp2 has DTensor shards (the bf16 AdamW's rounding adds
    a plain tensor to a DTensor): refused up front, naming what works instead."""
    from grpo_core.errors import SpecError
    from grpo_core.spec import load_spec

    spec = write_spec(tmp_path, train={"parallel": {"strategy": "fsdp2"}, "optimizer": {"state_dtype": "bfloat16"}},
                      algorithm={"kl": {"beta": 0.04, "reference_dtype": "bfloat16"}})
    with pytest.raises(SpecError) as info:
        load_spec(spec)
    message = str(info.value)
    assert "train.optimizer.state_dtype: bfloat16" in message and "use float32" in message
    assert "algorithm.kl.reference_dtype" in message
    ddp = write_spec(tmp_path / "ddp", train={"optimizer": {"state_dtype": "bfloat16"}},
                     algorithm={"kl": {"beta": 0.04, "reference_dtype": "bfloat16"}})
    load_spec(ddp)  # the same options are fine unsharded


# --------------------------------------------------------------------------- one-process group
@pytest.fixture
def group(tmp_path):
    """A one-process gloo group: FSDP2 shards over one rank (whole shards) but runs every hook,
    DTensor and collective of the sharded path."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _shard(model):
    return sharding.shard(model, ParallelSection(strategy="fsdp2"), torch.device("cpu"))


@pytest.mark.parametrize("tied", [False, True])
def test_gathered_weights_feed_vllm_and_generation_as_the_unsharded_model(group, tied):
    from grpo_plugins.rollout.weights import policy_weights

    tok = build_tokenizer()
    plain, model = build_model(tok, tied=tied), build_model(tok, tied=tied)
    root = _shard(model)
    assert any(hasattr(p, "full_tensor") for p in model.parameters())  # DTensor shards
    pushed = dict(policy_weights(model))  # what the vllm backend's sync_weights loads
    expected = dict(policy_weights(plain))
    assert pushed.keys() == expected.keys()
    assert all(torch.equal(pushed[k], expected[k]) and not hasattr(pushed[k], "full_tensor") for k in pushed)
    full = sharding.full_state_dict(model)
    assert ("lm_head.weight" in full) is not tied and all(torch.equal(full[k], plain.state_dict()[k]) for k in full)

    ids = torch.tensor([[5, 6, 7, 8]])
    kwargs = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": tok.pad_token_id}
    with sharding.full_weights(root), torch.inference_mode():
        assert all(not hasattr(p, "full_tensor") for p in model.parameters())  # gathered
        out = model.generate(input_ids=ids, **kwargs)
    assert torch.equal(out, plain.generate(input_ids=ids, **kwargs))
    assert all(hasattr(p, "full_tensor") for p in model.parameters())  # sharded again


def test_a_batch_without_tokens_still_runs_the_model_and_adds_zero_gradient(group):
    tok = build_tokenizer()
    model = build_model(tok)
    root = _shard(model)
    prompt, comp = torch.tensor([[5, 6]]), torch.tensor([[7, 8], [9, 10]])
    logp, _ = root(prompt, torch.ones_like(prompt, dtype=torch.bool), comp, torch.zeros_like(comp, dtype=torch.bool))
    assert torch.equal(logp, torch.zeros_like(logp)) and logp.requires_grad
    (logp.sum() * 0.0).backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and float(g.full_tensor().abs().max()) == 0 for g in grads)


@pytest.mark.parametrize("empty", [False, True])
def test_the_sharded_root_packs_rows_as_the_padded_path_computes_them(group, empty):
    """LogprobModel under FSDP2, packed against padded on the same shards: per-token log-probs
    to 1e-6 (float32) and the reduce-scattered gradients to 1e-5 of their largest entry; a
    micro-batch without tokens (a zero-gradient pass) runs packed too."""
    tok = build_tokenizer()
    model = build_model(tok)
    root = _shard(model)
    gen = torch.Generator().manual_seed(4)
    prompt = torch.randint(2, model.config.vocab_size, (2, 5), generator=gen)
    p_mask = torch.ones_like(prompt, dtype=torch.bool)
    p_mask[0, :2] = False
    comp = torch.randint(2, model.config.vocab_size, (6, 7), generator=gen)
    lengths = torch.tensor([7, 2, 5, 1, 6, 3])
    mask = torch.arange(7)[None, :] < lengths[:, None]
    mask[0, 3] = False  # a hole: attended to, not predicted
    if empty:
        mask[:] = False
    out = {}
    for packed in (False, True):
        model.zero_grad(set_to_none=True)
        logp, _ = root(prompt, p_mask, comp, mask, packed=packed)
        (logp * torch.linspace(0.5, 1.5, logp.numel()).view_as(logp)).sum().backward()
        out[packed] = (logp.detach(), {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()})
    torch.testing.assert_close(out[True][0], out[False][0], atol=1e-6, rtol=0)
    for name, grad in out[False][1].items():
        atol = 1e-5 * float(grad.abs().max()) if not empty else 0.0
        torch.testing.assert_close(out[True][1][name], grad, atol=atol, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


def test_the_packed_forward_runs_under_fsdp2_bf16_parameters(group):
    """FSDP2's mixed precision hands every sharded layer a copy of its keyword arguments'
    dataclasses (the packed layout among them): the check that every layer ran the packed
    attention still counts them, and the values are the padded ones within bf16 rounding."""
    tok = build_tokenizer()
    model = build_model(tok)
    root = sharding.shard(model, ParallelSection(strategy="fsdp2", param_dtype="bfloat16"), torch.device("cpu"))
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(2, model.config.vocab_size, (2, 4), generator=gen)
    comp = torch.randint(2, model.config.vocab_size, (4, 6), generator=gen)
    mask = torch.arange(6)[None, :] < torch.tensor([6, 2, 4, 5])[:, None]
    with torch.no_grad():
        padded, packed = (root(prompt, torch.ones_like(prompt, dtype=torch.bool), comp, mask, packed=p)[0]
                          for p in (False, True))
    assert float((packed - padded).abs().max()) < 0.1 and bool((packed[mask] != 0).all())


@pytest.mark.slow
def test_fsdp2_on_two_processes_packed_takes_the_padded_step(tmp_path, write_spec):
    """Two sharded processes, the policy and its sharded KL reference, rows packed or padded:
    the same losses, KL and final weights."""
    spec = write_spec(tmp_path, **{**FSDP_SPEC, "checkpoint": {"every": 0}})
    for packing in ("false", "true"):
        _run([spec, "--nproc", "2", "--set", f"train.output_dir=packing-{packing}", "--set",
              f"train.packing={packing}"], tmp_path)
    padded, packed = (load_weights(tmp_path / f"packing-{p}" / "final") for p in ("false", "true"))
    assert _max_diff(padded, load_weights(Path(yaml.safe_load(spec.read_text())["model"]["path"]))) > 1e-3
    assert _max_diff(padded, packed) < 1e-5
    rows = {p: read_metrics(tmp_path / f"packing-{p}" / "metrics.jsonl") for p in ("false", "true")}
    assert len(rows["true"]) == len(rows["false"]) == 2
    for r1, r2 in zip(rows["false"], rows["true"]):
        for key in SAME:
            assert r2[key] == pytest.approx(r1[key], rel=1e-4, abs=1e-6), (r1["step"], key)


# The worker of the next test: one per process under torchrun. Every process builds the same
# policy and reference, shards both, and computes its own rows (other lengths, other holes, so
# a packed sequence of another length) packed and padded: the old and reference log-probs
# without gradients, then the trained log-probs and entropies with a backward whose
# reduce-scattered gradients sum both processes' losses. It writes the largest differences.
PACKING_WORKER = '''
import copy, json, sys
import torch
import torch.distributed as dist
from grpo_core.spec.parallel import ParallelSection
from grpo_core.testing import build_model, build_tokenizer
from grpo_core.train.learner import sharding
from grpo_core.train.learner.logprobs import completion_logprobs
from grpo_core.train.learner.packing import pack_rows

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
tok = build_tokenizer()
policy, reference = build_model(tok), build_model(tok, seed=1)
plain = copy.deepcopy(policy)
roots = [sharding.shard(m, ParallelSection(strategy="fsdp2"), torch.device("cpu")) for m in (policy, reference)]
gen = torch.Generator().manual_seed(20 + rank)
prompt = torch.randint(2, policy.config.vocab_size, (2, 6), generator=gen)
p_mask = torch.ones_like(prompt, dtype=torch.bool)
p_mask[rank, : 2 + rank] = False  # left padding
width = 9 + 4 * rank
comp = torch.randint(2, policy.config.vocab_size, (6, width), generator=gen)
lengths = torch.randint(1, width + 1, (6,), generator=gen)
lengths[rank] = width
mask = torch.arange(width)[None, :] < lengths[:, None]
mask[rank, 2:4] = False  # a hole: an environment's tokens, attended to, not predicted
mask[5 - rank, 1] = False
out = {"packed_tokens": pack_rows(prompt, p_mask, comp, mask, torch.arange(2).repeat_interleave(3)).tokens}
logp = {}
for packed in (False, True):
    with torch.no_grad():
        logp["old", packed] = roots[0](prompt, p_mask, comp, mask, packed=packed)[0]
        logp["reference", packed] = roots[1](prompt, p_mask, comp, mask, packed=packed)[0]
    policy.zero_grad(set_to_none=True)
    trained, entropy = roots[0](prompt, p_mask, comp, mask, with_entropy=True, packed=packed)
    ((trained * torch.linspace(0.5, 1.5, trained.numel()).view_as(trained)).sum() + 0.3 * entropy.sum()).backward()
    logp["trained", packed], logp["entropy", packed] = trained.detach(), entropy.detach()
    logp["grads", packed] = [p.grad.full_tensor() for p in policy.parameters()]
for what in ("old", "reference", "trained", "entropy"):
    out[what] = float((logp[what, True] - logp[what, False]).abs().max())
out["grads"] = max(float((a - b).abs().max()) / float(b.abs().max())
                   for a, b in zip(logp["grads", True], logp["grads", False]))
with torch.no_grad():
    unsharded = completion_logprobs(plain, prompt, p_mask, comp, mask)[0]
out["unsharded"] = float((unsharded - logp["old", True]).abs().max())
out["reference_is_another_model"] = float((logp["reference", False] - logp["old", False]).abs().max())
with open(sys.argv[1] + f"/rank{rank}.json", "w") as f:
    json.dump(out, f)
dist.destroy_process_group()
'''


@pytest.mark.slow
def test_two_sharded_processes_pack_per_token_log_probs_as_they_pad_them(tmp_path):
    """FSDP2 over two processes (torchrun, gloo), each packing rows of other lengths than the
    other's: the old, reference and trained log-probs (and entropies) to 1e-6 in float32, the
    summed sharded gradients to 1e-5 of their largest entry, the sharded packed log-probs equal
    to an unsharded padded forward's."""
    script = tmp_path / "worker.py"
    script.write_text(PACKING_WORKER)
    env = {**os.environ, **CHILD_ENV}
    env.pop("WORLD_SIZE", None)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    done = subprocess.run([*launcher, str(script), str(tmp_path)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [yaml.safe_load((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["packed_tokens"] != ranks[1]["packed_tokens"]  # packed sequences of other lengths
    for rank in ranks:
        for what in ("old", "reference", "trained", "entropy", "unsharded"):
            assert rank[what] < 1e-6, (what, rank)
        assert rank["grads"] < 1e-5, rank
        assert rank["reference_is_another_model"] > 1e-3


# The worker of the next test: each process computes the no-grad log-probs of its own rows in
# another number of micro-batches (one forward on rank 0, one per group on rank 1), as the
# token budget makes them when completion lengths differ; every call of the sharded model is a
# collective, so rank 0 must add unused forwards. It writes the largest difference from an
# unsharded computation of the same rows (or the error, if the collectives did not match).
NO_GRAD_WORKER = '''
import copy, json, sys
from contextlib import nullcontext
import torch
from grpo_core.spec.parallel import ParallelSection
from grpo_core.testing import build_model, build_tokenizer
from grpo_core.train.distributed import Dist
from grpo_core.train.learner.parallel import FSDP2, forward_of
from grpo_core.train.learner.batch import TrainBatch, batch_logprobs

torch.set_num_threads(1)
dist = Dist.from_env("cpu", timeout_s=40)
aligned = sys.argv[2] == "aligned"
tok = build_tokenizer()
policy = build_model(tok)
plain = copy.deepcopy(policy)
strategy = FSDP2(dist, ParallelSection(strategy="fsdp2"))
strategy.setup(policy)
gen = torch.Generator().manual_seed(5 + dist.rank)
prompt = torch.randint(2, policy.config.vocab_size, (2, 5), generator=gen)
comp = torch.randint(2, policy.config.vocab_size, (6, 7 + 3 * dist.rank), generator=gen)
mask = torch.rand(comp.shape, generator=gen) < 0.8
batch = TrainBatch(prompt, torch.ones_like(prompt, dtype=torch.bool), comp, mask, torch.zeros(comp.shape))
rows = torch.arange(6)
micro = [rows] if dist.rank == 0 else [rows[:3], rows[3:]]
out = {}
for packed in (False, True):
    try:
        got = batch_logprobs(strategy.forward(policy), batch, micro, 1.0, nullcontext, packed=packed,
                             strategy=strategy if aligned else None)
        want = batch_logprobs(forward_of(plain), batch, 6, 1.0, nullcontext)
        out[str(packed)] = float((got - want)[mask].abs().max())
    except Exception as exc:
        out[str(packed)] = f"{type(exc).__name__}: {str(exc)[:200]}"
        break
with open(sys.argv[1] + f"/rank{dist.rank}.json", "w") as f:
    json.dump(out, f)
'''


@pytest.mark.slow
@pytest.mark.parametrize("aligned", [True, False])
def test_sharded_no_grad_forwards_match_across_processes_with_other_micro_batch_counts(tmp_path, aligned):
    """Old and reference log-probs under FSDP2 when the processes' micro-batch counts differ
    (packed, or padded to other widths): the process with fewer forwards adds unused ones, and
    the log-probs equal an unsharded model's. Without the added forwards (the negative
    control) the collectives do not pair up: an error, a hang cut by the timeout, or log-probs
    of mixed weights."""
    script = tmp_path / "worker.py"
    script.write_text(NO_GRAD_WORKER)
    env = {**os.environ, **CHILD_ENV}
    env.pop("WORLD_SIZE", None)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    try:
        done = subprocess.run([*launcher, str(script), str(tmp_path), "aligned" if aligned else "plain"],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=150)
    except subprocess.TimeoutExpired:
        assert not aligned, "the aligned forwards hung"
        return
    ranks = [yaml.safe_load(p.read_text()) for p in sorted(tmp_path.glob("rank*.json"))]
    if aligned:
        assert done.returncode == 0, done.stderr[-3000:]
        assert len(ranks) == 2
        for rank in ranks:
            assert rank["False"] < 1e-5 and rank["True"] < 1e-5, rank
    else:
        good = done.returncode == 0 and len(ranks) == 2 and all(
            isinstance(v, float) and v < 1e-5 for rank in ranks for v in rank.values())
        assert not good, ranks
