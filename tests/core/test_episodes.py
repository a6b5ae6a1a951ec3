"""Multi-turn episodes (grpo_core.train.actor.drivers.environment): the mask with holes, the limits, tool
faults seen by the model, and the gradient over model tokens only.

The hand-built episodes use :class:`Scripted`, a rollout backend that writes fixed turns
(a policy that always calls a tool), so the expected tokens are known exactly; the
environment, the runner and the chat template are the real ones. The last tests run the
real ``hf`` backend on a tiny model.
"""

from __future__ import annotations

import copy
import time
from contextlib import nullcontext
from dataclasses import replace

import pytest
import torch
from grpo_plugins.environments import ToolsOptions, tools_environment
from grpo_plugins.rollout.hf import HFRollout

from grpo_core.contracts import (
    Observation,
    RolloutBatch,
    RolloutCapabilities,
    RolloutSetup,
    SamplingParams,
    special_ids,
)
from grpo_core.plugin_manager import load_plugins
from grpo_core.testing import build_model, build_tokenizer
from grpo_core.train.actor.data import Prompt
from grpo_core.train.actor.drivers.environment import EpisodeRunner
from grpo_core.train.actor.drivers.episodes import episode_metrics, with_tools
from grpo_core.train.learner.batch import TrainBatch
from grpo_core.train.learner.learner import Learner, UpdateSettings
from grpo_core.train.learner.parallel import forward_of
from grpo_core.train.learner.update import Objective, update

torch.set_num_threads(1)

CALL = '<tool_call>{{"name": "{name}", "arguments": {args}}}</tool_call>'
SAMPLING = SamplingParams(max_new_tokens=256, seed=0)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


class Scripted:
    """A rollout backend whose every row writes ``turns[k]`` at its k-th call (the last
    one repeats); it records the token ids it was asked to continue."""

    capabilities = RolloutCapabilities()  # used without the registry, which fills in the defaults

    def __init__(self, tokenizer, turns: list[str]):
        self.tokenizer, self.turns, self.calls = tokenizer, turns, []

    def generate(self, prompt_ids, group_size, sampling) -> RolloutBatch:
        k = len(self.calls)
        self.calls.append([list(p) for p in prompt_ids])
        ids = self.tokenizer(self.turns[min(k, len(self.turns) - 1)], add_special_tokens=False)["input_ids"]
        truncated = len(ids) > sampling.max_new_tokens
        ids = ids[: sampling.max_new_tokens]
        rows = len(prompt_ids) * group_size
        prompt = torch.tensor([list(p)[-1:] for p in prompt_ids])
        return RolloutBatch(
            prompt, torch.ones_like(prompt, dtype=torch.bool), torch.tensor([ids] * rows),
            torch.ones(rows, len(ids), dtype=torch.bool), torch.tensor([truncated] * rows),
            [self.tokenizer.decode(ids, skip_special_tokens=True)] * rows,
        )


def prompt_of(tok, question: str = "What is 12 * 34?", tools=()) -> Prompt:
    messages = [{"role": "user", "content": question}]
    shown, extra = with_tools(tok, messages, list(tools))
    text = tok.apply_chat_template(shown, tokenize=False, add_generation_prompt=True, **extra)
    return Prompt({"prompt": messages}, messages, text, tok(text, add_special_tokens=False)["input_ids"])


def runner(tok, env, *, max_turns=4, max_total_tokens=2000) -> EpisodeRunner:
    return EpisodeRunner(env, tok, max_turns=max_turns, max_total_tokens=max_total_tokens,
                         eos_ids=[tok.eos_token_id], pad_id=tok.pad_token_id)


def segments(mask_row: torch.Tensor) -> list[tuple[bool, int]]:
    """Runs of equal mask values: ``[(value, length), ...]``."""
    out: list[tuple[bool, int]] = []
    for v in mask_row.tolist():
        if out and out[-1][0] == v:
            out[-1] = (v, out[-1][1] + 1)
        else:
            out.append((v, 1))
    return out


