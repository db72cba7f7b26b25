"""The error a user sees: one line naming the bad value and what would be valid.

A leaf: every config section, reader and check raises these without importing the job config, so
the imports flow one way (:mod:`elaswave.config` gathers the sections; no section reaches back).
"""
from typing import NoReturn


class ConfigError(ValueError):
    """A configuration value is invalid; the message is one line meant for the user."""


def fail(key: str, value: object, valid: str) -> NoReturn:
    """Raise the one-line error for ``key=value``, saying what would be valid."""
    raise ConfigError(f"{key}={value!r} is invalid: {valid}")
