"""The question "who wrote this flag?", asked by the layers below the watch.

The ledger (a drift warning) and the TF32 family (:class:`~speedflags.MixedTF32APIError`)
end their messages with who wrote the state they found. Only a running
:func:`speedflags.watch` knows, and it sits above them: it registers itself here when it
starts and removes itself when it stops, so these layers ask this module and never import
the watch (as pytest's core calls hooks that plugins register). With no watch on, the answer
says how to learn it.

Example:
    >>> import torch
    >>> from speedflags.levers import culprits
    >>> from speedflags.levers.registry import lever_spec
    >>> lever = lever_spec("cudnn_benchmark").lever()
    >>> note = culprits.culprit_note(lever, True)  # who set cudnn.benchmark to True?
    >>> "speedflags.watch()" in note  # no watch: how to learn it; watching: what it saw
    True
"""

from __future__ import annotations

from typing import Any, Protocol

from ._base import Guard, Lever

__all__ = [
    "NOT_WATCHING",
    "CulpritSource",
    "culprit_note",
    "mixed_note",
    "set_source",
    "torch_write",
]

NOT_WATCHING = "To learn which code wrote it, run under speedflags.watch() (or SPEEDFLAGS_WATCH=1)."


class CulpritSource(Protocol):
    """What a running watch registers: each method returns a sentence to append, or ``""``."""

    def culprit_note(self, lever: Lever, state: Any) -> str:
        """Who wrote ``lever``'s current ``state``, as " Last written by: ..." (or why unknown)."""

    def mixed_note(self, state: Any) -> str:
        """Which write made the TF32 family's ``state`` mixed (or why unknown)."""

    def torch_write(self, lever: Guard, state: Any) -> str | None:
        """The write of ``lever``'s ``state`` in words, if PyTorch made it by itself."""


_source: CulpritSource | None = None


def set_source(source: CulpritSource | None) -> None:
    """Register the running watch (``None`` when it stops). Called with the ledger's lock held."""
    global _source
    _source = source


def culprit_note(lever: Lever, state: Any) -> str:
    """A sentence for a message about ``lever`` found in ``state``: who wrote it, if known."""
    source = _source
    if source is None:
        return f" {NOT_WATCHING}"
    return source.culprit_note(lever, state)


def mixed_note(state: Any) -> str:
    """For ``MixedTF32APIError``: the write that made the TF32 state mixed, if known."""
    source = _source
    if source is None:
        return f" {NOT_WATCHING}"
    return source.mixed_note(state)


def torch_write(lever: Guard, state: Any) -> str | None:
    """If a running watch saw PyTorch itself write ``lever``'s ``state`` (a lazy write of
    its own, reached from the user's call), that write in words; otherwise None."""
    source = _source
    return None if source is None else source.torch_write(lever, state)


def known_torch_write(lever: Guard, before: Any, after: Any) -> str | None:
    """``before`` -> ``after`` in words if the lever knows it as a write PyTorch makes by
    itself where no watch can see it (in C++); otherwise None. Needs no watch."""
    explain = getattr(lever, "torch_write", None)
    return None if explain is None else explain(before, after)  # type: ignore[no-any-return, unused-ignore]


def made_by_torch(lever: Guard, before: Any, after: Any) -> str | None:
    """``before`` -> ``after`` in words if PyTorch made it by itself: a running watch saw the
    write come from torch's own code, or the lever knows it as a C++ write of PyTorch's.
    What the ledger's drift check and the leak check ask; None otherwise."""
    return torch_write(lever, after) or known_torch_write(lever, before, after)
