"""What tinker-serve holds: one base model (a local transformers folder), a LoRA adapter and an
AdamW optimizer per training client on it (PEFT's named adapters, so clients never share
weights or moments), snapshots saved for sampling, and the ``hf`` rollout backend that samples
from them. Every method runs on the server's one worker thread, in request order.

Paths are Tinker's: ``tinker://<model_id>/weights/<name>`` (``save_state``: adapter, optimizer,
step; loaded back exactly) and ``tinker://<model_id>/sampler_weights/<name>`` (the adapter
only), stored as ``torch.save`` files under the server's state folder.
"""

from __future__ import annotations

import itertools
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from grpo_plugins.tinker.engines import RESERVED
from grpo_plugins.tinker.objectives import check, loss_terms
from grpo_plugins.tinker.wire import Datum, Refused

__all__ = ["LORA_ALPHA", "SAMPLER_ADAPTERS", "Refused", "Service", "TrainingClient"]

_TARGETS = {"attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj"),
            "unembed": ("lm_head",)}
#: LoRA's scaling numerator (scale = alpha / rank) for every adapter: Tinker's config has no alpha.
LORA_ALPHA = 32.0
#: Sampler snapshots the served model holds as adapters at once (the least recently used is
#: dropped first and loaded again from its file when sampled again).
SAMPLER_ADAPTERS = 4
_PATH = re.compile(r"^tinker://([^/]+)/(weights|sampler_weights)/([A-Za-z0-9_.-]+)$")


@dataclass
class TrainingClient:
    """One training client: its adapter (named by ``model_id``), LoRA settings, optimizer and
    the count of optimizer steps taken."""

    model_id: str
    lora: dict[str, Any]
    optimizer: torch.optim.Optimizer | None = None
    steps: int = 0
    pending: bool = False  # gradients accumulated since the last optim_step
    metrics: dict[str, float] = field(default_factory=dict)


