"""On a GPU: PyTorch's own first-call writes are never blamed on the block that ran them.

On compute capability 9.x/10.x with cuDNN > 9.1.5, the first SDPA call in a process moves
cuDNN attention to the front of the priority order (pytorch/pytorch#185511). Each test runs
in a fresh process, so that its SDPA call is the process's first. Skips without a CUDA GPU.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

FIRST_CALL = textwrap.dedent(
    """
    import logging, warnings, torch, torch.nn.functional as F, speedflags
    logging.basicConfig(level=logging.INFO, format="LOG %(name)s %(message)s")
    q = torch.randn(2, 8, 256, 64, device="cuda", dtype=torch.float16)
    before = torch._C._get_sdp_priority_order()
    warnings.simplefilter("error")  # a DriftWarning fails the run
    with speedflags.watch():
        with speedflags.fast_math(sdpa=("flash", "efficient", "cudnn"), device="cuda"):
            F.scaled_dot_product_attention(q, q, q)
        inside_moved = torch._C._get_sdp_priority_order() != before
    print("ORDER", before, torch._C._get_sdp_priority_order(), "MOVED", inside_moved)
    """
)


def test_the_first_sdpa_call_inside_a_block_is_no_drift() -> None:
    done = subprocess.run(
        [sys.executable, "-c", FIRST_CALL], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "DriftWarning" not in done.stderr
    # Where PyTorch made its move, it was logged as PyTorch's, not the block's.
    if "by PyTorch itself" in done.stderr:
        assert "pytorch/pytorch#185511" in done.stderr
    print(done.stdout, done.stderr[-2000:])


PLAIN_FIRST_CALL = textwrap.dedent(
    """
    import torch, torch.nn.functional as F
    q = torch.randn(2, 8, 256, 64, device="cuda", dtype=torch.float16)
    F.scaled_dot_product_attention(q, q, q)
    print("ORDER", torch._C._get_sdp_priority_order())
    """
)

BLOCK_FIRST_CALL = textwrap.dedent(
    """
    import warnings, torch, torch.nn.functional as F, speedflags
    from torch.profiler import profile
    q = torch.randn(2, 8, 256, 64, device="cuda", dtype=torch.float16)  # CUDA in use
    warnings.simplefilter("error", speedflags.DriftWarning)  # a DriftWarning fails the run
    with speedflags.fast_math(sdpa=("flash", "cudnn"), device="cuda"):
        with profile() as prof:
            F.scaled_dot_product_attention(q, q, q)
            torch.cuda.synchronize()
    ops = sorted({e.name for e in prof.events() if "scaled_dot_product" in e.name})
    print("OPS", ops)
    print("ORDER", torch._C._get_sdp_priority_order())
    """
)


def _run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.skipif(
    not hasattr(torch._C, "_get_sdp_priority_order"), reason="no SDPA priority order here"
)
def test_a_blocks_first_sdpa_call_keeps_its_preference_and_leaves_torchs_default() -> None:
    """``sdpa=("flash", "cudnn")`` around the process's first SDPA call (CUDA already in
    use): flash runs, though PyTorch's first-call write (pytorch/pytorch#185511) would put
    cuDNN first; after the block the order is what a process without speedflags has after
    its first SDPA call (PyTorch's default, cuDNN first on sm90/sm100 with cuDNN > 9.15).
    Each part in a fresh process, so that its SDPA call is the first."""
    plain = [line for line in _run(PLAIN_FIRST_CALL).splitlines() if line.startswith("ORDER")]
    out = _run(BLOCK_FIRST_CALL).splitlines()
    assert [line for line in out if line.startswith("ORDER")] == plain
    (ops,) = [line for line in out if line.startswith("OPS")]
    assert "_scaled_dot_product_flash_attention" in ops and "cudnn" not in ops, ops
