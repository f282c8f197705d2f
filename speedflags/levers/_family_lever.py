"""What the ``tf32`` and ``matmul_precision`` levers share: one state, both TF32 API families.

Both levers read, check and restore the same thing (every getter of both families, one
ledger stack for the two); they differ only in the target a value asks for.
"""

from __future__ import annotations

from . import _fp32_model as family
from ._base import SimpleLever, verified
from ._fp32_torch import read_state, transition


class FamilyLever(SimpleLever):
    """Base of the levers whose state is every getter of both TF32 API families.

    Scope: process. Entering refuses a mixed TF32 state before anything changes;
    restoring writes back every getter's answer.
    """

    scope = "process"
    domain = "fp32_precision"
    checks_state = True  # refuses a mixed TF32 state

    def read(self) -> family.FamilyState:
        return read_state()

    def restore(
        self, target: family.FamilyState, current: family.FamilyState
    ) -> family.FamilyState:
        after, wanted = transition(("restore", current, target), current, _same, target)
        return after if after is wanted else verified(self, "restoring", target, after)


def _same(state: family.FamilyState) -> family.FamilyState:
    return state
