"""The "leave this lever alone" sentinel."""

from __future__ import annotations

import enum


class _Unset(enum.Enum):
    # A one-member enum (PEP 484 singleton idiom) so type checkers can narrow on it;
    # ``None`` cannot serve, because some levers accept falsy values (amp=False).
    UNSET = "UNSET"

    def __repr__(self) -> str:
        return "UNSET"


UNSET = _Unset.UNSET
