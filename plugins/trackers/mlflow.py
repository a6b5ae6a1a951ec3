"""Tracker ``mlflow`` (the default): params, metrics, the spec, completion tables and, on request,
the final model, logged to MLflow; what cannot be sent while the server is down is kept, and
checkpointed, until it answers."""

from __future__ import annotations

import logging
import os
import time
import uuid
import warnings
from typing import Any

from pydantic import Field

from grpo_core import hookimpl
from grpo_core.options import Options, Seconds

__all__ = ["MLflowOptions", "MLflowTracker"]

log = logging.getLogger("grpo.tracking")

# MLflow's limits on one log_batch call, and on a param value.
_MAX_METRICS_PER_BATCH = 1000
_MAX_PARAMS_PER_BATCH = 100
_MAX_PARAM_VALUE = 6000
_RUN_KEY = "grpo_run_key"


class MLflowOptions(Options):
    experiment: str = Field("grpo-core", description="MLflow experiment name (created when missing).")
    tracking_uri: str | None = Field(
        None,
        description="Tracking server or store URI; default: MLflow's own default "
        "(MLFLOW_TRACKING_URI when set, else a local store in the working directory).",
    )
    tags: dict[str, str] = Field(default_factory=dict, description="Tags set on the run.")
    retry_every: Seconds = Field(
        30.0, ge=0, description="Seconds between attempts to reach an unreachable server again."
    )
    request_timeout: Seconds = Field(
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

    When the server cannot be reached, metrics, params, artifacts and tables are kept in
    memory and sent, in order, once it answers again (a run that could not be created at
    start is created then); training never waits for it beyond one failed call. What is
    still unsent is part of the run's checkpoints, so a run that stops while the server is
    down sends it after ``--resume`` (artifacts by path: the files in the run folder).

    One MLflow run per trajectory: the run is tagged with a key of its own
    (``grpo_run_key``), and a creation that failed (a timeout, maybe after the server had
    created it) is followed by a search for that tag before creating again. After a resume,
    a step already in the run's history is not logged again (the first values are kept;
    ``metrics.jsonl`` has the redone ones).
    """

    def __init__(self, options: MLflowOptions):
        self.options = options
        self.run_id: str | None = None
        self._client = None
        self._pending: list[tuple[dict[str, float], int, int]] = []
        self._run_name: str | None = None
        self._unsent: list[tuple[str, Any]] = []  # params, artifacts and tables not sent yet
        self._last_failure = 0.0
        self.failures = 0
        self._key = uuid.uuid4().hex  # tags the run: found again after a creation that timed out
        self._create_tried = False
        self._logged: dict[str, set[int]] | None = None  # after a resume: steps in the history, by key

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
                self._logged = {}
                self._connect().update_run(resume_id, status="RUNNING")
            else:
                self._create_run()
        except Exception as exc:
            self._failed("start", exc)
        return self.run_id

    def _create_run(self) -> None:
        """Create the run (or find the one a failed attempt created), then send what was
        logged before it existed (server down at start)."""
        client = self._connect()
        exp = client.get_experiment_by_name(self.options.experiment)
        exp_id = exp.experiment_id if exp else client.create_experiment(self.options.experiment)
        found = None
        if self._create_tried:  # the last attempt may have reached the server
            found = client.search_runs([exp_id], filter_string=f"tags.{_RUN_KEY} = '{self._key}'", max_results=1)
        if found:
            self.run_id = found[0].info.run_id
        else:
            self._create_tried = True
            tags = {**self.options.tags, _RUN_KEY: self._key}
            self.run_id = client.create_run(exp_id, run_name=self._run_name, tags=tags).info.run_id

    def log_params(self, params: dict[str, Any]) -> None:
        self._unsent.append(("params", dict(params)))
        self.flush()

    def _send(self, kind: str, arg: Any) -> None:
        client = self._connect()
        if kind == "params":
            from mlflow.entities import Param

            items = [Param(k[:250], str(v)[:_MAX_PARAM_VALUE]) for k, v in arg.items()]
            for i in range(0, len(items), _MAX_PARAMS_PER_BATCH):
                client.log_batch(self.run_id, params=items[i:i + _MAX_PARAMS_PER_BATCH])
        elif kind == "artifact":
            client.log_artifact(self.run_id, arg)
        elif kind == "table":
            client.log_table(self.run_id, data=arg["data"], artifact_file=arg["file"])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self._pending.append((dict(metrics), step, int(time.time() * 1000)))
        self.flush()

    def flush(self, force: bool = False) -> bool:
        """Send what is pending (creating the run first if the server was down at start);
        True when nothing is left."""
        if self._run_name is None:  # not started
            return not (self._pending or self._unsent)
        if self.failures and not force and time.monotonic() - self._last_failure < self.options.retry_every:
            return False
        try:
            if self.run_id is None:
                self._create_run()
            self._send_metrics()
            while self._unsent:
                self._send(*self._unsent[0])
                del self._unsent[0]
        except Exception as exc:
            self._failed("log", exc)
            return False
        return True

    def _send_metrics(self) -> None:
        from mlflow.entities import Metric

        while self._pending:
            batch: list[Metric] = []
            taken = 0
            for metrics, step, ts in self._pending:
                if batch and len(batch) + len(metrics) > _MAX_METRICS_PER_BATCH:
                    break
                batch.extend(Metric(k, float(v), ts, step) for k, v in metrics.items() if self._new(k, step))
                taken += 1
            if batch:
                self._connect().log_batch(self.run_id, metrics=batch)
            for metrics, step, _ in self._pending[:taken]:
                for key in metrics if self._logged is not None else ():
                    self._logged.setdefault(key, set()).add(step)
            del self._pending[:taken]

    def _new(self, key: str, step: int) -> bool:
        """Whether ``key`` at ``step`` is not in the run yet: always, unless this run was
        resumed (then its history is read once per key, from the server)."""
        if self._logged is None:
            return True
        if key not in self._logged:
            history = self._connect().get_metric_history(self.run_id, key)
            self._logged[key] = {m.step for m in history}
        return step not in self._logged[key]

    # -- checkpointed with the run: what is not sent yet survives the process and goes after a resume
    def state_dict(self) -> dict[str, Any]:
        return {
            "pending": [(dict(metrics), step, ts) for metrics, step, ts in self._pending],
            "unsent": [(kind, arg) for kind, arg in self._unsent],
            "key": self._key,
            "create_tried": self._create_tried,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        kept = [(dict(metrics), int(step), int(ts)) for metrics, step, ts in state.get("pending", [])]
        self._pending[:0] = kept  # sent with their original timestamps: a row sent twice is one row
        self._unsent[:0] = [(str(kind), arg) for kind, arg in state.get("unsent", [])]
        self._key = str(state.get("key", self._key))
        self._create_tried = bool(state.get("create_tried", self._create_tried))

    def log_artifact(self, path: str) -> None:
        self._unsent.append(("artifact", str(path)))
        self.flush()

    def log_table(self, name: str, rows: list[dict[str, Any]], step: int) -> None:
        if not rows:
            return
        columns = list(rows[0])
        data = {c: [r.get(c) for r in rows] for c in columns}
        self._unsent.append(("table", {"data": data, "file": f"{name}/step_{step:06d}.json"}))
        self.flush()

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
            rows, other = len(self._pending), len(self._unsent)
            log.warning("MLflow unreachable at the end of the run: %d metric rows were not sent (they are "
                        "in the run folder's metrics.jsonl), nor %d params, artifacts or tables", rows, other)
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


@hookimpl
def register_trackers(register):
    register.add("mlflow", MLflowTracker, options=MLflowOptions)
