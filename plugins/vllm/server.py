"""Rollout backend ``vllm-server``: generation on vLLM rollout servers in other processes or
on other machines (``grpo-run serve``, :mod:`grpo_plugins.vllm.serve`), addressed by URL.

The split of work follows TRL's ``vllm_mode="server"`` and verl's rollout workers: the
learner trains, the servers generate, and after each update (or every ``push_every``) the
learner pushes the policy's weights to every server. Nothing here is a new protocol:

- generation is vLLM's OpenAI-compatible ``/v1/completions``, one request per prompt with
  ``n = G`` samples and that prompt's seed (:func:`~grpo_plugins.rollout.outputs.request_seed`, the
  colocated ``vllm`` backend's), token ids in and out and the sampler's log-probs, made
  into the same :class:`~grpo_core.contracts.RolloutBatch` by
  :func:`~grpo_plugins.rollout.outputs.outputs_to_batch`;
- a push is vLLM's weight-transfer API (``/start_weight_update``, ``/update_weights``,
  ``/finish_weight_update``) driving the server's ``grpo_torch`` engine, with the tensors
  broadcast over a ``torch.distributed`` group per server (gloo on the CPU, NCCL on GPUs;
  :mod:`grpo_plugins.rollout.channel`), then ``/reset_prefix_cache``.

The learner needs PyTorch and the standard library, not vLLM: this module imports, registers and
validates specs without it.

Several URLs are data-parallel generation: a step's prompts are split into contiguous,
near-equal parts (:func:`~grpo_plugins.rollout.servers.assign_prompts`). Every request goes
through the project's one HTTP client (:mod:`grpo_core.http`): a deadline of ``timeout_s`` per
attempt however slowly a server answers, a cap on the answer's size, no redirects. Every answer
is checked against its request before it enters a batch
(:func:`~grpo_plugins.vllm.client.to_outputs`: ``G`` completions, token ids within the policy's
vocabulary, one finite log-prob ``<= 0`` per token): a bad answer is that server's fault, like a
failed connection. Faults: a request is retried ``retries`` times; a server that still fails
(refused, timed out, an error, a bad answer, a broken weight channel) is dropped for the rest of
the run and its unfinished prompts go to the live ones
(:class:`~grpo_plugins.rollout.servers.Failover`, through the backend's base
:class:`~grpo_plugins.rollout.servers.ServerPool`). Each prompt's seed travels with it, so the
batch is the same whichever server samples it. With no server left the rollout raises a
:class:`~grpo_core.errors.RunError` naming every URL and what failed: the run stops with exit 1
and the engine's failure path keeps the last completed step's checkpoint.

Each server's generation time (seconds per decode step of each rollout call) is followed
through the run: a server whose recent calls take more than ``drift_bound`` times its early ones
is named in the log, once per crossing (:mod:`grpo_plugins.rollout.drift`; issue 60 item 5, a
long-lived server that slowed from 6 to 20 s a batch).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
from typing import Annotated, Any, Literal

import torch
from grpo_plugins.rollout.delta import DeltaEncoder
from grpo_plugins.rollout.drift import GenerationDrift
from grpo_plugins.rollout.outputs import outputs_to_batch, request_seed
from grpo_plugins.rollout.partial import PartialCompletion, stitched_outputs, versions_tensor
from grpo_plugins.rollout.pushes import ServerPushes
from grpo_plugins.rollout.servers import (
    Failover,
    ServerFault,
    ServerPool,
    assign_prompts,
    check_url,
    launch_tag,
    process_rank,
)
from grpo_plugins.rollout.weights import push_bucket_field
from grpo_plugins.vllm.client import Expected, ServerClient
from grpo_plugins.vllm.io import NO_ROUTES_ON_CPU, completion_body, repeat_greedy
from pydantic import AfterValidator, Field, ValidationInfo, field_validator

from grpo_core import hookimpl
from grpo_core.contracts import (
    RolloutBatch,
    RolloutCapabilities,
    RolloutSetup,
    SamplingParams,
    WeightPush,
    WeightSwitch,
    check_request,
    special_ids,
)
from grpo_core.errors import RunError
from grpo_core.options import Options, Seconds

__all__ = ["ROUTES_REFUSAL", "VLLMServerOptions", "VLLMServerRollout"]

log = logging.getLogger("grpo.rollout.vllm-server")
NAME = "vllm-server"

#: Why this backend records no expert routes (``algorithm.routing_replay`` is refused for it).
ROUTES_REFUSAL = (
    "a vLLM 0.32 server returns a request's routed experts only on its scale-out route /inference/v1/generate "
    "(choices[].routed_experts, base64 .npy; vllm serve --enable-scale-out --enable-return-routed-experts), not on "
    f"the /v1/completions this backend calls; and {NO_ROUTES_ON_CPU}"
)


#: One server's URL in the options, checked item by item (every bad one is reported).
ServerURL = Annotated[str, AfterValidator(check_url)]


class VLLMServerOptions(Options):
    """Options of the ``vllm-server`` rollout backend (sampling settings come from the
    spec's rollout section)."""

    urls: list[ServerURL] = Field(
        default_factory=list,
        validate_default=True,
        description=(
            "The rollout servers, started with grpo-run serve (http://HOST:PORT each). Several are "
            "data-parallel generation: each step's prompts are split across them. Left out when the "
            "launcher places the servers (grpo-run run --launcher ray --launcher-option servers=N): it "
            "hands every rank their URLs, with secret_env and weight_host."
        ),
    )
    timeout_s: Seconds = Field(
        120.0,
        gt=0,
        description=(
            "Longest wait, in seconds, for one answer of a server: one prompt's G completions, one "
            "step of a weight push, or a member of the weight channel. A server that exceeds it is "
            "retried, then dropped."
        ),
    )
    retries: int = Field(
        2,
        ge=0,
        description=(
            "Retries of a failed request to a server (0.5 s apart, doubling) before it is dropped for "
            "the rest of the run and its prompts go to the others."
        ),
    )
    delta_push: bool = Field(
        False,
        description=(
            "Send only the elements that changed since the servers' copy (bitwise), with each tensor's "
            "checksum, which the servers check after rebuilding it: a full push at setup, at the first sync "
            "(a resumed run's weights) and for any tensor whose changed elements and their positions would "
            "take more bytes than the tensor. Costs one copy of the pushed weights on the learner (per server "
            "dtype) and one on each server worker. Each push's bytes, and a full push's, are logged with the next "
            "step (sync/push_bytes, sync/push_full_bytes)."
        ),
    )
    push_bucket_mb: float = push_bucket_field()
    lora_push: Literal["auto", "adapter", "merged"] = Field(
        "auto",
        description=(
            "What a LoRA policy's weight push sends: adapter, the adapter alone (over the weight channel; each "
            "server writes it to its own disk and loads it with vLLM's /v1/load_lora_adapter, keeping "
            "rollout.max_staleness + 1 versions loaded; the base weights go once, at setup); merged, the full "
            "merged weights; auto, the adapter when the adapter is one vLLM can load (not modules_to_save, "
            "DoRA, lora_bias, a 4-bit base, a non-linear target) and every server was started with LoRA "
            "(grpo-run serve MODEL -- --enable-lora --max-lora-rank R --max-loras K, R at least the adapter's "
            "rank, K at least max_staleness + 1), else merged, said in the log."
        ),
    )
    push_every: int = Field(
        1,
        ge=1,
        description=(
            "Push the policy's weights to the servers every n weight syncs (one per training step, and "
            "one after a resume): at the first sync and every n-th after it. 1 keeps the servers on the "
            "current policy; above 1 they sample with weights up to n - 1 steps old, which the rollout "
            "correction's importance ratio accounts for; a resumed run's first sync pushes the resumed weights."
        ),
    )
    weight_backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto",
        description=(
            "torch.distributed backend of the weight channel: nccl between GPUs (the learner's and the "
            "server's), gloo through CPU memory; auto picks nccl when the policy is on a CUDA device."
        ),
    )
    weight_host: str | None = Field(
        None,
        description=(
            "The learner's address as the servers reach it (they join its weight channel there); null: "
            "this machine's address on the route to each server."
        ),
    )
    weight_port: int = Field(
        0,
        ge=0,
        le=65535,
        description=(
            "TCP port of the weight channel for the first server, the next ones for the next servers "
            "(open them between the nodes); 0: any free port."
        ),
    )

    drift_bound: float = Field(
        2.0,
        ge=0,
        description=(
            "Warn, naming the server, when a server's generation time (seconds per decode step of a rollout "
            "call, the median of its last drift_window calls) passes this many times its own at the start of the "
            "run (the median of its first drift_window calls); once per crossing. A long-lived server that slows "
            "down is restarted (the vLLM guide, 'A server that slows down'). 0: no check."
        ),
    )
    drift_window: int = Field(
        5,
        ge=1,
        le=1000,
        description=(
            "Rollout calls (a step's batch, an evaluation's, a round of partial rollouts' continuations) in each "
            "median that drift_bound compares: a server's first ones, and its latest ones."
        ),
    )

    secret_env: str = Field(
        "GRPO_SERVE_SECRET",
        min_length=1,
        description=(
            "Environment variable holding the servers' shared secret (the value grpo-run serve was started "
            "with in its GRPO_SERVE_SECRET, or its vLLM --api-key), sent as 'Authorization: Bearer ...' with "
            "every request; unset: no credential is sent. The secret itself never goes in the spec."
        ),
    )

    @field_validator("drift_bound")
    @classmethod
    def _drift_bound(cls, bound: float) -> float:
        if 0 < bound <= 1:
            raise ValueError(f"a factor above 1 (2: warn when a server takes twice its early time per token), or 0 "
                             f"for no check; got {bound:g}")
        return bound

    @field_validator("urls")
    @classmethod
    def _urls(cls, urls: list[str], info: ValidationInfo) -> list[str]:
        repeated = sorted({u for u in urls if urls.count(u) > 1})
        if repeated:
            raise ValueError(f"each server once: {', '.join(repeated)} is listed more than once")
        placed = (info.context or {}).get("rollout_servers", 0)
        if not urls and not placed:
            raise ValueError(
                "no rollout server: list each one's URL here (http://HOST:PORT, printed by grpo-run serve), or let "
                "the launcher place them: grpo-run run SPEC --launcher ray --launcher-option servers=N")
        if urls and placed:
            raise ValueError(
                f"the launcher places {placed} rollout server(s) of its own and hands their URLs to the run: "
                f"drop these {len(urls)}, or the launcher's servers option")
        return urls


