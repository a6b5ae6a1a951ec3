"""Agent episodes: programs that talk to the policy through an OpenAI-compatible endpoint.

For each rollout, :class:`AgentRunner` serves an endpoint on 127.0.0.1
(:mod:`grpo_core.endpoint.server`), runs ``G`` episodes of each prompt with the spec's agent
(``rollout.agent``: a function or coroutine function, :class:`~grpo_core.contracts.Agent`),
at most ``concurrency`` at once, each within ``timeout_s`` of its agent's own time (the time its
requests wait for the policy's answers does not count; one request waiting longer than
``wait_timeout_s`` stops the run: the engine is stuck), and answers their requests with
the run's rollout backend from the calling thread: requests that arrive together (every
running episode waiting, or ``batch_window_ms`` after the first) share one ``generate``
call per set of stop strings, a prompt asked for by several episodes (their first turn)
prefilled once.

What trains is what the endpoint recorded: per episode, one sequence of the first prompt's
tokens, then each call's sampled tokens (in the loss mask, with the sampler's log-probs when
the backend gives them) and the tokens of the messages the agent added (context). A request
that does not extend the episode so far starts a new training sample of it, or fails it
(``rollout.agent.history``, :mod:`grpo_core.train.actor.drivers.histories`). The ``G`` episodes of a
prompt share the longest common prefix of their samples' prompts as the group's prompt; the
rest of each prompt is context. An episode whose agent raised, timed out,
edited its history (under ``history: refuse``) or broke a limit is failed: no reward, no token
in the loss (``env/failed_episodes`` counts them). An agent's ``SystemExit`` (``sys.exit``,
``_thread.exit``) or ``KeyboardInterrupt`` fails its own episode like any exception: the
event loop all coroutine agents share goes on, as it does when an agent stops it. Agent
episodes are not bit-reproducible across runs: which requests share a ``generate`` call
depends on timing.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any

from grpo_core.contracts import DriverSetup, RolloutBatch, SamplingParams
from grpo_core.endpoint.server import (
    Endpoint,
    EndpointError,
    Request,
    plain,
    same_message,
)
from grpo_core.endpoint.streaming import pieces
from grpo_core.endpoint.toolcalls import tool_format
from grpo_core.errors import RunError, fault_text
from grpo_core.train.actor.drivers.agent_tasks import AgentTasks, EpisodeClock, Job, JobQueue, timed_out
from grpo_core.train.actor.drivers.episodes import (
    EpisodeRecord,
    TurnRenderer,
    device_of,
    episodes_batch,
    source_of,
    with_tools,
)
from grpo_core.train.actor.drivers.histories import (
    NotExtended,
    Sample,
    called_names,
    episode_row,
    first_difference,
    keeps_turn,
    shared_messages,
    template_message,
)

log = logging.getLogger("grpo.agents")
#: Where a chat template that renders an episode otherwise than it was sampled is named.
template_log = logging.getLogger("grpo.templates")


@dataclass
class _Live:
    """One agent episode while it runs (its tokens are in ``record``)."""

    key: str
    row: dict[str, Any]
    index: int
    record: EpisodeRecord
    first: list[int] | None = None  # the first prompt's token ids
    history: list[tuple[dict[str, Any], bool]] = field(default_factory=list)  # (message, answered here)
    text: str | None = None  # the completions API's text so far
    pending: list[dict[str, Any]] | None = None  # the choices of an n > 1 call, until one is continued
    eos: bool = False  # the last sampled turn ended with an EOS token
    said: str | None = None  # the text of the last sampled turn
    samples: list[Sample] = field(default_factory=list)  # the episode's finished training samples
    calls: int = 0
    busy: bool = False
    exhausted: bool = False  # max_total_tokens reached
    clock: EpisodeClock = field(default_factory=EpisodeClock)
    closed: bool = False
    failure: str | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def fail(self, why: str) -> None:
        if not self.closed:
            self.failure, self.closed = why, True


@dataclass
class AgentRunner:
    """Runs agent episodes against an endpoint backed by a rollout backend (module doc)."""

    agent: Any
    slot: Any  # the spec's rollout.agent (AgentSlot)
    tokenizer: Any
    eos_ids: list[int]
    pad_id: int
    max_n: int = 16
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # data.chat_template_kwargs

    def __post_init__(self) -> None:
        self.renderer = TurnRenderer(self.tokenizer, self.eos_ids)
        self.format = tool_format(self.tokenizer.chat_template)  # how this model family writes tool calls
        self._warned = False  # a template that renders an episode otherwise was logged

    @property
    def tools(self) -> list[dict]:
        """Agents send their tools with their requests: the prompts show none."""
        return []

    # ----------------------------------------------------------------- a rollout
    def run(self, backend: Any, prompts: list, group_size: int, sampling: SamplingParams) -> RolloutBatch:
        """``G = group_size`` agent episodes of each of the ``P`` prompts; a
        :class:`RolloutBatch` of ``B = P*G`` rows whose mask has holes."""
        episodes = [_Live(secrets.token_urlsafe(16), dict(p.row), g, EpisodeRecord([], None))
                    for p in prompts for g in range(group_size)]
        self._episodes = {e.key: e for e in episodes}
        self._sampling, self._queue, self._with_logp = sampling, JobQueue(), True
        self._stuck: str | None = None  # why the engine is taken as stuck (a request waited past wait_timeout_s)
        endpoint = Endpoint(self._handle, self._refuse, sampling, self.slot.max_request_bytes, self.max_n,
                            self.slot.cut_response)
        tasks = AgentTasks(self.agent, episodes, endpoint.base_url, self.slot.concurrency, self.slot.timeout_s,
                       self._queue.poke)
        calls = [0]
        try:
            while not all(e.closed for e in episodes) or self._queue.jobs:
                jobs = self._queue.take(self.slot.batch_window_ms / 1000, lambda: tasks.running,
                                        lambda: all(e.closed for e in episodes))
                self._expire(episodes)
                if jobs:
                    self._generate(backend, jobs, sampling, calls)
                self._check_engine()
            self._check_engine()
        finally:
            for job in self._queue.jobs:
                job.error = "the rollout ended"
                job.done.set()
            tasks.cancel()
            endpoint.close()
        return self._assemble(prompts, episodes, group_size, backend)

    def _expire(self, episodes: list[_Live]) -> None:
        """Close episodes past their timeout whose agent did not stop (cancelled too late)."""
        now = time.monotonic()
        for e in episodes:
            if not e.closed and e.clock.own(now) > self.slot.timeout_s + 1.0:
                e.fail(timed_out(self.slot.timeout_s))

    def _check_engine(self) -> None:
        """A :class:`RunError` once a request waited past ``wait_timeout_s`` for the policy."""
        if self._stuck is not None:
            raise RunError(f"agent episodes: a request {self._stuck}; the rollout backend is stuck, or slower than "
                           "the setting allows (raise it if the backend is only slow)")

    def _generate(self, backend: Any, jobs: list[Job], sampling: SamplingParams, calls: list[int]) -> None:
        """The policy's answers to ``jobs``: one ``generate`` per stop set and copies per
        prompt, identical prompts prefilled once."""
        groups: dict[tuple, dict[tuple, list[Job]]] = {}
        for job in jobs:
            groups.setdefault((job.stop, job.n), {}).setdefault(tuple(job.prompt), []).append(job)
        for (stop, n), buckets in groups.items():
            by_size: dict[int, list[tuple[tuple, list[Job]]]] = {}
            for prompt, same in buckets.items():
                by_size.setdefault(len(same), []).append((prompt, same))
            for size, entries in by_size.items():
                todo = [j for _, same in entries for j in same]
                params = replace(sampling, stop=stop, max_new_tokens=max(j.want for j in todo),
                                 seed=None if sampling.seed is None else sampling.seed + 104_729 * calls[0])
                calls[0] += 1
                try:
                    batch = backend.generate([list(p) for p, _ in entries], size * n, params)
                except Exception as exc:
                    for job in todo:
                        job.error = f"generation failed: {fault_text(exc)}"
                        job.done.set()
                    raise
                self._with_logp = self._with_logp and batch.sampling_logp is not None
                for row_start, job in zip(range(0, len(todo) * n, n), todo):
                    job.choices = [self._choice(batch, row, job.want) for row in range(row_start, row_start + n)]
                    job.done.set()

    def _choice(self, batch: RolloutBatch, row: int, want: int) -> dict[str, Any]:
        size = int(batch.completion_mask[row].sum())
        ids = batch.completion_ids[row, :size].tolist()
        logp = batch.sampling_logp[row, :size].tolist() if batch.sampling_logp is not None else None
        cut = len(ids) > want
        ids, logp = ids[:want], None if logp is None else logp[:want]
        text = self.tokenizer.decode(ids, skip_special_tokens=True) if cut else batch.completions[row]
        finish = "length" if cut or bool(batch.truncated[row]) else "stop"
        return {"ids": ids, "logp": logp, "text": text, "finish": finish,
                "eos": bool(ids) and ids[-1] in self.eos_ids}

    # ----------------------------------------------------------------- the endpoint's side
    def _refuse(self, key: str, error: EndpointError) -> None:
        episode = self._episodes.get(key)
        if episode is not None and error.fatal:
            episode.fail(f"HTTP {error.status}: {error.message}")

    def _handle(self, request: Request) -> tuple[list[dict[str, Any]], int]:
        """Answer one request (called in an endpoint thread): the choices (dicts of ``text``,
        ``ids``, ``logp``, ``finish``, ``message``) and the prompt's length in tokens. The time
        the endpoint takes (the chat template, the queue for the shared policy, its generate
        call, the answer) is the episode's wait, not its agent's own time."""
        e = self._episodes.get(request.key)
        if e is None:
            raise EndpointError(401, "unknown episode key: use the api_key of the episode's AgentEpisode")
        with e.lock:
            if e.closed:
                raise EndpointError(409, f"the episode is over ({e.failure or 'its agent returned'})")
            if e.busy:
                raise EndpointError(409, "one request at a time per episode: its history is one sequence", True)
            e.busy = True
        e.clock.wait_begins()
        try:
            return self._serve(e, request)
        finally:
            e.clock.wait_ends()
            with e.lock:
                e.busy = False

    def _serve(self, e: _Live, request: Request) -> tuple[list[dict[str, Any]], int]:
        """:meth:`_handle`'s work on a request of episode ``e``, which is not closed and has no other."""
        slot = self.slot
        with e.lock:
            e.calls += 1
            if e.calls > slot.max_calls:
                raise EndpointError(429, f"more than {slot.max_calls} requests (rollout.agent.max_calls)", True)
            try:
                prompt_tokens = self._extend(e, request)
            except EndpointError as exc:
                e.calls -= not exc.fatal  # refused, not served: the agent may correct it
                raise
            room = slot.max_total_tokens - len(e.record.ids)
            if e.exhausted or room <= 0:
                e.record.truncated = e.exhausted = True
                empty = {"ids": [], "logp": None, "text": "", "finish": "length", "eos": False,
                         "message": {"role": "assistant", "content": ""}}
                return [dict(empty, pieces=[]) for _ in range(request.n)], prompt_tokens
            want = min(request.max_tokens or self._sampling.max_new_tokens, self._sampling.max_new_tokens, room)
            stop = tuple(dict.fromkeys((*self._sampling.stop, *request.stop,
                                        *(self.format.stop if request.tools else ()))))
            job = Job(e, e.first + e.record.ids, want, stop, request.n)
        self._queue.submit(job)
        finished = job.done.wait(timeout=slot.wait_timeout_s)
        with e.lock:
            if not finished:
                why = (f"waited more than {slot.wait_timeout_s:g} s for the policy's answer "
                       "(rollout.agent.wait_timeout_s)")
                log.error("an agent episode's request %s: the rollout backend is stuck or far slower than that; the "
                          "run stops when its generate call returns", why)
                self._stuck = self._stuck or why
                raise EndpointError(504, why, True)
            if job.error is not None:
                raise EndpointError(503, job.error, True)
            if e.closed:
                raise EndpointError(409, f"the episode is over ({e.failure or 'its agent returned'})")
            return self._answer(e, request, job.choices), prompt_tokens

    def _extend(self, e: _Live, request: Request) -> int:
        """Append what the agent added since its last call (context) to the episode; the
        prompt's length in tokens. A request that does not extend the episode starts a new
        training sample (``history: split``) or fails the episode (``refuse``)."""
        if e.first is None:
            if request.chat:
                e.first = self._rendered(request.messages, request.tools, plain)
                e.history = [(m, False) for m in request.messages]
            else:
                e.first, e.text = self.tokenizer(request.prompt)["input_ids"], request.prompt
            return len(e.first)
        try:
            (self._extend_chat if request.chat else self._extend_text)(e, request)
        except NotExtended as broken:
            if self.slot.history == "refuse":
                raise broken.error from None
            self._split(e, request)
        return len(e.first) + len(e.record.ids)

    def _rendered(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], shown) -> list[int]:
        """The token ids of ``messages`` (each as ``shown`` gives it to the chat template) as a
        prompt: rendered whole, with the generation prompt; a 400 (the episode goes on) when
        the template refuses them."""
        try:
            given, kwargs = with_tools(self.tokenizer, [shown(m) for m in messages], tools)
            text = self.tokenizer.apply_chat_template(given, tokenize=False, add_generation_prompt=True,
                                                      **self.chat_template_kwargs, **kwargs)
        except Exception as exc:  # the agent's messages: it may send others
            raise _unrenderable(messages, exc) from None
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _extend_chat(self, e: _Live, request: Request) -> None:
        """Append the messages the agent added since its last call (context) to the episode;
        :class:`NotExtended` when the request does not extend it."""
        messages = request.messages
        known = len(e.history)
        if e.pending is not None:  # an n > 1 call: the choice the agent went on with
            kept = next((c for c in e.pending if known < len(messages)
                         and same_message(messages[known], c["message"])), None)
            if kept is None:
                raise NotExtended(EndpointError(400, f"message {known} is none of the {len(e.pending)} choices "
                                                     "answered before: the episode's history was edited", True))
            self._keep(e, kept)
            known += 1
        shared = shared_messages(messages, e.history)
        if shared < min(len(messages), len(e.history)):
            raise NotExtended(EndpointError(400, f"message {shared} differs from the episode's history: a request "
                                                 "must repeat every earlier message and answer unchanged", True))
        new = messages[known:]
        if len(messages) < known or not new:
            raise NotExtended(EndpointError(400, "the request adds no message to the episode's history (a retry of "
                                                 "an answered request edits the history)", True))
        own = self.format.observation([plain(m) for m in new], called_names(e.history, new), e.eos)
        try:
            ids = self.renderer.observation_ids([plain(m) for m in new], e.eos) if own is None else \
                self.tokenizer(own, add_special_tokens=False)["input_ids"]
        except RunError as exc:  # nothing of the request is recorded yet: the agent may send others
            raise NotExtended(_unrenderable(new, exc.__cause__ or exc)) from None
        if self.slot.history == "split" and e.said is not None and not self._keeps(e, new):
            raise NotExtended(EndpointError(400, "the chat template renders the last answer otherwise once "
                                                 "these messages follow it", True))
        self._context(e, ids)
        e.history.extend((m, False) for m in new)
        e.record.messages.extend(plain(m) for m in new)
        if self.slot.template_check != "off" and not e.exhausted:
            self._check_rendering(e, request)

    def _keeps(self, e: _Live, new: list[dict[str, Any]]) -> bool:
        """Whether the episode's last answer stays as the policy wrote it once ``new`` follows:
        the tool-call format's rule where it has one, else the chat template's rendering."""
        answer = next((m for m, answered in reversed(e.history) if answered), {})
        kept = self.format.keeps(answer)
        return keeps_turn(self.tokenizer, e.said, new, self.chat_template_kwargs) if kept is None else kept

    def _check_rendering(self, e: _Live, request: Request) -> None:
        """Compare the chat template's rendering of the request's messages (the answers as
        parsed, as a server renders a conversation) with the episode's tokens (the sampled
        ones): a difference is logged once (``template_check: warn``) or fails the episode
        (``refuse``), named."""
        try:
            fresh = self._rendered(request.messages, request.tools, template_message)
        except EndpointError as exc:
            difference = f"the template cannot render the conversation whole ({exc.message})"
        else:
            difference = first_difference(self.tokenizer, fresh, e.first + e.record.ids)
        if difference is None:
            return
        what = (f"the chat template renders this episode's conversation otherwise than the tokens the policy sampled "
                f"and trains on (tool-call format {self.format.name}): {difference}")
        if self.slot.template_check == "refuse":
            raise EndpointError(400, f"{what} (rollout.agent.template_check: refuse)", True)
        if not self._warned:
            self._warned = True
            template_log.warning("%s; the model is trained on contexts its server renders otherwise "
                        "(rollout.agent.template_check: warn; logged once)", what)

    def _extend_text(self, e: _Live, request: Request) -> None:
        """The completions API: the prompt extends the episode's text so far."""
        if e.pending is not None:
            kept = next((c for c in e.pending if request.prompt.startswith(e.text + c["text"])), None)
            if kept is None:
                raise NotExtended(EndpointError(400, "the prompt continues none of the choices answered before",
                                                True))
            self._keep(e, kept)
        if not request.prompt.startswith(e.text) or request.prompt == e.text:
            raise NotExtended(EndpointError(400, "the prompt must extend the episode's text so far (its previous "
                                                 "prompt and the completion answered)", True))
        self._context(e, self.tokenizer(request.prompt[len(e.text):], add_special_tokens=False)["input_ids"])
        e.text = request.prompt

    def _split(self, e: _Live, request: Request) -> None:
        """Start a new training sample of the episode, prompted by ``request`` as the chat
        template renders its messages (the text itself for the completions API): the tokens so
        far become a finished sample (an n > 1 call not continued keeps its first choice)."""
        if request.chat:
            prompt = self._rendered(request.messages, request.tools, template_message)  # a 400 changes nothing
        else:
            prompt = self.tokenizer(request.prompt)["input_ids"]
        if e.pending is not None:
            self._keep(e, e.pending[0])
        record = e.record
        e.samples.append(Sample(e.first, record.ids, record.mask, record.logp))
        record.ids, record.mask, record.logp = [], [], []
        e.first, e.exhausted, e.said = prompt, False, None
        if request.chat:
            record.messages.extend(plain(m) for m in request.messages[shared_messages(request.messages,
                                                                                      e.history):])
            e.history = [(m, False) for m in request.messages]
        else:
            e.text = request.prompt

    def _context(self, e: _Live, ids: list[int]) -> None:
        if len(e.record.ids) + len(ids) >= self.slot.max_total_tokens:
            e.exhausted = True
            return
        e.record.extend(ids, False)

    def _answer(self, e: _Live, request: Request, choices: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The choices as the agent receives them; a single one is the episode's at once,
        several wait for the agent to go on with one."""
        for choice in choices:
            if request.chat:
                raw = self.tokenizer.decode([i for i in choice["ids"] if i not in self.eos_ids]) \
                    if self.format.special else None
                choice["message"], calls = self.format.message(choice["text"], bool(request.tools), raw,
                                                               request.tools)
                choice["calls"] = len(choice["message"].get("tool_calls") or [])
                if calls and choice["finish"] == "stop":
                    choice["finish"] = "tool_calls"
            else:
                choice["message"], choice["calls"] = {"role": "assistant", "content": choice["text"]}, 0
            if request.stream:
                choice["pieces"] = pieces(self.tokenizer, choice["ids"], choice["text"])
        if len(choices) == 1:
            self._keep(e, choices[0])
        else:
            e.pending = choices
        return choices

    def _keep(self, e: _Live, choice: dict[str, Any]) -> None:
        """The episode goes on with ``choice``: its tokens in the loss, its message in the history."""
        e.pending = None
        e.record.extend(choice["ids"], True, choice["logp"])
        e.record.turns += 1
        e.record.tool_calls += choice["calls"]
        e.record.messages.append(plain(choice["message"]) | (
            {"tool_calls": choice["message"]["tool_calls"]} if choice["message"].get("tool_calls") else {}))
        e.history.append((choice["message"], True))
        e.eos, e.said = choice["eos"], choice["text"]
        if e.text is not None:
            e.text += choice["text"]
        if choice["finish"] == "length" and len(e.record.ids) >= self.slot.max_total_tokens:
            e.record.truncated = e.exhausted = True
        elif choice["finish"] == "length":
            e.record.truncated = True

    # ----------------------------------------------------------------- the batch
    def _assemble(self, prompts: list, episodes: list[_Live], group_size: int, backend: Any) -> RolloutBatch:
        """The rollout: per prompt, the longest common prefix of its episodes' first prompts;
        the rest of each first prompt leads its completion as context. A failed episode
        keeps no token in the loss and no reward."""
        group_prompts = []
        for p, prompt in enumerate(prompts):
            group = episodes[p * group_size: (p + 1) * group_size]
            for e in group:
                if e.pending is not None:  # the episode ended on an n > 1 call: its first choice
                    self._keep(e, e.pending[0])
            firsts = [s.prompt for e in group if e.first is not None and e.failure is None for s in _samples(e)]
            common = _common_prefix(firsts) if firsts else list(prompt.ids)
            if not common:
                for e in group:
                    e.fail("the prompts of the group's training samples share no token, so they cannot share a prompt")
                common = list(prompt.ids)
            for e in group:
                record = e.record
                if e.clock.started is not None:
                    record.queue_wait, record.agent_seconds = e.clock.wait(), e.clock.own()
                if e.failure is None:
                    record.ids, record.mask, record.logp, record.splits = episode_row(_samples(e), len(common))
                else:  # nothing of it trains: its sampled tokens, as context
                    record.ids = [t for s in _samples(e) for t in s.ids]
                    record.mask, record.logp = [False] * len(record.ids), [0.0] * len(record.ids)
                    record.reward = None
                    record.messages.append({"role": "system", "content": f"agent failed: {e.failure}"})
            group_prompts.append(common)
        failures = [e.failure for e in episodes if e.failure is not None]
        if failures:  # env/failed_episodes counts them; the console says why
            log.warning("%d of %d agent episodes failed (no reward, no token in the loss); the first: %s",
                        len(failures), len(episodes), failures[0])
        with_logp = self._with_logp and any(e.record.turns for e in episodes)
        return episodes_batch(group_prompts, [e.record for e in episodes], self.tokenizer, self.pad_id,
                              device_of(backend), with_logp, failed=[e.failure is not None for e in episodes])


class AgentDriver:
    """The built-in ``agent`` episode driver: each episode an agent program run against the
    endpoint (``rollout.agent``, or a route's agent), through an :class:`AgentRunner`."""

    multi_turn = True

    def __init__(self, options: Any = None) -> None:
        self.runner: AgentRunner | None = None

    def setup(self, run: DriverSetup) -> None:
        slot = source_of(run, "agent", "agent")
        self.runner = AgentRunner(slot.build(), slot, run.tokenizer, eos_ids=run.eos_ids, pad_id=run.pad_id,
                                  max_n=run.group_size, chat_template_kwargs=dict(run.chat_template_kwargs))

    def tools_for(self, row: dict[str, Any]) -> list[dict]:
        """Agents send their tools with their requests: the prompts show none."""
        return []

    def run(self, backend: Any, prompts: list, group_size: int, sampling: SamplingParams) -> RolloutBatch:
        return self.runner.run(backend, prompts, group_size, sampling)


def _unrenderable(messages: list[dict[str, Any]], exc: BaseException) -> EndpointError:
    """The 400 of messages the model's chat template refuses (a role it does not know...)."""
    roles = sorted({str(m.get("role")) for m in messages})
    return EndpointError(400, f"the chat template cannot render these messages (roles {roles}): {fault_text(exc)}")


def _samples(e: _Live) -> list[Sample]:
    """The episode's training samples: the finished ones, then the one it ended in."""
    return [*e.samples, Sample(e.first or [], e.record.ids, e.record.mask, e.record.logp)]


def _common_prefix(sequences: list[list[int]]) -> list[int]:
    first = sequences[0]
    size = len(first)
    for other in sequences[1:]:
        size = min(size, len(other))
        size = next((i for i in range(size) if first[i] != other[i]), size)
    return list(first[:size])