class Service:
    """The base model and everything trained on it (see the module docstring)."""

    def __init__(self, model_path: str, state_dir: str | Path, name: str | None = None, tracker: Any = None):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.name, self.path = name or model_path, model_path
        self.state_dir = Path(state_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        self.model.requires_grad_(False)
        self.max_context = int(getattr(self.model.config, "max_position_embeddings", 0) or 0) or None
        self.clients: dict[str, TrainingClient] = {}
        self.sampling_sessions: dict[str, str | None] = {}  # id -> sampler path (None: the base model)
        self._sampler_adapters: OrderedDict[str, str] = OrderedDict()  # sampler path -> adapter, oldest use first
        self._ids = itertools.count()
        self._rollout: Any = None  # the hf rollout backend, made at the first sample
        #: The engine samples go to (``--rollout vllm`` or ``vllm-server``,
        #: :class:`~grpo_plugins.tinker.engines.EngineSampler`); None: the hf backend.
        self.engine: Any = None
        self.tracker = tracker

    # ------------------------------------------------------------------ adapters
    def _peft(self) -> Any:
        return self.model if hasattr(self.model, "peft_config") else None

    def lora_section(self, lora: dict[str, Any]) -> dict[str, Any]:
        """A Tinker ``lora_config`` as grpo-core's ``model.lora`` on this model: the adapter a
        training client gets (rank, alpha :data:`LORA_ALPHA`, no dropout, the layers its
        ``train_attn``/``train_mlp``/``train_unembed`` ask for that the model has)."""
        targets = [m for part, names in _TARGETS.items() if lora.get(f"train_{part}", True) for m in names]
        present = {n.rsplit(".", 1)[-1] for n, _ in self.model.named_modules()}
        targets = [t for t in targets if t in present]
        if not targets:
            raise Refused("the LoRA config trains no layer of this model (train_attn, train_mlp, train_unembed)")
        return {"r": int(lora["rank"]), "alpha": LORA_ALPHA, "dropout": 0.0, "target_modules": targets}

    def _add_adapter(self, adapter: str, lora: dict[str, Any]) -> None:
        from peft import LoraConfig, get_peft_model

        section = self.lora_section(lora)
        config = LoraConfig(r=section["r"], lora_alpha=section["alpha"], target_modules=section["target_modules"],
                            lora_dropout=section["dropout"])
        if lora.get("seed") is not None:
            torch.manual_seed(int(lora["seed"]))
        if self._peft() is None:
            self.model = get_peft_model(self.model, config, adapter_name=adapter)
            self._rollout = None
        else:
            self.model.add_adapter(adapter, config)

    def _use(self, adapter: str) -> None:
        self.model.set_adapter(adapter)
        for name, p in self.model.named_parameters():
            p.requires_grad_(f".{adapter}." in name)

    def _adapter_state(self, adapter: str) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.model.named_parameters() if f".{adapter}." in n}

    def _load_adapter(self, adapter: str, tensors: dict[str, torch.Tensor], source: str) -> None:
        mine = {n: p for n, p in self.model.named_parameters() if f".{adapter}." in n}
        renamed = {re.sub(r"\.[^.]+\.(?=weight$)", f".{adapter}.", n): t for n, t in tensors.items()}
        if set(mine) != set(renamed):
            raise Refused(f"{source} holds an adapter of another shape than this client's (rank or layers differ)")
        with torch.no_grad():
            for n, p in mine.items():
                p.copy_(renamed[n])

    # ------------------------------------------------------------------ training clients
    def create_model(self, base_model: str, lora: dict[str, Any] | None, optimizer: dict | None,
                     model_id: str) -> TrainingClient:
        """A new training client ``model_id`` (the SDK's ``<session>:train:<seq>``) with a fresh
        adapter of that name."""
        if base_model != self.name:
            raise Refused(f"base_model {base_model!r} is not served; this server serves {self.name!r}")
        if lora is None:
            raise Refused("full fine-tuning (no lora_config) is not served: tinker-serve trains LoRA adapters")
        if optimizer and optimizer.get("type", "adamw") != "adamw":
            raise Refused(f"optimizer {optimizer.get('type')!r} is not served; tinker-serve runs adamw")
        if model_id in self.clients or model_id == RESERVED or not re.fullmatch(r"[A-Za-z0-9_:-]+", model_id):
            raise Refused(f"training client id {model_id!r} is taken or malformed")
        if self.engine is not None:
            self.engine.check_rank(int(lora["rank"]))
        self._add_adapter(model_id, lora)
        client = TrainingClient(model_id, dict(lora))
        self.clients[model_id] = client
        self._track(client, "create", {"lora_rank": float(lora["rank"])})
        return client

    def client(self, model_id: str) -> TrainingClient:
        if model_id not in self.clients:
            raise Refused(f"no training client {model_id!r} on this server")
        return self.clients[model_id]

    def _logprobs(self, data: list[Datum]) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """``logp (B, T)`` of each datum's ``target_tokens`` after its input tokens, the
        ``bool (B, T)`` mask of real positions and the other loss inputs padded to ``(B, T)``."""
        width = max(len(d.tokens) for d in data)
        ids = torch.zeros((len(data), width), dtype=torch.long)
        mask = torch.zeros((len(data), width), dtype=torch.bool)
        targets = torch.zeros_like(ids)
        inputs: dict[str, torch.Tensor] = {}
        for row, d in enumerate(data):
            n = len(d.tokens)
            if "target_tokens" not in d.inputs or d.inputs["target_tokens"].shape != (n,):
                raise Refused(f"datum {row}: target_tokens must be one token per input token ({n})")
            ids[row, :n] = torch.tensor(d.tokens)
            mask[row, :n] = True
            targets[row, :n] = torch.from_numpy(d.inputs["target_tokens"].astype(np.int64))
            for name, value in d.inputs.items():
                if name != "target_tokens":
                    inputs.setdefault(name, torch.zeros((len(data), width)))[row, :n] = torch.from_numpy(
                        value.astype(np.float32))
        logits = self.model(input_ids=ids, attention_mask=mask.long()).logits.float()
        logp = -torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
        return logp, mask, inputs

    def forward_backward(self, model_id: str, loss_fn: str, config: dict, data: list[Datum],
                         forward_only: bool) -> tuple[list[dict[str, np.ndarray]], dict[str, float]]:
        """Run ``loss_fn`` on ``data`` with the client's adapter; unless ``forward_only``,
        add its gradient to the client's (until ``optim_step``). Returns each datum's
        ``logprobs`` and ``elementwise_loss`` and the metrics (``loss:sum``)."""
        client = self.client(model_id)
        config = check(loss_fn, config)
        if not data:
            raise Refused("forward_backward got no data")
        self._use(model_id)
        with torch.enable_grad() if not forward_only else torch.no_grad():
            logp, mask, inputs = self._logprobs(data)
            terms = loss_terms(loss_fn, config, logp, inputs, mask)
            loss = terms.sum()
            if not forward_only:
                loss.backward()
                client.pending = True
        outputs = [{"logprobs": logp[r, :len(d.tokens)].detach().numpy(),
                    "elementwise_loss": terms[r, :len(d.tokens)].detach().numpy()} for r, d in enumerate(data)]
        metrics = {"loss:sum": float(loss.detach())}
        self._track(client, "forward" if forward_only else "forward_backward",
                    {f"{loss_fn}/loss_sum": metrics["loss:sum"], "tokens": float(mask.sum())})
        return outputs, metrics

    def optim_step(self, model_id: str, adam: dict[str, float]) -> dict[str, float]:
        """One AdamW step on the client's adapter with Tinker's Adam parameters (decoupled
        weight decay, optional global-norm clip), then the gradients are cleared."""
        client = self.client(model_id)
        params = [p for n, p in self.model.named_parameters() if f".{model_id}." in n]
        hyper = {"lr": adam.get("learning_rate", 1e-4), "betas": (adam.get("beta1", 0.9), adam.get("beta2", 0.95)),
                 "eps": adam.get("eps", 1e-12), "weight_decay": adam.get("weight_decay", 0.0)}
        if client.optimizer is None:
            client.optimizer = torch.optim.AdamW(params, **hyper)
        for group in client.optimizer.param_groups:
            group.update(hyper)
        metrics: dict[str, float] = {}
        if adam.get("grad_clip_norm", 0.0) > 0:
            metrics["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(params, adam["grad_clip_norm"]))
        client.optimizer.step()
        client.optimizer.zero_grad(set_to_none=True)
        client.steps += 1
        client.pending = False
        self._track(client, "optim_step", {"lr": hyper["lr"], **metrics})
        return metrics

    # ------------------------------------------------------------------ checkpoints
    def _file(self, path: str) -> tuple[str, str, Path]:
        match = _PATH.match(path)
        if match is None:
            raise Refused(f"path {path!r} is not a tinker://<model_id>/(weights|sampler_weights)/<name> path "
                          "this server wrote")
        model_id, kind, name = match.groups()
        return model_id, kind, self.state_dir / model_id / kind / f"{name}.pt"

    def _new_path(self, model_id: str, kind: str, name: str | None) -> tuple[str, Path]:
        name = name or f"{kind}-{next(self._ids)}"
        path = f"tinker://{model_id}/{kind}/{name}"
        file = self._file(path)[2]
        file.parent.mkdir(parents=True, exist_ok=True)
        return path, file

    def save_state(self, model_id: str, name: str | None) -> str:
        client = self.client(model_id)
        path, file = self._new_path(model_id, "weights", name)
        torch.save({"lora": client.lora, "adapter": self._adapter_state(model_id), "steps": client.steps,
                    "optimizer": None if client.optimizer is None else client.optimizer.state_dict()}, file)
        self._track(client, "save_state", {"steps": float(client.steps)})
        return path

    def load_state(self, path: str, optimizer: bool, model_id: str) -> str:
        """Load a ``save_state`` file into client ``model_id``, made from it when new; with
        ``optimizer`` its AdamW moments and step count too."""
        _, kind, file = self._file(path)
        if kind != "weights" or not file.exists():
            raise Refused(f"no state saved at {path!r} (save_state writes tinker://<id>/weights/<name>)")
        saved = torch.load(file, weights_only=False)
        client = self.clients.get(model_id)
        if client is None:
            client = self.create_model(self.name, saved["lora"], None, model_id)
        self._load_adapter(client.model_id, saved["adapter"], path)
        client.optimizer, client.steps = None, 0
        if optimizer and saved["optimizer"] is not None:
            params = [p for n, p in self.model.named_parameters() if f".{client.model_id}." in n]
            client.optimizer = torch.optim.AdamW(params)
            client.optimizer.load_state_dict(saved["optimizer"])
            client.steps = saved["steps"]
        return client.model_id

    def save_for_sampler(self, model_id: str, name: str | None) -> str:
        client = self.client(model_id)
        path, file = self._new_path(model_id, "sampler_weights", name)
        torch.save({"lora": client.lora, "adapter": self._adapter_state(model_id)}, file)
        return path

    def sampling_session(self, path: str | None, base_model: str | None) -> str:
        """A sampling session on a sampler snapshot (``path``) or on the base model."""
        if path is None and base_model != self.name:
            raise Refused(f"base_model {base_model!r} is not served; this server serves {self.name!r}")
        if path is not None:
            _, kind, file = self._file(path)
            if kind != "sampler_weights" or not file.exists():
                raise Refused(f"no sampler weights at {path!r} (save_weights_for_sampler writes them)")
        session = f"sampling-{next(self._ids)}"
        self.sampling_sessions[session] = path
        return session

    # ------------------------------------------------------------------ tracking
    def track_push(self, path: str, size: float, seconds: float) -> None:
        """Log a sampler snapshot's push to the sampling engine under its training client."""
        client = self.clients.get(self._file(path)[0])
        if client is not None:
            self._track(client, "sampler_push", {"push_bytes": size, "push_seconds": seconds})

    def _track(self, client: TrainingClient, event: str, values: dict[str, float]) -> None:
        if self.tracker is not None:
            self.tracker(client.model_id, event, client.steps, values)
