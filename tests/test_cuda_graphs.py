"""@speedup(cuda_graphs=True): the option, the device, shapes, learning rates, outputs, records.

CUDA graphs need a GPU; everything around them does not, and runs here with the real torch.
Where a test needs the graphed path on a CPU, the ``graphs_here`` fixture says "CUDA graphs
can work here" (``graph_policy.unavailable`` answers None: what a CPU build cannot show) and,
where inductor's recording is not the subject, compiles through dynamo's ``aot_eager``
backend instead of inductor's graph trees: the rules speedflags applies around the graphs
(signatures, the shape limit, learning rates, outputs, the history) run for real. One test
runs inductor with CUDA graphs asked for on the CPU, so that its real "skipping cudagraphs"
path is what gets recorded. The GPU runs are in ``tests/test_gpu_cuda_graphs.py``.
"""

from __future__ import annotations

import collections
import logging
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from _cuda_graphs_helpers import train_step
from conftest import last_seq, records_since

import speedflags
from speedflags import (
    CudaGraphsError,
    CudaGraphsWarning,
    InvalidTypeError,
    InvalidValueError,
    LeverUnavailableError,
    speedup,
)
from speedflags._compile import graph_policy as policy
from speedflags._compile.graphed import SKIP_LOGGERS, SkipWatch

CPU = torch.device("cpu")


@pytest.fixture
def graphs_here(monkeypatch: pytest.MonkeyPatch) -> Callable[[dict[str, Any] | None], None]:
    """Pretend CUDA graphs can work on this CPU; compile with ``options`` (aot_eager by
    default: the subject is what happens around the graphs, not the recording)."""

    def use(options: dict[str, Any] | None = None) -> None:
        monkeypatch.setattr(policy, "unavailable", lambda device: None)
        if options is not None:
            monkeypatch.setattr(policy, "graph_options", lambda given, shown: dict(options))

    return use


def cuda_graphs_records(seq: int) -> list[speedflags.FlagRecord]:
    return [r for r in records_since(seq) if r.lever == "cuda_graphs"]


# --- the option ---------------------------------------------------------------------------


@pytest.mark.parametrize("value", [1, 0, None, "yes", 1.0, torch.tensor(True)])
def test_values_other_than_true_or_false_are_refused_when_the_decorator_is_built(
    value: object,
) -> None:
    with pytest.raises(InvalidTypeError, match=r"speedup\(cuda_graphs=.*expected True or False"):
        speedup(cuda_graphs=value)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("compile", "words"),
    [
        ({"backend": "aot_eager"}, "backend 'aot_eager' has none"),
        ({"mode": "max-autotune-no-cudagraphs"}, "turns CUDA graphs off"),
        ({"options": {"triton.cudagraphs": False}}, "turns CUDA graphs"),
        ({"options": {"triton.cudagraph_trees": False}}, "their trees"),
        ({"mode": "no-such-mode"}, "no mode 'no-such-mode'; valid:"),
    ],
)
def test_compile_options_that_contradict_cuda_graphs_are_refused_at_decoration(
    compile: dict[str, Any], words: str
) -> None:
    with pytest.raises(InvalidValueError, match=words) as caught:
        speedup(cuda_graphs=True, compile=compile, device="cpu")
    assert str(caught.value).startswith("speedup(")


def test_compile_options_are_kept_with_cuda_graphs_added() -> None:
    shown = "speedup(cuda_graphs=True)"
    assert policy.graph_options(None, shown) == {"options": {"triton.cudagraphs": True}}
    assert policy.graph_options({"mode": "reduce-overhead"}, shown) == {"mode": "reduce-overhead"}
    assert policy.graph_options({"mode": "max-autotune", "dynamic": False}, shown) == {
        "mode": "max-autotune",
        "dynamic": False,
    }
    default = policy.graph_options({"mode": "default", "fullgraph": True}, shown)
    assert default == {"fullgraph": True, "options": {"triton.cudagraphs": True}}
    given = {"options": {"fallback_random": True}, "backend": "inductor"}
    assert policy.graph_options(given, shown) == {
        "options": {"fallback_random": True, "triton.cudagraphs": True},
        "backend": "inductor",
    }
    assert given == {"options": {"fallback_random": True}, "backend": "inductor"}  # untouched


def test_generator_functions_are_refused() -> None:
    def steps() -> Iterator[int]:
        yield 1

    with pytest.raises(InvalidTypeError, match=r"speedup\(cuda_graphs=True\) cannot compile"):
        speedup(cuda_graphs=True, device="cpu")(steps)


