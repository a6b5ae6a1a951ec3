"""What the engine hands a rollout backend and logs of its pushes, on the CPU with a plugin
defined here: ``setup`` receives one :class:`~grpo_core.contracts.RolloutSetup` (the staleness
bound among it) and the engine sets no attribute of the backend; the push ``setup`` returns is
logged with the first step and each ``sync_weights`` push with the next, as ``sync/push_bytes``,
``sync/push_seconds`` and ``sync/push_<figure>``; a sync that pushes nothing (None) leaves the
last push logged, the one the rollouts still sample after."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from grpo_core.spec import load_spec
from grpo_core.train.loop.assemble import build_run
from grpo_core.train.loop.step import train_step

torch.set_num_threads(1)
SPECS = Path(__file__).resolve().parents[2] / "specs"

#: Every completion is the EOS token; setup's push is 100 bytes, then each sync n pushes
#: 100 + n bytes with a figure, except every second one, which pushes nothing.
BACKEND = textwrap.dedent('''
    import torch
    from grpo_core import hookimpl
    from grpo_core.contracts import RolloutBatch, WeightPush, left_pad, special_ids

    class Counting:
        """Writes EOS at once; counts its pushes."""

        def __init__(self):
            self.runs, self.syncs = [], 0

        def setup(self, run):
            self.runs.append(run)
            self.eos, self.pad = special_ids(run.model, run.tokenizer, "counting")
            return WeightPush(bytes=100.0, seconds=0.25)

        def sync_weights(self, model):
            self.syncs += 1
            if self.syncs % 2 == 0:
                return None
            return WeightPush(bytes=100.0 + self.syncs, seconds=0.5, figures={"full_bytes": 1000.0})

        def generate(self, prompt_ids, group_size, sampling):
            rows = len(prompt_ids) * group_size
            prompts, mask = left_pad(prompt_ids, self.pad)
            ids, ones = torch.full((rows, 1), self.eos[0]), torch.ones(rows, 1, dtype=torch.bool)
            return RolloutBatch(prompts, mask, ids, ones, torch.zeros(rows, dtype=torch.bool), [""] * rows)

    @hookimpl
    def register_rollout_backends(register):
        register.add("counting", Counting(), description="EOS at once, counted pushes")
''')


@pytest.fixture
def run(tmp_path, tiny_model_dir):
    plugin = tmp_path / "counting.py"
    plugin.write_text(BACKEND, encoding="utf-8")
    sets = [f"model.path={tiny_model_dir}", "tracking=[]", f"train.output_dir={tmp_path / 'out'}",
            "train.progress=false", "train.threads=1", "eval.every=0", "eval.at_start=false", "eval.at_end=false",
            f"plugins=[{plugin}]", "rollout.name=counting", "train.steps=4"]
    return build_run(load_spec(SPECS / "tiny.yaml", sets))


def test_setup_gets_one_record_and_every_step_logs_the_push_it_sampled_after(run):
    backend = run.actor.backend
    assert len(backend.runs) == 1
    given = backend.runs[0]
    assert given.model is run.model and given.max_staleness == 0 and given.switch is None and given.processor is None
    assert not {"max_staleness", "processor", "switch"} & set(vars(backend))  # nothing set on the backend
    run.feed.start(run.model, 0)
    metrics = [train_step(run.feed, run.learner, t).metrics for t in range(4)]
    pushed = [(m["sync/push_bytes"], m["sync/push_seconds"], m.get("sync/push_full_bytes")) for m in metrics]
    # step 1: setup's push; step 2: sync 1's; step 3: sync 2 pushed nothing (sync 1's still
    # holds); step 4: sync 3's
    assert pushed == [(100.0, 0.25, None), (101.0, 0.5, 1000.0), (101.0, 0.5, 1000.0), (103.0, 0.5, 1000.0)]
