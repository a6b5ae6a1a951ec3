"""The ``vllm`` backend on prompts with images, against a real vLLM engine: a tiny random
SmolVLM-shaped model (Idefics3: head size 32, which vLLM's CPU attention supports) whose
processor vLLM loads from the engine's folder. vLLM expands the image placeholders itself,
into the processor's tokens; its sampler log-probs equal the trainer's; the images are used."""

from __future__ import annotations

import pytest
import torch
from grpo_plugins.vllm.colocated import VLLMRollout, VLLMRolloutOptions
from PIL import Image, ImageDraw

from grpo_core.contracts import RolloutSetup, SamplingParams
from grpo_core.contracts.images import without_placeholders
from grpo_core.spec.data import DataSlot
from grpo_core.testing import build_vision_model, build_vision_processor
from grpo_core.train.actor.data import PromptSource
from grpo_core.train.learner.logprobs import completion_logprobs

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("one_thread")]

TOL = 1e-5  # float32 engine against the float32 trainer


def drawing(colour: tuple[int, int, int]) -> Image.Image:
    image = Image.new("RGB", (56, 56), (235, 235, 235))
    ImageDraw.Draw(image).rectangle([10, 10, 40, 30], fill=colour)
    return image


@pytest.fixture(scope="module")
def processor():
    return build_vision_processor("smolvlm")


@pytest.fixture(scope="module")
def policy(processor):
    return build_vision_model(processor, kind="smolvlm", seed=0).eval()


@pytest.fixture(scope="module")
def engine(policy, processor):
    backend = VLLMRollout(VLLMRolloutOptions(dtype="float32", enforce_eager=True, max_model_len=256,
                                             max_num_seqs=16))
    backend.setup(RolloutSetup(policy, processor.tokenizer, processor=processor))  # as the engine, for images
    return backend


def render(processor, colours):
    rows = [{"prompt": f"How many shapes? ({i})", "image": drawing(c)} for i, c in enumerate(colours)]
    source = PromptSource(rows, processor.tokenizer, DataSlot(name="shapes", image_column="image"), seed=0,
                          max_tokens=200, shuffle=False, processor=processor)
    return source.next(len(rows))


def generate(engine, prompts, sampling):
    return engine.generate([p.ids for p in prompts], 3, sampling, images=[p.images for p in prompts])


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampler_logps_with_images_equal_the_trainers(engine, policy, processor, temperature):
    prompts = render(processor, [(200, 30, 30), (30, 30, 200)])
    sampling = SamplingParams(max_new_tokens=8, temperature=temperature, seed=5)
    batch = generate(engine, prompts, sampling)  # vLLM's expansion was checked against the processor's
    assert batch.sampling_logp is not None and batch.completion_mask.sum() > 10
    # as the learner does: a completion that wrote an image placeholder (a random model does) is left out
    ids, mask = without_placeholders(batch.completion_ids, batch.completion_mask, policy.config)
    assert mask.sum() > 10
    with torch.no_grad():
        mine, _ = completion_logprobs(policy, batch.prompt_ids, batch.prompt_mask, ids, mask,
                                      temperature=temperature, images=[p.images for p in prompts])
    gap = (mine - batch.sampling_logp).abs()[mask]
    assert float(gap.max()) <= TOL, float(gap.max())


def test_the_engine_sees_the_images(engine, processor):
    sampling = SamplingParams(max_new_tokens=8, greedy=True)
    red = generate(engine, render(processor, [(200, 30, 30)]), sampling)
    blue = generate(engine, render(processor, [(30, 30, 200)]), sampling)
    assert torch.equal(red.prompt_ids, blue.prompt_ids)  # the same tokens: only the pixels differ
    assert not torch.equal(red.sampling_logp, blue.sampling_logp)


def test_a_lora_run_with_images_pushes_every_update_into_the_engine(tmp_path):
    """specs/vision.yaml on the engine: each step's sampler log-probs (from the weights pushed
    after the previous step, the adapter merged) equal the trainer's."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from grpo_core.testing import save_tiny_vision_model

    model = save_tiny_vision_model(tmp_path / "model")
    spec = Path(__file__).resolve().parents[2] / "specs" / "vision.yaml"
    sets = [f"model.path={model}", f"train.output_dir={tmp_path / 'out'}", "tracking=[]", "train.threads=1",
            "train.steps=3", "eval.every=0", "data.train_size=8", "data.eval_size=0",
            "rollout={name: vllm, group_size: 4, max_new_tokens: 6, dtype: float32, enforce_eager: true, "
            "max_model_len: 256, max_num_seqs: 32}", "rewards=[{name: format, pattern: '[aeiou]'}]"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)  # set by the in-process engine of this pytest process
    done = subprocess.run([sys.executable, "-m", "grpo_core.cli", "run", str(spec), *[a for s in sets for a in
                           ("--set", s)]], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "rollout_correction/logp_diff/max" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["rollout_correction/logp_diff/max"] <= 1e-4 for r in steps), steps
    assert any(r["grad_norm"] > 0 for r in steps[:2])  # the pushes carried moved weights
