"""Base class for plugin options models, and the type of a duration in a spec."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

__all__ = ["MAX_SECONDS", "Options", "Seconds", "WholeSeconds", "check_seconds"]

#: The longest duration a spec or an option may hold, in seconds (365 days). A longer wait
#: bounds nothing, and beyond about 9.2e9 s no lock, socket or clock of the platform can hold
#: it (Python then raises ``OverflowError`` at the first call, long after validation).
MAX_SECONDS = 365 * 24 * 3600


def check_seconds(value: float) -> float:
    """``value`` if it is a duration the platform can wait for (at most :data:`MAX_SECONDS`);
    else a ``ValueError`` saying what is valid (pydantic reports it with the field's path)."""
    if value > MAX_SECONDS:
        raise ValueError(
            f"at most {MAX_SECONDS} seconds (365 days), got {value:g}: a longer wait bounds nothing, "
            "and the platform's locks and sockets cannot represent one much longer"
        )
    return value


#: A duration in seconds: a finite number, at most :data:`MAX_SECONDS`. Give its lower bound at
#: the field (``Field(30.0, gt=0, ...)``).
Seconds = Annotated[float, Field(allow_inf_nan=False), AfterValidator(check_seconds)]
#: A duration in whole seconds (an API that takes an ``int``), at most :data:`MAX_SECONDS`.
WholeSeconds = Annotated[int, AfterValidator(check_seconds)]


class Options(BaseModel):
    """Options of a component: unknown keys are errors, values are immutable, and a float
    is finite (``.inf`` and ``.nan`` are refused with the option's path: an infinite timeout
    would pass ``gt=0`` and then fail every call). Type a duration :data:`Seconds`, so that
    one the platform cannot represent (``1e30``) is refused here too.

    Subclass it, give every field a ``description``, and pass the class as
    ``register.add(name, factory, options=MyOptions)``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
