"""The SFT stage (spec section ``sft``): its loss is the textbook cross-entropy on the completion
tokens only (padded and packed, whatever the micro-batching), demonstrations are encoded with
the prompt and non-assistant turns masked, and a spec with an ``sft`` section trains it before
GRPO, which then starts from its weights."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
import yaml

from grpo_core.cli import main
from grpo_core.errors import SpecError
from grpo_core.spec import load_spec
from grpo_core.spec.sft import SftSection
from grpo_core.testing import build_model, build_tokenizer
from grpo_core.train.learner.parallel import forward_of
from grpo_core.train.learner.sft import SftSettings, demo_batch, heldout_loss, sft_micro_loss, sft_update
from grpo_core.train.loop.demonstrations import Demonstrations

# --------------------------------------------------------------------------- the loss


def _demos():
    """Rows of different prompt and completion lengths; the last has a hole in its mask (a
    user turn between two assistant turns) and one row trains nothing."""
    g = torch.Generator().manual_seed(0)

    def ids(n):
        return torch.randint(7, 300, (n,), generator=g).tolist()

    prompts = [ids(3), ids(7), ids(1), ids(5), ids(4)]
    completions = [ids(4), ids(2), ids(6), ids(5), ids(3)]
    masks = [[True] * 4, [True] * 2, [True] * 6, [True, True, False, False, True], [False] * 3]
    return prompts, completions, masks


def _textbook(model, prompts, completions, masks) -> torch.Tensor:
    """Cross-entropy of each masked completion token given everything before it, one row at a
    time through the full model (no padding, no packing), token-mean over all rows."""
    total, count = torch.zeros(()), 0
    for p, c, m in zip(prompts, completions, masks):
        ids = torch.tensor([p + c])
        logits = model(input_ids=ids).logits[0].float()
        targets = torch.tensor(c)
        predicted = logits[len(p) - 1: len(p) - 1 + len(c)]
        nll = F.cross_entropy(predicted, targets, reduction="none")
        total = total + nll[torch.tensor(m, dtype=torch.bool)].sum()
        count += sum(m)
    return total / count


def _grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("micro", [None, 1, 2])
def test_the_sft_loss_and_gradient_are_the_textbook_cross_entropy(packed, micro):
    torch.manual_seed(0)
    model = build_model(build_tokenizer()).double()
    prompts, completions, masks = _demos()
    want = _textbook(model, prompts, completions, masks)
    want.backward()
    want_grads = _grads(model)

    batch = demo_batch(prompts, completions, masks, pad_id=0)
    assert batch.mask.sum() == sum(map(sum, masks))
    settings = SftSettings(micro_batch_size=micro, micro_batch_tokens=10, packed=packed)
    from grpo_core.train.learner.batch import micro_batches

    rows = torch.arange(len(prompts))
    micros = micro_batches(batch, rows, micro, settings.micro_batch_tokens, packed)
    assert len(micros) > 1  # the normalizer must be the step's, not each micro-batch's
    n = float(batch.mask.sum())
    got = sum(sft_micro_loss(forward_of(model), batch, mb, n, packed=packed) for mb in micros)
    got.backward()
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=0)  # the engine's losses are float32
    got_grads = _grads(model)
    assert got_grads.keys() == want_grads.keys()
    for name in want_grads:
        # the engine's tolerance for its textbook checks (test_episodes): the output layer's
        # backward is chunked, its softmax rounding differs from the full-vocabulary one
        torch.testing.assert_close(got_grads[name], want_grads[name], rtol=1e-5, atol=1e-8)

    nll, tokens = heldout_loss(model, batch, settings)
    assert tokens == n and nll / tokens == pytest.approx(float(want), rel=1e-6)


def test_one_sft_update_is_the_same_whatever_the_micro_batching():
    prompts, completions, masks = _demos()
    batch = demo_batch(prompts, completions, masks, pad_id=0)
    after = []
    for settings in (SftSettings(), SftSettings(micro_batch_size=1), SftSettings(micro_batch_tokens=9, packed=True)):
        torch.manual_seed(0)
        model = build_model(build_tokenizer()).double()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        metrics = sft_update(model, optimizer, scheduler, batch, settings)
        assert metrics["sft/tokens"] == batch.mask.sum() and metrics["sft/nonfinite_updates"] == 0
        after.append((metrics["sft/loss"], [p.detach().clone() for p in model.parameters()]))
    for loss, params in after[1:]:
        assert loss == pytest.approx(after[0][0], rel=1e-6)
        for a, b in zip(params, after[0][1]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8)


# --------------------------------------------------------------------------- demonstrations
def _section(**changes) -> SftSection:
    return SftSection.model_validate({"data": {"name": "arithmetic"}, **changes})


def test_a_chat_prompt_and_completion_train_only_the_assistant_turn():
    tok = build_tokenizer()
    rows = [{"prompt": [{"role": "user", "content": "What is 2 + 3?"}], "completion": "2 + 3 = 5\n5"}]
    demos = Demonstrations(rows, tok, _section(), seed=0, eos_id=tok.eos_token_id, shuffle=False)
    (demo,) = demos.all()
    prompt_text = tok.apply_chat_template(rows[0]["prompt"], tokenize=False, add_generation_prompt=True)
    assert demo.prompt == tok(prompt_text, add_special_tokens=False)["input_ids"]
    assert all(demo.mask)
    assert tok.decode(demo.completion) == "2 + 3 = 5\n5<|end|>\n"  # the turn and its end: what generation must stop on


def test_a_string_prompt_ends_its_completion_with_eos():
    tok = build_tokenizer()
    rows = [{"prompt": "What is 2 + 3?", "completion": " 5"}]
    (demo,) = Demonstrations(rows, tok, _section(), seed=0, eos_id=tok.eos_token_id, shuffle=False).all()
    assert demo.completion[-1] == tok.eos_token_id and tok.decode(demo.completion[:-1]) == " 5"


def test_a_conversation_trains_every_assistant_turn_and_nothing_else():
    tok = build_tokenizer()
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "And times 4?"},
        {"role": "assistant", "content": "20"},
    ]
    section = _section(completion_column=None, messages_column="messages")
    (demo,) = Demonstrations([{"messages": messages}], tok, section, seed=0, eos_id=tok.eos_token_id).all()
    full = tok.apply_chat_template(messages, tokenize=False)
    assert tok.decode(demo.prompt + demo.completion) == full
    trained = [t for t, m in zip(demo.completion, demo.mask) if m]
    assert tok.decode(trained) == "5<|end|>\n20<|end|>\n"
    context = [t for t, m in zip(demo.completion, demo.mask) if not m]
    assert tok.decode(context) == "<|user|>And times 4?<|end|>\n<|assistant|>"


def test_demonstrations_longer_than_max_length_are_cut_and_counted():
    tok = build_tokenizer()
    rows = [{"prompt": "What is 2 + 3?", "completion": " 5 " * 40}]
    demos = Demonstrations(rows, tok, _section(max_length=20), seed=0, eos_id=tok.eos_token_id, shuffle=False)
    (demo,) = demos.all()
    assert len(demo.prompt) + len(demo.completion) == 20 and demo.truncated and demos.truncated == 1


@pytest.mark.parametrize("row, message", [
    ({"messages": [{"role": "user", "content": "hi"}]}, "has no assistant turn"),
    ({"messages": "hi"}, "must hold lists of chat messages"),
])
def test_a_bad_conversation_names_the_column(row, message):
    from grpo_core.errors import RunError

    section = _section(completion_column=None, messages_column="messages")
    with pytest.raises(RunError, match=message):
        Demonstrations([row], build_tokenizer(), section, seed=0, eos_id=1)


# --------------------------------------------------------------------------- the spec
def _spec_dict(tmp_path, **sft):
    return {"model": {"path": str(tmp_path)}, "rewards": [{"name": "accuracy"}],
            "sft": {"data": {"name": "arithmetic"}, **sft}}


@pytest.mark.parametrize("sft, extra, message", [
    ({"messages_column": "messages"}, {}, "set one of sft.completion_column"),
    ({"completion_column": None}, {}, "set one of sft.completion_column"),
    ({"data": {"name": "arithmetic", "sampler": {"name": "curriculum"}}}, {}, "sft.data.sampler is not supported"),
    ({}, {"model": {"lora": {"r": 4}}, "algorithm": {"kl": {"beta": 0.04}}}, "sft with model.lora"),
    ({"steps": 0}, {}, "sft.steps"),
])
def test_spec_errors_of_the_sft_section(tmp_path, sft, extra, message):
    raw = _spec_dict(tmp_path, **sft)
    for key, value in extra.items():
        raw[key] = {**raw.get(key, {}), **value}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(SpecError, match=message):
        load_spec(path)


# --------------------------------------------------------------------------- a run
def _metrics(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_run_trains_the_sft_stage_then_grpo_from_its_weights(tmp_path, write_spec, kit):
    spec = write_spec(
        tmp_path, data={"eval_size": 4},
        sft={"data": {"name": "arithmetic", "train_size": 32, "eval_size": 4, "solutions": True},
             "completion_column": "solution", "steps": 4, "batch_size": 4, "lr": 1.0e-2, "eval_every": 2,
             "eval_rewards": True},
        eval={"at_start": True, "at_end": False, "max_prompts": 4},
        train={"steps": 2}, algorithm={"kl": {"beta": 0.04}},
    )
    assert main([str(spec)]) == 0
    out = tmp_path / "out"
    sft_rows = _metrics(out / "sft" / "metrics.jsonl")
    assert [r["step"] for r in sft_rows] == [0, 1, 2, 3, 4]
    assert set(sft_rows[0]) >= {"sft/eval_loss", "sft/eval/reward"}  # the starting point, before any SFT step
    assert sft_rows[-1]["sft/eval_loss"] < sft_rows[0]["sft/eval_loss"]  # it learns
    assert sft_rows[-1]["sft/loss"] < sft_rows[1]["sft/loss"]
    grpo_rows = _metrics(out / "metrics.jsonl")
    assert [r["step"] for r in grpo_rows] == [0, 1, 2]
    # GRPO's evaluation before its first step is the SFT result's: the same weights, greedy.
    start = grpo_rows[0]
    assert start["eval/completions/mean_length"] == sft_rows[-1]["sft/eval/completions/mean_length"]
    assert start["eval/reward"] == sft_rows[-1]["sft/eval/reward"]
    # The SFT result is saved, and GRPO changed the weights from it.
    sft_final, final = kit.load_weights(out / "sft" / "final"), kit.load_weights(out / "final")
    sft_ckpt = kit.load_weights(out / "sft" / "checkpoints" / "step-000004" / "model")
    assert all(torch.equal(sft_final[k], sft_ckpt[k]) for k in sft_final)
    assert any(not torch.equal(sft_final[k], final[k]) for k in final)


def test_grpo_starts_from_the_best_sft_step_when_asked(tmp_path, write_spec, kit):
    # A learning rate that overshoots: the held-out loss is lowest early, and GRPO starts there.
    spec = write_spec(
        tmp_path,
        sft={"data": {"name": "arithmetic", "train_size": 16, "eval_size": 4, "solutions": True},
             "completion_column": "solution", "steps": 4, "batch_size": 4, "lr": 3.0, "eval_every": 1,
             "start_from": "best"},
        train={"steps": 1}, checkpoint={"keep": 1},
    )
    assert main([str(spec)]) == 0
    out = tmp_path / "out"
    rows = _metrics(out / "sft" / "metrics.jsonl")
    losses = {r["step"]: r["sft/eval_loss"] for r in rows}
    best = min(losses, key=losses.get)
    assert best < 4, f"the test needs a best step before the last one: {losses}"
    assert ("sft/loss" in rows[best]) == (best > 0)
    kept = kit.load_weights(out / "sft" / "checkpoints" / f"step-{best:06d}" / "model")  # protected from pruning
    final = kit.load_weights(out / "sft" / "final")
    assert all(torch.equal(kept[k], final[k]) for k in final)


def test_the_python_trainer_takes_demonstrations_in_memory(tmp_path, write_spec):
    from grpo_core import Trainer

    spec = write_spec(tmp_path, train={"steps": 1})
    demos = [{"prompt": [{"role": "user", "content": f"What is {a} + 1?"}], "completion": str(a + 1)}
             for a in range(8)]
    trainer = Trainer(spec, sft_dataset=demos, sft_eval_dataset=demos[:2],
                      overrides={"sft.steps": 2, "sft.batch_size": 2})
    assert trainer.spec.sft.data.name == "python.sft" and trainer.spec.sft.steps == 2
    result = trainer.train()
    assert result.status == "finished"
    rows = _metrics(trainer.run_dir / "sft" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and "sft/eval_loss" in rows[-1]
    record = json.loads((trainer.run_dir / "python_objects.json").read_text())
    assert record["dataset"]["python.sft"] == {"rows": 8, "eval_rows": 2}


def test_the_recipe_spec_runs_with_a_tiny_model(tmp_path, tiny_model_dir):
    """specs/sft-grpo.yaml (SmolLM2 swapped for the tiny model, fewer steps) runs both stages."""
    from pathlib import Path

    spec = Path(__file__).resolve().parents[2] / "specs" / "sft-grpo.yaml"
    code = main([str(spec), "--set", "model.package=null", "--set", "model.gguf_file=null",
                 "--set", f"model.path={tiny_model_dir}", "--set", "sft.steps=2", "--set", "sft.eval_every=1",
                 "--set", "sft.data.eval_size=2", "--set", "sft.batch_size=2", "--set", "train.steps=1",
                 "--set", "eval.max_prompts=2", "--set", "rollout.max_new_tokens=4", "--set", "tracking=[]",
                 "--set", "train.progress=false", "--set", f"train.output_dir={tmp_path / 'recipe'}"])
    assert code == 0
    rows = _metrics(tmp_path / "recipe" / "sft" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2] and all("sft/eval/rewards/accuracy" in r for r in rows)
    assert (tmp_path / "recipe" / "final" / "config.json").exists()


# --------------------------------------------------------------------------- the TRL door
def test_the_trl_door_maps_sftconfig_onto_the_sft_section(tmp_path, tiny_model_dir):
    from datasets import Dataset

    from grpo_core.trl import GRPOConfig, GRPOTrainer, SFTConfig

    demos = [{"prompt": f"{a} + {a} =", "completion": f" {2 * a}"} for a in range(8)]
    sft = SFTConfig(output_dir="ignored", learning_rate=1e-3, max_steps=2, per_device_train_batch_size=2,
                    gradient_accumulation_steps=2, lr_scheduler_type="cosine", warmup_steps=1, max_length=64,
                    logging_steps=5)
    args = GRPOConfig(output_dir=str(tmp_path / "out"), max_steps=1, num_generations=4,
                      per_device_train_batch_size=8, max_completion_length=6)
    def zero(completions, **kwargs):
        return [0.0] * len(completions)

    trainer = GRPOTrainer(model=str(tiny_model_dir), reward_funcs=zero,
                          args=args, train_dataset=Dataset.from_list(demos), sft_args=sft,
                          sft_dataset=Dataset.from_list(demos))
    s = trainer.spec.sft
    assert (s.lr, s.steps, s.batch_size, s.micro_batch_size, s.schedule, s.warmup_steps, s.max_length) == (
        1e-3, 2, 4, 2, "cosine", 1, 64)
    assert s.data.name == "python.sft"
    trainer.train()
    rows = _metrics(tmp_path / "out" / "sft" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]


@pytest.mark.parametrize("fields, message", [
    ({"max_steps": 2, "num_train_epochs": 3}, "num_train_epochs=3: not read by the SFT stage; instead: max_steps"),
    ({"max_steps": 2, "packing": True}, "packing=True: .*instead: train.packing"),
    ({"max_steps": 2, "completion_only_loss": False}, "completion_only_loss=False"),
    ({"max_steps": 2, "dataset_txt_field": "text"}, "dataset_txt_field: not an SFTConfig argument"),
    ({}, "max_steps: required"),
])
def test_sftconfig_refuses_what_it_does_not_map_by_name(fields, message):
    from grpo_core.trl import SFTConfig, TRLConfigError

    with pytest.raises(TRLConfigError, match=message):
        SFTConfig(**fields)