# --------------------------------------------------------------------------- backend
class VLLMServerRollout(ServerPushes, ServerPool):
    """Generates on vLLM rollout servers; ``sync_weights`` pushes the policy's weights (LoRA
    merged, FSDP2 gathered, or the adapter alone) to every live server every ``push_every``
    syncs (the pushes: :class:`~grpo_plugins.rollout.pushes.ServerPushes`)."""

    name = NAME

    #: Seconds to wait, after a server's ``/pause`` answered, for the answers of the requests it aborted.
    pause_grace_s = 0.5

    def __init__(self, options: VLLMServerOptions):
        self.options = options
        self.failover = Failover(options.urls, NAME)
        self.drift = GenerationDrift(NAME, options.drift_bound, options.drift_window)
        secret = os.environ.get(options.secret_env) or None
        self.clients = {u: ServerClient(u, options.timeout_s, options.retries, secret=secret,
                                        secret_env=options.secret_env) for u in options.urls}
        self.vocab_size = 0
        self.device = torch.device("cpu")
        self.tokenizer: Any = None
        self.syncs = 0
        self.version = 0
        self.pusher = True
        self.backend = "gloo"
        self.tag = launch_tag()
        self.encoders: dict[str, DeltaEncoder] = {}  # per server dtype: what the servers hold (delta_push)
        #: The run's staleness bound (``RolloutSetup.max_staleness``): adapter pushes keep
        #: ``max_staleness + 1`` versions loaded on each server.
        self.max_staleness = 0
        self.push = "merged"  # or "adapter": chosen in setup from lora_push
        self.loaded: dict[int, str] = {}  # adapter versions loaded on the servers: version -> LoRA name
        self.serving = ""  # the LoRA name requests sample with (adapter pushes); "": the base model
        self.switch: WeightSwitch | None = None  # partial rollouts (RolloutSetup.switch)

    @property
    def capabilities(self) -> RolloutCapabilities:
        """The servers hold their own copy of the weights (pushed by ``sync_weights``); the
        batches are on the policy's device after setup; with a switch, a weight update pauses
        the servers mid-generation (:meth:`_generate_partial`). No expert routes
        (:data:`ROUTES_REFUSAL`)."""
        return RolloutCapabilities(device=self.device, interruptible=True, routes_refusal=ROUTES_REFUSAL)

    # ----------------------------------------------------------------- contract
    def setup(self, run: RolloutSetup) -> WeightPush | None:
        """Check every server, open the weight channels (the learner's process of rank 0
        only) and push the policy's weights (weight version 1; each push adds one): the push
        returned (an adapter push's: the base weights go first, whole)."""
        model, tokenizer = run.model, run.tokenizer
        self.max_staleness, self.switch = run.max_staleness, run.switch
        self.tokenizer = tokenizer
        self.eos_ids, self.pad_id = special_ids(model, tokenizer, NAME)
        self.vocab_size = _vocab_size(model)
        self.device = next(model.parameters()).device
        self.backend = self.options.weight_backend
        if self.backend == "auto":
            self.backend = "nccl" if self.device.type == "cuda" else "gloo"
        self.pusher = process_rank() == 0
        self._each(lambda c: c.connect(), "did not answer as a grpo-run serve server")
        if hasattr(model, "peft_config"):
            self._choose_push(model)
        if self.pusher:
            self._open_channels()
        if self.push == "adapter":
            self._push_base(model)
            return self._push_adapter(model)
        return self._push(model)

    def sync_weights(self, model: Any) -> WeightPush | None:
        """Push the policy's weights to every live server at syncs ``1, 1 + n, 1 + 2n, ...``
        (``n = push_every``): the first sync pushes, so that after a resume (setup, then the
        checkpoint loaded, then one sync) the servers get the resumed weights at once.

        A server that fails during the push is dropped; when none is left this does not
        raise: the engine calls it after a step's update, and a failure there would lose
        that completed step. The next ``generate`` (the next step, before its update)
        raises the :class:`RunError`, and the engine's failure path checkpoints the last
        completed step. Returns the push (None on the processes that do not push, and at
        the syncs ``push_every`` skips)."""
        self.syncs += 1
        if (self.syncs - 1) % self.options.push_every:
            return None
        return self._push_adapter(model) if self.push == "adapter" else self._push(model)

    def loaded_versions(self) -> list[int]:
        """The adapter versions the servers hold, oldest first (adapter pushes: each push adds
        one, the last ``max_staleness + 1`` stay loaded); [] otherwise."""
        return sorted(self.loaded)

    def sample_with(self, version: int | None) -> None:
        """Sample from now on with adapter version ``version`` (one of :meth:`loaded_versions`)
        or, for None, with the servers' base weights: for a caller that keeps several adapters
        loaded and picks one per call (tinker-serve's sampler snapshots)."""
        if version is None:
            self.serving = ""
            return
        if version not in self.loaded:
            raise ValueError(f"{NAME} rollout: adapter version {version} is not loaded; "
                             f"loaded: {self.loaded_versions()}")
        self.serving = self.loaded[version]

    def generate(self, prompt_ids: list[list[int]], group_size: int, sampling: SamplingParams) -> RolloutBatch:
        """``G = group_size`` completions for each of the ``P`` prompts, spread over the live
        servers; prompt ``i`` seeded from ``request_seed(sampling.seed + i)`` (the ``vllm``
        backend's convention). Returns ``B = P * G`` rows, prompt-major, with the servers'
        ``sampling_logp`` (``float32 (B, T)``)."""
        check_request(prompt_ids, group_size, sampling, NAME)
        if self.switch is not None:
            return self._generate_partial(prompt_ids, group_size, sampling)
        requests = []
        for i, prompt in enumerate(prompt_ids):
            seed = None if sampling.seed is None else request_seed(sampling.seed + i)
            body = completion_body(list(prompt), group_size, sampling, self.eos_ids, seed, "")
            requests.append((body, Expected(body["n"], sampling.max_new_tokens, self.vocab_size, len(prompt))))
        outputs = self._complete(requests)
        if sampling.greedy:
            outputs = repeat_greedy(outputs, group_size)
        return outputs_to_batch(
            outputs, prompt_ids, group_size, pad_id=self.pad_id, eos_ids=self.eos_ids,
            max_new_tokens=sampling.max_new_tokens, stop=sampling.stop, device=self.device,
            decode=lambda rows: self.tokenizer.batch_decode(rows, skip_special_tokens=True),
        )

    # ----------------------------------------------------------------- partial rollouts
    def _generate_partial(self, prompt_ids: list[list[int]], group_size: int, sampling: SamplingParams
                          ) -> RolloutBatch:
        """:meth:`generate` with :attr:`switch` set: the same requests; when newer weights
        wait, every live server is paused with vLLM's ``/pause?mode=abort`` (its requests end
        with ``finish_reason: "abort"`` and the tokens so far; one that reached it after the
        pause waits in its queue), the weights are pushed (``switch.take()``), the servers
        resume, and each unfinished completion continues as one request from its prefix
        (:mod:`grpo_plugins.rollout.partial`). An answer that came in before the resume was
        sampled with the old weights; one that comes after it waited in the queue, all of it
        with the new ones, unless the pushes are adapters: it then names, and samples with, the
        old adapter version, which stays loaded (``max_staleness + 1`` are)."""
        if self.options.push_every != 1:
            raise RunError(f"rollout.partial_rollouts: every weight update must reach the servers mid-generation; set "
                           f"rollout.push_every: 1 (it is {self.options.push_every})")
        parts: list[list[PartialCompletion]] = []
        todo: list[tuple[dict[str, Any], Expected, list[PartialCompletion]]] = []
        for i, prompt in enumerate(prompt_ids):
            seed = None if sampling.seed is None else request_seed(sampling.seed + i)
            body = completion_body(list(prompt), group_size, sampling, self.eos_ids, seed, "")
            group = [PartialCompletion(list(prompt), k, None if seed is None else seed + k) for k in range(body["n"])]
            parts.append(group)
            todo.append((body, Expected(body["n"], sampling.max_new_tokens, self.vocab_size, len(prompt)), group))
        while todo:
            for (_, _, group), (output, version) in zip(todo, self._complete_interruptible(todo), strict=True):
                for c in output.outputs:
                    (group[c.index] if len(group) > 1 else group[0]).fold(c, version)
            todo = []
            for part in (p for group in parts for p in group if not p.finished):
                prompt, left, seed = part.rest(sampling.max_new_tokens)
                body = completion_body(prompt, 1, sampling, self.eos_ids, seed, "")
                body["max_tokens"] = left
                todo.append((body, Expected(1, left, self.vocab_size, len(prompt)), [part]))
        batch = outputs_to_batch(
            stitched_outputs(parts), prompt_ids, group_size, pad_id=self.pad_id, eos_ids=self.eos_ids,
            max_new_tokens=sampling.max_new_tokens, stop=sampling.stop, device=self.device,
            decode=lambda rows: self.tokenizer.batch_decode(rows, skip_special_tokens=True),
        )
        batch.token_versions = versions_tensor(parts, group_size, sampling.max_new_tokens, self.device)
        return batch

    def _complete_interruptible(self, requests: list[tuple[dict[str, Any], Expected, Any]]) -> list[tuple[Any, int]]:
        """Each request's checked answer and the policy version it was sampled with, in order.
        Polls :attr:`switch` while they run; at most one weight update per call (the
        continuation requests of an interrupted call come in the next). A request whose server
        fails goes to a live one, whole."""
        switch = self.switch
        version = switch.version
        live = self.failover.live()
        if not live:
            raise RunError(self.failover.failure())
        results: list[Any] = [None] * len(requests)
        todo = {i: live[s] for i, s in enumerate(assign_prompts(len(requests), len(live)))}
        resumed_at = None  # set once the servers resumed with the new weights
        while todo:
            failed: list[int] = []
            with concurrent.futures.ThreadPoolExecutor(max_workers=min(len(todo), 256)) as pool:
                # adapter pushes: a request names the LoRA version loaded when it is submitted
                # (fixed here, not when its thread sends it), and one still queued at a pause
                # samples with that version after the resume too
                serving = self.serving
                futures = {pool.submit(self._ask, url, *requests[i][:2], serving): (i, url) for i, url in todo.items()}
                named = dict.fromkeys(futures, version if resumed_at is None else switch.version)
                waiting = set(futures)
                while waiting:
                    done, waiting = concurrent.futures.wait(waiting, timeout=0.02)
                    for future in done:
                        i, url = futures[future]
                        try:
                            now = version if resumed_at is None else switch.version
                            results[i] = (future.result(), named[future] if self.push == "adapter" else now)
                        except ServerFault as exc:
                            self.failover.drop(url, str(exc))
                            failed.append(i)
                    if waiting and resumed_at is None and switch.pending():
                        version = self._interrupt(waiting, futures, results, failed, version)
                        resumed_at = switch.version
            todo = self.failover.reassign(sorted(failed)) if failed else {}
        self.drift.close_call()
        return results

    def _interrupt(self, waiting: set, futures: dict, results: list, failed: list[int], version: int) -> int:
        """Pause every live server (its running requests end, aborted), collect the answers
        that come in before the weights move (sampled with ``version``), push the new weights
        and resume. Returns ``version``; the requests still waiting run after the resume."""
        self._each(lambda c: c.call("POST", "/pause?mode=abort", retries=0), "did not pause for a weight update")
        done, _ = concurrent.futures.wait(waiting, timeout=self.pause_grace_s)
        for future in done:
            waiting.discard(future)
            i, url = futures[future]
            try:
                results[i] = (future.result(), version)
            except ServerFault as exc:
                self.failover.drop(url, str(exc))
                failed.append(i)
        self.switch.take()
        self._each(lambda c: c.call("POST", "/resume", retries=0), "did not resume after a weight update")
        return version


def _vocab_size(model: Any) -> int:
    """Rows of the policy's input embedding: the token ids it can take (a server's answer
    holding another is refused)."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    rows = getattr(embeddings, "num_embeddings", None)
    return int(rows if rows is not None else model.config.vocab_size)


@hookimpl
def register_rollout_backends(register) -> None:
    register.add(NAME, VLLMServerRollout, options=VLLMServerOptions, description="vLLM rollout servers "
                 "(grpo-run serve) addressed by URL; weights pushed over torch.distributed")
