"""Base class for plugin options models."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Options(BaseModel):
    """Options of a component: unknown keys are errors, values are immutable.

    Subclass it, give every field a ``description``, and pass the class as
    ``register.add(name, factory, options=MyOptions)``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
