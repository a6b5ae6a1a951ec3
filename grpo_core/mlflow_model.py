"""The MLflow model of a trained policy (MLflow "models from code").

The ``mlflow`` tracker logs this file with the final model folder as the artifact
``model``: ``mlflow.pyfunc.load_model(uri).predict(["prompt", ...])`` returns one greedy
completion per prompt, and the model can be registered and served like any pyfunc model.
It needs torch and transformers where it is loaded (and peft for a LoRA adapter folder),
not grpo-core: this file is copied into the logged model.

Why not ``mlflow.transformers.log_model``: with transformers 5 and MLflow 3.17 it fails on
a local checkpoint folder (flavor config built from a string task) and, given a pipeline,
infers requirements by importing torchvision; a pyfunc with the folder as an artifact
works offline with any causal LM.
"""

from __future__ import annotations

from pathlib import Path

import mlflow
from mlflow.pyfunc import PythonModel

DEFAULT_PARAMS = {"max_new_tokens": 256, "temperature": 0.0}


class TextGenerator(PythonModel):
    """Prompts (strings, or a DataFrame's first column) -> completions (strings).

    Params: ``max_new_tokens``; ``temperature`` (0: greedy). Prompts are used as given:
    apply the chat template before calling for a chat model."""

    def load_context(self, context) -> None:
        import transformers

        folder = Path(context.artifacts["model"])
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if (folder / "adapter_config.json").is_file():  # a LoRA adapter on its base model
            from peft import AutoPeftModelForCausalLM

            self.model = AutoPeftModelForCausalLM.from_pretrained(folder)
        else:
            self.model = transformers.AutoModelForCausalLM.from_pretrained(folder)
        self.model.eval()

    def predict(self, context, model_input, params=None):  # no type hints: MLflow would validate by them
        import torch

        params = {**DEFAULT_PARAMS, **(params or {})}
        if hasattr(model_input, "iloc"):  # a DataFrame
            prompts = [str(x) for x in model_input.iloc[:, 0]]
        else:
            prompts = [str(x) for x in model_input]
        batch = self.tokenizer(prompts, return_tensors="pt", padding=True)
        sample = float(params["temperature"]) > 0
        extra = {"do_sample": True, "temperature": float(params["temperature"])} if sample else {"do_sample": False}
        with torch.inference_mode():
            out = self.model.generate(
                **batch, max_new_tokens=int(params["max_new_tokens"]),
                pad_token_id=self.tokenizer.pad_token_id, **extra,
            )
        new = out[:, batch["input_ids"].shape[1]:]
        return self.tokenizer.batch_decode(new, skip_special_tokens=True)


mlflow.models.set_model(TextGenerator())
