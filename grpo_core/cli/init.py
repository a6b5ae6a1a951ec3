"""``grpo-run init [--task math|tools|custom] [SPEC]``: a commented starter spec that
validates as written, plus the small files it names (a data file, a reward plugin)."""

from __future__ import annotations

from pathlib import Path

from grpo_core.errors import UsageError

MATH = """\
# GRPO on grade-school math (GSM8K) with a small instruct model.
# Check it:   grpo-run validate {spec}
# Try it:     grpo-run {spec} --dry-run     (one rollout, printed with its rewards; no training)
# Train:      grpo-run {spec}               (a GPU is advised)
model:
  path: Qwen/Qwen2.5-0.5B-Instruct      # a Hub id or a local folder; the HF cache is used when it has it
  dtype: bfloat16
  # lora: {{r: 16, alpha: 32}}          # train a LoRA adapter instead (pip install 'grpo-core[lora]')
data:
  name: hf                              # a Hugging Face dataset: downloaded on the first run, then cached
  config: main
  path: openai/gsm8k                    # the dataset's Hub id (or a save_to_disk folder)
  eval_split: test
  prompt_column: question               # GSM8K's columns: question, answer ("... #### 72")
  as_user_message: true                 # the question becomes a user message, so the chat template applies
  system_prompt: "Solve the problem step by step, then give the final answer in \\\\boxed{{}}."
  # chat_template_kwargs: {{enable_thinking: false}}   # variables of the chat template (Qwen3)
rollout:
  group_size: 8                         # G completions per prompt
  max_new_tokens: 384
  temperature: 1.0
  mask_truncated_completions: false     # a cut-off answer stays in the loss, scored 0: running long costs
rewards:
  - name: accuracy                      # 1 when the final answer equals the gold one (math-verify)
    answer_column: answer
  - name: format                        # a small bonus for a boxed answer
    pattern: "\\\\\\\\boxed\\\\{{"
    weight: 0.1
algorithm:
  advantage: {{name: grpo}}               # (r - mean) / std within each group (DeepSeekMath)
  kl: {{name: low_var_kl, beta: 0.0}}     # beta > 0 adds the k3 KL penalty to a reference model
  policy_loss: {{name: clip}}
  aggregation: {{name: token-mean}}       # each token weighs the same whatever its answer's length (DAPO)
train:
  steps: 200
  prompts_per_step: 8                   # B = 8 x 8 = 64 completions per step
  micro_batch_size: 16                  # rows per forward/backward: lower it when memory is short
  lr: 1.0e-6
  warmup_steps: 10
  schedule: cosine                      # decays to 0 at the last step
  mixed_precision: bf16
eval:
  every: 50
  max_prompts: 200
tracking:
  - name: mlflow                        # add {{name: wandb}} or {{name: tensorboard}} (optional extras)
export:
  model_card: true                      # final/README.md: how the model was trained
"""

TOOLS = """\
# GRPO for tool calling: the model answers each request with one <tool_call>{{json}}</tool_call>,
# rewarded when the call names the expected tool with the expected arguments.
# This trains the call alone (one turn). To run the tools and train over whole episodes (the
# model calls, reads the result, answers), see rollout.environment in the README and specs/tools.yaml.
# Files next to this spec: {data} (the requests) and {plugin} (the reward function).
# Check it:   grpo-run validate {spec}
# Try it:     grpo-run {spec} --dry-run
model:
  path: Qwen/Qwen2.5-0.5B-Instruct      # its chat template renders the `tools` below
data:
  name: file                            # JSONL, CSV or Parquet; every column reaches the rewards
  train: {data}
  prompt_column: prompt                 # chat messages
  chat_template_kwargs:                 # passed to apply_chat_template: the tools the model may call
    tools:
      - type: function
        function:
          name: get_weather
          description: Current weather in a city.
          parameters:
            type: object
            properties: {{city: {{type: string}}}}
            required: [city]
      - type: function
        function:
          name: convert_currency
          description: Convert an amount between currencies.
          parameters:
            type: object
            properties: {{amount: {{type: number}}, from: {{type: string}}, to: {{type: string}}}}
            required: [amount, from, to]
rollout:
  group_size: 8                         # G completions per prompt
  max_new_tokens: 96                    # a tool call is short
rewards:
  - name: tool_call                     # defined in {plugin}
plugins:
  - {plugin}                            # local plugin files, relative to this spec
train:
  steps: 100
  prompts_per_step: 4                   # B = 4 x 8 = 32 completions per step
  lr: 1.0e-6
eval:                                   # no held-out split in this starter: add data.eval to measure
  at_start: false
  at_end: false
tracking:
  - name: mlflow                        # or wandb / tensorboard (optional extras)
"""

TOOLS_DATA = [
    ("What's the weather like in Paris right now?", "get_weather", {"city": "Paris"}),
    ("Is it raining in Tokyo?", "get_weather", {"city": "Tokyo"}),
    ("How much is 100 USD in EUR?", "convert_currency", {"amount": 100, "from": "USD", "to": "EUR"}),
    ("Convert 25 GBP to JPY please.", "convert_currency", {"amount": 25, "from": "GBP", "to": "JPY"}),
]

