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
