"""One rank of the multi-process tests (tests/test_distributed.py starts it; not a test module).

    python tests/_dist_worker.py ranks RANK WORLD_SIZE STORE_FILE OUT_FILE
        joins a gloo group through a FileStore and runs the check_ranks and DDP scenarios,
        writing each scenario's findings (or its traceback) to OUT_FILE as JSON.
    torchrun ... tests/_dist_worker.py report-mismatch
        rank 1 switches TF32 on, then every rank runs `python -m speedflags report`.

Every collective runs under a short process-group timeout, so a rank left waiting fails
instead of hanging. A rank still running after HANG_LIMIT_S (stuck anywhere: its imports,
a scenario, gloo's teardown) prints every thread's stack to stderr and exits, before the
test's own bound kills it: the test's failure then shows where each rank was. Each rank also
says on stderr when it reaches each step.
"""

from __future__ import annotations

import faulthandler
import sys
import time

# the test waits 180 s for a rank (tests/test_distributed.py); this comes well before
HANG_LIMIT_S = 120
STARTED = time.monotonic()
if __name__ == "__main__":
    # armed before the imports below, so a rank stuck while importing shows where too
    faulthandler.dump_traceback_later(HANG_LIMIT_S, exit=True)

import json
import os
import threading
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from conftest import autocast_enabled

import speedflags
from speedflags import RankMismatchError, fast_math, speedup
from speedflags._distributed.compare import PER_RANK

TIMEOUT = timedelta(seconds=30)
# how long the group's teardown may take once the findings are written (below)
TEARDOWN_LIMIT_S = 20
THREADS = torch.get_num_threads()


def progress(rank: int, step: str) -> None:
    """One line on stderr: where this rank is, and when (the test shows it if a rank fails)."""
    print(f"rank {rank}: {step} at {time.monotonic() - STARTED:.1f} s", file=sys.stderr, flush=True)


def rank_records(label_part: str) -> list[dict[str, Any]]:
    return [
        r.to_dict()
        for r in speedflags.ledger().history
        if r.lever == "ranks" and label_part in r.label
    ]


def scenario_agree(rank: int) -> dict[str, Any]:
    common = speedflags.check_ranks()
    with fast_math(cudnn_benchmark=True, label="rank-record"):
        pass
    records = [r.to_dict() for r in speedflags.ledger().history if r.label == "rank-record"]
    return {
        "checked": common.checked,
        "rank": common.rank,
        "world_size": common.world_size,
        "backend": common.backend,
        "reason": common.reason,
        "equals_snapshot": dict(common)
        == {k: v for k, v in speedflags.snapshot().items() if k not in PER_RANK},
        "record_ranks": [r["rank"] for r in records],
        "check_records": rank_records("check_ranks()"),
    }


def scenario_planted_tf32(rank: int) -> dict[str, Any]:
    before = speedflags.snapshot()
    if rank == 1:
        torch.backends.cuda.matmul.allow_tf32 = True  # one rank with TF32 switched on
    try:
        speedflags.check_ranks()
    except RankMismatchError as exc:
        return {
            "raised": True,
            "message": str(exc),
            "levers": list(exc.levers),
            "differences": {k: [repr(v) for v in vs] for k, vs in exc.differences.items()},
            "is_runtime_error": isinstance(exc, RuntimeError),
        }
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False
        if hasattr(torch.backends, "fp32_precision"):
            torch._C._set_fp32_precision_setter("cuda", "matmul", "none")
        assert speedflags.snapshot() == before
    return {"raised": False}


def scenario_default_dtype(rank: int) -> dict[str, Any]:
    # a guarded setting ranks must share, and two they need not (threads, default device)
    torch.set_num_threads(1 + rank)
    torch.set_default_device("cpu" if rank == 0 else "meta")
    try:
        agreed = speedflags.check_ranks().reason
        if rank == 1:
            torch.set_default_dtype(torch.float64)
        try:
            speedflags.check_ranks()
            return {"raised": False, "agreed": agreed}
        except RankMismatchError as exc:
            return {"raised": True, "agreed": agreed, "message": str(exc)}
    finally:
        torch.set_default_dtype(torch.float32)
        torch.set_default_device(None)
        torch.set_num_threads(THREADS)


