"""Prompts with images on tiny random vision-language models built from configs (Qwen2-VL's and
Qwen2.5-VL's architectures, with their 3-D rotary positions, Gemma 3's and SmolVLM's): the learner's log-probs equal a
plain forward of the model, one update is the textbook gradient, the hf backend generates what
transformers' generate does, the images are really used, and bad image data is refused when it
loads."""

from __future__ import annotations

import copy

import pytest
import torch
from PIL import Image, ImageDraw

from grpo_core.contracts import RolloutSetup, SamplingParams, left_pad
from grpo_core.errors import RunError
from grpo_core.plugin_manager import load_plugins
from grpo_core.spec.data import DataSlot
from grpo_core.spec.models import LoraSection, ModelSection
from grpo_core.testing import VISION_KINDS, build_vision_model, build_vision_processor, save_tiny_model
from grpo_core.train.actor.data import PromptSource
from grpo_core.train.learner.batch import TrainBatch, batch_logprobs
from grpo_core.train.learner.learner import Learner, UpdateSettings
from grpo_core.train.learner.packing import resolve_packing
from grpo_core.train.learner.parallel import forward_of
from grpo_core.train.learner.update import Objective, update
from grpo_core.train.model import load_processor, prepare_policy, vision_modules

torch.set_num_threads(1)
KINDS = ["qwen2-vl", "qwen2.5-vl", "gemma3", "smolvlm"]
#: The token each kind's model fills with image features; the per-token input it needs
#: (Qwen's modality of each token for the 3-D positions, Gemma 3's for its image attention).
IMAGE_TOKEN = {"qwen2-vl": "<|image_pad|>", "qwen2.5-vl": "<|image_pad|>", "gemma3": "<image_soft_token>",
               "smolvlm": "<image>"}
PER_TOKEN = {"qwen2-vl": "mm_token_type_ids", "qwen2.5-vl": "mm_token_type_ids", "gemma3": "token_type_ids"}
VISION = {"smolvlm": ["model.vision_model", "model.connector"],
          "gemma3": ["model.vision_tower", "model.multi_modal_projector"]}
G = 2


def drawing(seed: int, size=(56, 56)) -> Image.Image:
    """A small picture: a few coloured rectangles on a grey ground."""
    gen = torch.Generator().manual_seed(seed)
    image = Image.new("RGB", size, (128, 128, 128))
    draw = ImageDraw.Draw(image)
    for _ in range(3):
        x, y = torch.randint(0, size[0] - 12, (2,), generator=gen).tolist()
        colour = tuple(torch.randint(0, 256, (3,), generator=gen).tolist())
        draw.rectangle([x, y, x + 10, y + 10], fill=colour)
    return image


@pytest.fixture(scope="module", params=KINDS)
def vlm(request):
    processor = build_vision_processor(request.param)
    model = build_vision_model(processor, kind=request.param).double()
    return request.param, processor, model


def image_prompts(processor, rows):
    source = PromptSource(rows, processor.tokenizer, DataSlot(name="arithmetic", image_column="image"), seed=0,
                          max_tokens=500, shuffle=False, processor=processor)
    return source.next(len(rows))


ROWS = [{"prompt": "How many squares?", "image": drawing(1)},
        {"prompt": "What colour is the first one?", "image": drawing(2, (48, 56))},
        {"prompt": "Count them.", "image": drawing(3)}]


def batch_of(prompts, seed=0, width=5) -> TrainBatch:
    """Random completions (ragged lengths) of ``prompts``, ``G`` each, random advantages."""
    gen = torch.Generator().manual_seed(seed)
    ids, mask = left_pad([p.ids for p in prompts], 0)
    rows = len(prompts) * G
    completions = torch.randint(10, 300, (rows, width), generator=gen)
    lengths = torch.randint(1, width + 1, (rows,), generator=gen)
    cmask = torch.arange(width)[None, :] < lengths[:, None]
    adv = torch.randn(rows, 1, generator=gen, dtype=torch.float64).expand(-1, width) * cmask
    return TrainBatch(ids, mask, completions * cmask, cmask, adv.clone(), prompt_images=[p.images for p in prompts])


