"""Built-in trackers: ``mlflow`` (the default) and ``console``.

Trackers never raise for a failure of their own backend: the engine also writes every
metric to ``metrics.jsonl`` in the run folder, so nothing is lost when a server is down.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import warnings
from typing import Any

from pydantic import Field

from grpo_core import hookimpl
from grpo_core.options import Options

log = logging.getLogger("grpo.tracking")

# MLflow's limits on one log_batch call, and on a param value.
_MAX_METRICS_PER_BATCH = 1000
_MAX_PARAMS_PER_BATCH = 100
_MAX_PARAM_VALUE = 6000


class MLflowOptions(Options):
    experiment: str = Field("grpo-core", description="MLflow experiment name (created when missing).")
    tracking_uri: str | None = Field(
        None,
        description="Tracking server or store URI; default: MLflow's own default "
        "(MLFLOW_TRACKING_URI when set, else a local store in the working directory).",
    )
    tags: dict[str, str] = Field(default_factory=dict, description="Tags set on the run.")
    retry_every: float = Field(
        30.0, ge=0, description="Seconds between attempts to reach an unreachable server again."
    )
    request_timeout: float = Field(
        10.0, gt=0, description="Seconds one HTTP request to the server may take (MLFLOW_HTTP_REQUEST_TIMEOUT)."
    )
    request_retries: int = Field(
        0, ge=0, description="MLflow's own retries of a failed HTTP request (MLFLOW_HTTP_REQUEST_MAX_RETRIES). "
        "0 by default: this tracker keeps what failed and sends it later, so training never waits on retries."
    )
    log_model: bool = Field(
        False, description="At the end of the run, log the final model (the merged one when export.merged) "
        "as the MLflow model 'model' of the run (a pyfunc: prompts in, completions out), which can be "
        "registered and served. Off by default: it copies the weights into the artifact store."
    )
    registered_model_name: str | None = Field(
        None, min_length=1, description="Also register the logged model under this name in the model "
        "registry (needs log_model and a store with a registry, e.g. sqlite or a server)."
    )


class MLflowTracker:
    """Logs params, metrics, the spec and completion tables to MLflow.

    When the server cannot be reached, metrics are kept in memory and sent, in order,
    once it answers again (a run that could not be created at start is created then, with
    its params); training never waits for it beyond one failed call. Rows still unsent are
    part of the run's checkpoints, so a run that stops while the server is down sends them
    after ``--resume``.
    """

    def __init__(self, options: MLflowOptions):
        self.options = options
        self.run_id: str | None = None
        self._client = None
        self._pending: list[tuple[dict[str, float], int, int]] = []
        self._run_name: str | None = None
        self._unsent: list[tuple[str, Any]] = []  # params and artifacts logged before the run existed
        self._last_failure = 0.0
        self.failures = 0

    # -- connection
    def _connect(self):
        if self._client is None:
            from mlflow import MlflowClient

            # Read by MLflow at request time; a user's own setting wins.
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(int(self.options.request_timeout)))
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", str(self.options.request_retries))

            self._client = MlflowClient(tracking_uri=self.options.tracking_uri)
        return self._client

    @property
    def tracking_uri(self) -> str:
        import mlflow

        return self.options.tracking_uri or mlflow.get_tracking_uri()

    def _failed(self, what: str, exc: Exception) -> None:
        self.failures += 1
        self._last_failure = time.monotonic()
        if self.failures == 1 or self.failures % 50 == 0:
            log.warning("MLflow %s failed (%s: %s); metrics are kept and retried", what, type(exc).__name__, exc)

    # -- Tracker contract
    def start(self, run_name: str, resume_id: str | None = None) -> str | None:
        self._run_name = run_name
        try:
            if resume_id:
                self.run_id = resume_id  # known even while the server is down: rows wait for it
                self._connect().update_run(resume_id, status="RUNNING")
            else:
                self._create_run()
        except Exception as exc:
            self._failed("start", exc)
        return self.run_id

    def _create_run(self) -> None:
        """Create the run, then send what was logged before it existed (server down at start)."""
        client = self._connect()
        exp = client.get_experiment_by_name(self.options.experiment)
        exp_id = exp.experiment_id if exp else client.create_experiment(self.options.experiment)
        run = client.create_run(exp_id, run_name=self._run_name, tags=dict(self.options.tags))
        self.run_id = run.info.run_id
        unsent, self._unsent = self._unsent, []
        for method, arg in unsent:
            getattr(self, method)(arg)

    def log_params(self, params: dict[str, Any]) -> None:
        if self.run_id is None:
            self._unsent.append(("log_params", dict(params)))
            return
        from mlflow.entities import Param

        items = [Param(k[:250], str(v)[:_MAX_PARAM_VALUE]) for k, v in params.items()]
        try:
            for i in range(0, len(items), _MAX_PARAMS_PER_BATCH):
                self._connect().log_batch(self.run_id, params=items[i:i + _MAX_PARAMS_PER_BATCH])
        except Exception as exc:
            self._failed("log_params", exc)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self._pending.append((dict(metrics), step, int(time.time() * 1000)))
        self.flush()

    def flush(self, force: bool = False) -> bool:
        """Send what is pending (creating the run first if the server was down at start);
        True when nothing is left."""
        if self._run_name is None:  # not started
            return not self._pending
        if self.failures and not force and time.monotonic() - self._last_failure < self.options.retry_every:
            return False
        from mlflow.entities import Metric

        try:
            if self.run_id is None:
                self._create_run()
            while self._pending:
                batch: list[Metric] = []
                taken = 0
                for metrics, step, ts in self._pending:
                    if batch and len(batch) + len(metrics) > _MAX_METRICS_PER_BATCH:
                        break
                    batch.extend(Metric(k, float(v), ts, step) for k, v in metrics.items())
                    taken += 1
                self._connect().log_batch(self.run_id, metrics=batch)
                del self._pending[:taken]
        except Exception as exc:
            self._failed("log_metrics", exc)
            return False
        return True

    # -- checkpointed with the run: rows not sent yet survive the process and go after a resume
    def state_dict(self) -> dict[str, Any]:
        return {"pending": [(dict(metrics), step, ts) for metrics, step, ts in self._pending]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        kept = [(dict(metrics), int(step), int(ts)) for metrics, step, ts in state.get("pending", [])]
        self._pending[:0] = kept  # sent with their original timestamps: a row sent twice is one row

    def log_artifact(self, path: str) -> None:
        if self.run_id is None:
            self._unsent.append(("log_artifact", str(path)))
            return
        try:
            self._connect().log_artifact(self.run_id, str(path))
        except Exception as exc:
            self._failed("log_artifact", exc)

    def log_table(self, name: str, rows: list[dict[str, Any]], step: int) -> None:
        if self.run_id is None or not rows:
            return
        columns = list(rows[0])
        data = {c: [r.get(c) for r in rows] for c in columns}
        try:
            self._connect().log_table(self.run_id, data=data, artifact_file=f"{name}/step_{step:06d}.json")
        except Exception as exc:
            self._failed("log_table", exc)

    def log_model(self, folder: str) -> str | None:
        """Log ``folder`` (the final model) as this run's MLflow model; its URI, or None
        when ``log_model`` is off or MLflow failed (warned)."""
        if not self.options.log_model or self.run_id is None:
            return None
        try:
            return _log_pyfunc(self.tracking_uri, self.run_id, folder, self.options.registered_model_name)
        except Exception as exc:
            self._failed("log_model", exc)
            return None

    def finish(self, status: str) -> None:
        if not self.flush(force=True):
            rows = len(self._pending)
            log.warning("MLflow unreachable at the end of the run: %d metric rows were not sent "
                        "(they are in the run folder's metrics.jsonl)", rows)
        if self.run_id is None:
            return
        try:
            self._connect().set_terminated(self.run_id, status=status)
        except Exception as exc:
            self._failed("finish", exc)


def _log_pyfunc(uri: str, run_id: str, folder: str, registered: str | None) -> str:
    """``grpo_core/mlflow_model.py`` logged as a models-from-code pyfunc with ``folder`` as
    its ``model`` artifact, into run ``run_id``; returns the model URI."""
    import importlib.metadata as metadata
    from pathlib import Path

    import mlflow
    from mlflow.models import infer_signature

    from grpo_core import mlflow_model

    needed = ["torch", "transformers"] + (["peft"] if (Path(folder) / "adapter_config.json").is_file() else [])
    requirements = [f"{name}=={metadata.version(name)}" for name in needed]
    signature = infer_signature(["a prompt"], ["a completion"], params=mlflow_model.DEFAULT_PARAMS)
    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(uri)
    try:
        with mlflow.start_run(run_id=run_id), warnings.catch_warnings():
            # MLflow advises type hints on predict; the explicit signature above serves instead.
            warnings.filterwarnings("ignore", message=".*type hint", category=UserWarning)
            info = mlflow.pyfunc.log_model(
                name="model", python_model=mlflow_model.__file__, artifacts={"model": str(folder)},
                signature=signature, pip_requirements=requirements, registered_model_name=registered,
            )
    finally:
        mlflow.set_tracking_uri(previous)
    return info.model_uri


class ConsoleOptions(Options):
    every: int = Field(1, ge=1, description="Print metrics every N steps.")
    keys: list[str] | None = Field(
        None, description="Metric names to print; default: reward, kl, loss, eval metrics and step time."
    )


_DEFAULT_KEYS = ("reward", "reward_std", "kl", "loss", "completions/mean_length", "time/step")


class ConsoleTracker:
    """Prints one line of metrics per step to stderr (a plain-text log of the run)."""

    def __init__(self, options: ConsoleOptions):
        self.options = options

    def start(self, run_name: str, resume_id: str | None = None) -> str | None:
        return None

    def log_params(self, params: dict[str, Any]) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        keys = self.options.keys
        if keys is None:
            keys = [k for k in metrics if k in _DEFAULT_KEYS or k.startswith("eval/")]
        if step % self.options.every and not any(k.startswith("eval/") for k in metrics):
            return
        shown = " ".join(f"{k}={metrics[k]:.4g}" for k in keys if k in metrics)
        if shown:
            print(f"[step {step}] {shown}", file=sys.stderr, flush=True)

    def log_artifact(self, path: str) -> None:
        pass

    def log_table(self, name: str, rows: list[dict[str, Any]], step: int) -> None:
        if rows:
            print(f"[step {step}] {name}: {json.dumps(rows[0], ensure_ascii=False)[:300]}", file=sys.stderr)

    def finish(self, status: str) -> None:
        pass


@hookimpl
def register_trackers(register):
    register.add("mlflow", MLflowTracker, options=MLflowOptions)
    register.add("console", ConsoleTracker, options=ConsoleOptions)
