"""The ``tensorboard`` tracker, for real: its event files read back with TensorBoard's own
EventAccumulator."""

from __future__ import annotations

from grpo_plugins.trackers.tensorboard import TensorBoardOptions, TensorBoardTracker

from .conftest import events


def test_tensorboard_event_files_read_back_with_its_own_reader(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    spec_file = tmp_path / "spec.resolved.yaml"
    spec_file.write_text("train:\n  lr: 0.001\n", encoding="utf-8")
    tracker = TensorBoardTracker(TensorBoardOptions(log_dir=tmp_path / "tb"))
    events(tracker, spec_file)
    assert tracker.failures == 0

    acc = EventAccumulator(str(tmp_path / "tb" / "unit-run"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("reward")] == [(1, 0.25), (2, 0.75)]
    assert [(e.step, e.value) for e in acc.Scalars("kl")] == [(1, 0.5), (2, 0.25)]

    def text(tag: str) -> tuple[int, str]:
        (event,) = acc.Tensors(tag)
        return event.step, event.tensor_proto.string_val[0].decode()

    step, table = text("completions/text_summary")
    assert step == 2 and "| prompt | completion | reward |" in table and "5 \\| five<br>yes" in table
    assert "    train:" in text("files/spec.resolved.yaml/text_summary")[1]
    assert "| train.lr | 0.001 |" in text("params/text_summary")[1]
    assert text("status/text_summary")[1] == "FINISHED"