def test_the_mask_with_holes_is_exact_on_a_hand_built_episode(tok):
    call = CALL.format(name="calculator", args='{"expression": "12 * 34"}')
    final = "The answer is 408" + tok.eos_token
    env = tools_environment()(ToolsOptions())
    backend = Scripted(tok, [call, final])
    prompt = prompt_of(tok, tools=env.tools)
    out = runner(tok, env).run(backend, [prompt], 2, SAMPLING)

    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    # The model's call ended at the stop string, so the template's end of turn is the environment's.
    env_text = "<|end|>\n<|tool|>408<|end|>\n<|assistant|>"
    expected = ids(call) + ids(env_text) + ids(final)
    expected_mask = [True] * len(ids(call)) + [False] * len(ids(env_text)) + [True] * len(ids(final))
    for row in range(2):
        assert out.completion_ids[row].tolist() == expected
        assert out.completion_mask[row].tolist() == expected_mask
    # prompt + episode is exactly the chat template's rendering of the whole conversation
    conversation = [{"role": "assistant", "content": call}, {"role": "tool", "content": "408"}]
    shown, _ = with_tools(tok, prompt.prompt, env.tools)
    rendered = tok.apply_chat_template(shown + conversation, tokenize=False, add_generation_prompt=True)
    assert tok.decode(prompt.ids + expected) == rendered + final
    assert out.episodes.messages[0] == conversation + [{"role": "assistant", "content": "The answer is 408"}]
    # the second turn continued from the prompt, the call and the tool's result
    assert backend.calls[1] == [prompt.ids + ids(call) + ids(env_text)] * 2
    assert out.episodes.turns.tolist() == [2, 2] and out.episodes.tool_calls.tolist() == [1, 1]
    assert out.episodes.lengths.tolist() == [len(expected)] * 2
    assert not out.truncated.any()
    metrics = episode_metrics(out.episodes, out.completion_mask)
    assert metrics["env/env_tokens"] == len(ids(env_text))
    assert metrics["env/model_tokens"] == len(ids(call)) + len(ids(final))
    assert metrics["env/tool_success_rate"] == 1.0 and metrics["env/tool_call_rate"] == 1.0


def test_max_turns_stops_an_episode_that_keeps_calling(tok):
    call = CALL.format(name="calculator", args='{"expression": "1 + 1"}')
    env = tools_environment()(ToolsOptions())
    backend = Scripted(tok, [call])
    out = runner(tok, env, max_turns=3).run(backend, [prompt_of(tok)], 2, SAMPLING)
    assert len(backend.calls) == 3
    assert out.episodes.turns.tolist() == [3, 3]
    assert out.episodes.tool_calls.tolist() == [3, 3]
    assert [v for v, _ in segments(out.completion_mask[0])] == [True, False, True, False, True]
    assert not out.truncated.any()  # the turn limit is a rule of the episode, not a truncation


def test_the_token_budget_stops_an_episode_and_marks_it_truncated(tok):
    call = CALL.format(name="calculator", args='{"expression": "1 + 1"}')
    n_call = len(tok(call, add_special_tokens=False)["input_ids"])
    env = tools_environment()(ToolsOptions())
    budget = 2 * n_call + 5  # room for two calls and one observation, not for a third turn's call
    out = runner(tok, env, max_turns=10, max_total_tokens=budget).run(Scripted(tok, [call]), [prompt_of(tok)], 1,
                                                                      SAMPLING)
    assert int(out.episodes.lengths[0]) <= budget
    assert out.completion_ids.shape[1] <= budget
    assert bool(out.truncated[0])
    assert int(out.episodes.turns[0]) < 10