TOOLS_PLUGIN = '''\
"""Reward for tool calls: 1.0 for a <tool_call> naming the expected tool with the expected
arguments, 0.5 for the right tool with other arguments, 0.0 otherwise."""

import json
import re

from grpo_core import hookimpl
from grpo_core.contracts import completion_text

CALL = re.compile(r"<tool_call>\\s*(\\{.*?\\})\\s*</tool_call>", re.DOTALL)


def tool_call(prompts, completions, expected_call, **columns):
    scores = []
    for completion, expected in zip(completions, expected_call):
        match = CALL.search(completion_text(completion))
        try:
            call = json.loads(match.group(1)) if match else None
        except ValueError:
            call = None
        if not isinstance(call, dict) or call.get("name") != expected["name"]:
            scores.append(0.0)
        else:
            scores.append(1.0 if call.get("arguments") == expected["arguments"] else 0.5)
    return scores


@hookimpl
def register_reward_functions(register):
    register.add("tool_call", tool_call)
'''

CUSTOM = """\
# A starter for your own task: your prompts in {data}, your reward in {plugin}.
# Check it:   grpo-run validate {spec}
# Try it:     grpo-run {spec} --dry-run     (prints completions and the rewards your function gives)
model:
  path: HuggingFaceTB/SmolLM2-135M-Instruct   # a Hub id or a local folder
data:
  name: file                            # JSONL, CSV or Parquet; every column reaches the rewards
  train: {data}
  prompt_column: prompt
rollout:
  group_size: 8                         # G completions per prompt: the group GRPO normalizes within
  max_new_tokens: 64
rewards:
  - name: my_reward                     # defined in {plugin}; list more, each with a weight
plugins:
  - {plugin}                            # local plugin files, relative to this spec
algorithm:
  advantage: {{name: grpo}}               # (r - mean) / std within each group (DeepSeekMath)
  kl: {{name: low_var_kl, beta: 0.0}}     # beta > 0 adds a KL penalty to the initial model
train:
  steps: 50
  prompts_per_step: 4                   # B = 4 x 8 = 32 completions per step
  lr: 1.0e-5
eval:                                   # no held-out split in this starter: add data.eval to measure
  at_start: false
  at_end: false
tracking:
  - name: console                       # prints metrics; mlflow, wandb, tensorboard log them
"""

CUSTOM_DATA = [
    ("Write a haiku about the sea.", 17),
    ("Describe a cat in one short sentence.", 10),
    ("Name three primary colours.", 5),
]

CUSTOM_PLUGIN = '''\
"""Your reward function: TRL's signature, one float (or None: unscorable) per completion.
Every dataset column arrives as a keyword list with one entry per completion."""

from grpo_core import hookimpl
from grpo_core.contracts import completion_text


def my_reward(prompts, completions, target_words, **columns):
    """1.0 at exactly `target_words` words, falling off linearly with the distance."""
    scores = []
    for completion, target in zip(completions, target_words):
        words = len(completion_text(completion).split())
        scores.append(max(0.0, 1.0 - abs(words - target) / target))
    return scores


@hookimpl
def register_reward_functions(register):
    register.add("my_reward", my_reward)
'''

TASKS = ("math", "tools", "custom")


def _jsonl(rows: list[dict]) -> str:
    import json

    return "".join(json.dumps(r) + "\n" for r in rows)


def starter_files(task: str, spec: Path) -> dict[Path, str]:
    """The files ``init`` writes for ``task``: the spec and what it names, by path."""
    folder, stem = spec.parent, spec.stem
    if task == "math":
        return {spec: MATH.format(spec=spec.name)}
    if task == "tools":
        data, plugin = f"{stem}_requests.jsonl", f"{stem}_reward.py"
        rows = [{"prompt": [{"role": "user", "content": q}], "expected_call": {"name": n, "arguments": a}}
                for q, n, a in TOOLS_DATA]
        return {spec: TOOLS.format(spec=spec.name, data=data, plugin=plugin),
                folder / data: _jsonl(rows), folder / plugin: TOOLS_PLUGIN}
    if task == "custom":
        data, plugin = f"{stem}_prompts.jsonl", f"{stem}_reward.py"
        rows = [{"prompt": q, "target_words": n} for q, n in CUSTOM_DATA]
        return {spec: CUSTOM.format(spec=spec.name, data=data, plugin=plugin),
                folder / data: _jsonl(rows), folder / plugin: CUSTOM_PLUGIN}
    raise UsageError(f"--task: unknown task {task!r}; choose one of {', '.join(TASKS)}")


def write_starter(task: str, spec: Path, force: bool = False) -> list[Path]:
    """Write the starter files; refuse (UsageError) to overwrite any unless ``force``."""
    files = starter_files(task, spec)
    existing = [p for p in files if p.exists()]
    if existing and not force:
        raise UsageError(f"init: {', '.join(map(str, existing))} already exist(s); pass --force to overwrite")
    spec.parent.mkdir(parents=True, exist_ok=True)
    for path, text in files.items():
        path.write_text(text, encoding="utf-8")
    return list(files)