def test_the_option_is_typed_bool_on_the_decorator() -> None:
    # mypy's side: tests/test_lever_arguments.py refuses speedup(cuda_graphs="yes")
    import inspect

    parameter = inspect.signature(speedup).parameters["cuda_graphs"]
    assert parameter.kind is inspect.Parameter.KEYWORD_ONLY
    assert parameter.annotation == "bool" and parameter.default is False


# --- the device ---------------------------------------------------------------------------


def test_on_a_cpu_it_is_skipped_with_its_reason_recorded_and_the_step_runs_eagerly() -> None:
    seq = last_seq()
    ran = []

    @speedup(cuda_graphs=True, device="cpu", amp=False)
    def step(x: torch.Tensor) -> torch.Tensor:
        ran.append(1)
        return x * 2

    assert step.stats.cuda_graphs.state == "pending"
    assert step.stats.mode == "pending"
    assert torch.equal(step(torch.ones(2)), torch.full((2,), 2.0))
    graphs = step.stats.cuda_graphs
    assert graphs.state == "skipped"
    assert graphs.reason.startswith("no effect on cpu: CUDA graphs record and replay")
    assert step.stats.mode == "eager" and step.stats.compile_options is None  # no compile
    (record,) = cuda_graphs_records(seq)
    assert (record.action, record.reason) == ("skip", graphs.reason)
    assert record.label.startswith("test_on_a_cpu_it_is_skipped")
    step(torch.ones(2))
    assert len(ran) == 2 and len(cuda_graphs_records(seq)) == 1  # recorded once
    assert step.stats.to_dict()["cuda_graphs"]["state"] == "skipped"


def test_on_a_cpu_with_compile_it_is_compiled_without_graphs() -> None:
    @speedup(cuda_graphs=True, compile=True, device="cpu", amp=False)  # inductor, as users write
    def step(x: torch.Tensor) -> torch.Tensor:
        return (x * 2).sin()

    x = torch.randn(8)
    torch.testing.assert_close(step(x), (x * 2).sin())
    assert step.stats.cuda_graphs.state == "skipped"
    assert step.stats.mode == "compiled"
    assert step.stats.compile_options == {}  # the user's options: no triton.cudagraphs


def test_strict_refuses_it_before_the_step_runs_and_restores_the_levers() -> None:
    before = speedflags.snapshot()
    ran = []

    @speedup(cuda_graphs=True, device="cpu", strict=True, deterministic=True)
    def step() -> None:
        ran.append(1)

    with pytest.raises(LeverUnavailableError, match="cuda_graphs=True: no effect on cpu"):
        step()
    assert ran == [] and speedflags.snapshot() == before
    assert step.stats.cuda_graphs.state == "pending"  # refused again at the next call
    with pytest.raises(LeverUnavailableError):
        step()


