"""What the parts of the GPU check share: the device and its clocks, the JSON record each part
writes as it goes, the models and tokenizers built from configs (no download), the model
FLOPs formulas, and the spec of a tiny grpo-run.

Imported only in the part process (``run.py --child``), after ``run.py`` made the checkout
importable; it imports torch and the engine.
"""

from __future__ import annotations

import gc
import json
import math
import resource
import time
import traceback
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

#: Qwen2.5-0.5B's architecture, from its config.json on the Hub (the numbers transformers'
#: ``Qwen2Config`` takes): 494M parameters with the tied embeddings, 358M without them.
QWEN25_05B: dict[str, Any] = {
    "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
    "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 32768, "rope_theta": 1.0e6,
    "tie_word_embeddings": True, "rms_norm_eps": 1e-6,
}
#: The same architecture (Qwen2: GQA, QKV bias, tied head) at a size a CPU test runs in seconds.
TINY_QWEN: dict[str, Any] = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 1024, "rope_theta": 1.0e6,
    "tie_word_embeddings": True, "rms_norm_eps": 1e-6,
}
#: Dense bf16 tensor-core peak, TFLOP/s, by a name in the device's name (NVIDIA's data sheets,
#: SXM parts): the denominator of model FLOPs utilisation.
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}


# --------------------------------------------------------------------------- the device
def pick_device(name: str) -> torch.device:
    """``auto``: the first GPU when CUDA is available, else the CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: torch sees no CUDA device")
        torch.cuda.set_device(0)
        return torch.device("cuda", 0)
    return torch.device("cpu")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def clock(device: torch.device, into: dict[str, float], key: str):
    """Wall seconds of the block into ``into[key]``, the GPU's queued work included."""
    sync(device)
    start = time.perf_counter()
    try:
        yield
    finally:
        sync(device)
        into[key] = time.perf_counter() - start


