"""A ``verifiers`` environment run unchanged as an agent, and its dataset as the run's rows.

``verifiers`` (Prime Intellect's environment library, used by prime-rl, SkyRL and
tinker-cookbook) packages a task as an ``Environment``: a dataset of rows (``prompt`` messages,
``answer``, ``info``, ``task``), a rollout protocol (one turn, a multi-turn game, a tool loop)
that talks to the policy through an ``AsyncOpenAI`` client, and a ``Rubric`` that scores the
finished rollout. Environments are shared as Python packages exposing ``load_environment(**args)``
and are found by id (``vf.load_environment("wordle")`` imports the module ``wordle``).

Here an environment runs as it is: each grpo-core episode is one ``env.run_rollout`` with a
client pointed at the episode's endpoint and key, so the policy's tokens are recorded as for any
agent, and the rubric's reward is the episode's (``env_reward``). A rollout that verifiers ends on
an error (a model call that failed, an empty answer, a tool crash: its ``error`` field) fails the
episode with that error, rather than train a reward of 0 it did not earn.

In a spec (both by the environment's id, with its ``load_environment`` arguments)::

    data: {name: verifiers, environment: my-env, env_args: {difficulty: easy}}
    rollout: {agent: {name: verifiers, environment: my-env, env_args: {difficulty: easy}}}
    rewards: [{name: env_reward}]

In Python: ``Trainer(spec, agent=verifiers_agent(env), train_dataset=env.get_dataset())``.
Tested with verifiers 0.1.10, the last release that installs beside openai 3 (0.2.1 and later pin
``mcp<2`` or ``openai<3``); it uses ``load_environment``, ``Environment.run_rollout``,
``get_dataset`` and ``get_eval_dataset``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from pydantic import Field

from grpo_core import hookimpl
from grpo_core.errors import UsageError
from grpo_core.options import Options

#: The dataset columns a verifiers rollout reads (``RolloutInput``); the rest stay grpo-core's.
INPUT_COLUMNS = ("prompt", "answer", "task", "info", "example_id")

_loaded: dict[tuple[str, str], Any] = {}
_loading = threading.Lock()


def load_environment(environment: Any, env_args: dict[str, Any] | None = None) -> Any:
    """``environment`` itself when it is a ``verifiers.Environment``; for an id, the environment
    its installed package's ``load_environment(**env_args)`` makes, loaded once per process and
    arguments (the agent and the dataset of one run share it)."""
    if not isinstance(environment, str):
        if env_args:
            raise UsageError("verifiers: env_args go with an environment id; an Environment object is already made")
        return environment
    try:
        import verifiers as vf
    except ImportError as exc:
        raise UsageError(f"verifiers environment {environment!r}: the verifiers package is not installed "
                         f"(pip install 'verifiers==0.1.10'): {exc}") from exc
    key = (environment, repr(sorted((env_args or {}).items())))
    with _loading:
        if key not in _loaded:
            try:
                _loaded[key] = vf.load_environment(environment, **(env_args or {}))
            except (ImportError, AttributeError, TypeError, ValueError) as exc:
                module = environment.replace("-", "_").split("/")[-1]
                raise UsageError(f"verifiers environment {environment!r}: could not load it ({type(exc).__name__}: "
                                 f"{exc}); an id names an installed package whose module {module!r} has "
                                 "load_environment(**env_args) (e.g. `prime env install OWNER/NAME` or "
                                 "`pip install` its package)") from exc
        return _loaded[key]


def rollout_input(row: dict[str, Any], message_type: str = "chat") -> dict[str, Any]:
    """The ``RolloutInput`` of a dataset row: its verifiers columns (a text prompt becomes one
    user message for a chat environment)."""
    if "prompt" not in row:
        raise UsageError(f"verifiers: the row has no prompt column (columns: {sorted(row)})")
    given = {k: row[k] for k in INPUT_COLUMNS if k in row}
    if message_type == "chat" and isinstance(given["prompt"], str):
        given["prompt"] = [{"role": "user", "content": given["prompt"]}]
    given.setdefault("answer", "")
    given.setdefault("info", {})
    return given


def verifiers_agent(environment: Any, *, env_args: dict[str, Any] | None = None,
                    sampling_args: dict[str, Any] | None = None,
                    http_client: Callable[[], Any] | None = None) -> Callable[[Any], Any]:
    """An agent (``grpo_core.Trainer(agent=...)``) running one rollout of a verifiers environment
    per episode.

    ``environment``: a ``verifiers.Environment``, or the id of an installed one (then made with
    ``env_args``). ``sampling_args``: what verifiers passes on to each model call (e.g.
    ``{"max_tokens": 256}``, a cap under ``rollout.max_new_tokens``); ``temperature`` and ``top_p``
    only at the spec's values, which the endpoint samples at (it refuses others with a 400).
    ``http_client``: a function making the ``httpx.AsyncClient`` of each episode's OpenAI client
    (a proxy, or to read the answers); unset, the OpenAI client's own.
    """
    loaded: list[Any] = []  # made at the first episode, in the process that runs it

    async def agent(episode: Any) -> float:
        import openai

        if not loaded:
            loaded.append(load_environment(environment, env_args))
        env = loaded[0]
        extra = {"http_client": http_client()} if http_client is not None else {}
        client = openai.AsyncOpenAI(base_url=episode.base_url, api_key=episode.api_key, max_retries=0,
                                    timeout=episode.timeout, **extra)
        try:
            output = await env.run_rollout(rollout_input(episode.row, getattr(env, "message_type", "chat")), client,
                                           episode.model, dict(sampling_args or {}))
        finally:
            await client.close()
        error = output.get("error")
        if error:  # verifiers records it as {'error': name, 'error_chain_repr': ..., ...}
            shown = error.get("error_chain_repr") or error.get("error") if isinstance(error, dict) else error
            raise RuntimeError(f"the verifiers rollout ended on an error: {shown}")
        return float(output["reward"])

    agent.__name__ = "verifiers_agent"
    return agent


class VerifiersAgentOptions(Options):
    """Options of the ``verifiers`` agent."""

    environment: str = Field(min_length=1, description="The id of an installed verifiers environment (its "
                             "package's module has load_environment), e.g. 'wordle' or 'owner/wordle'.")
    env_args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of its load_environment.")
    sampling_args: dict[str, Any] = Field(
        default_factory=dict, description="What verifiers passes on to each model call (e.g. max_tokens, a cap); "
        "temperature and top_p only at the spec's rollout values.")


class VerifiersDatasetOptions(Options):
    """Options of the ``verifiers`` dataset: the environment's own rows."""

    environment: str = Field(min_length=1, description="The id of an installed verifiers environment.")
    env_args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of its load_environment.")
    train_rows: int = Field(-1, ge=-1, description="Rows of its dataset to train on (-1: all).")
    eval_rows: int = Field(-1, ge=-1, description="Rows of its eval dataset to hold out (-1: all; 0: none).")


class VerifiersDataset:
    """The rows of a verifiers environment: ``get_dataset()`` for training, ``get_eval_dataset()``
    held out (none when it has no eval dataset), with the environment's prompt formatting (its
    system prompt and few-shot messages) already applied."""

    def __init__(self, options: VerifiersDatasetOptions):
        self.options = options

    def load(self, split: str) -> list[dict[str, Any]]:
        env = load_environment(self.options.environment, self.options.env_args)
        if split == "train":
            return env.get_dataset(n=self.options.train_rows).to_list()
        # no eval rows of its own: none held out (verifiers would fall back to the training rows)
        if self.options.eval_rows == 0 or env.build_eval_dataset() is None:
            return []
        return env.get_eval_dataset(n=self.options.eval_rows).to_list()


@hookimpl
def register_agents(register) -> None:
    register.add("verifiers", lambda options: verifiers_agent(
        options.environment, env_args=dict(options.env_args), sampling_args=dict(options.sampling_args)),
        options=VerifiersAgentOptions, description="a verifiers environment, by id, run unchanged")


@hookimpl
def register_datasets(register) -> None:
    register.add("verifiers", VerifiersDataset, options=VerifiersDatasetOptions,
                 description="the rows of a verifiers environment, by id")
