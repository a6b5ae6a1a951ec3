"""Building a run from a validated spec: the data, the model, the learner, the actor and the
feed between them (:func:`build_run`). Nothing here trains; the loop is
:mod:`grpo_core.train.loop.run`.

Every component is made once, here, from the spec's validated sections; the objects the loop
then holds read no spec value of their own. Copies of the policy are all made with
:func:`~grpo_core.contracts.policy_copy`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from grpo_core import checkpoint as ckpt
from grpo_core.contracts import (
    DriverSetup,
    EpisodeDriver,
    RolloutBackend,
    RolloutSetup,
    RowStream,
    policy_copy,
    special_ids,
)
from grpo_core.errors import RunError
from grpo_core.spec import LoadedSpec, Spec
from grpo_core.spec.metrics import reward_labels
from grpo_core.spec.parallel import parallel_conflicts
from grpo_core.tracking import RunLog
from grpo_core.train import model as modeling
from grpo_core.train.actor.actor import Actor, RolloutSettings
from grpo_core.train.actor.data import Prompt, PromptSource, check_columns
from grpo_core.train.actor.rollout import Scorer
from grpo_core.train.actor.scoring import RewardFn
from grpo_core.train.actor.stream import StreamingPromptSource
from grpo_core.train.distributed import Dist, check_layout, parallel_from_launcher
from grpo_core.train.feed import Feed, SyncFeed
from grpo_core.train.learner.kl import KLTerm
from grpo_core.train.learner.learner import Learner, UpdateSettings
from grpo_core.train.learner.optim import make_optimizer
from grpo_core.train.learner.packing import resolve_packing
from grpo_core.train.learner.parallel import Strategy, strategy_for
from grpo_core.train.learner.routing import check_replayable
from grpo_core.train.learner.update import Objective
from grpo_core.train.loop.evaluate import load_eval_sets
from grpo_core.train.loop.grpo import GrpoStage
from grpo_core.train.loop.iterative import build_iterative
from grpo_core.train.loop.sft import build_sft
from grpo_core.train.loop.state import Run, Stage
from grpo_core.train.pipeline import Pipeline
from grpo_core.train.reasoning_steps import split_steps
from grpo_core.train.seeds import seed_everything


def build_rewards(spec: Spec, splitter: Any) -> list[RewardFn]:
    """The spec's reward functions, labelled ``name`` (``name#i`` when a name is listed twice)."""
    labels = reward_labels([slot.name for slot in spec.rewards])
    cut = partial(split_steps, splitter, spec.algorithm.step_splitter.name)
    out = []
    for slot, label in zip(spec.rewards, labels):
        only = None if slot.sources is None else (spec.data.source_column, frozenset(slot.sources))
        out.append(RewardFn.of(label, slot.weight, slot.build(), splitter=cut,
                               concurrency=slot.concurrency, timeout=slot.call_timeout, only=only))
    return out


def build_scorer(spec: Spec, rewards: list[RewardFn], splitter: Any, with_steps: bool = False) -> Scorer:
    """How the actor calls the reward functions (``train.reward_errors``, the step splitter)."""
    return Scorer(rewards, spec.data.prompt_column, spec.train.reward_errors,
                  split=partial(split_steps, splitter, spec.algorithm.step_splitter.name), with_steps=with_steps)


def load_rows(spec: Spec, split: str) -> list[dict] | RowStream:
    """The rows of ``split`` (``train`` or ``eval``) of the spec's dataset, then of each of
    ``data.more_sources``, each labelled in ``data.source_column`` when it has a label; a
    failure names the dataset. A training split that streams comes back as a
    :class:`~grpo_core.contracts.RowStream` (held-out rows are read into memory)."""
    data = spec.data
    loaded = _load(data, split)
    stream = RowStream.of(loaded, f"dataset '{data.name}'") if not isinstance(loaded, list) else None
    if stream is not None and split == "eval":  # held-out rows are few: read them into memory
        loaded = list(stream.open())
    elif stream is not None:
        return _streamed(spec, stream)
    rows = _labelled(loaded, data.source_column, data.source)
    for i, more in enumerate(data.more_sources):
        extra = _load(more, split)
        if not isinstance(extra, list):
            raise RunError(f"data.more_sources[{i}]: dataset '{more.name}' streams its training rows, which a mixture "
                           "cannot take (it joins the sources' rows in memory): set its streaming: false")
        rows += _labelled(extra, data.source_column, more.source)
    return rows