def reset_peak(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> dict[str, float]:
    """GPU: the allocator's peak since :func:`reset_peak` (allocated and reserved), GiB. CPU: the
    process's peak resident memory since it started (``ru_maxrss``), GiB."""
    if device.type == "cuda":
        return {"peak_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30,
                "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30}
    return {"peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def peak_tflops(device: torch.device, override: float | None) -> float | None:
    """The bf16 dense peak of the device (``override`` wins); None where unknown (CPUs)."""
    if override:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def cuda_context_broken(device: torch.device) -> bool:
    """Whether the CUDA context can still run a kernel (after an illegal access or a device
    assert it cannot, and every later part would fail the same way)."""
    if device.type != "cuda":
        return False
    try:
        torch.cuda.synchronize(device)
        return float((torch.ones(1, device=device) + 1).item()) != 2.0
    except Exception:
        return True


# --------------------------------------------------------------------------- the record
class Record:
    """A part's result, rewritten to ``path`` after every check (so that a part killed at its
    time limit still reports what it finished). Each check is a dict with ``status``: ``ok``,
    ``failed`` (it ran and a bound did not hold), ``error`` (it raised) or ``skipped``."""

    def __init__(self, path: Path, part: str):
        self.path, self.data = path, {"part": part, "status": "running", "checks": {}, "started": time.time()}
        self.write()

    def write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=_jsonable), encoding="utf-8")
        tmp.replace(self.path)

    def check(self, name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """Run ``fn`` (a dict of figures with ``ok`` where it judges) and record it under ``name``."""
        start = time.perf_counter()
        print(f"[gpu-check] {self.data['part']}/{name} ...", flush=True)
        try:
            out = dict(fn())
            out.setdefault("status", "ok" if out.get("ok", True) else "failed")
        except Exception as exc:  # recorded; the part goes on with its next check
            out = _error(exc)
        out["seconds"] = round(time.perf_counter() - start, 3)
        self.data["checks"][name] = out
        print(f"[gpu-check] {self.data['part']}/{name}: {out['status']} ({out['seconds']} s)"
              + (f" {out['error']}" if "error" in out else ""), flush=True)
        self.write()
        return out

    def fail(self, name: str, exc: BaseException) -> None:
        """Record an exception raised outside the checks (in the part's own code) as ``name``."""
        self.data["checks"][name] = _error(exc)
        self.write()

    def note(self, **values: Any) -> None:
        self.data.update(values)
        self.write()

    def finish(self) -> None:
        states = [c["status"] for c in self.data["checks"].values()]
        self.data["status"] = ("error" if "error" in states else "failed" if "failed" in states
                               else "ok" if "ok" in states else "skipped")
        self.data["seconds"] = round(time.time() - self.data.pop("started"), 3)
        self.write()


def _error(exc: BaseException) -> dict[str, Any]:
    return {"status": "error", "error": f"{type(exc).__name__}: {exc}"[:2000],
            "traceback": "".join(traceback.format_exception(exc))[-4000:]}


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, (torch.device, torch.dtype, Path)):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return repr(value)


def rel_error(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """``||a - b|| / ||b||`` over all tensors of two same-keyed dicts, in float64 on the CPU."""
    num = sum(float((a[k].double().cpu() - b[k].double().cpu()).pow(2).sum()) for k in b)
    den = sum(float(b[k].double().cpu().pow(2).sum()) for k in b)
    return math.sqrt(num / den) if den else math.inf


# --------------------------------------------------------------------------- models
def wide_tokenizer(vocab_size: int):
    """A word-level tokenizer whose ids cover ``vocab_size`` (the tiny BPE of
    :mod:`grpo_core.testing` has 320): the special tokens of the tiny one, then the word ``t<i>``
    for every other id ``i``. The text ``"t17 t4096"`` is exactly the ids ``[17, 4096]``, and any
    id a random model samples decodes."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from grpo_core.testing import CHAT_TEMPLATE, SPECIAL_TOKENS

    specials = [*SPECIAL_TOKENS, "<|unk|>"]
    vocab = {token: i for i, token in enumerate(specials)}
    vocab.update({f"t{i}": i for i in range(len(specials), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|unk|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|endoftext|>",
                                   unk_token="<|unk|>", additional_special_tokens=specials[2:])
    fast.chat_template = CHAT_TEMPLATE
    fast.padding_side = "left"
    return fast


def first_word_id() -> int:
    """The smallest id of :func:`wide_tokenizer` that is an ordinary word."""
    from grpo_core.testing import SPECIAL_TOKENS

    return len(SPECIAL_TOKENS) + 1


def qwen_config(shape: dict[str, Any], tokenizer):
    """A ``Qwen2Config`` of ``shape`` (:data:`QWEN25_05B` or :data:`TINY_QWEN`), its special ids
    those of ``tokenizer``."""
    from transformers import Qwen2Config

    values = {k: v for k, v in shape.items() if k != "rope_theta"}
    return Qwen2Config(
        **values, rope_parameters={"rope_type": "default", "rope_theta": shape["rope_theta"]},
        use_sliding_window=False, hidden_act="silu", pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )


def save_random_qwen(folder: Path, shape: dict[str, Any], device: torch.device, seed: int = 0) -> dict[str, Any]:
    """Write a randomly initialised float32 Qwen2 of ``shape`` to ``folder`` and its
    :func:`wide_tokenizer` to ``folder/tokenizer``, made on ``device`` (initialising 494M
    parameters takes seconds on a GPU). Returns what was built. Reuses a folder already written
    with the same shape."""
    from transformers import Qwen2ForCausalLM

    marker = folder / "shape.json"
    if marker.is_file() and json.loads(marker.read_text())["shape"] == shape and (folder / "tokenizer").is_dir():
        return json.loads(marker.read_text())
    tokenizer = wide_tokenizer(shape["vocab_size"])
    config = qwen_config(shape, tokenizer)
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen2ForCausalLM(config)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    # In a folder of its own: beside a qwen2 config.json, AutoTokenizer would rebuild it as
    # Qwen2's byte-level BPE, which a word-level vocabulary is not.
    tokenizer.save_pretrained(folder / "tokenizer")
    info = {"shape": shape, "parameters": sum(p.numel() for p in model.parameters()),
            "rope_theta": config.rope_parameters["rope_theta"],
            "tied": model.lm_head.weight is model.model.embed_tokens.weight}
    marker.write_text(json.dumps(info))
    del model
    free_memory(device)
    return info


# --------------------------------------------------------------------------- model FLOPs
@dataclass(frozen=True)
class Dims:
    """The numbers of a decoder-only transformer that its FLOPs depend on."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @classmethod
    def of(cls, config: Any) -> Dims:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
                   config.num_key_value_heads, head_dim, config.intermediate_size, config.vocab_size)

    @property
    def decoder_matmul_params(self) -> int:
        """``N_dec``: weights each token multiplies in the decoder layers (q, k, v, o, gate, up,
        down; biases and norms are negligible)."""
        d, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return self.layers * (d * q + 2 * d * kv + q * d + 3 * d * self.intermediate)

    @property
    def head_params(self) -> int:
        """``d * V``: the output layer's weights (a tied one multiplies the embedding matrix)."""
        return self.hidden * self.vocab

    @property
    def attention_width(self) -> int:
        return self.heads * self.head_dim


def forward_flops(dims: Dims, prompt_len: int, completion_lens: list[int]) -> float:
    """Forward FLOPs of one group: its prompt encoded once (``p`` tokens), then each completion
    (``c_i`` tokens) attending to the prompt and to itself, the output layer on completion
    tokens only (the only positions with a loss):

        2 N_dec p + 2 L w p (p + 1)
        + sum_i [ 2 (N_dec + d V) c_i + 4 L w (c_i p + c_i (c_i + 1) / 2) ]

    with ``w = heads * head_dim``: a query attending to ``k`` keys costs ``4 w k`` per layer
    (``QK^T`` and ``AV``, a multiply and an add each)."""
    n, lw, p = dims.decoder_matmul_params, dims.layers * dims.attention_width, prompt_len
    total = 2.0 * n * p + 2.0 * lw * p * (p + 1)
    for c in completion_lens:
        total += 2.0 * (n + dims.head_params) * c + 4.0 * lw * (c * p + c * (c + 1) / 2)
    return total


def batch_flops(dims: Dims, prompt_mask: torch.Tensor, mask: torch.Tensor, *, training: bool) -> float:
    """Model FLOPs of a batch (``P`` prompts, ``B = P*G`` rows, prompt-major): the forward of
    every group (:func:`forward_flops`, real tokens only: padding excluded); training is
    forward plus backward, 3x the forward."""
    prompts, rows = prompt_mask.shape[0], mask.shape[0]
    group = rows // prompts
    lengths = mask.sum(dim=1).tolist()
    total = 0.0
    for p in range(prompts):
        total += forward_flops(dims, int(prompt_mask[p].sum()), lengths[p * group:(p + 1) * group])
    return 3.0 * total if training else total


# --------------------------------------------------------------------------- the engine
VARIED_REWARD = '''
from grpo_core import hookimpl

def varied(prompts, completions, **kwargs):
    """Rewards that differ within every group whatever a random model writes: every row trains."""
    return [float(i % 2) for i in range(len(completions))]

@hookimpl
def register_reward_functions(register):
    register.add("varied", varied)
'''


def run_spec(folder: Path, model_path: Path, device: torch.device, **sections: Any) -> dict[str, Any]:
    """A spec dict for a grpo-run of the model at ``model_path`` on ``device`` that needs none of
    what the GPU machine lacks: the synthetic arithmetic task, a reward from a local plugin file
    (written to ``folder``), no tracker. ``sections`` update the sections key by key."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "varied.py").write_text(VARIED_REWARD, encoding="utf-8")
    spec: dict[str, Any] = {
        "plugins": ["varied.py"],
        "model": {"path": str(model_path)},
        "data": {"name": "arithmetic", "train_size": 64, "eval_size": 0},
        "rollout": {"group_size": 4, "max_new_tokens": 6},
        "rewards": [{"name": "varied"}],
        "algorithm": {"kl": {"name": "low_var_kl", "beta": 0.0}},
        "train": {"steps": 2, "prompts_per_step": 2, "lr": 1e-3, "progress": False, "seed": 0,
                  "log_completions_every": 0, "device": device.type, "output_dir": str(folder / "out")},
        "checkpoint": {"every": 1, "keep": 5, "every_minutes": 0},
        "eval": {"at_start": False, "at_end": False},
        "tracking": [],
    }
    for section, values in sections.items():
        spec[section] = {**spec.get(section, {}), **values} if isinstance(values, dict) else values
    return spec


def packing_available() -> bool:
    """Whether this build's spec has ``train.packing`` (the padding-free learner forward)."""
    from grpo_core.spec.models import TrainSection

    return "packing" in TrainSection.model_fields


def load_run_spec(folder: Path, spec: dict[str, Any], overrides: list[str] = ()):
    """The spec written to ``folder/spec.yaml`` and loaded as grpo-run loads it."""
    import yaml

    from grpo_core.spec import load_spec

    path = folder / "spec.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False), encoding="utf-8")
    return load_spec(path, list(overrides), external_plugins=False)
