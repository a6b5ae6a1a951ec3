"""MLflow runs for tinker-serve: one run per training client (named by its model id) in the
experiment given to ``--mlflow``, with each call it makes logged as metrics at its optimizer
step: ``forward_backward``'s summed loss and tokens, ``optim_step``'s learning rate (and grad
norm when clipped), a sampler snapshot's push to a vLLM engine (bytes, seconds), a count of
each call."""

from __future__ import annotations

from collections import Counter

__all__ = ["MLflowClients"]


class MLflowClients:
    """``tracker(model_id, event, step, values)``: log ``values`` under ``event/`` in the
    client's run (started at its first event)."""

    def __init__(self, experiment: str):
        import mlflow

        self.mlflow = mlflow.tracking.MlflowClient()
        found = self.mlflow.get_experiment_by_name(experiment)
        self.experiment = found.experiment_id if found else self.mlflow.create_experiment(experiment)
        self.runs: dict[str, str] = {}
        self.calls: Counter[tuple[str, str]] = Counter()

    def run_id(self, model_id: str) -> str:
        if model_id not in self.runs:
            run = self.mlflow.create_run(self.experiment, run_name=model_id, tags={"tinker.model_id": model_id})
            self.runs[model_id] = run.info.run_id
        return self.runs[model_id]

    def __call__(self, model_id: str, event: str, step: int, values: dict[str, float]) -> None:
        run = self.run_id(model_id)
        self.calls[model_id, event] += 1
        for key, value in {**values, "calls": float(self.calls[model_id, event])}.items():
            self.mlflow.log_metric(run, f"{event}/{key.replace(':', '_')}", value, step=step)
