"""Whole runs with prompts that have images, on a tiny random SmolVLM-shaped model saved to
disk (loaded by transformers' auto classes and AutoProcessor): specs/vision.yaml trains and
exports with its processor, a LoRA run resumes bit for bit, and the KL's reference sees the
images too."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from grpo_core.cli import main
from grpo_core.errors import RunError
from grpo_core.spec import load_spec
from grpo_core.testing import save_tiny_vision_model
from grpo_core.train.loop.assemble import build_run

SPECS = Path(__file__).resolve().parents[2] / "specs"
QUIET = ["tracking=[]", "train.threads=1", "data.train_size=16", "data.eval_size=4", "eval.max_prompts=2"]


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory) -> Path:
    return save_tiny_vision_model(tmp_path_factory.mktemp("vlm") / "model")


def _grpo(out: Path, model: Path, *sets: str, resume: bool = False) -> int:
    args = [str(SPECS / "vision.yaml"), "--set", f"model.path={model}", "--set", f"train.output_dir={out}"]
    args += [x for s in (*QUIET, *sets) for x in ("--set", s)]
    return main([*args, "--resume", "latest"] if resume else args)


def test_the_vision_spec_trains_and_exports_the_merged_model_with_its_processor(tiny_vlm, tmp_path, kit, capsys):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    assert _grpo(tmp_path / "out", tiny_vlm, "export.merged=true") == 0
    rows = [r for r in kit.read_metrics(tmp_path / "out" / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all("kl" in r for r in rows)  # the reference (the base without the adapter) saw the images
    final = tmp_path / "out" / "final"
    assert (final / "processor_config.json").exists() and (final / "adapter_model.safetensors").exists()
    merged = final / "merged"
    processor = AutoProcessor.from_pretrained(merged)
    model = AutoModelForImageTextToText.from_pretrained(merged)
    assert processor.image_processor is not None and type(model).__name__ == "Idefics3ForConditionalGeneration"
    base = AutoModelForImageTextToText.from_pretrained(tiny_vlm)
    vision = dict(base.model.vision_model.named_parameters())
    for name, p in model.model.vision_model.named_parameters():  # frozen: the merge left the tower as it was
        assert torch.equal(p, vision[name]), name
    assert any(not torch.equal(p, dict(base.model.text_model.named_parameters())[n])
               for n, p in model.model.text_model.named_parameters())
    # grpo-run eval renders the held-out images with the saved processor
    sets = [f"model.path={tiny_vlm}", *QUIET]
    capsys.readouterr()
    assert main(["eval", str(SPECS / "vision.yaml"), *[a for s in sets for a in ("--set", s)], "--model",
                 str(final)]) == 0
    out = capsys.readouterr()
    assert "grpo-run eval:" in out.err and "rewards/accuracy" in out.out + out.err


def test_a_lora_run_with_images_resumes_bit_for_bit(tiny_vlm, tmp_path, kit):
    # a reward whose value differs within groups, so that the resumed steps move the adapter
    sets = ("train.steps=4", "checkpoint.every=2", "checkpoint.keep=3", "eval.every=0",
            "rewards=[{name: format, pattern: '[aeiou]'}]")
    assert _grpo(tmp_path / "whole", tiny_vlm, *sets) == 0
    assert _grpo(tmp_path / "cut", tiny_vlm, *sets, "train.steps=2") == 0
    assert _grpo(tmp_path / "cut", tiny_vlm, *sets, resume=True) == 0
    whole, cut = kit.load_weights(tmp_path / "whole" / "final"), kit.load_weights(tmp_path / "cut" / "final")
    assert whole and set(whole) == set(cut)
    for name in whole:
        assert torch.equal(whole[name], cut[name]), name
    at_two = kit.load_weights(tmp_path / "cut" / "checkpoints" / "step-000002" / "model")
    assert any(not torch.equal(at_two[name], whole[name]) for name in whole)  # steps 3 and 4 trained
    want = {r["step"]: r for r in kit.read_metrics(tmp_path / "whole" / "metrics.jsonl") if "loss" in r}
    got = {r["step"]: r for r in kit.read_metrics(tmp_path / "cut" / "metrics.jsonl") if "loss" in r}
    for step in (3, 4):
        assert got[step]["loss"] == want[step]["loss"] and got[step]["reward"] == want[step]["reward"]
    assert any(want[step]["advantage/std"] > 0 for step in (3, 4))


def test_an_image_run_refuses_what_it_cannot_run(tiny_vlm, tmp_path):
    base = [f"model.path={tiny_vlm}", f"train.output_dir={tmp_path / 'out'}", *QUIET]
    with pytest.raises(RunError, match="train.packing: true cannot run this model exactly: the model takes images"):
        build_run(load_spec(SPECS / "vision.yaml", [*base, "train.packing=true"]))
    tools = "rollout.environment={name: tools, tools: [calculator]}"
    with pytest.raises(RunError, match="multi-turn episodes .* do not take images yet"):
        build_run(load_spec(SPECS / "vision.yaml", [*base, tools]))
    teacher = f"algorithm.advantage={{name: opd, teacher: {{path: {tiny_vlm}}}}}"
    with pytest.raises(RunError, match="estimator 'opd' scores with a teacher model, which does not see the images"):
        build_run(load_spec(SPECS / "vision.yaml", [*base, teacher]))


def test_a_qwen2_vl_policy_trains_from_python_with_its_reference_and_old_logprobs(tmp_path):
    """The Python trainer with a tiny Qwen2-VL (3-D positions) and its processor as the
    tokenizer: a full fine-tune with the KL's frozen reference and mu = 2 (old log-probs), the
    language model moved, the vision tower frozen (the default)."""
    from grpo_core import Trainer
    from grpo_core.testing import build_vision_model, build_vision_processor

    processor = build_vision_processor("qwen2-vl")
    model = build_vision_model(processor)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    spec = {
        "data": {"name": "shapes", "image_column": "image", "train_size": 8, "eval_size": 0},
        "rollout": {"group_size": 4, "max_new_tokens": 6},
        "rewards": [{"name": "format", "pattern": "[aeiou]"}],
        "algorithm": {"kl": {"name": "low_var_kl", "beta": 0.04}, "mu": 2},
        "train": {"steps": 2, "prompts_per_step": 2, "lr": 1.0e-2, "progress": False, "threads": 1,
                  "output_dir": str(tmp_path / "out")},
        "eval": {"at_start": False, "at_end": False}, "tracking": [],
    }
    result = Trainer(spec, model=model, tokenizer=processor).train()
    rows = [r for r in result.history if "loss" in r]
    assert len(rows) == 2 and all("kl" in r and "policy/ratio" in r for r in rows)
    assert (result.final_model / "processor_config.json").exists()  # saved with its processor
    after = model.state_dict()
    moved = [k for k in before if not torch.equal(before[k], after[k])]
    assert moved and all("visual" not in k for k in moved)
    assert any("language_model" in k for k in moved)


def test_an_asynchronous_image_run_trains(tiny_vlm, tmp_path, kit):
    """rollout.max_staleness: 1: the actor's thread samples image prompts from its own copy of
    the policy while the learner trains."""
    assert _grpo(tmp_path / "out", tiny_vlm, "rollout.max_staleness=1", "train.steps=3", "eval.every=0") == 0
    rows = [r for r in kit.read_metrics(tmp_path / "out" / "metrics.jsonl") if "loss" in r]
    assert [r["async/staleness"] for r in rows] == [0, 1, 1]


# --------------------------------------------------------------------------- TRL's door
def _shape_rows(n: int) -> list[dict]:
    from PIL import Image, ImageDraw

    rows = []
    for i in range(n):
        image = Image.new("RGB", (56, 56), "white")
        ImageDraw.Draw(image).rectangle([4 + i, 4, 20 + i, 20], fill="black")
        rows.append({"prompt": [{"role": "user", "content": "How many shapes?"}], "image": image, "answer": "1"})
    return rows


def test_trls_vlm_recipe_runs_through_the_door_with_the_image_column(tiny_vlm, tmp_path, monkeypatch):
    """TRL's vision-language usage (rows with an ``image`` column, the model's processor as
    ``processing_class`` or None): the column becomes data.image_column and the run trains."""
    from datasets import Dataset
    from transformers import AutoProcessor

    from grpo_core.trl import GRPOConfig, GRPOTrainer

    monkeypatch.chdir(tmp_path)
    rows = _shape_rows(4)

    def short(completions, **kwargs):
        assert "image" in kwargs  # the rewards see the row's columns, the images included
        return [-float(len(str(c))) for c in completions]

    args = GRPOConfig(output_dir="vlm", max_steps=1, max_completion_length=4, num_generations=2,
                      per_device_train_batch_size=4, bf16=False, report_to=[], logging_steps=1)
    processor = AutoProcessor.from_pretrained(tiny_vlm)
    trainer = GRPOTrainer(model=str(tiny_vlm), reward_funcs=short, args=args,
                          train_dataset=Dataset.from_list(rows), processing_class=processor)
    assert trainer.spec.data.image_column == "image"
    assert trainer.train().global_step == 1
    assert (tmp_path / "vlm" / "final" / "processor_config.json").exists()


def test_the_door_names_a_processor_without_images_and_a_tokenizer_with_them(tiny_vlm, tmp_path, monkeypatch):
    from transformers import AutoProcessor

    from grpo_core.trl import GRPOConfig, GRPOTrainer
    from grpo_core.trl.config import TRLConfigError

    monkeypatch.chdir(tmp_path)
    processor = AutoProcessor.from_pretrained(tiny_vlm)
    args = GRPOConfig(output_dir="vlm", max_steps=1, num_generations=2, per_device_train_batch_size=4, bf16=False)
    text_rows = [{"prompt": "How many?"} for _ in range(4)]
    with pytest.raises(TRLConfigError, match="no 'image' or 'images' column"):
        GRPOTrainer(model=str(tiny_vlm), reward_funcs=lambda completions, **k: [0.0] * len(completions), args=args,
                    train_dataset=text_rows, processing_class=processor)
    with pytest.raises(TRLConfigError, match="'image' column holds images; instead: the model's processor"):
        GRPOTrainer(model=str(tiny_vlm), reward_funcs=lambda completions, **k: [0.0] * len(completions), args=args,
                    train_dataset=_shape_rows(4), processing_class=processor.tokenizer)
