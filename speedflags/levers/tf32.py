"""The ``tf32`` lever: TF32 for cuBLAS matmuls and cuDNN convolutions/RNNs (process scope).

Both of PyTorch's TF32 API families stay readable: the write goes through the legacy
setters and is corrected through the new ``fp32_precision`` API where needed, and a mixed
starting state is refused with :class:`~speedflags.MixedTF32APIError` before anything is
changed. The policy and its limits are in ``docs/tf32_policy.md``.
"""

from __future__ import annotations

from typing import Any

import torch

from ..hardware import capabilities
from . import _fp32_model as family
from ._base import Effect, validate_bool
from ._family_lever import FamilyLever


class TF32Lever(FamilyLever):
    """``tf32=True/False``: TF32 tensor-core math for float32 matmuls and convolutions.

    Scope: process. The state read and restored is every getter of both TF32 API families.
    """

    name = "tf32"
    change = "change TF32"
    target = staticmethod(family.tf32_target)
    validate = staticmethod(validate_bool)

    def describe(self, state: family.FamilyState) -> Any:
        return family.describe_state(state)

    def available(self, value: bool, device: torch.device) -> Effect:
        caps = capabilities(device)
        if caps.tf32:
            return Effect(True, "")
        return Effect(False, f"no effect on {caps.device}: {caps.tf32.reason}")