def scenario_first_entry(rank: int) -> dict[str, Any]:
    spec = fast_math(cudnn_benchmark=True, check_ranks=True, label="first-entry")
    before = speedflags.snapshot()
    out: dict[str, Any] = {}
    if rank == 1:
        torch.backends.cudnn.deterministic = True  # part of the deterministic lever
    try:
        with spec:
            out["entered_while_mismatched"] = True
    except RankMismatchError as exc:
        out["first_entry_error"] = str(exc)
    finally:
        torch.backends.cudnn.deterministic = False
    out["restored_after_refusal"] = speedflags.snapshot() == before
    out["benchmark_after_refusal"] = torch.backends.cudnn.benchmark
    with spec:  # fixed now: this entry checks again and passes
        out["benchmark_inside"] = torch.backends.cudnn.benchmark
    with spec:  # checked once: no further collective
        pass
    out["checks"] = [r["reason"] for r in rank_records("first-entry")]
    return out


def scenario_ddp(rank: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    initial = [p.detach().clone().tolist() for p in model.parameters()]
    data = torch.Generator().manual_seed(100 + rank)  # each rank its own batch
    dtypes: list[str] = []

    @speedup(amp="bf16", device="cpu", check_ranks=True)
    def train_step(x: torch.Tensor, y: torch.Tensor) -> float:
        optimizer.zero_grad()
        out = ddp(x)
        dtypes.append(str(out.dtype))
        loss = torch.nn.functional.mse_loss(out.float(), y)
        loss.backward()
        optimizer.step()
        return float(loss)

    losses = [
        train_step(torch.randn(32, 8, generator=data), torch.randn(32, 4, generator=data))
        for _ in range(4)
    ]
    return {
        "losses": losses,
        "dtypes": dtypes,
        "params": [p.detach().tolist() for p in model.parameters()],
        "initial": initial,
        "autocast_after": autocast_enabled("cpu"),
        "checks": [r["reason"] for r in rank_records("train_step")],
    }


SCENARIOS: dict[str, Callable[[int], dict[str, Any]]] = {
    "agree": scenario_agree,
    "planted_tf32": scenario_planted_tf32,
    "first_entry": scenario_first_entry,
    "ddp": scenario_ddp,
    "default_dtype": scenario_default_dtype,
}


def tear_down(rank: int) -> None:
    """Destroy the group, bounded: gloo's teardown on PyTorch 2.1 now and then never returns
    (a worker thread it joins), after the findings are written; that is not what these tests
    test, so a rank past TEARDOWN_LIMIT_S says so and leaves anyway."""
    teardown = threading.Thread(target=dist.destroy_process_group, daemon=True)
    teardown.start()
    teardown.join(TEARDOWN_LIMIT_S)
    if teardown.is_alive():
        progress(rank, f"the group's teardown still running after {TEARDOWN_LIMIT_S} s; leaving")
        faulthandler.dump_traceback(all_threads=True)
    else:
        progress(rank, "group destroyed")


def run_ranks(rank: int, world_size: int, store_file: str, out_file: str) -> None:
    progress(rank, "imported; joining the group")
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store_file}",
        rank=rank,
        world_size=world_size,
        timeout=TIMEOUT,
    )
    progress(rank, "joined")
    results: dict[str, Any] = {}
    try:
        for name, scenario in SCENARIOS.items():
            try:
                results[name] = scenario(rank)
            except Exception:
                results[name] = {"error": traceback.format_exc()}
            progress(rank, f"{name} done")
            dist.barrier()
    finally:
        with open(out_file, "w", encoding="utf-8") as fh:
            json.dump(results, fh)
        progress(rank, "findings written")
        tear_down(rank)


def report_mismatch() -> int:
    from speedflags.__main__ import main

    if os.environ["RANK"] == "1":  # set by torchrun
        torch.backends.cuda.matmul.allow_tf32 = True
    return main(["report"])


if __name__ == "__main__":
    if sys.argv[1] == "ranks":
        run_ranks(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
        # The findings are written and the group destroyed. Leave without the interpreter's
        # teardown: now and then a gloo thread still joinable there aborts the process
        # ("terminate called without an active exception", exit -6) after the work is done.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    elif sys.argv[1] == "report-mismatch":
        sys.exit(report_mismatch())
    else:
        sys.exit(f"unknown scenario {sys.argv[1]!r}")
