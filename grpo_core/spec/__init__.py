"""The YAML spec: models, component slots and the loader."""

from grpo_core.spec.loader import LoadedSpec, dump_spec, load_spec
from grpo_core.spec.models import Spec
from grpo_core.spec.slots import Slot, SpecPath

__all__ = ["LoadedSpec", "Slot", "Spec", "SpecPath", "dump_spec", "load_spec"]
