"""The slots of episodes: an in-process environment, an agent program, per-row routes, and
the episode driver that runs them (:class:`DriverSlot`)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from grpo_core.options import Seconds
from grpo_core.spec.slots import Section, Slot


class EnvironmentSlot(Slot):
    """Multi-turn episodes: an environment plugin answers every model turn (a tool result,
    a user message) until it ends the episode or a limit is hit. The episode is trained as
    one sequence whose loss mask covers only the model's tokens."""

    kind = "environment"
    name: str = Field(description="Environment plugin: tools (function calling) or an installed one.")
    max_turns: int = Field(4, ge=1, description="Model turns per episode at most (rollout.max_new_tokens bounds each).")
    max_total_tokens: int = Field(
        512, ge=1, description="Tokens after the prompt per episode at most, model and environment tokens "
        "together; an episode that reaches it ends (counted as truncated).",
    )


class AgentSlot(Slot):
    """Agent episodes: an agent program (a function or coroutine, see
    grpo_core.contracts.Agent) runs each episode against an OpenAI-compatible endpoint the
    run serves on 127.0.0.1 during rollouts, backed by the rollout backend; the tokens the
    policy sampled there are recorded and trained, one sequence per episode whose loss mask
    covers only those tokens (the agent's messages, tool results included, are context); an
    episode whose history is not append-only is several such sequences (``history``)."""

    kind = "agent"
    name: str = Field(description="Agent plugin (registered with register_agents, or passed to grpo_core.Trainer).")
    concurrency: int = Field(16, ge=1, description="Episodes running at once; their requests share generate calls.")
    timeout_s: Seconds = Field(
        300.0, gt=0,
        description="Seconds of its agent's own time one episode may take; then it is cancelled and recorded as "
        "failed (no reward). The time its requests wait at the endpoint for the policy's answers (queued behind "
        "other episodes' generate calls, then their own) does not count: env/queue_wait_seconds logs it.",
    )
    wait_timeout_s: Seconds = Field(
        600.0, gt=0,
        description="Seconds one request may wait for the policy's answer (the openai client's default request "
        "timeout); a longer wait means the rollout backend is stuck: the request is answered 504 (its episode "
        "fails) and the run stops with an error naming this setting once the backend's generate call returns.",
    )
    max_calls: int = Field(32, ge=1, description="Completion requests per episode at most; past it the episode fails.")
    max_total_tokens: int = Field(
        1024, ge=1, description="Tokens after the prompt per episode (per training sample of a split episode) at "
        "most, the policy's and the agent's together; a request that reaches it is answered up to it "
        "(finish_reason length) and the episode is counted as truncated.",
    )
    history: Literal["split", "refuse"] = Field(
        "split", description="A request whose prompt does not extend the episode's tokens so far (an edited or "
        "compacted history, a sub-agent, a chat template that drops past thinking): split: it starts a new training "
        "sample of the episode, prompted as the chat template renders its messages (the samples share the episode's "
        "reward and advantage; env/samples_per_episode counts them); refuse: HTTP 400 and the episode fails.",
    )
    template_check: Literal["warn", "refuse", "off"] = Field(
        "warn", description="At each chat request that extends an episode, the chat template renders the request's "
        "messages whole (as a server would, the answers as parsed) and the result is compared with the episode's "
        "tokens (the sampled ones, which are what trains): warn: a difference is logged once, naming the tool-call "
        "format and the first differing text (the model is trained on contexts its server renders otherwise); "
        "refuse: HTTP 400 and the episode fails; off: no check.",
    )
    max_request_bytes: int = Field(
        1_000_000, ge=1024, description="A request body larger than this is refused (HTTP 413) and fails its episode.",
    )
    batch_window_ms: float = Field(
        20.0, ge=0, le=10_000, allow_inf_nan=False,
        description="How long a request waits for other episodes' requests to join its generate call (every "
        "running episode waiting ends the wait sooner).",
    )
    cut_response: Literal["incomplete", "completed"] = Field(
        "incomplete", description="What POST /v1/responses answers for an answer cut at a token limit "
        "(max_output_tokens, rollout.max_new_tokens, max_total_tokens): incomplete (status incomplete, "
        "incomplete_details.reason max_output_tokens, as OpenAI and vLLM answer; the OpenAI Agents SDK's default "
        "model raises ModelBehaviorError on it, which fails the episode), or completed (the cut text as a completed "
        "response, as finish_reason length lets a chat client go on: the episode goes on and is scored, counted as "
        "truncated).",
    )


class DriverSlot(Slot):
    """The episode driver: how a prompt's G episodes run (grpo_core.contracts.EpisodeDriver).
    Unset, it is the driver of the episode source that is set: single-turn (none), environment,
    agent or routing."""

    kind = "episode_driver"
    name: str = Field(description="Episode driver plugin (registered with register_episode_drivers).")


class RouteSection(Section):
    """Where the rows of one route run: an environment or an agent."""

    environment: EnvironmentSlot | None = Field(None, description="An in-process environment for these rows.")
    agent: AgentSlot | None = Field(None, description="An agent for these rows.")
    driver: DriverSlot | None = Field(
        None, description="The episode driver of these rows; default: the route's source's (environment or agent).",
    )

    @model_validator(mode="after")
    def _one_source(self):
        if (self.environment is None) == (self.agent is None):
            raise ValueError("a route runs its rows with an environment or an agent: set exactly one")
        if self.driver is None:
            self.driver = DriverSlot(name=self.source.kind)
        return self

    @property
    def source(self) -> EnvironmentSlot | AgentSlot:
        return self.environment or self.agent


class RoutingSection(Section):
    """Episodes that differ per dataset row: a column of each row names its route, and each
    route runs its rows with its own environment or agent (tools shown in a row's prompt are
    its route's)."""

    kind: ClassVar[str] = "routing"  # what the routing episode driver runs
    column: str = Field("environment", description="The dataset column whose value names a row's route.")
    routes: dict[str, RouteSection] = Field(
        min_length=1, description="Route name -> {environment: {...}} or {agent: {...}}; a row whose column "
        "names none of them stops the run, naming the row's value and the routes.",
    )