def test_cuda_without_a_gpu_warns_once_and_skips(monkeypatch: pytest.MonkeyPatch) -> None:
    if torch.cuda.is_available():  # the other branch: graphs on, tests/test_gpu_cuda_graphs.py
        pytest.skip("this machine has CUDA: the step is graphed there")
    from speedflags import _warn

    monkeypatch.setattr(_warn, "_seen", set())
    step = speedup(cuda_graphs=True, device="cuda", amp=False)(lambda: 3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert step() == 3
        assert step() == 3
    said = [str(w.message) for w in caught if "cuda_graphs=True on cuda" in str(w.message)]
    assert len(said) == 1 and "strict=True refuses it" in said[0]
    assert all(issubclass(w.category, speedflags.DeviceUnavailableWarning) for w in caught)
    assert step.stats.cuda_graphs.reason == "no effect on cuda: CUDA is not available here"


def test_a_step_called_inside_torch_compile_runs_in_its_frame(graphs_here: Any) -> None:
    graphs_here({"backend": "aot_eager"})
    step = speedup(cuda_graphs=True, device="cpu", amp=False)(lambda x: x + 1)
    outer = torch.compile(lambda x: step(x) * 2, backend="eager")
    assert torch.equal(outer(torch.ones(3)), torch.full((3,), 4.0))
    assert step.stats.calls == 1 and step.stats.cuda_graphs.state == "on"
    skipped = speedup(cuda_graphs=True, device="cpu", amp=False)(lambda x: x - 1)
    outer = torch.compile(lambda x: skipped(x) * 2, backend="eager")
    assert torch.equal(outer(torch.ones(3)), torch.zeros(3))


# --- shapes -------------------------------------------------------------------------------


def test_signatures_key_shapes_dtypes_and_numbers_not_values() -> None:
    a, b = torch.randn(2, 3), torch.randn(2, 3)
    assert policy.signature([a, {"y": [b]}], {"n": 1}) == policy.signature(
        [b, {"y": [a]}], {"n": 1}
    )
    assert policy.signature([a], {"n": 1}) != policy.signature([a], {"n": 2})
    assert policy.signature([a], {}) != policy.signature([a.double()], {})
    assert policy.signature([a], {}) != policy.signature([a.requires_grad_()], {})
    assert policy.signature([torch.nn.Linear(2, 2)], {}) == policy.signature(
        [torch.nn.Linear(3, 3)], {}
    )  # objects: by type (their tensors are the graph's own state, not inputs)


def test_a_step_fed_20_sequence_lengths_falls_back_after_the_limit_and_says_so_once(
    graphs_here: Any,
) -> None:
    graphs_here({"backend": "aot_eager"})
    seq = last_seq()
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 16)

    @speedup(cuda_graphs=True, device="cpu", amp=False)
    def step(tokens: torch.Tensor) -> torch.Tensor:
        return layer(tokens).sum(dim=1)

    lengths = list(range(5, 25))  # 20 distinct sequence lengths
    batches = [torch.randn(4, n, 16) for n in lengths]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = [step(x) for x in batches]
        again = step(batches[0])  # a shape recorded before the limit: still graphed
    for x, out in zip(batches, outs, strict=True):
        torch.testing.assert_close(out, layer(x).sum(dim=1))
    torch.testing.assert_close(again, outs[0])
    graphs = step.stats.cuda_graphs
    limit = policy.SHAPE_LIMIT
    assert (graphs.recorded, graphs.beyond_limit) == (limit, 20 - limit)
    assert (graphs.graphed_calls, graphs.eager_calls) == (limit + 1, 20 - limit)
    assert graphs.shapes[0] == "tokens: (4, 5, 16)"
    said = [w for w in caught if issubclass(w.category, CudaGraphsWarning)]
    assert len(said) == 1, [str(w.message) for w in said]
    message = str(said[0].message)
    assert f"{limit + 1} distinct input shapes, past the limit of {limit}" in message
    assert "tokens: (4, 5, 16), (4, 6, 16)" in message and "(4, 13, 16)" in message
    assert "Pad inputs" in message
    records = cuda_graphs_records(seq)
    assert [r.action for r in records] == ["set"] + ["record"] * limit + ["fallback"]
    assert records[-1].reason in message


def test_a_number_argument_that_changes_is_named_in_the_warning(graphs_here: Any) -> None:
    graphs_here({"backend": "aot_eager"})

    @speedup(cuda_graphs=True, device="cpu", amp=False)
    def step(x: torch.Tensor, iteration: int) -> torch.Tensor:
        return x * iteration

    with pytest.warns(CudaGraphsWarning, match="iteration: a Python number that changes"):
        for i in range(policy.SHAPE_LIMIT + 1):
            assert float(step(torch.ones(1), i)) == i


def test_shape_budget_and_descriptions() -> None:
    budget = policy.ShapeBudget(limit=2)
    assert [budget.admit(k) for k in "ababcdc"] == ["record", "record", "replay", "replay",
                                                    "eager", "eager", "eager"]  # fmt: skip
    assert budget.seen == ["a", "b"] and budget.beyond == ["c", "d"] and budget.beyond_count == 2
    seen = [policy.signature([torch.ones(1, n), {"m": [torch.ones(n)]}], {}) for n in range(12)]
    text = policy.describe_signatures(seen, ["x"])
    assert text.startswith("x: (1, 0), (1, 1), (1, 2)") and "... (12 in all)" in text
    assert "argument 1: {'m': [(0,)]}, {'m': [(1,)]}" in text


# --- learning rates -----------------------------------------------------------------------


def _model_and_batch() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return torch.nn.Linear(8, 4), torch.randn(16, 8)