def plain_logprobs(model, processor, prompt, completion) -> torch.Tensor:
    """Log-probs of ``completion`` after ``prompt`` from one forward of the whole model on the
    processor's own encoding (the model places the image features and positions)."""
    encoded = processor(text=[prompt.text], images=[prompt.images.images], return_tensors="pt",
                        add_special_tokens=False)
    extra = {k: v for k, v in encoded.items() if k not in ("input_ids", "attention_mask")}
    if "mm_token_type_ids" in extra:
        extra["mm_token_type_ids"] = torch.cat(
            [extra["mm_token_type_ids"], torch.zeros(1, len(completion), dtype=torch.long)], dim=1)
    length = encoded["input_ids"].shape[1]
    ids = torch.cat([encoded["input_ids"][0], completion])[None]
    logits = model(input_ids=ids, **extra).logits[0].double()
    logp = torch.log_softmax(logits[length - 1: length - 1 + len(completion)], -1)
    return logp.gather(1, completion[:, None]).squeeze(1)


# ----------------------------------------------------------------------------- rendering
def test_prompts_hold_the_processors_image_tokens_and_tensors(vlm):
    kind, processor, _ = vlm
    prompts = image_prompts(processor, ROWS)
    image_id = processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN[kind])
    for prompt, row in zip(prompts, ROWS):
        # the image first in the user message; the rewards' prompt stays the row's text
        assert prompt.prompt == [{"role": "user", "content": row["prompt"]}]
        assert prompt.text.startswith("<|user|>" + VISION_KINDS[kind][0])
        assert prompt.ids.count(image_id) >= 1
        assert prompt.images.images[0].size == row["image"].size
        assert "pixel_values" in prompt.images.per_image
        assert prompt.row is row  # the rewards see the row's columns as they are
    if kind in PER_TOKEN:
        assert prompts[0].images.per_token[PER_TOKEN[kind]].tolist().count(1) == prompts[0].ids.count(image_id)
        assert prompts[0].ids.count(image_id) == 4  # Qwen: 56x56 is 4x4 patches of 14, merged 2x2