def _streamed(spec: Spec, stream: RowStream) -> RowStream:
    """The training split as a stream, refusing what needs its rows in memory."""
    data, where = spec.data, f"data: dataset '{spec.data.name}' streams its training rows"
    needs = [(data.more_sources, "data.more_sources (a mixture joins rows in memory)"),
             (data.sampler, f"data.sampler '{data.sampler.name if data.sampler else ''}' (it draws rows by index from "
                            "the whole training split)"),
             (spec.iterative, "iterative (its reward-model prompts are drawn on every process)"),
             (data.image_column, "data.image_column (images are loaded and checked with the rows)")]
    for given, what in needs:
        if given:
            raise RunError(f"{where}, which {what} cannot take: drop it, or load the rows into memory "
                           f"({_in_memory(spec)})")
    if data.source_column is not None and data.source is not None:
        column, label, inner = data.source_column, data.source, stream
        return RowStream(lambda: ({**row, column: label} for row in inner.open()), stream.name, once=stream.once)
    return stream


def _in_memory(spec: Spec) -> str:
    """How the spec's training split comes into memory instead of streaming."""
    if getattr(spec.data.options, "streaming", None) is True:
        return "data.streaming: false"
    return "a datasets.Dataset or a list of rows instead of a stream"


def load_sft_rows(spec: Spec) -> tuple[list[dict], list[dict]] | None:
    """The ``(train, eval)`` demonstrations of ``spec.sft`` (None without it), their columns checked."""
    s = spec.sft
    if s is None:
        return None
    rows = _load(s.data, "train"), _load(s.data, "eval")
    if not all(isinstance(r, list) for r in rows):
        raise RunError(f"sft.data: dataset '{s.data.name}' streams its rows; the SFT stage reads its demonstrations "
                       "into memory: load them without streaming")
    needed = ({s.messages_column: "sft.messages_column"} if s.messages_column is not None else
              {s.data.prompt_column: "sft.data.prompt_column", s.completion_column: "sft.completion_column"})
    check_columns(rows[0], needed, "SFT training")
    check_columns(rows[1], needed, "SFT held-out")
    return rows


def _load(slot: Any, split: str) -> list[dict]:
    try:
        return slot.build().load(split)
    except RunError:
        raise
    except Exception as exc:
        raise RunError(f"data: dataset '{slot.name}' failed to load: {type(exc).__name__}: {exc}") from exc


def _labelled(rows: list[dict], column: str | None, label: str | None) -> list[dict]:
    if column is None or label is None:
        return rows
    return [{**row, column: label} for row in rows]


def required_columns(rewards: list[RewardFn]) -> dict[str, str]:
    """Each dataset column a reward function that scores every row needs, with who needs it."""
    return {c: f"reward function '{fn.name}'" for fn in rewards if fn.only is None for c in fn.required_columns}


def check_routed_columns(rows: list[dict], rewards: list[RewardFn], split: str) -> None:
    """The columns a reward with ``sources`` needs, in the first row of one of its sources."""
    for fn in rewards:
        if fn.only is not None and fn.required_columns:
            column, allowed = fn.only
            mine = [row for row in rows if str(row.get(column)) in allowed][:1]
            check_columns(mine, dict.fromkeys(fn.required_columns, f"reward function '{fn.name}'"),
                          f"{split} rows of source {sorted(allowed)}")


