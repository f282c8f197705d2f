"""The ledger as its frame API sees it: :class:`FrameLedger`, and :class:`Scope`.

The frame API (:mod:`.scope`, :mod:`.entering`, :mod:`.decorate`, :mod:`.suspend`) works on
a ledger it is handed, and :class:`~speedflags.FlagLedger` builds its scopes
(``FlagLedger.frame``), so the API cannot import the ledger's module, not even for its type:
it names what it uses here, and ``FlagLedger`` follows it. Likewise :class:`Scope` is what
the decorators and the interrupt handling use of a :class:`~.scope.FrameScope`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from .._tracing import Where
from .frame import Frame
from .program import Levers
from .ring import Ring
from .stacks import Stacks
from .threads import Threads

__all__ = ["FrameLedger", "Scope"]


class FrameLedger(Protocol):
    """What the frame API uses of a ledger: its frame calls, its lock, and three of its
    parts (``stacks``: the open frames; ``ring``: the history; ``threads``: the threads that
    opened frames, and why a frame cannot be closed in this one)."""

    stacks: Stacks
    ring: Ring
    threads: Threads

    @property
    def lock(self) -> Any: ...

    @property
    def open(self) -> Callable[[Levers, str, Where, object, str | None], Frame]:
        """``FlagLedger.open``, as the frame API calls it: ``(levers, label, where, owner,
        device)``, every argument given, in that order."""

    def close(self, frame: Frame, where: Where = None) -> None: ...

    def innermost(self, owner: object) -> Frame: ...


class Scope(Protocol):
    """What the decorators and the interrupt handling use of a scope: its ledger, and how
    it opens one frame (owned by itself)."""

    @property
    def ledger(self) -> FrameLedger: ...

    def open_frame(self, label: str, where: Where) -> Frame: ...
