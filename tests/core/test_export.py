"""The Hugging Face round trip and the MLflow model of a finished run (grpo_core/export.py):
a real LoRA run on a tiny model in a ``grpo-run`` subprocess (HF_HUB_OFFLINE=1), then the
merged model loaded without peft, the model card, the environment, the MLflow model loaded
back from a real SQLite store and registered, and the Hub upload attempted up to the
network (which these machines lack)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from grpo_core.errors import SpecError
from grpo_core.export import model_card, upload_plan
from grpo_core.spec import load_spec


def _greedy(folder: Path, prompt: str, new_tokens: int) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    batch = tokenizer([prompt], return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**batch, max_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, batch["input_ids"].shape[1]:], skip_special_tokens=True)


@pytest.mark.slow
def test_lora_run_exports_merged_model_card_environment_and_mlflow_model(
    tmp_path, write_spec, mlflow_db, child, tiny_model_dir, kit
):
    uri = mlflow_db(tmp_path / "mlflow")
    spec = write_spec(
        tmp_path,
        model={"lora": {"r": 4, "alpha": 8}},
        data={"eval_size": 4},
        train={"steps": 2, "lr": 0.05},
        eval={"at_end": True},
        export={"merged": True, "push_to_hub": {"repo_id": "someone/tiny-grpo", "revision": "v1"}},
        tracking=[{"name": "mlflow", "tracking_uri": uri, "experiment": "export",
                   "log_model": True, "registered_model_name": "tiny-grpo"}],
    )
    proc = child(["run", spec], cwd=tmp_path)
    assert proc.wait(240) == 0, proc.output()
    out, final = tmp_path / "out", tmp_path / "out" / "final"
    merged = final / "merged"
    log = proc.output()

    # The upload went as far as the network: the message says what to upload by hand.
    assert "push_to_hub to someone/tiny-grpo failed" in log
    assert f"hf upload someone/tiny-grpo {merged} --revision v1" in log
    assert upload_plan(final) == (merged, [])
    # The end-of-run summary table, plain text in a log file.
    table = [line for line in log.splitlines() if line.startswith(("held-out ", "eval/reward"))]
    assert table[0].split() == ["held-out", "first", "last"] and all("\x1b" not in line for line in table)
    assert any(line.startswith("eval/rewards/accuracy") and line.endswith("(step 2)") for line in table)

    # final/merged: a plain transformers model (no adapter files) equal to base + adapter.
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    assert (final / "adapter_config.json").is_file() and not (merged / "adapter_config.json").exists()
    plain = AutoModelForCausalLM.from_pretrained(merged).eval()
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), final).eval()
    ids = torch.tensor([[5, 17, 42, 99, 7]])
    with torch.inference_mode():
        expected, got = adapted(ids).logits, plain(ids).logits
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    with torch.inference_mode():
        assert not torch.allclose(base(ids).logits, got, atol=1e-4)  # training changed it
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)

    # The model cards: front matter, steps, held-out scores, the resolved spec.
    card = (final / "README.md").read_text(encoding="utf-8")
    front = yaml.safe_load(card.split("---")[1])
    assert front["library_name"] == "peft" and "grpo" in front["tags"]
    assert "base_model" not in front  # a local folder is no Hub id
    heldout = [r for r in kit.read_metrics(out / "metrics.jsonl") if "eval/reward" in r][-1]
    assert "- Steps: 2 of 2," in card
    assert f"| eval/rewards/accuracy | {heldout['eval/rewards/accuracy']:.4f} |" in card
    assert (out / "spec.resolved.yaml").read_text(encoding="utf-8").rstrip() in card
    merged_card = (merged / "README.md").read_text(encoding="utf-8")
    assert yaml.safe_load(merged_card.split("---")[1])["library_name"] == "transformers"
    assert "merged into the base weights (no peft needed)" in merged_card and "as a LoRA adapter." in card

    env = json.loads((out / "environment.json").read_text(encoding="utf-8"))
    assert env["packages"]["torch"] == torch.__version__ and env["packages"]["mlflow"]

    # MLflow: the spec and environment as artifacts, the model registered, loaded back, run.
    import mlflow
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("export").experiment_id])
    assert run.info.status == "FINISHED"
    names = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"spec.resolved.yaml", "environment.json", "spec.yaml"} <= names
    (version,) = client.search_model_versions("name='tiny-grpo'")
    assert version.run_id == run.info.run_id
    mlflow.set_tracking_uri(uri)
    try:
        model = mlflow.pyfunc.load_model("models:/tiny-grpo/1")
    finally:
        mlflow.set_tracking_uri(None)
    prompt = "What is 12 + 30?"
    assert model.predict([prompt], params={"max_new_tokens": 5}) == [_greedy(merged, prompt, 5)]


def test_upload_plan_is_final_without_merged_model(tmp_path):
    (tmp_path / "final").mkdir()
    assert upload_plan(tmp_path / "final") == (tmp_path / "final", ["merged/*"])


BASE = {"model": {"path": "Qwen/Qwen2.5-0.5B-Instruct"}, "rewards": [{"name": "accuracy"}]}


@pytest.mark.parametrize(
    "export, message",
    [
        ({"merged": True}, "spec: export.merged folds a LoRA adapter into its base model, but model.lora is not set"),
        ({"push_to_hub": {"repo_id": "not a repo!"}},
         "spec.export.push_to_hub.repo_id (line 1): not a valid Hub repository id"),
        ({"push_to_hub": {}}, "spec.export.push_to_hub.repo_id (line 1): required but missing"),
        ({"push_to_hub": {"repo_id": "a/b", "privat": True}},
         "unknown key 'privat'; did you mean 'private'?; valid keys: repo_id, private, revision, commit_message"),
    ],
)
def test_export_options_are_validated_with_their_path(export, message, tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text(json.dumps({**BASE, "export": export}), encoding="utf-8")
    with pytest.raises(SpecError) as err:
        load_spec(path)
    assert message in str(err.value)


def test_push_to_hub_is_off_by_default_and_private_when_on():
    spec = load_spec(BASE).spec
    assert spec.export.push_to_hub is None and spec.export.merged is False and spec.export.model_card
    on = load_spec({**BASE, "export": {"push_to_hub": {"repo_id": "me/model"}}}).spec.export.push_to_hub
    assert on.private is True and on.revision is None


def test_model_card_of_a_hub_model_names_it_as_base_model(tmp_path):
    spec = load_spec({**BASE, "train": {"steps": 7}}).spec
    card = model_card(spec, tmp_path, name="gsm8k", steps=7, last_eval={}, adapter=False)
    front = yaml.safe_load(card.split("---")[1])
    assert front["base_model"] == "Qwen/Qwen2.5-0.5B-Instruct" and front["library_name"] == "transformers"
    assert "- Steps: 7 of 7," in card and "No held-out evaluation was run" in card
