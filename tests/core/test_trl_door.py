"""The TRL door (``grpo_core.trl``): a TRL script runs with its import changed; every mapped
field lands on the spec key its table entry names; every value grpo-core cannot honour is
refused naming what to use; a door run is the grpo_core.Trainer run of the table's spec."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from grpo_core import Trainer
from grpo_core.errors import SpecError
from grpo_core.trl import FIELDS, GRPOConfig, GRPOTrainer, TRLConfigError
from grpo_core.trl.table import IGNORED, MAPPED, REFUSED, read

from .test_agents import CALL

pytestmark = pytest.mark.usefixtures("one_thread")

#: The training rows the table's examples are written for (8 rows; see TRLField.examples).
ROWS = [{"prompt": f"{a} + {a} =", "answer": str(2 * a)} for a in range(8)]
#: What keeps a run a few seconds long on the tiny model.
SMALL = {"max_steps": 2, "num_generations": 4, "per_device_train_batch_size": 8, "max_completion_length": 6}


def reward_len(completions, **kwargs):
    """TRL's quickstart reward: completions close to 20 characters score best."""
    return [-abs(20 - len(completion)) for completion in completions]


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def _door(tmp_path: Path, model: Path, **fields) -> GRPOTrainer:
    from datasets import Dataset

    args = GRPOConfig(**{"output_dir": str(tmp_path / "out"), **fields})
    held_out = Dataset.from_list(ROWS[:2]) if fields.get("eval_strategy", "no") != "no" else None
    return GRPOTrainer(model=str(model), reward_funcs=reward_len, args=args, train_dataset=Dataset.from_list(ROWS),
                       eval_dataset=held_out)


def _spec(trainer: GRPOTrainer) -> dict:
    return trainer.spec.model_dump(mode="json")


