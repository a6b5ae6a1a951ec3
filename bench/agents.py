"""Agent episodes against the in-process environment, on the same episodes: episodes per
second and the endpoint's overhead.

Two rollouts of the same prompts, run alternately ``--repeats`` times in one process: the
``tools`` environment in process, and an OpenAI-client agent with the same calculator through
the endpoint (``grpo_core.train.actor.drivers.agents``). With ``--backend scripted`` the policy is a rule
(no model: a calculator call, then an answer), so the difference is the endpoint's own cost
(HTTP, JSON, chat-template rendering, batching waits) per episode; with ``--backend hf`` the
tiny random model generates, as in training.

    python bench/agents.py --backend scripted --prompts 4 --group 8 --repeats 5 --out bench/runs/agents/scripted.json
    python bench/agents.py --backend hf --prompts 4 --group 8 --repeats 3

Quote the CPU (lscpu) and whether the machine was idle with the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def urllib_agent(episode):
    """The calculator agent of the tests with the standard library's HTTP client."""
    import urllib.request

    from grpo_plugins.environments.calculator import calculator

    from tests.core.test_agents import TOOLS

    messages = list(episode.row["prompt"])
    for _ in range(3):
        body = json.dumps({"model": episode.model, "messages": messages, "tools": TOOLS}).encode()
        request = urllib.request.Request(f"{episode.base_url}/chat/completions", data=body, headers={
            "Authorization": f"Bearer {episode.api_key}", "Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            message = json.load(response)["choices"][0]["message"]
        messages.append(message)
        if not message.get("tool_calls"):
            return None
        for call in message["tool_calls"]:
            result = calculator(**json.loads(call["function"]["arguments"]))
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=("scripted", "hf"), default="scripted")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--client", choices=("openai", "urllib"), default="openai",
                        help="the agent's HTTP client: the official openai client (whose construction alone "
                        "costs tens of ms), or the standard library's, to see the endpoint's own cost")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    from grpo_core import Trainer
    from grpo_core.testing import save_tiny_model
    from tests.core.test_agents import ScriptedPlugin, calculator_agent

    work = Path(tempfile.mkdtemp(prefix="bench-agents-"))
    model = save_tiny_model(work / "model")
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = 2048
    (model / "config.json").write_text(json.dumps(config))
    base = {
        "model": {"path": str(model)},
        "data": {"name": "arithmetic", "train_size": 64, "eval_size": 0},
        "rollout": {"group_size": args.group, "max_new_tokens": 96,
                    **({"name": "scripted"} if args.backend == "scripted" else {})},
        "rewards": [{"name": "accuracy"}],
        "train": {"prompts_per_step": args.prompts, "threads": args.threads, "progress": False},
        "eval": {"at_start": False, "at_end": False}, "tracking": [],
    }
    env = {**base, "rollout": {**base["rollout"], "environment": {
        "name": "tools", "tools": ["calculator"], "max_turns": 3, "max_total_tokens": 240}}}
    agent = {**base, "rollout": {**base["rollout"], "agent": {"max_total_tokens": 240, "concurrency": 64}}}
    plugins = [ScriptedPlugin()] if args.backend == "scripted" else []
    runs = {
        "in_process": Trainer(env, {"train.output_dir": str(work / "env")}, plugins=plugins)._build(),
        "endpoint": Trainer(agent, {"train.output_dir": str(work / "agent")}, plugins=plugins,
                            agent=calculator_agent if args.client == "openai" else urllib_agent)._build(),
    }
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    turns: dict[str, float] = {}
    failed: dict[str, float] = {}
    for step in range(args.repeats + 1):  # the first round warms up, untimed
        for name, run in runs.items():
            t0 = time.perf_counter()
            experience = run.actor.collect(step)
            if step:
                seconds[name].append(time.perf_counter() - t0)
            turns[name] = float(experience.scored.rollout.episodes.turns.float().mean())
            failed[name] = max(failed.get(name, 0.0), float(experience.scored.rollout.episodes.failed.float().mean()))
    episodes = args.prompts * args.group
    result = {
        "backend": args.backend, "client": args.client, "prompts": args.prompts, "group_size": args.group,
        "repeats": args.repeats,
        "episodes_per_rollout": episodes, "turns_per_episode": turns,
        "failed_episodes_max": failed,  # the most of any rollout: the figures mean little unless 0
        "seconds_median": {k: statistics.median(v) for k, v in seconds.items()},
        "episodes_per_second": {k: episodes / statistics.median(v) for k, v in seconds.items()},
    }
    result["endpoint_overhead_ms_per_episode"] = 1000 * (
        result["seconds_median"]["endpoint"] - result["seconds_median"]["in_process"]) / episodes
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