def build_episodes(spec: Spec, model, tokenizer, scorer: Scorer) -> EpisodeDriver:
    """The episode driver ``rollout.driver`` names (by default the one of the episode source the
    spec sets: single-turn, environment, agent or routing), set up for this run."""
    r = spec.rollout
    driver = r.driver.build()
    if driver.multi_turn and (scorer.with_steps or any(fn.takes_steps for fn in scorer.rewards)):
        raise RunError(f"episode driver '{r.driver.name}': process supervision (step scores) is not supported on "
                       "multi-turn episodes; use outcome rewards")
    eos_ids, pad_id = special_ids(model, tokenizer, r.driver.name)
    driver.setup(DriverSetup(tokenizer, eos_ids, pad_id, r.group_size, r.episode_source[1],
                             dict(spec.data.chat_template_kwargs)))
    return driver


def check_routes(spec: Spec, rows: list[dict]) -> None:
    """Every row names a route of ``rollout.routing`` (when set): a bad value is found before
    the model loads, with how many rows hold it."""
    routing = spec.rollout.routing
    if routing is None:
        return
    values: dict[Any, int] = {}
    for row in rows:
        value = row.get(routing.column)
        if value not in routing.routes:
            values[value] = values.get(value, 0) + 1
    if values:
        found = ", ".join(f"{v!r} ({n} rows)" for v, n in values.items())
        raise RunError(f"rollout.routing: column '{routing.column}' holds values that name no route: {found}; "
                       f"routes: {', '.join(routing.routes)}")


def prompt_tools(driver: EpisodeDriver) -> Any:
    """What the prompts show as tools: the driver's, per row."""
    return driver.tools_for


