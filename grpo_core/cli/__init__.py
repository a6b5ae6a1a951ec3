"""The ``grpo-run`` command line, one module per command family; nothing in the engine
imports this package.

- ``app``: the parser, the dispatch and the process exit (``main``, the ``grpo-run`` entry).
- ``eval``: ``grpo-run eval``, a saved model evaluated on a spec's held-out data.
- ``init``: ``grpo-run init``, starter specs written from the package's templates.
- ``runs``: ``grpo-run runs``, the runs of an output folder.
- ``dryrun``: ``grpo-run run --dry-run``, one step's shapes without training.
"""

from grpo_core.cli.app import _entry, main

__all__ = ["_entry", "main"]
