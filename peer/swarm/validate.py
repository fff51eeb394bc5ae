"""The argument checks every settings dataclass of both peers uses in its ``__post_init__``.

Each raises ``ValueError`` with a message that names the setting and says what is valid; the typed-argument
parser turns it into a command-line error (exit status 2).
"""

from __future__ import annotations

import math


def require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def positive(owner: object, *names: str, unit: str = "number") -> None:
    """Each named field is a finite number > 0 (``unit`` names what it counts, e.g. "number of seconds")."""
    for name in names:
        value = getattr(owner, name)
        require(_is_number(value) and value > 0, f"{name} must be a positive {unit}, got {value!r}")


def non_negative(owner: object, *names: str) -> None:
    for name in names:
        value = getattr(owner, name)
        require(_is_number(value) and value >= 0, f"{name} must be zero or a positive number, got {value!r}")


def integer_at_least(owner: object, minimum: int, *names: str, note: str = "") -> None:
    """Each named field is an int >= ``minimum``; ``note`` is appended to the message (e.g. "(0 disables it)")."""
    for name in names:
        value = getattr(owner, name)
        require(
            isinstance(value, int) and value >= minimum,
            f"{name} must be an integer >= {minimum}{' ' + note if note else ''}, got {value!r}",
        )