def prompt_budget(spec: Spec, model) -> int:
    """The longest prompt in tokens: ``data.max_prompt_tokens``, else what the model's context
    leaves after the longest completion (or episode)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    context = getattr(config, "max_position_embeddings", None) or 10**9
    return spec.data.max_prompt_tokens or max(1, context - spec.rollout.episode_tokens)


def held_out_prompts(spec: Spec, rows: list[dict], tokenizer, max_tokens: int, tools, processor=None
                     ) -> list[Prompt]:
    """The default held-out set: ``rows`` rendered, unrenderable ones left out, at most
    ``eval.max_prompts``."""
    source = PromptSource(rows or [{}], tokenizer, spec.data, seed=0, max_tokens=max_tokens, shuffle=False,
                          tools=tools, processor=processor, split="held-out")
    return [p for p in map(source.render, rows) if p is not None][: spec.eval.max_prompts]


def build_learner(spec: Spec, model, tokenizer, strategy: Strategy) -> Learner:
    """The learner of ``model``: the objective, optimizer and schedule, the advantage estimator
    and the KL term; ``model`` (and the KL's reference copy) wrapped or sharded by
    ``strategy`` before the optimizer is made, which must hold what the strategy trains."""
    algo, dist = spec.algorithm, strategy.dist
    kl = KLTerm.from_spec(algo.kl, model)
    strategy.setup(model, getattr(kl and kl.reference, "model", None))
    objective = Objective(
        policy_loss=algo.policy_loss.build(), aggregator=algo.aggregation.build(),
        kl=kl if kl is not None and kl.in_loss else None,
        entropy_coef=algo.entropy_coef, early_stop_imp_ratio=algo.early_stop_imp_ratio,
        max_length=spec.rollout.episode_tokens,
        correction=algo.rollout_correction,
    )
    optimizer, scheduler = make_optimizer(model, spec.train, spec.train.steps * algo.mu * spec.train.mini_batches)
    learner = Learner(
        model=model, optimizer=optimizer, scheduler=scheduler, objective=objective,
        settings=UpdateSettings.from_spec(spec), estimator=algo.advantage.build(), kl=kl, tokenizer=tokenizer,
        strategy=strategy, autocast=partial(modeling.autocast, spec.train.mixed_precision, dist.device),
        scaler=torch.amp.GradScaler(dist.device.type) if spec.train.mixed_precision == "fp16" else None,
    )
    learner.check_teacher()
    return learner


def build_actor(spec: Spec, backend, scorer: Scorer, dist: Dist, driver: EpisodeDriver, weights,
                greedy_baseline: bool) -> Actor:
    """The actor of the spec's rollout settings, with no prompt source yet."""
    return Actor(
        backend=backend, scorer=scorer, settings=RolloutSettings.from_spec(spec), dist=dist,
        autocast=partial(modeling.autocast, spec.train.mixed_precision, dist.device), driver=driver,
        weights=weights, greedy_baseline=greedy_baseline,
    )


def _actor_and_feed(spec: Spec, model, tokenizer, processor, backend, learner: Learner, scorer: Scorer, snapshot,
                    sampler) -> tuple[Actor, Feed]:
    """The actor and the feed that hands its experience over: synchronous, or the pipeline
    when ``rollout.max_staleness > 0`` (then the actor's collectives get a process group of
    their own: they run in its thread); the backend set up on the policy (or on the
    ``sampler`` copy of an asynchronous run whose backend generates with the policy module),
    with the pipeline's weight switch under partial rollouts."""
    strategy, k = learner.strategy, spec.rollout.max_staleness
    actor = build_actor(
        spec, backend, scorer, strategy.dist.side_group() if k else strategy.dist,
        build_episodes(spec, model, tokenizer, scorer),
        partial(strategy.rollout_weights, backend) if sampler is None else contextlib.nullcontext,
        learner.estimator.needs_greedy_baseline,
    )
    feed = SyncFeed(actor) if not k else Pipeline(
        actor, k, snapshot, sampler=sampler, behaviour=learner.sampler_logprobs if sampler is not None else None,
        interruptible=interruptible_backend(spec, backend, strategy.dist.world))
    actor.pushed = backend.setup(RolloutSetup(model if sampler is None else sampler, tokenizer, processor=processor,
                                              max_staleness=k, switch=feed.switch if k else None,
                                              record_routes=spec.algorithm.routing_replay))
    return actor, feed


def interruptible_backend(spec: Spec, backend: RolloutBackend, world: int) -> bool:
    """Whether the run has partial rollouts: ``rollout.partial_rollouts`` is on and the
    backend can stop mid-generation (its capabilities say ``interruptible``). Refused, naming
    what to change, for a backend that cannot, and for several processes (each would take new
    weights at its own moment, and their weight gathers and pushes are collectives that must
    pair up)."""
    if not spec.rollout.partial_rollouts:
        return False
    can = backend.capabilities
    if not can.interruptible:
        raise RunError(f"rollout.partial_rollouts: rollout backend '{spec.rollout.name}' cannot stop mid-generation; "
                       "use rollout.name: vllm or vllm-server, or partial_rollouts: false")
    if can.generates_with_policy:
        raise RunError(f"rollout.partial_rollouts: rollout backend '{spec.rollout.name}' generates with the policy "
                       "module, whose sampler log-probs the pipeline computes after the batch with one version; "
                       "partial rollouts need a backend that returns each token's own (vllm, vllm-server)")
    if world > 1:
        raise RunError(f"rollout.partial_rollouts: runs in one process only (this run has {world}); "
                       "set partial_rollouts: false or run one process")
    return True


def load_processing(loaded: LoadedSpec, given: Any = None) -> tuple[Any, Any]:
    """``(processor, tokenizer)``: with ``data.image_column``, the model's processor (or
    ``given``, when it is a processor) and its tokenizer; otherwise no processor and the
    tokenizer loaded (or ``given``) as ever."""
    spec = loaded.spec
    processor = None
    if given is not None and getattr(given, "image_processor", None) is not None:
        processor, given = given, given.tokenizer
    elif spec.data.image_column is not None and given is None:
        processor = modeling.load_processor(spec.model, loaded.base_dir)
        given = processor.tokenizer
    tokenizer = modeling.load_tokenizer(spec.model, loaded.base_dir) if given is None else modeling.prepare_tokenizer(
        given)
    if spec.data.image_column is None:
        return None, tokenizer
    if processor is None:
        from grpo_core.train.model import check_processor

        check_processor(None, "given from Python: pass its processor as the tokenizer")
    return processor, tokenizer


def check_image_run(spec: Spec, backend: RolloutBackend, model: Any) -> None:
    """Refuse what prompts with images cannot run with yet, naming the setting (``train.packing:
    true`` before the first step: :func:`~grpo_core.train.learner.packing.resolve_packing`)."""
    resolve_packing(spec.train.packing, model)
    if not backend.capabilities.accepts_images:
        raise RunError(f"data.image_column: rollout backend '{spec.rollout.name}' does not take images; "
                       "use rollout.name: hf or vllm")
    if getattr(spec.algorithm.advantage.options, "teacher", None) is not None:
        raise RunError(f"data.image_column: the advantage estimator '{spec.algorithm.advantage.name}' scores with a "
                       "teacher model, which does not see the images; train image prompts without a teacher")
    r = spec.rollout
    if r.environment is not None or r.agent is not None or r.routing is not None:
        raise RunError("data.image_column: multi-turn episodes (rollout.environment, agent, routing) do not take "
                       "images yet")


@dataclass
class _Rows:
    """The rows a run reads before its model loads: training (the first row of a stream stands
    for the others in the checks), held-out, and the SFT stage's ``(train, eval)``."""

    train: list[dict]
    eval: list[dict]
    stream: RowStream | None
    sft: tuple[list[dict], list[dict]] | None


def _prepare(loaded: LoadedSpec, dist: Dist | None) -> tuple[Dist, Any, RolloutBackend]:
    """What is settled before anything loads: the processes, the parallel strategy (the
    launcher's accelerate config checked against the spec), the rollout backend built (not
    set up) to refuse what it cannot do, the random state seeded and the thread count set."""
    spec = loaded.spec
    dist = dist or Dist.from_env(spec.train.device, spec.train.parallel.timeout_s)
    check_layout(spec, dist.world)
    backend = spec.rollout.build()
    interruptible_backend(spec, backend, dist.world)
    parallel = parallel_from_launcher(spec.train.parallel)
    if parallel_conflicts(spec, parallel):
        raise RunError("accelerate's FSDP config selects fsdp2, but " + "; ".join(parallel_conflicts(spec, parallel)))
    seed_everything(spec.train.seed)
    if spec.train.threads:
        torch.set_num_threads(spec.train.threads)
    return dist, parallel, backend


def _read_rows(spec: Spec, rewards: list[RewardFn]) -> _Rows:
    """The datasets' rows, every column the prompts, routes and reward functions need checked
    in the training and held-out rows, before the model loads."""
    train_rows, eval_rows = load_rows(spec, "train"), load_rows(spec, "eval")
    stream = train_rows if isinstance(train_rows, RowStream) else None
    if stream is not None:  # its first row stands for the others in the checks
        first = stream.first()
        train_rows = [first] if first is not None else []
    needed = {spec.data.prompt_column: "data.prompt_column"}
    if spec.rollout.routing is not None:
        needed[spec.rollout.routing.column] = "rollout.routing.column"
    needed.update({c: who for c, who in required_columns(rewards).items() if c not in needed})
    for rows, split in ((train_rows, "training"), (eval_rows, "held-out")):
        check_columns(rows, needed, split)
        check_routed_columns(rows, rewards, split)
    check_routes(spec, train_rows + eval_rows)
    return _Rows(train_rows, eval_rows, stream, load_sft_rows(spec))


def _prompt_source(spec: Spec, rows: _Rows, tokenizer, processor, dist: Dist, max_tokens: int, tools
                   ) -> PromptSource | StreamingPromptSource:
    """Where the actor draws its training prompts: the stream, or the rows in memory through
    ``data.sampler``."""
    if rows.stream is not None:
        return StreamingPromptSource(rows.stream, tokenizer, spec.data, seed=spec.train.seed, max_tokens=max_tokens,
                                     rank=dist.rank, world=dist.world, buffer_size=spec.data.shuffle_buffer,
                                     tools=tools)
    sampler = spec.data.sampler.build() if spec.data.sampler is not None else None
    return PromptSource(rows.train, tokenizer, spec.data, seed=spec.train.seed, max_tokens=max_tokens, tools=tools,
                        sampler=sampler, processor=processor)


def _load_policy(loaded: LoadedSpec, model, tokenizer, dist: Dist) -> tuple[Any, Any, Any]:
    """``(model, processor, tokenizer)``: the policy loaded from ``model.path`` (or the given
    object prepared) on this process's device."""
    spec = loaded.spec
    processor, tokenizer = load_processing(loaded, tokenizer)
    model = (modeling.load_policy(spec.model, loaded.base_dir, tokenizer, dist.device) if model is None
             else modeling.prepare_policy(model, spec.model, tokenizer)).to(dist.device)
    return model, processor, tokenizer


def _stages(spec: Spec, rows: _Rows, learner: Learner, rewards: list[RewardFn], output_dir: Path, eos_id: int
            ) -> list[Stage]:
    """The run's stages in order: the SFT stage (spec section ``sft``), then GRPO with
    iterative GRPO's reward-model refresh as its hook."""
    reference = learner.kl.reference if learner.kl is not None else None
    sft = build_sft(spec, learner.tokenizer, output_dir, rows.sft, eos_id)
    grpo = GrpoStage(spec, learner, output_dir, build_iterative(spec, rewards, reference))
    return [stage for stage in (sft, grpo) if stage is not None]


def build_run(loaded: LoadedSpec, dist: Dist | None = None, *, model=None, tokenizer=None) -> Run:
    """The run of ``loaded``: every component built, nothing trained yet. ``model`` and
    ``tokenizer``: objects to train instead of loading ``model.path`` (the Python trainer's)."""
    spec = loaded.spec
    dist, parallel, backend = _prepare(loaded, dist)
    output_dir = ckpt.run_folder(loaded)
    output_dir.mkdir(parents=True, exist_ok=True)
    splitter = spec.algorithm.step_splitter.build()
    rewards = build_rewards(spec, splitter)
    rows = _read_rows(spec, rewards)
    model, processor, tokenizer = _load_policy(loaded, model, tokenizer, dist)
    if processor is not None:
        check_image_run(spec, backend, model)
    if spec.algorithm.routing_replay:
        check_replayable(model)
    # Asynchronous rollouts: whole copies of the policy, made before the strategy shards it: the
    # snapshot the learner's weights cross in, and for a backend that generates with the policy
    # module, the weights the actor samples from while the learner's move.
    k = spec.rollout.max_staleness
    snapshot = policy_copy(model) if k else None
    sampler = policy_copy(model) if k and backend.capabilities.generates_with_policy else None
    learner = build_learner(spec, model, tokenizer, strategy_for(dist, parallel))
    scorer = build_scorer(spec, rewards, splitter, with_steps=learner.estimator.needs_step_scores)
    actor, feed = _actor_and_feed(spec, model, tokenizer, processor, backend, learner, scorer, snapshot, sampler)
    max_prompt, tools = prompt_budget(spec, model), prompt_tools(actor.driver)
    actor.source = _prompt_source(spec, rows, tokenizer, processor, dist, max_prompt, tools)
    run = Run(
        spec=spec, loaded=loaded, output_dir=output_dir, actor=actor, learner=learner, feed=feed,
        stages=_stages(spec, rows, learner, rewards, output_dir, special_ids(model, tokenizer, "sft")[0][0]),
        eval_prompts=held_out_prompts(spec, rows.eval, tokenizer, max_prompt, tools, processor),
        log=RunLog({slot.name: slot.build() for slot in spec.tracking}, output_dir, enabled=dist.is_main),
        eval_sets=load_eval_sets(spec, tokenizer, max_prompt, required_columns(rewards), tools, processor),
        processor=processor,
    )
    if run.stages[-1].best is not None and not run.has_eval:
        raise RunError("checkpoint.best_metric ranks steps by an evaluation, but this run has no held-out "
                       "prompts (data.eval_size, eval.sets): add some or drop best_metric")
    return run