def test_a_turn_cut_at_its_token_limit_is_still_answered(tok):
    call = CALL.format(name="calculator", args='{"expression": "2 * 21"}') + " and then some chatter"
    limit = len(tok(call, add_special_tokens=False)["input_ids"]) - 3  # the call fits, the chatter does not
    backend = Scripted(tok, [call, "42" + tok.eos_token])
    env = tools_environment()(ToolsOptions())
    out = runner(tok, env).run(backend, [prompt_of(tok)], 1, replace(SAMPLING, max_new_tokens=limit))
    assert out.episodes.turns.tolist() == [2] and out.episodes.tool_calls.tolist() == [1]
    assert out.episodes.messages[0][1] == {"role": "tool", "content": "42"}
    assert not bool(out.truncated[0])  # the last turn ended by itself
    cut = runner(tok, env, max_turns=1).run(Scripted(tok, [call]), [prompt_of(tok)], 1,
                                            replace(SAMPLING, max_new_tokens=limit))
    assert bool(cut.truncated[0])  # its only turn was cut


def slow(seconds: float) -> str:
    """Sleep, then answer.

    Args:
        seconds: How long to sleep.
    """
    time.sleep(seconds)
    return "woke up"


def broken(x: int) -> int:
    """Always fails.

    Args:
        x: Anything.
    """
    raise RuntimeError(f"broken on {x}")


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (CALL.format(name="broken", args='{"x": 3}'), "error: tool 'broken' raised RuntimeError: broken on 3"),
        (CALL.format(name="slow", args='{"seconds": 5}'), "error: tool 'slow' did not return within 0.2 s"),
        ("<tool_call>{not json</tool_call>", "error: malformed tool call"),
        (CALL.format(name="nope", args="{}"), "error: unknown tool 'nope'; available: slow, broken, calculator"),
        (CALL.format(name="calculator", args='{"expression": "__import__(1)"}'), "error: tool 'calculator' raised"),
        (CALL.format(name="calculator", args='{"wrong": 1}'), "error: tool 'calculator' raised TypeError"),
    ],
    ids=["raises", "hangs", "malformed", "unknown", "refused", "bad-arguments"],
)
def test_a_faulty_tool_call_is_an_error_the_model_sees_next_turn(tok, call, message):
    env = tools_environment(slow, broken)(ToolsOptions(tool_timeout=0.2))
    backend = Scripted(tok, [call, "ok" + tok.eos_token])
    t0 = time.perf_counter()
    out = runner(tok, env).run(backend, [prompt_of(tok, tools=env.tools)], 1, SAMPLING)
    assert time.perf_counter() - t0 < 3  # the hanging tool was abandoned at its timeout
    seen = tok.decode(backend.calls[1][0])  # the context of the turn after the call
    assert message in seen
    assert out.episodes.tool_errors.tolist() == [1] and out.episodes.tool_calls.tolist() == [1]
    assert out.episodes.messages[0][1]["content"].startswith(message)
    assert out.episodes.turns.tolist() == [2]


def test_long_tool_output_is_cut(tok):
    def shout(text: str) -> str:
        """Repeat.

        Args:
            text: What to repeat.
        """
        return text * 100

    env = tools_environment(shout)(ToolsOptions(tools=[], max_tool_output_chars=12))
    backend = Scripted(tok, [CALL.format(name="shout", args='{"text": "ab"}'), "ok" + tok.eos_token])
    out = runner(tok, env).run(backend, [prompt_of(tok)], 1, SAMPLING)
    assert out.episodes.messages[0][1]["content"] == "abababababab ...[truncated]"


# ----------------------------------------------------------------------------- the gradient
def _episode_batch(env_ids: list[list[int]]) -> TrainBatch:
    """P=2 prompts, G=2 episodes each: model tokens m, environment tokens e (given), padding.

    Row layouts: [m m e.. m m m], [m e.. m], [m m m m], [m m m e.. m]."""
    gen = torch.Generator().manual_seed(3)
    model = [[2, 3], [1, 1], [4], [3, 1]]  # model-token runs around each row's environment tokens
    rows, masks = [], []
    for runs, env in zip(model, env_ids):
        ids = torch.randint(10, 300, (runs[0],), generator=gen).tolist() + env
        ids += torch.randint(10, 300, (runs[1] if len(runs) > 1 else 0,), generator=gen).tolist()
        mask = [True] * runs[0] + [False] * len(env) + [True] * (runs[1] if len(runs) > 1 else 0)
        rows.append(ids)
        masks.append(mask)
    width = max(len(r) for r in rows) + 1
    ids = torch.zeros(4, width, dtype=torch.long)
    mask = torch.zeros(4, width, dtype=torch.bool)
    for i, (r, m) in enumerate(zip(rows, masks)):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(m)] = torch.tensor(m)
    prompt_ids = torch.randint(10, 300, (2, 4), generator=gen)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=torch.float64)[:, None].expand(-1, width) * mask
    return TrainBatch(prompt_ids, torch.ones(2, 4, dtype=torch.bool), ids, mask, adv.clone())


