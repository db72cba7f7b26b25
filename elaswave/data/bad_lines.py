"""The lines of a corpus that ``elaswave prepare`` cannot use, all of them counted.

Stopping at the first bad line sends a user back and forth once per line; reading on costs only the
rest of a pass. So every bad line is counted, the first few are kept to be shown, and at the end
one line says how many there are, of how many, and shows those few -- nothing is written.
"""
from __future__ import annotations

from elaswave.errors import ConfigError

SHOWN = 3


class BadLines:
    def __init__(self) -> None:
        self.count = 0
        self.read = 0
        """Lines (records) read, bad ones included."""
        self.first: list[str] = []

    def add(self, message: str) -> None:
        self.count += 1
        if len(self.first) < SHOWN:
            self.first.append(message)

    def check(self) -> None:
        """One error for them all, if any."""
        if not self.count:
            return
        more = f"; and {self.count - len(self.first)} more" if self.count > len(self.first) else ""
        raise ConfigError(f"{self.count} of the {self.read:,} lines read cannot be used, so nothing was written "
                          f"(fix or remove them and prepare again): {'; '.join(self.first)}{more}")
