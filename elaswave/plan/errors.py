"""The planner's refusal: no plan fits the live ranks."""
from __future__ import annotations


class PlanError(ValueError):
    """No plan fits the live ranks; the message says why. ``saved_step``: the step whose state the
    survivors saved to disk before stopping (every step before it happened), if they did."""

    saved_step: int | None = None