def test_a_python_float_learning_rate_is_refused_before_the_call_runs(graphs_here: Any) -> None:
    graphs_here({"backend": "aot_eager"})
    model, x = _model_and_batch()
    plain = train_step(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    start = [p.detach().clone() for p in model.parameters()]
    ran = []

    @speedup(cuda_graphs=True, device="cpu", amp=False)
    def step(batch: torch.Tensor) -> torch.Tensor:
        ran.append(1)
        return plain(batch)

    with pytest.raises(CudaGraphsError) as caught:
        step(x)
    message = str(caught.value)
    assert "AdamW param group 0: lr=0.001 is a Python number" in message
    assert "lr=torch.tensor(0.001, device='cpu')" in message
    assert "call opt.step() outside the graphed step" in message
    assert ran == []
    assert all(torch.equal(a, b) for a, b in zip(start, model.parameters(), strict=True))


def test_a_learning_rate_on_another_device_than_its_parameters_is_refused() -> None:
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.AdamW([w], lr=torch.tensor(0.1))
    opt.param_groups[0]["lr"] = torch.tensor(0.1, device="meta")  # not the parameters' device
    (problem,) = policy.rate_problems([opt], {})
    assert "lr is a tensor on meta, its parameters on cpu" in problem
    assert "torch.tensor(..., device='cpu')" in problem
    assert policy.rate_problems([torch.optim.AdamW([w], lr=torch.tensor(0.1))], {}) == []


def test_a_tensor_rate_a_scheduler_replaces_by_a_number_is_refused_at_the_next_call(
    graphs_here: Any,
) -> None:
    graphs_here({"backend": "aot_eager"})
    model, x = _model_and_batch()
    lr = torch.tensor(0.01)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, foreach=False)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0)
    stepped = False  # the optimizer is reachable (closure), stepped outside the graphs

    @speedup(cuda_graphs=True, device="cpu", amp=False)
    def step(batch: torch.Tensor) -> torch.Tensor:
        loss = model(batch).square().mean()
        loss.backward()
        if stepped:  # never taken: dynamo does not trace the optimizer on this CPU
            opt.step()
        return loss.detach()

    step(x)
    # PyTorch 2.1's dynamo turns capturable on for every optimizer a traced frame can see,
    # which needs CUDA parameters: put back for the eager step on this CPU
    opt.param_groups[0]["capturable"] = False
    opt.step()
    opt.zero_grad()
    sched.step(1.0)
    sched.step(1.0)  # no improvement: the rate is halved
    now = opt.param_groups[0]["lr"]
    assert float(now) == pytest.approx(0.005)
    if isinstance(now, torch.Tensor):  # filled in place (PyTorch 2.13 does)
        assert now is lr
        step(x)
    else:  # a float written over the tensor (PyTorch 2.1.2 does)
        with pytest.raises(CudaGraphsError, match="where it was a tensor at an earlier call"):
            step(x)


def _cpu_optimizer_compiles() -> bool:
    """Whether dynamo can trace an optimizer step on this CPU: PyTorch 2.1's makes every
    traced optimizer capturable, which needs CUDA parameters there."""
    param = torch.nn.Parameter(torch.ones(2))
    param.grad = torch.ones(2)
    opt = torch.optim.AdamW([param], lr=torch.tensor(0.1), foreach=False)
    try:
        torch.compile(opt.step, backend="eager")()
    except Exception:
        return False
    finally:
        torch._dynamo.reset()
    return True


def test_a_tensor_rate_under_a_scheduler_is_neither_recompiled_per_value_nor_frozen(
    graphs_here: Any,
) -> None:
    if not _cpu_optimizer_compiles():
        pytest.skip("this PyTorch's dynamo cannot trace an optimizer step on a CPU")
    from torch._dynamo.utils import counters

    graphs_here({"backend": "aot_eager"})
    torch._dynamo.reset()

    def train(graphed: bool) -> tuple[list[torch.Tensor], list[int]]:
        model, x = _model_and_batch()
        opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.05), foreach=False)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 / (i + 1))
        step = train_step(model, opt)
        run = speedup(cuda_graphs=True, device="cpu", amp=False)(step) if graphed else step
        graphs = []
        for _ in range(8):
            run(x)
            sched.step()  # a new rate every call
            graphs.append(int(counters["stats"]["unique_graphs"]))
        return [p.detach().clone() for p in model.parameters()], graphs

    eager, _ = train(graphed=False)
    graphed, counts = train(graphed=True)
    assert counts[2:] == [counts[2]] * 6, counts  # compiled in the first calls, never again
    for a, b in zip(eager, graphed, strict=True):
        torch.testing.assert_close(a, b)  # the scheduler's rates reached every step


# --- outputs ------------------------------------------------------------------------------


def test_outputs_of_a_graphed_call_are_safe_to_keep_across_calls(graphs_here: Any) -> None:
    graphs_here({"backend": "aot_eager"})
    static = torch.zeros(3)  # stands for a graph's output memory, rewritten by each replay

    def replay(x: torch.Tensor) -> dict[str, Any]:
        static.copy_(x)
        return {"out": static, "pair": (static, 1)}

    step = speedup(cuda_graphs=True, device="cpu", amp=False)(replay)
    first = step(torch.ones(3))
    second = step(torch.full((3,), 2.0))
    assert first["out"].tolist() == [1.0, 1.0, 1.0]  # not overwritten by the second call
    assert first["pair"][0].tolist() == [1.0, 1.0, 1.0] and first["pair"][1] == 1
    assert second["out"].tolist() == [2.0, 2.0, 2.0]


