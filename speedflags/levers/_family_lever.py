"""What the ``tf32`` and ``matmul_precision`` levers share: one state, both TF32 API families.

Both levers read, check, write and restore the same thing (every getter of both families,
one ledger stack for the two); they differ only in the target a value asks for
(:meth:`FamilyLever.target`) and in how they describe the state.
"""

from __future__ import annotations

from typing import Any, Callable

from . import _fp32_model as family
from ._base import SimpleLever, verified
from ._fp32_mixed import require_consistent
from ._fp32_torch import read_state, transition


class FamilyLever(SimpleLever):
    """Base of the levers whose state is every getter of both TF32 API families.

    Scope: process. Entering refuses a mixed TF32 state before anything changes;
    restoring writes back every getter's answer.

    A subclass sets ``name``, ``change`` (what a mixed state stops it doing, for the error:
    ``"change TF32"``) and ``target``.
    """

    scope = "process"
    domain = "fp32_precision"
    checks_state = True  # refuses a mixed TF32 state
    change = ""
    # (state before, value) -> the consistent state that writing the value asks for
    target: Callable[[family.FamilyState, Any], family.FamilyState]

    def read(self) -> family.FamilyState:
        return read_state()

    def check(self, state: family.FamilyState) -> None:
        require_consistent(state, self.change)

    def apply(self, value: Any, before: family.FamilyState) -> family.FamilyState:
        after, target = transition((self.name, before, value), before, self.target, before, value)
        return after if after is target else verified(self, "setting", target, after)

    def restore(
        self, target: family.FamilyState, current: family.FamilyState
    ) -> family.FamilyState:
        after, wanted = transition(("restore", current, target), current, _same, target)
        return after if after is wanted else verified(self, "restoring", target, after)


def _same(state: family.FamilyState) -> family.FamilyState:
    return state