def _textbook_loss(model, batch: TrainBatch, aggregation: str) -> torch.Tensor:
    """-sum over model tokens of A_i * log pi(token | everything before it), from one plain
    forward per row over prompt + episode (environment tokens are inputs, never targets)."""
    terms, counts = [], []
    for i in range(batch.completion_ids.shape[0]):
        m = batch.mask[i]
        last = int(m.nonzero().max()) + 1
        seq = torch.cat([batch.prompt_ids[i // 2], batch.completion_ids[i, :last]])
        logits = model(seq[None]).logits[0].double()
        logp = torch.log_softmax(logits, -1)
        start = batch.prompt_ids.shape[1]
        total = 0.0
        for t in range(last):
            if m[t]:
                total = total + batch.advantages[i, t] * logp[start + t - 1, seq[start + t]]
        terms.append(total)
        counts.append(int(m.sum()))
    if aggregation == "seq-mean-token-mean":
        return -sum(x / n for x, n in zip(terms, counts)) / len(terms)
    return -sum(terms) / sum(counts)  # token-mean


def _engine_gradient(model, batch: TrainBatch, aggregation: str, packing: bool = True,
                     micro_batch_size: int | None = 1) -> dict[str, torch.Tensor]:
    """``-delta`` of one SGD(lr=1) step of the engine's update (``train.packing`` and
    ``micro_batch_size`` as given): its gradient."""
    registry = load_plugins(external=False).registry
    objective = Objective(policy_loss=registry.get("policy_loss", "clip").build(),
                          aggregator=registry.get("loss_aggregator", aggregation).build(), kl=None,
                          entropy_coef=0.0, early_stop_imp_ratio=None, max_length=16)
    trained = copy.deepcopy(model)
    opt = torch.optim.SGD(trained.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    settings = UpdateSettings(micro_batch_size=micro_batch_size, packing=packing)
    update(Learner(trained, opt, sched, objective, settings), batch)
    before = dict(model.named_parameters())
    return {k: (before[k] - p).detach() for k, p in trained.named_parameters()}


def _textbook_gradient(model, batch: TrainBatch, aggregation: str) -> dict[str, torch.Tensor]:
    model = copy.deepcopy(model)
    _textbook_loss(model, batch, aggregation).backward()
    return {k: p.grad.detach().clone() for k, p in model.named_parameters()}


@pytest.mark.parametrize("aggregation", ["seq-mean-token-mean", "token-mean"])
@pytest.mark.parametrize("packing,micro", [(False, 1), (True, 1), (True, None)], ids=["padded", "packed-rows",
                                                                                        "packed-groups"])
def test_the_gradient_on_episodes_is_the_textbook_loss_over_model_tokens_only(tok, aggregation, packing, micro):
    """The engine's update, padded or packed (one row per forward, or whole groups packed by
    the token budget: prompts shared, rows never seeing each other), against one plain forward
    per row in float64."""
    model = build_model(tok).double()
    env = [[301, 302, 303], [304, 305], [], [306, 307, 308, 309]]
    batch = _episode_batch(env)
    engine = _engine_gradient(model, batch, aggregation, packing, micro)
    book = _textbook_gradient(model, batch, aggregation)
    for name in book:
        torch.testing.assert_close(engine[name], book[name], rtol=1e-5, atol=1e-8)

    # Other environment tokens (as many, other ids): the same normalizers, a different context.
    other = _episode_batch([[10, 11, 12], [13, 14], [], [15, 16, 17, 18]])
    engine2 = _engine_gradient(model, other, aggregation, packing, micro)
    book2 = _textbook_gradient(model, other, aggregation)
    for name in book2:
        torch.testing.assert_close(engine2[name], book2[name], rtol=1e-5, atol=1e-8)
    assert any(not torch.allclose(engine[n], engine2[n]) for n in engine)  # env tokens are attended to

    # More environment tokens in one hole: no normalizer counts them (the textbook divides by
    # model tokens; an aggregator counting environment tokens would give another gradient).
    longer = _episode_batch([[301, 302, 303, 40, 41, 42, 43], [304, 305], [], [306, 307, 308, 309]])
    engine3 = _engine_gradient(model, longer, aggregation, packing, micro)
    book3 = _textbook_gradient(model, longer, aggregation)
    for name in book3:
        torch.testing.assert_close(engine3[name], book3[name], rtol=1e-5, atol=1e-8)


def test_advantage_on_environment_tokens_changes_nothing(tok):
    """A (buggy) advantage on environment positions is ignored: they are not in the mask."""
    model = build_model(tok).double()
    batch = _episode_batch([[301, 302, 303], [304, 305], [], [306, 307, 308, 309]])
    dirty = copy.deepcopy(batch)
    dirty.advantages = dirty.advantages + (~batch.mask).double() * 7.0
    a, b = _engine_gradient(model, batch, "token-mean"), _engine_gradient(model, dirty, "token-mean")
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0)


# ----------------------------------------------------------------------------- the hf backend
class Chatty:
    """Answers every model turn with a user message; a turn ends at a digit or a space."""

    tools: list = []
    stop = tuple("0123456789 ")

    def reset(self, row):
        return {"turn": 0}

    def step(self, state, text):
        state["turn"] += 1
        return Observation(messages=[{"role": "user", "content": f"go on {state['turn']}"}])


def test_episodes_with_the_hf_backend_have_holes_where_the_environment_spoke(tok):
    model = build_model(tok)
    backend = HFRollout()
    backend.setup(RolloutSetup(model, tok))
    eos, pad = special_ids(model, tok, "test")
    run = EpisodeRunner(Chatty(), tok, max_turns=3, max_total_tokens=200, eos_ids=eos, pad_id=pad)
    out = run.run(backend, [prompt_of(tok), prompt_of(tok, "What is 1 + 2?")], 2,
                  SamplingParams(max_new_tokens=12, seed=5))
    assert out.completion_ids.shape[0] == 4
    multi = 0
    for i in range(4):
        n = int(out.episodes.lengths[i])
        runs = segments(out.completion_mask[i, :n])
        assert runs[0][0] is True  # an episode starts with the model
        assert sum(1 for v, _ in runs if v) == int(out.episodes.turns[i])
        # each hole decodes to what the template renders for "go on k"
        holes = [seg for seg in _holes(out.completion_ids[i, :n], out.completion_mask[i, :n])]
        for k, hole in enumerate(holes, start=1):
            assert f"<|user|>go on {k}<|end|>\n<|assistant|>" in tok.decode(hole)
        assert not out.completion_mask[i, n:].any()
        multi += int(out.episodes.turns[i]) > 1
    assert multi > 0
    # training on it: the model-token log-probs under the engine match the sampler's context
    batch = TrainBatch(out.prompt_ids, out.prompt_mask, out.completion_ids, out.completion_mask,
                       torch.zeros(out.completion_mask.shape))
    from grpo_core.train.learner.batch import batch_logprobs

    logp = batch_logprobs(forward_of(model), batch, 4, 1.0, nullcontext)
    assert torch.isfinite(logp).all() and (logp[~batch.mask] == 0).all() and (logp[batch.mask] < 0).all()


def _holes(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    out, current = [], []
    for token, m in zip(ids.tolist(), mask.tolist()):
        if not m:
            current.append(token)
        elif current:
            out.append(current)
            current = []
    if current:
        out.append(current)
    return out