# ----------------------------------------------------------------------------- log-probs
def test_learner_logprobs_with_images_equal_a_plain_full_forward(vlm):
    """Micro-batches of whole groups and of single rows (ragged: one prompt row per
    completion) both give the model's own full-forward log-probs, Qwen2-VL's 3-D positions included."""
    _, processor, model = vlm
    prompts = image_prompts(processor, ROWS)
    batch = batch_of(prompts)
    with torch.no_grad():
        want = torch.zeros(batch.mask.shape, dtype=torch.float64)
        for row in range(batch.mask.shape[0]):
            m = batch.mask[row]
            want[row, m] = plain_logprobs(model, processor, prompts[row // G], batch.completion_ids[row][m])
        for micro in (G, 2 * G, 3 * G, 1, 3):  # one, two, three groups a forward (shared); ragged
            got = batch_logprobs(forward_of(model), batch, micro, 1.0, torch.no_grad)
            torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)
            assert bool((got[~batch.mask] == 0).all())


def test_a_swapped_image_changes_the_logprobs(vlm):
    _, processor, model = vlm
    prompts = image_prompts(processor, ROWS[:1])
    swapped = image_prompts(processor, [{**ROWS[0], "image": drawing(7)}])
    assert prompts[0].ids == swapped[0].ids  # same tokens: only the pixels differ
    batch = batch_of(prompts)
    other = copy.copy(batch)
    other.prompt_images = [swapped[0].images]
    a = batch_logprobs(forward_of(model), batch, G, 1.0, torch.no_grad)
    b = batch_logprobs(forward_of(model), other, G, 1.0, torch.no_grad)
    assert float((a - b)[batch.mask].abs().max()) > 1e-4


# ----------------------------------------------------------------------------- the update
def _textbook_loss(model, processor, prompts, batch) -> torch.Tensor:
    """seq-mean-token-mean of -A * log pi over each row's tokens, one plain forward per row
    (the clip loss at ratio 1 is the vanilla policy gradient)."""
    terms = []
    for row in range(batch.mask.shape[0]):
        m = batch.mask[row]
        logp = plain_logprobs(model, processor, prompts[row // G], batch.completion_ids[row][m])
        terms.append((batch.advantages[row][m] * logp).sum() / m.sum())
    return -sum(terms) / len(terms)


def test_one_update_is_the_textbook_gradient_on_image_prompts(vlm):
    _, processor, model = vlm
    registry = load_plugins(external=False).registry
    prompts = image_prompts(processor, ROWS)
    batch = batch_of(prompts, seed=1)
    objective = Objective(policy_loss=registry.get("policy_loss", "clip").build(),
                          aggregator=registry.get("loss_aggregator", "seq-mean-token-mean").build(), kl=None,
                          entropy_coef=0.0, early_stop_imp_ratio=None, max_length=5)
    trained = copy.deepcopy(model)
    opt = torch.optim.SGD(trained.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    update(Learner(trained, opt, sched, objective, UpdateSettings(micro_batch_size=2 * G, packing=False)), batch)
    book = copy.deepcopy(model)
    _textbook_loss(book, processor, prompts, batch).backward()
    before = dict(model.named_parameters())
    moved = 0
    for name, p in trained.named_parameters():
        grad = book.get_parameter(name).grad
        grad = torch.zeros_like(p) if grad is None else grad
        torch.testing.assert_close((before[name] - p).detach(), grad, rtol=1e-5, atol=1e-7)  # float32 norms inside
        moved += int(bool(grad.abs().sum() > 0))
    assert moved > 10
    # the vision tower is trained through the image features (a policy without frozen parts)
    vision = vision_modules(model)
    assert vision and any(book.get_submodule(v).parameters().__next__().grad is not None for v in vision)


# ----------------------------------------------------------------------------- generation
@pytest.mark.parametrize("shared", [True, False], ids=["prompt-encoded-once", "per-row"])
@pytest.mark.parametrize("kind", KINDS)
def test_hf_generation_with_images_equals_transformers_generate(kind, shared):
    """Each prompt encoded once with its images and its cache (and Qwen2-VL's position
    offsets) repeated for the group, or every row encoded: the tokens of transformers' own
    generate on the processor's encoding of the prompt alone."""
    from grpo_plugins.rollout.hf import HFRollout, HFRolloutOptions

    processor = build_vision_processor(kind)
    model = build_vision_model(processor, kind=kind).eval()
    prompts = image_prompts(processor, ROWS)
    backend = HFRollout(HFRolloutOptions(share_prompt_prefill=shared))
    backend.setup(RolloutSetup(model, processor.tokenizer))
    out = backend.generate([p.ids for p in prompts], G, SamplingParams(max_new_tokens=8, greedy=True),
                           images=[p.images for p in prompts])
    assert out.completion_ids.shape[0] == len(prompts) * G
    for index, prompt in enumerate(prompts):
        encoded = processor(text=[prompt.text], images=[prompt.images.images], return_tensors="pt",
                            add_special_tokens=False)
        with torch.no_grad():
            ref = model.generate(**encoded, max_new_tokens=8, do_sample=False,
                                 eos_token_id=processor.tokenizer.eos_token_id,
                                 pad_token_id=processor.tokenizer.pad_token_id)[0, encoded["input_ids"].shape[1]:]
        for row in range(index * G, index * G + G):
            got = out.completion_ids[row][out.completion_mask[row]]
            assert got.tolist() == ref[: len(got)].tolist()
            assert len(got) == len(ref) or got[-1] == processor.tokenizer.eos_token_id
    # the images are used: other images, other completions
    swapped = image_prompts(processor, [{**row, "image": drawing(10 + i)} for i, row in enumerate(ROWS)])
    again = backend.generate([p.ids for p in swapped], G, SamplingParams(max_new_tokens=8, greedy=True),
                             images=[p.images for p in swapped])
    assert not torch.equal(again.completion_ids, out.completion_ids)


# ----------------------------------------------------------------------------- load-time errors
def _source(rows, processor):
    return PromptSource(rows, processor.tokenizer if processor is not None else None,
                        DataSlot(name="arithmetic", image_column="image"), seed=0, max_tokens=500, shuffle=False,
                        processor=processor)


def test_bad_images_are_refused_when_the_data_loads_naming_the_row(tmp_path):
    processor = build_vision_processor("smolvlm")
    good = tmp_path / "good.png"
    drawing(0).save(good)
    (tmp_path / "broken.png").write_bytes(b"not a png at all")
    cases = [
        ({"image": str(tmp_path / "missing.png")}, "image file '" + str(tmp_path / "missing.png") + "' does not exist"),
        ({"image": str(tmp_path / "broken.png")}, "cannot read '" + str(tmp_path / "broken.png") + "' as an image"),
        ({"image": 42}, "got int; each image must be a path to an image file, a PIL image"),
        ({"image": {"bytes": b"junk", "path": None}}, "cannot read its bytes as an image"),
    ]
    for bad, message in cases:
        rows = [{"prompt": "a", "image": str(good)}, {"prompt": "b", **bad}]
        with pytest.raises(RunError, match="data.image_column 'image', training row 1: ") as err:
            _source(rows, processor)
        assert message in str(err.value)
    with pytest.raises(RunError, match="needs column 'image', which the training data does not have; its "
                                       "columns are: prompt"):
        _source([{"prompt": "a"}], processor)
    # every accepted form loads: a path, a PIL image, datasets.Image's {bytes, path}, a list, none
    source = _source([{"prompt": "a", "image": str(good)}, {"prompt": "b", "image": drawing(1)},
                      {"prompt": "c", "image": {"bytes": good.read_bytes(), "path": None}},
                      {"prompt": "d", "image": [str(good), drawing(2)]}, {"prompt": "e", "image": None}], processor)
    counts = [len(p.images.images) if p.images is not None else 0 for p in source.next(5)]
    assert counts == [1, 1, 1, 2, 0]


def test_images_need_a_model_with_a_processor(tmp_path):
    text_only = save_tiny_model(tmp_path / "text")
    with pytest.raises(RunError, match="has no image processor: images need an image-text-to-text model"):
        load_processor(ModelSection(path=str(text_only)), tmp_path)
    with pytest.raises(RunError, match="has no image processor"):
        _source([{"prompt": "a", "image": drawing(0)}], None)


# ----------------------------------------------------------------------------- model parts
def test_packing_is_off_for_image_text_models_and_refused_when_asked():
    model = build_vision_model(build_vision_processor("qwen2-vl"))
    assert resolve_packing("auto", model, torch.device("cpu")) is False
    with pytest.raises(RunError, match="train.packing: true cannot run this model exactly: the model takes images"):
        resolve_packing(True, model)


@pytest.mark.parametrize("kind", KINDS)
def test_the_vision_tower_is_frozen_by_default_and_lora_adapts_the_language_model_only(kind):
    processor = build_vision_processor(kind)
    tok = processor.tokenizer
    vision = vision_modules(build_vision_model(processor, kind=kind))
    assert vision == VISION.get(kind, ["model.visual"])

    frozen = prepare_policy(build_vision_model(processor, kind=kind), ModelSection(path="x"), tok)
    assert not any(p.requires_grad for v in vision for p in frozen.get_submodule(v).parameters())
    assert all(p.requires_grad for p in frozen.get_decoder().parameters())
    trained = prepare_policy(build_vision_model(processor, kind=kind), ModelSection(path="x", train_vision=True), tok)
    assert all(p.requires_grad for p in trained.parameters())

    lora = prepare_policy(build_vision_model(processor, kind=kind), ModelSection(path="x", lora=LoraSection(r=2)), tok)
    adapted = {n for n, p in lora.named_parameters() if p.requires_grad}
    assert adapted and all("lora_" in n and "language_model" in n or "text_model" in n for n in adapted)
    assert not any(v.split(".")[-1] in n for n in adapted for v in vision)
    both = prepare_policy(build_vision_model(processor, kind=kind),
                          ModelSection(path="x", lora=LoraSection(r=2), train_vision=True), tok)
    assert any(vision[0].split(".")[-1] in n for n, p in both.named_parameters() if p.requires_grad)


def write_bomb(path, side: int = 30_000) -> None:
    """A decompression bomb: a valid 1-bit PNG of ``side x side`` pixels (30000: 900 million,
    2.7 GB once converted to RGB) whose zeros deflate to about 110 kB. Written chunk by chunk
    with zlib, so that the test never holds the image itself."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    row = bytes(1 + (side + 7) // 8)  # the filter byte, then the row's bits
    deflate = zlib.compressobj(9)
    data = b"".join(deflate.compress(row) for _ in range(side)) + deflate.flush()
    header = struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0)  # 1 bit per pixel, grayscale
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", data) + chunk(b"IEND", b""))


def test_a_decompression_bomb_is_refused_naming_the_row_the_file_and_the_limit(tmp_path):
    """A 110 kB PNG of 30000 x 30000 pixels (issue 47, item 12) stopped the run with Pillow's
    DecompressionBombError, naming no row, column or file. It is refused when the data loads,
    naming them, the image's size, the limit and how to raise it; data.max_image_pixels lowers
    the limit or raises it for data the user trusts."""
    processor = build_vision_processor("smolvlm")
    bomb, good = tmp_path / "bomb.png", tmp_path / "good.png"
    write_bomb(bomb)
    drawing(0).save(good)
    assert bomb.stat().st_size < 150_000
    rows = [{"prompt": "a", "image": str(good)}, {"prompt": "b", "image": str(bomb)}]
    with pytest.raises(RunError) as err:
        _source(rows, processor)
    assert str(err.value) == (
        f"data.image_column 'image', training row 1: '{bomb}' is 30000 x 30000 pixels (900,000,000), more than "
        "the limit of 178,956,970 (Pillow's decompression-bomb limit; data.max_image_pixels is unset): a small "
        "file that decodes to that many pixels can exhaust the run's memory. If you trust the data, set "
        "data.max_image_pixels to 900000000 or more")
    inline = [rows[0], {"prompt": "b", "image": {"bytes": bomb.read_bytes(), "path": "shard-3/bomb.png"}}]
    with pytest.raises(RunError, match=r"training row 1: its bytes \('shard-3/bomb.png'\) are 30000 x 30000 "
                                       r"pixels \(900,000,000\), more than the limit"):
        _source(inline, processor)

    def source(rows, limit):
        return PromptSource(rows, processor.tokenizer, DataSlot(name="arithmetic", image_column="image",
                                                                max_image_pixels=limit),
                            seed=0, max_tokens=500, shuffle=False, processor=processor)

    small = [{"prompt": "a", "image": str(good)}, {"prompt": "b", "image": drawing(1, size=(60, 60))}]
    with pytest.raises(RunError, match=r"training row 1: the PIL image is 60 x 60 pixels \(3,600\), more than the "
                                       r"limit of 3,500 \(data.max_image_pixels\)"):
        source(small, 3500)
    assert [p.images is not None for p in source(small, 3600).next(2)] == [True, True]
    assert Image.MAX_IMAGE_PIXELS == 89_478_485  # Pillow's own guard is as it was


def test_max_image_pixels_raises_the_limit_above_pillows_own(tmp_path, monkeypatch):
    """Pillow's guard set low (as a user's process may set it): a 60 x 60 file is over its
    limit of 2 x 1,000 pixels and refused, naming it; data.max_image_pixels above the image
    loads it (Pillow's guard lifted for that image, then restored)."""
    processor = build_vision_processor("smolvlm")
    path = tmp_path / "sixty.png"
    drawing(1, size=(60, 60)).save(path)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    rows = [{"prompt": "a", "image": str(path)}]
    with pytest.raises(RunError, match=r"training row 0: '.*sixty.png' is 60 x 60 pixels \(3,600\), more than the "
                                       r"limit of 2,000 \(Pillow's decompression-bomb limit; data.max_image_pixels is "
                                       r"unset\).* set data.max_image_pixels to 3600 or more"):
        _source(rows, processor)
    slot = DataSlot(name="arithmetic", image_column="image", max_image_pixels=3600)
    loaded = PromptSource(rows, processor.tokenizer, slot, seed=0, max_tokens=500, shuffle=False, processor=processor)
    assert loaded.next(1)[0].images.images[0].size == (60, 60)
    assert Image.MAX_IMAGE_PIXELS == 1000


def test_max_image_pixels_is_a_positive_integer():
    with pytest.raises(ValueError, match="max_image_pixels"):
        DataSlot(name="arithmetic", image_column="image", max_image_pixels=0)
