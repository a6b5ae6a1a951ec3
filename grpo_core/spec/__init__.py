"""The YAML spec: models, component slots and the loader.

- ``models``: the spec, one small pydantic model per section, composed into ``Spec``;
- ``slots``: the parts of a spec that select a plugin by name;
- the sections with a module of their own: ``algorithm``, ``data``, ``episodes``, ``export``,
  ``iterative``, ``optimizer``, ``parallel``, ``sft``;
- ``loader``: safe YAML, ``--set`` overrides, plugin files, validation of everything at once;
- ``schema``: the spec's JSON Schema with every registered component's options;
- ``metrics``: the metric names an evaluation of a spec logs (what ``checkpoint.best_metric`` may name);
- ``resolved``: checks that read the components the slots resolved to (what a streamed training
  split cannot take, partial rollouts' backend and process count).
"""

from grpo_core.spec.loader import LoadedSpec, dump_spec, load_spec
from grpo_core.spec.models import Spec
from grpo_core.spec.slots import Slot, SpecPath

__all__ = ["LoadedSpec", "Slot", "Spec", "SpecPath", "dump_spec", "load_spec"]
