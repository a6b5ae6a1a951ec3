"""grpo-core: Group Relative Policy Optimization as a small engine plus plugins.

Two ways in: a YAML spec and ``grpo-run``, or :class:`Trainer` from Python (imported on first
use, so that plugins importing ``hookimpl`` do not pay for the training stack); and for a
script written for TRL, ``grpo_core.trl``'s ``GRPOConfig`` and ``GRPOTrainer``.

The engine's rooms:

- the doors: ``cli/`` (``grpo-run``), ``trainer`` (:class:`Trainer`), ``trl/`` (TRL's arguments);
- the training engine: ``train/`` (the actor, the learner, the loop, and what lies between);
- the agent server: ``endpoint/``, the OpenAI-compatible HTTP server agent programs talk to
  during rollouts (it imports nothing of training);
- the plugin machinery: ``hookspecs`` (one hook per kind), ``kinds``, ``registry``,
  ``plugin_manager``, ``commands`` (plugins' ``grpo-run`` commands), ``contracts/`` (what flows
  between the engine and its plugins), ``groups`` and ``options`` (helpers plugins share);
- the spec: ``spec/``;
- the run's records and the world outside: ``checkpoint``, ``runlock``, ``tracking``,
  ``export`` and ``mlflow_model`` (the trained model), ``launching`` (starting a run's
  processes), ``http`` (every outbound call);
- small things: ``errors``, ``textout`` (terminal tables), ``testing`` (tiny models for tests),
  ``docs_gen`` (the reference pages), ``version``.
"""

import logging

from grpo_core.hookspecs import hookimpl
from grpo_core.version import __version__

# bitsandbytes (model.quantization) warns when imported on a CPU with AVX512-BF16 (peft imports it
# too) that it could not fetch the kernel of its CPU inference repacking from the Hugging Face Hub
# (the `kernels` package it names downloads it at run time). grpo-core turns that repacking off
# (grpo_core.train.model.exact_cpu_4bit: it changed LoRA gradients), so the kernel would never run.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)

__all__ = ["Callback", "TrainResult", "Trainer", "hookimpl", "__version__"]

_LAZY = {"Trainer", "TrainResult", "Callback"}


def __getattr__(name: str):
    if name in _LAZY:
        from grpo_core import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'grpo_core' has no attribute {name!r}")
