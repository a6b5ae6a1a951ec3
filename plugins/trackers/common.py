"""What the optional trackers (``wandb``, ``tensorboard``) share: the check, at validation, that
their package is installed (:func:`require_package`), backend calls that warn instead of raising
(:class:`GuardedTracker`), and completion tables as markdown (:func:`markdown_table`)."""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

from pydantic_core import PydanticCustomError

__all__ = ["GuardedTracker", "markdown_table", "require_package"]

log = logging.getLogger("grpo.tracking")


def require_package(package: str, extra: str, tracker: str) -> None:
    """Raise a validation error naming the install command when ``package`` is missing."""
    if importlib.util.find_spec(package) is None:
        raise PydanticCustomError(
            f"{package}_missing",
            f"tracker '{tracker}' needs the {package} package, which is not installed: "
            f"pip install 'grpo-core[{extra}]'",
        )


class GuardedTracker:
    """A tracker whose backend calls warn (once per method) and never raise. :meth:`start` runs
    the subclass's ``_start(run_name)`` so and returns None: the run id the engine checkpoints
    is MLflow's, these trackers keep their own in their state."""

    label = "tracker"

    def __init__(self, options: Any):
        self.options = options
        self._warned: set[str] = set()
        self.failures = 0

    def _guard(self, what: str, fn, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            self.failures += 1
            if what not in self._warned:
                self._warned.add(what)
                log.warning("%s %s failed (%s: %s); carrying on", self.label, what, type(exc).__name__, exc)
            return None

    def start(self, run_name: str, resume_id: str | None = None) -> str | None:
        self._guard("start", self._start, run_name)
        return None


def markdown_table(rows: list[dict[str, Any]], limit: int = 500) -> str:
    """Rows as a markdown table (TensorBoard renders text summaries as markdown); cells
    are cut to ``limit`` characters and their newlines and pipes escaped."""
    if not rows:
        return ""
    columns = list(rows[0])

    def cell(value: Any) -> str:
        text = "" if value is None else str(value)
        text = text[:limit].replace("|", "\\|").replace("\r", "").replace("\n", "<br>")
        return text

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)
