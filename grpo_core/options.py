"""Base class for plugin options models."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Options(BaseModel):
    """Options of a component: unknown keys are errors, values are immutable, and a float
    is finite (``.inf`` and ``.nan`` are refused with the option's path: an infinite timeout
    would pass ``gt=0`` and then fail every call).

    Subclass it, give every field a ``description``, and pass the class as
    ``register.add(name, factory, options=MyOptions)``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