# --------------------------------------------------------------------------- 1. TRL's quickstart
def test_trls_quickstart_runs_with_only_the_import_changed(tmp_path, tiny_model_dir, monkeypatch):
    """TRL's documented GRPO quickstart (a dataset with a prompt column, ``reward_len``,
    ``GRPOConfig``, ``GRPOTrainer(...)``, ``.train()``), on a tiny model and rows in memory."""
    monkeypatch.chdir(tmp_path)
    from datasets import Dataset

    from grpo_core.trl import GRPOConfig, GRPOTrainer  # the one line that changed

    dataset = Dataset.from_dict({"prompt": [f"Write about {w}:" for w in ("cats", "rain", "maps", "tea")]})

    # Define the reward function, which rewards completions that are close to 20 characters
    def reward_len(completions, **kwargs):
        return [-abs(20 - len(completion)) for completion in completions]

    training_args = GRPOConfig(output_dir="tiny-GRPO", logging_steps=1, max_steps=2, max_completion_length=8)
    trainer = GRPOTrainer(
        model=str(tiny_model_dir),
        reward_funcs=reward_len,
        args=training_args,
        train_dataset=dataset,
    )
    result = trainer.train()

    assert result.status == "finished" and result.global_step == 2
    assert (tmp_path / "tiny-GRPO" / "final" / "config.json").is_file()
    rows = [json.loads(line) for line in (tmp_path / "tiny-GRPO" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["reward"] <= 0 for r in rows)
    # TRL's defaults, not grpo-core's: G=8 from one prompt (per_device_train_batch_size=8 completions),
    # the dapo loss (token-mean), bf16 autocast, seed 42, no KL
    spec = trainer.spec
    assert (spec.rollout.group_size, spec.train.prompts_per_step) == (8, 1)
    assert spec.algorithm.aggregation.name == "token-mean" and spec.algorithm.kl.beta == 0.0
    assert spec.train.mixed_precision == "bf16" and spec.train.seed == 42 and spec.train.lr == 1e-6


# --------------------------------------------------------------------------- 2. where each field lands
EXAMPLES = [(f.name, ex) for f in FIELDS for ex in f.examples]


def test_every_mapped_field_has_an_example_and_keys():
    for entry in FIELDS:
        if entry.kind == MAPPED:
            assert entry.examples and entry.keys and entry.how, entry.name
        else:
            assert not entry.keys and entry.note, entry.name
    assert len({f.name for f in FIELDS}) == len(FIELDS)


@pytest.mark.parametrize(("name", "example"), EXAMPLES, ids=[f"{n}={e[0]!r}"[:60] for n, e in EXAMPLES])
def test_a_mapped_field_lands_on_the_key_its_entry_names(name, example, tmp_path, tiny_model_dir):
    value, expected, *others = example
    fields = {**(others[0] if others else {}), name: value}
    default = next(f.default for f in FIELDS if f.name == name)
    assert value != default or others, "an example sets a value other than TRL's default"
    if fields.get("use_vllm") and fields.get("vllm_mode", "colocate") == "colocate" and not _has_vllm():
        spec = _unvalidated_vllm_spec(fields)
    else:
        spec = _spec(_door(tmp_path, tiny_model_dir, **fields))
    for key, want in expected.items():
        got = read(spec, key)
        if isinstance(want, str) and isinstance(got, str) and Path(got).is_absolute() and not Path(want).is_absolute():
            got = str(Path(got).relative_to(Path.cwd()))  # a relative path, resolved from the working directory
        assert got == want, (key, got, want)


def _has_vllm() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def _unvalidated_vllm_spec(fields: dict) -> dict:
    """Without vllm installed, a vllm rollout slot does not validate (its options model wants
    the package): the table's spec data, each option checked to be one of the backend's."""
    from grpo_core.plugin_manager import load_plugins
    from grpo_core.spec.models import RolloutSlot

    data = GRPOConfig(**fields).spec_data(rows=len(ROWS))
    component = load_plugins(external=False).registry.get("rollout_backend", data["rollout"]["name"])
    options = {k for k in data["rollout"] if k not in RolloutSlot.model_fields}
    assert options <= set(component.options.model_fields), options - set(component.options.model_fields)
    return data


def test_trls_defaults_become_the_spec(tmp_path, tiny_model_dir):
    """Nothing set: the spec computes TRL 1.16's default algorithm."""
    spec = _spec(_door(tmp_path, tiny_model_dir))
    algo = spec["algorithm"]
    assert algo["advantage"] == {"name": "grpo", "scale_by_std": True, "std": "unbiased", "std_scope": "group",
                                 "eps": 1e-4}
    assert algo["policy_loss"] == {"name": "clip", "eps_low": 0.2, "eps_high": None, "log_ratio_clamp": None,
                                   "dual_clip": None}
    assert algo["aggregation"]["name"] == "token-mean" and algo["mu"] == 1 and algo["kl"]["beta"] == 0.0
    assert algo["rollout_correction"]["level"] == "sequence" and algo["rollout_correction"]["cap"] == 3.0
    assert spec["rollout"]["name"] == "hf" and spec["rollout"]["dtype"] is None
    assert (spec["rollout"]["group_size"], spec["rollout"]["max_new_tokens"]) == (8, 512)
    train = spec["train"]
    assert (train["lr"], train["schedule"], train["warmup_steps"], train["seed"]) == (1e-6, "linear", 0, 42)
    assert train["optimizer"]["state_dtype"] == "float32" and train["mixed_precision"] == "bf16"
    assert (train["prompts_per_step"], train["mini_batches"], train["micro_batch_size"]) == (1, 1, 8)
    assert train["steps"] == 3 * len(ROWS)  # 3 epochs of 8 one-prompt batches
    assert spec["model"]["gradient_checkpointing"] is True
    assert spec["tracking"] == [{"name": "console", "every": 10, "keys": None}]
    assert spec["eval"]["every"] == 0 and spec["checkpoint"]["every"] == 500


def test_ignored_fields_change_nothing(tmp_path, tiny_model_dir):
    flipped = {f.name: not f.default for f in FIELDS if f.kind == IGNORED and isinstance(f.default, bool)}
    flipped.update({"dataloader_num_workers": 4, "ddp_timeout": 60, "pad_to_multiple_of": 64, "torch_compile": True})
    assert len(flipped) > 20
    base = _spec(_door(tmp_path / "a", tiny_model_dir))
    changed = _spec(_door(tmp_path / "a", tiny_model_dir, **flipped))
    assert changed == base


# --------------------------------------------------------------------------- 3. what is refused
REFUSALS = [(f.name, r) for f in FIELDS for r in f.refusals]


def test_every_refused_field_has_a_refused_example():
    for entry in FIELDS:
        if entry.kind == REFUSED:
            assert entry.refusals, entry.name


@pytest.mark.parametrize(("name", "refusal"), REFUSALS, ids=[f"{n}={r[0]!r}"[:60] for n, r in REFUSALS])
def test_a_value_grpo_core_cannot_honour_is_refused_naming_the_alternative(name, refusal, tmp_path, tiny_model_dir):
    value, instead, *others = refusal
    fields = {**(others[0] if others else {}), name: value}
    with pytest.raises(TRLConfigError) as err:
        _door(tmp_path, tiny_model_dir, **fields)
    text = str(err.value)
    assert any(p.startswith(f"{name}=") or p.startswith(f"{name}:") for p in err.value.problems) or \
        f"{name}=" in text, text
    assert "instead" in text and instead in text, text


def test_every_refusal_is_reported_at_once():
    with pytest.raises(TRLConfigError) as err:
        GRPOConfig(min_p=0.1, loss_type="vespo", use_vllm=True, top_entropy_quantile=0.2)
    assert len(err.value.problems) == 3
    assert "rollout.top_p" in str(err.value) and "algorithm.policy_loss.name" in str(err.value)


def test_a_misspelt_field_is_refused_with_a_did_you_mean():
    with pytest.raises(TRLConfigError, match="learning_rte: not a field of TRL's GRPOConfig; did you mean "
                                             "'learning_rate'"):
        GRPOConfig(learning_rte=1e-5)
    args = GRPOConfig()
    with pytest.raises(TRLConfigError, match="did you mean 'num_generations'"):
        args.num_generation = 4
    with pytest.raises(AttributeError, match="did you mean 'beta'"):
        _ = args.betta
    args.num_generations = 4  # a known field reads and writes like TRL's
    assert args.num_generations == 4 and args.learning_rate == 1e-6


def test_luspo_at_token_level_is_taken_with_trls_warning(tmp_path, tiny_model_dir, caplog):
    """TRL 1.16 takes loss_type='luspo' at its default importance_sampling_level='token': its
    GRPOTrainer logs a warning and trains PPO's token-level clip, each sequence's token sum averaged
    (tests/plugins/peers/test_trl.py checks the loss against TRL's). The door does the same; at
    'sequence' (the paper's setup) it trains gspo and says nothing."""
    with caplog.at_level("WARNING", logger="grpo.trl"):
        trainer = _door(tmp_path, tiny_model_dir, loss_type="luspo", **SMALL)
    algorithm = _spec(trainer)["algorithm"]
    assert (algorithm["policy_loss"]["name"], algorithm["aggregation"]["name"]) == ("clip", "seq-mean-token-sum")
    assert [r.getMessage() for r in caplog.records] == [
        "When using `'luspo'` loss, `importance_sampling_level` should be set to `'sequence'` to mirror the "
        "paper's setup."]
    assert trainer.train().status == "finished"
    caplog.clear()
    with caplog.at_level("WARNING", logger="grpo.trl"):
        trainer = _door(tmp_path, tiny_model_dir, loss_type="luspo", importance_sampling_level="sequence",
                        use_bias_correction_kl=False, **SMALL)
    assert _spec(trainer)["algorithm"]["policy_loss"]["name"] == "gspo" and not caplog.records


def test_trainer_arguments_grpo_core_cannot_take_are_refused(tmp_path, tiny_model_dir):
    from datasets import Dataset
    from transformers import TrainerCallback

    def needs_state(completions, trainer_state, **kwargs):
        return [0.0] * len(completions)

    with pytest.raises(TRLConfigError) as err:
        GRPOTrainer(model=str(tiny_model_dir), reward_funcs=[reward_len, needs_state],
                    args=GRPOConfig(output_dir=str(tmp_path)), train_dataset=Dataset.from_list(ROWS),
                    callbacks=[TrainerCallback()], tools=[len], optimizers=(object(), None),
                    reward_processing_classes=object())
    text = str(err.value)
    for culprit in ("TrainerCallback", "trainer_state", "tools", "optimizers", "reward_processing_classes"):
        assert culprit in text, culprit
    assert "grpo_core.Callback" in text and "tools: len:" in text  # a tool without a schema TRL could read


def test_rollout_func_is_refused_and_a_bad_environment_factory_is_named(tmp_path, tiny_model_dir):
    """rollout_func stays refused, saying why (TRL hands it its own trainer) and what to use; an
    environment_factory whose environment has no reset, a tools entry TRL could not describe,
    and rows naming no environment of a dict factory are each named."""
    from datasets import Dataset

    def rollout(prompts, trainer):
        return {}

    class Env:
        def reset(self, **row):
            return None

    with pytest.raises(TRLConfigError) as err:
        GRPOTrainer(model=str(tiny_model_dir), reward_funcs=reward_len, args=GRPOConfig(output_dir=str(tmp_path)),
                    train_dataset=Dataset.from_list([{**r, "environment": "chess"} for r in ROWS]), tools=[len],
                    rollout_func=rollout, environment_factory={"broken": object, "fine": Env})
    problems = err.value.problems
    rollout_func = next(p for p in problems if p.startswith("rollout_func:"))
    assert "rollout_func(prompts, trainer)" in rollout_func and "grpo_core.Trainer(agent=...)" in rollout_func
    assert any(p.startswith("environment_factory['broken']: its environment (object) has no reset") for p in problems)
    assert any(p.startswith("tools: len:") for p in problems)
    assert "train_dataset: rows whose 'environment' names no environment_factory entry: chess; entries: broken, " \
        "fine" in problems


class CountdownEnv:
    """A TRL environment (environment_factory): reset(**row) adds to the prompt, public
    methods are tools, get_reward scores the episode from the environment's state."""

    def reset(self, answer, **row):
        self.answer, self.used = answer, 0
        return " Use the calculator."

    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: The arithmetic expression.
        """
        self.used += 1
        return str(eval(expression, {"__builtins__": {}}))  # noqa: S307 - the test's own expressions

    def get_reward(self) -> float:
        return float(self.used)


def test_trls_tool_loop_runs_as_an_agent(tmp_path, tiny_model_dir):
    """tools= and environment_factory run TRL's loop against the endpoint: reset's text ends
    the prompt, the policy's call runs the environment's method (TRL's str(result)), a call
    to an unknown tool gets TRL's error text, and get_reward() is the episode's env_reward."""
    import shutil

    from grpo_core.trl.tool_loop import TRLToolLoop

    from .test_agents import ScriptedPlugin

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = 2048
    (model / "config.json").write_text(json.dumps(config))

    def square(x: int) -> int:
        """Square a number.

        Args:
            x: The number.
        """
        return x * x

    rows = [{"prompt": [{"role": "user", "content": "What is 2+3?"}], "answer": "5"}] * 4
    spec = {"model": {"path": str(model)}, "data": {"name": "arithmetic"},
            "rollout": {"name": "scripted", "group_size": 2, "max_new_tokens": 96, "agent": {"max_calls": 2}},
            "rewards": [{"name": "env_reward"}], "train": {"output_dir": str(tmp_path / "o"), "prompts_per_step": 2},
            "tracking": []}
    plugin = ScriptedPlugin()
    loop = TRLToolLoop([square], {None: CountdownEnv}, max_iterations=1)
    run = Trainer(spec, agent=loop, train_dataset=rows, plugins=[plugin])._build()
    rollout = run.actor.collect(0).scored.rollout
    assert not rollout.episodes.failed.any(), [m[-1] for m in rollout.episodes.messages]
    assert list(rollout.episodes.env_rewards) == [1.0] * 4, rollout.episodes.messages[0]
    prompt = run.tokenizer.decode(rollout.prompt_ids[0][rollout.prompt_mask[0]])
    assert "What is 2+3? Use the calculator." in prompt and '"name": "square"' in prompt
    tool = next(m for m in rollout.episodes.messages[0] if m["role"] == "tool")
    assert tool["content"] == "5"
    plugin.backend.call = CALL.replace("calculator", "missing")
    rollout = run.actor.collect(1).scored.rollout
    tool = next(m for m in rollout.episodes.messages[0] if m["role"] == "tool")
    assert tool["content"] == "{'error': 'Tool missing not found.'}"
    assert list(rollout.episodes.env_rewards) == [0.0] * 4


def test_the_door_trains_with_an_environment_factory(tmp_path, tiny_model_dir):
    """GRPOTrainer(environment_factory=..., tools=...) with no reward_funcs: the spec's agent
    is TRL's loop, its budget max_completion_length, its calls max_tool_calling_iterations + 1,
    env_reward the reward; two steps train with no failed episode."""
    from datasets import Dataset

    def square(x: int) -> int:
        """Square a number.

        Args:
            x: The number.
        """
        return x * x

    args = GRPOConfig(output_dir=str(tmp_path / "out"), max_tool_calling_iterations=2, report_to="none", **SMALL)
    door = GRPOTrainer(model=str(tiny_model_dir), args=args, train_dataset=Dataset.from_list(ROWS), tools=[square],
                       environment_factory=CountdownEnv)
    spec = _spec(door)
    assert spec["rollout"]["agent"]["name"] == "trl_tool_loop" and spec["rollout"]["agent"]["max_calls"] == 3
    assert spec["rollout"]["agent"]["max_total_tokens"] == 6 and [r["name"] for r in spec["rewards"]] == ["env_reward"]
    result = door.train()
    assert result.global_step == 2
    assert all(row["env/failed_episodes"] == 0.0 for row in result.history)


def test_a_spec_problem_names_the_trl_field_behind_it(tmp_path, tiny_model_dir):
    with pytest.raises(SpecError, match=r"rollout.temperature.*\(GRPOConfig: temperature\)"):
        _door(tmp_path, tiny_model_dir, temperature=0.0)


# --------------------------------------------------------------------------- 4. the door adds nothing
CONFIGS = {
    "trl-defaults-kl": {**SMALL, "beta": 0.04},
    "grpo-loss-two-updates": {**SMALL, "loss_type": "grpo", "num_iterations": 2, "beta": 0.02,
                              "use_bias_correction_kl": False, "scale_rewards": "batch", "bf16": False,
                              "gradient_accumulation_steps": 2, "per_device_train_batch_size": 4,
                              "steps_per_generation": 4, "lr_scheduler_type": "cosine", "warmup_steps": 1,
                              "max_steps": 8, "epsilon_high": 0.28, "learning_rate": 1e-3},
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_door_run_is_the_trainer_run_of_the_tables_spec(name, tmp_path, tiny_model_dir):
    """Bit-identical final weights: the run the door starts is grpo_core.Trainer's on the spec
    the table makes of the fields (plus the model and the reward), nothing else."""
    fields = {**CONFIGS[name], "learning_rate": CONFIGS[name].get("learning_rate", 1e-2)}
    door = _door(tmp_path / "door", tiny_model_dir, **fields).train()
    assert door.status == "finished"

    args = GRPOConfig(output_dir=str(tmp_path / "plain" / "out"), **fields)
    spec = {**args.spec_data(rows=len(ROWS)), "rewards": [{"name": "reward_len"}]}
    spec["model"]["path"] = str(tiny_model_dir)
    plain = Trainer(spec, reward_funcs=[reward_len], train_dataset=ROWS).train()
    assert plain.step == door.step and door.global_step == fields["max_steps"]
    wa, wb = _weights(tmp_path / "door" / "out" / "final"), _weights(tmp_path / "plain" / "out" / "final")
    assert wa.keys() == wb.keys()
    for key in wa:
        assert torch.equal(wa[key], wb[key]), key
    assert door.history == plain.history or [
        {k: v for k, v in r.items() if not k.startswith(("time/", "perf/"))} for r in door.history] == [
        {k: v for k, v in r.items() if not k.startswith(("time/", "perf/"))} for r in plain.history]


# --------------------------------------------------------------------------- the rest of the surface
def test_peft_config_lands_on_model_lora(tmp_path, tiny_model_dir):
    from datasets import Dataset
    from peft import LoraConfig

    def build(config):
        return GRPOTrainer(model=str(tiny_model_dir), reward_funcs=reward_len,
                           args=GRPOConfig(output_dir=str(tmp_path)), train_dataset=Dataset.from_list(ROWS),
                           peft_config=config)

    lora = build(LoraConfig(r=4, lora_alpha=8, lora_dropout=0.05, task_type="CAUSAL_LM")).spec.model.lora
    # target_modules None: peft's default for the model type (llama: q_proj, v_proj), resolved here
    assert (lora.r, lora.alpha, lora.dropout, lora.target_modules) == (4, 8.0, 0.05, ["q_proj", "v_proj"])
    assert build(LoraConfig(target_modules="all-linear")).spec.model.lora.target_modules == "all-linear"
    with pytest.raises(TRLConfigError, match="use_dora.*model.lora carries r, lora_alpha"):
        build(LoraConfig(use_dora=True))


def test_quantization_config_lands_on_model_quantization(tmp_path, tiny_model_dir):
    """QLoRA through the door: a 4-bit BitsAndBytesConfig, as the trainer's argument or in
    model_init_kwargs, is model.quantization; 8 bits, other fields, or no adapter are refused."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import BitsAndBytesConfig

    def build(config=None, peft=True, **fields):
        return GRPOTrainer(model=str(tiny_model_dir), reward_funcs=reward_len,
                           args=GRPOConfig(output_dir=str(tmp_path), **fields), train_dataset=Dataset.from_list(ROWS),
                           peft_config=LoraConfig(r=4) if peft else None, quantization_config=config)

    nf4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                             bnb_4bit_compute_dtype=torch.bfloat16)
    q = build(nf4).spec.model.quantization
    assert (q.bits, q.quant_type, q.double_quant, q.compute_dtype) == (4, "nf4", True, "bfloat16")
    q = build(model_init_kwargs={"quantization_config": nf4.to_dict()}).spec.model.quantization
    assert (q.quant_type, q.double_quant, q.compute_dtype) == ("nf4", True, "bfloat16")
    with pytest.raises(TRLConfigError, match=r"quantization_config='load_in_8bit=True'.*load_in_4bit=True"):
        build(BitsAndBytesConfig(load_in_8bit=True))
    with pytest.raises(TRLConfigError, match="llm_int8_skip_modules.*leave the other BitsAndBytesConfig fields"):
        build(BitsAndBytesConfig(load_in_4bit=True, llm_int8_skip_modules=["lm_head"]))
    with pytest.raises(SpecError, match="a 4-bit base is frozen"):
        build(nf4, peft=False)


def test_reward_models_by_name_weights_and_order(tmp_path, tiny_model_dir):
    from datasets import Dataset

    trainer = GRPOTrainer(model=str(tiny_model_dir), reward_funcs=["some/reward-model", reward_len],
                          args=GRPOConfig(output_dir=str(tmp_path), reward_weights=[0.5, 2.0]),
                          train_dataset=Dataset.from_list(ROWS))
    first, second = trainer.spec.rewards
    assert (first.name, first.weight, second.name, second.weight) == ("reward_model", 0.5, "reward_len", 2.0)
    options = first.options.model_dump()
    assert options["path"] == "some/reward-model" and options["max_length"] is None
    assert options["add_special_tokens"] is False  # TRL tokenizes prompt + completion without them


def test_evaluate_save_model_and_resume(tmp_path, tiny_model_dir, monkeypatch):
    """eval_dataset with eval_strategy='steps' evaluates sampled completions (TRL's kind of
    evaluation); save_model writes to output_dir; resume_from_checkpoint=True continues."""
    monkeypatch.chdir(tmp_path)
    from datasets import Dataset

    args = GRPOConfig(output_dir="out", eval_strategy="steps", eval_steps=1, num_generations_eval=2,
                      save_steps=1, **SMALL)
    trainer = GRPOTrainer(model=str(tiny_model_dir), reward_funcs=reward_len, args=args,
                          train_dataset=Dataset.from_list(ROWS), eval_dataset=Dataset.from_list(ROWS[:2]))
    result = trainer.train()
    assert [e["step"] for e in result.evaluations] == [1, 2]
    assert any(k.startswith("eval/") for k in result.evaluations[-1])
    assert trainer.evaluate().keys() == {k for k in result.evaluations[-1] if k != "step"}
    assert trainer.save_model() == tmp_path / "out" and (tmp_path / "out" / "config.json").is_file()
    assert trainer.model is not None and trainer.processing_class is not None

    longer = GRPOConfig(output_dir="out", eval_strategy="steps", eval_steps=1, num_generations_eval=2,
                        save_steps=1, **{**SMALL, "max_steps": 3})
    again = GRPOTrainer(model=str(tiny_model_dir), reward_funcs=reward_len, args=longer,
                        train_dataset=Dataset.from_list(ROWS), eval_dataset=Dataset.from_list(ROWS[:2]))
    resumed = again.train(resume_from_checkpoint=True)
    assert resumed.step == 3 and [r["step"] for r in resumed.history] == [3]
    with pytest.raises(Exception, match="no eval_dataset"):
        _door(tmp_path / "x", tiny_model_dir, **SMALL).evaluate()
    with pytest.raises(TRLConfigError, match="eval_strategy='steps' without eval_dataset"):
        GRPOTrainer(model=str(tiny_model_dir), reward_funcs=reward_len, args=GRPOConfig(eval_strategy="steps"),
                    train_dataset=Dataset.from_list(ROWS))


def test_load_best_model_at_end_trains_to_the_best_evaluated_checkpoint(tmp_path, tiny_model_dir, monkeypatch):
    """load_best_model_at_end with metric_for_best_model='reward': the model after train() (and
    save_model's) is the checkpoint of the step whose eval_reward was the highest, the first on ties
    (transformers' strict comparison), among the evaluated steps only."""
    monkeypatch.chdir(tmp_path)
    from datasets import Dataset

    args = GRPOConfig(output_dir="out", eval_strategy="steps", eval_steps=1, save_steps=1, num_generations_eval=2,
                      metric_for_best_model="reward", load_best_model_at_end=True, learning_rate=0.05,
                      save_total_limit=1, **{**SMALL, "max_steps": 3})
    trainer = GRPOTrainer(model=str(tiny_model_dir), reward_funcs=reward_len, args=args,
                          train_dataset=Dataset.from_list(ROWS), eval_dataset=Dataset.from_list(ROWS[:2]))
    assert (trainer.spec.checkpoint.final, trainer.spec.checkpoint.best_metric) == ("best", "eval/mean@2")
    result = trainer.train()
    rewards = {e["step"]: e["eval/mean@2"] for e in result.evaluations}
    assert sorted(rewards) == [1, 2, 3]
    best = max(rewards, key=lambda step: (rewards[step], -step))
    listing = json.loads((tmp_path / "out" / "checkpoints" / "best.json").read_text())
    assert listing["best"][0]["step"] == best
    saved = _weights(Path(listing["best"][0]["folder"]) / "model")
    live = {k: v.detach() for k, v in trainer.model.state_dict().items()}
    assert all(torch.equal(live[k], v) for k, v in saved.items())
    if best != 3:  # the last step's weights, kept beside the best, are not the final model's
        from grpo_core.checkpoint import step_folder

        last = _weights(step_folder(tmp_path / "out" / "checkpoints", 3) / "model")
        assert any(not torch.equal(live[k], v) for k, v in last.items())
    final = _weights(trainer.save_model(tmp_path / "exported"))
    assert all(torch.equal(final[k], v) for k, v in saved.items())


# --------------------------------------------------------------------------- streamed rows
def test_an_iterable_dataset_streams_through_the_door(tmp_path, tiny_model_dir):
    """TRL takes an IterableDataset as train_dataset (with max_steps: it has no length); so does
    the door, through the streaming path: the rows are read through the shuffle buffer, not
    materialized, and the run takes max_steps steps."""
    from datasets import Dataset

    iterable = Dataset.from_list(ROWS).to_iterable_dataset()
    args = GRPOConfig(output_dir=str(tmp_path / "out"), **SMALL)
    trainer = GRPOTrainer(model=str(tiny_model_dir), reward_funcs=reward_len, args=args, train_dataset=iterable)
    assert trainer.spec.data.name == "python" and trainer.spec.train.steps == 2
    result = trainer.train()
    assert result.status == "finished" and result.global_step == 2
    record = json.loads((tmp_path / "out" / "python_objects.json").read_text())
    assert record["dataset"]["python"]["rows"] == "stream"
    state = torch.load(sorted((tmp_path / "out" / "checkpoints").glob("step-*"))[-1] / "state.pt",
                       weights_only=False)
    assert state["data"]["stream"] and state["data"]["read"] > 0  # the stream's position, for an exact resume


def test_an_iterable_dataset_needs_max_steps_as_in_trl(tmp_path, tiny_model_dir):
    from datasets import Dataset

    iterable = Dataset.from_list(ROWS).to_iterable_dataset()
    with pytest.raises(TRLConfigError, match="max_steps: required with an IterableDataset"):
        GRPOTrainer(model=str(tiny_model_dir), reward_funcs=reward_len, args=GRPOConfig(output_dir=str(tmp_path)),
                    train_dataset=iterable)