def test_keep_outputs_copies_tensors_of_the_graphs_device_in_containers() -> None:
    Pair = collections.namedtuple("Pair", "a b")
    t = torch.ones(2, requires_grad=True)
    kept = policy.keep_outputs([Pair(t, 2), {"x": t}, (t,), "s"], "cpu")
    assert isinstance(kept[0], Pair) and kept[0].b == 2
    assert kept[0].a is not t and kept[1]["x"] is not t and kept[2][0] is not t
    assert kept[0].a.requires_grad and kept[0].a.grad_fn is not None  # autograd kept
    assert kept[3] == "s"
    assert policy.keep_outputs(t, "cuda") is t  # another device: not the graphs' memory


# --- inductor's reasons -------------------------------------------------------------------


def test_inductors_skip_reasons_go_to_stats_history_and_one_warning(graphs_here: Any) -> None:
    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        # what inductor says while it compiles a graph it will not record
        logging.getLogger(SKIP_LOGGERS[0]).warning(
            "skipping cudagraphs due to mutated inputs (1 instances). Found from :\n  trace"
        )
        return gm.forward

    graphs_here({"backend": backend})
    seq = last_seq()
    step = speedup(cuda_graphs=True, device="cpu", amp=False)(lambda x: x.sin())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step(torch.ones(2))
        step(torch.ones(3))  # a new shape: compiled again, the same reason again
    assert step.stats.cuda_graphs.skips == ["mutated inputs (1 instances)"]
    said = [str(w.message) for w in caught if issubclass(w.category, CudaGraphsWarning)]
    assert len(said) == 1 and "inductor did not record a CUDA graph: mutated inputs" in said[0]
    skips = [r for r in cuda_graphs_records(seq) if r.action == "skip"]
    assert [r.reason for r in skips] == ["inductor did not record a CUDA graph: mutated inputs "
                                         "(1 instances)"]  # fmt: skip


def test_inductor_on_a_cpu_graph_is_recorded_as_a_skip(graphs_here: Any) -> None:
    # the real inductor, with CUDA graphs asked for, compiling a CPU graph it cannot record
    graphs_here()
    step = speedup(cuda_graphs=True, device="cpu", amp=False)(lambda x: (x * 2).cos())
    x = torch.randn(4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CudaGraphsWarning)
        torch.testing.assert_close(step(x), (x * 2).cos())
    assert step.stats.compile_options == {"options": {"triton.cudagraphs": True}}
    (reason,) = step.stats.cuda_graphs.skips
    # PyTorch 2.1 logs "skipping cudagraphs for unknown reason"; later versions count the
    # skip of a graph without CUDA work without a message
    assert reason == "unknown reason" or "counted as skipped without a message" in reason


def test_skip_watch_reads_only_its_own_thread_and_lets_records_through() -> None:
    import threading

    logger = logging.getLogger(SKIP_LOGGERS[1])
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logger.addHandler(handler)
    try:
        with SkipWatch() as watch:
            other = threading.Thread(target=lambda: logger.warning("skipping cudagraphs due to x"))
            other.start()
            other.join(30)
            logger.warning("skipping cudagraphs due to cpu device (arg0_1)")
            logger.warning("unrelated")
    finally:
        logger.removeHandler(handler)
    assert watch.reasons == ["cpu device (arg0_1)"]
    assert len(seen) == 3 and not logger.filters


# --- the stats ----------------------------------------------------------------------------


def test_stats_without_cuda_graphs_have_none() -> None:
    step = speedup(device="cpu", amp=False)(lambda: None)
    step()
    assert step.stats.cuda_graphs is None and step.stats.to_dict()["cuda_graphs"] is None


def test_optimizers_are_found_through_a_helper_and_a_trainer_object() -> None:
    from speedflags._compile.reachable import reachable

    model, _ = _model_and_batch()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    helper = train_step(model, opt)  # the optimizer in a helper's closure

    class Trainer:
        def __init__(self) -> None:
            self.model, self.opt = model, opt

        def step(self, batch: torch.Tensor) -> torch.Tensor:
            self.opt.step()  # reached through self only
            return batch

    kinds = (torch.optim.Optimizer,)
    assert reachable(lambda x: helper(x), (), {}, kinds, further=True) == [opt]
    assert reachable(Trainer.step, (Trainer(), None), {}, kinds, further=True) == [opt]
    assert reachable(lambda x: helper(x), (), {}, kinds) == []  # tune's search stops sooner
