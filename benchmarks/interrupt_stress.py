"""Ctrl-C at random instants: decorated generators, coroutines, async generators, refused enters.

Each trial runs one *form* (below) once, under a one-shot ``SIGALRM`` timer set to a random
instant within the form's run time, whose handler raises ``KeyboardInterrupt`` as Ctrl-C
does: either plain, or wrapped with :func:`speedflags.signal_safe`. After each trial it
counts

- a **leak**: :func:`speedflags.snapshot` (and inference mode) differs from before the
  trial, or a ledger frame is still open;
- a **lost interrupt**: the handler was called during the trial (the timer fired while the
  trial ran), but no ``KeyboardInterrupt`` reached the trial's caller, or a
  ``signal_safe`` handler call is still waiting to run.

The forms: a generator, a coroutine and an async generator, each decorated with
``fast_math(...)`` and with ``speedup(..., inference=True)`` (one ledger frame per step, as
``docs/architecture.md`` says), and a generator, a coroutine and an async generator whose
body holds a block across each ``yield``/``await`` (set aside and put back at every step),
consumed to the end and closed; and, where PyTorch has the
``fp32_precision`` API (2.9+) and so a mixed TF32 state can exist, an enter that the ledger
refuses with ``MixedTF32APIError``: a ``with`` block, a decorated call, a decorated
generator's step. Coroutines are driven by hand (``send(None)`` until done), so that
interrupts land in speedflags and the user's code, not in an event loop.

Run it standalone (it is not a timed benchmark; ``pytest benchmarks`` does not collect it)::

    .venv/bin/python benchmarks/interrupt_stress.py [--trials 10000] [--seed 0] [--json]

Exit status 0 when there was no leak and no lost interrupt. ``tests/test_interrupt_stress.py``
runs it with a few hundred trials per form, and reuses its forms for an exhaustive
(traced) injection.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import random
import signal
import sys
import time
import types
from collections.abc import Callable, Generator, Sequence
from types import FrameType
from typing import Any

import torch

import speedflags
from speedflags import MixedTF32APIError, fast_math, speedup
from speedflags._ledger.interrupts import PENDING
from speedflags._watch.setters import domains

PACKAGE = os.path.dirname(speedflags.__file__)
HAS_MIXED_STATE = hasattr(torch.backends, "fp32_precision")  # PyTorch 2.9's second TF32 API
LEVERS: dict[str, Any] = dict(tf32=True, cudnn_benchmark=True, amp="bf16", device="cpu")
STEPS = 3  # steps of each generator, coroutine and async generator
X = torch.ones(4, 4)
DOMAINS = domains()
KEPT: list[Any] = []  # inference-mode guards that undo a leaked one (see reset)


@types.coroutine
def pause() -> Generator[None, None, None]:
    """One suspension: hands control back to the driver, as an event loop's await would."""
    yield


def work() -> None:
    """A step's own work: a small matmul, under the levers."""
    torch.mm(X, X)


def decorated_forms(decorator: Callable[[Any], Any]) -> dict[str, Callable[[], None]]:
    """A generator, a coroutine and an async generator decorated with ``decorator``, each
    wrapped in a function that runs it to the end and closes it."""

    @decorator
    def generator(n: int) -> Generator[int, None, None]:
        for i in range(n):
            work()
            yield i

    @decorator
    async def coroutine(n: int) -> int:
        for _ in range(n):
            work()
            await pause()
        return n

    @decorator
    async def async_generator(n: int) -> Any:
        for i in range(n):
            work()
            await pause()
            yield i

    @decorator
    def held_generator(n: int) -> Generator[int, None, None]:
        # a block the body holds across each yield: set aside and put back at every step
        with fast_math(matmul_precision="high", device="cpu", label="held"):
            for i in range(n):
                work()
                yield i

    @decorator
    async def held_coroutine(n: int) -> int:
        with fast_math(matmul_precision="high", device="cpu", label="held"):
            for _ in range(n):
                work()
                await pause()
        return n

    @decorator
    async def held_async_generator(n: int) -> Any:
        with fast_math(matmul_precision="high", device="cpu", label="held"):
            for i in range(n):
                work()
                await pause()
                yield i

    def run_held_async_generator() -> None:
        async def consume() -> None:
            it = held_async_generator(STEPS)
            try:
                async for _ in it:
                    pass
            finally:
                await it.aclose()

        drive(consume())

    def run_held_generator() -> None:
        it = held_generator(STEPS)
        try:
            for _ in it:
                pass
        finally:
            it.close()

    def run_held_coroutine() -> None:
        drive(held_coroutine(STEPS))

    def run_generator() -> None:
        it = generator(STEPS)
        try:
            for _ in it:
                pass
        finally:
            it.close()

    def run_coroutine() -> None:
        drive(coroutine(STEPS))

    def run_async_generator() -> None:
        async def consume() -> None:
            it = async_generator(STEPS)
            try:
                async for _ in it:
                    pass
            finally:
                await it.aclose()

        drive(consume())

    return {
        "generator": run_generator,
        "coroutine": run_coroutine,
        "async generator": run_async_generator,
        "generator holding a block": run_held_generator,
        "coroutine holding a block": run_held_coroutine,
        "async generator holding a block": run_held_async_generator,
    }


def drive(coroutine: Any) -> Any:
    """Run ``coroutine`` to the end without an event loop (each ``pause`` is one send).

    An exception raised here, between two sends, while the coroutine waits (an interrupt
    landing in this loop) is thrown into it, as an event loop cancels a task: the coroutine
    unwinds from where it waits, through the decorated code's own handling.
    """
    try:
        while True:
            coroutine.send(None)
    except StopIteration as stop:
        return stop.value
    except BaseException as exc:
        if inspect.getcoroutinestate(coroutine) == inspect.CORO_SUSPENDED:
            coroutine.throw(exc)  # raises what the coroutine let out
        raise
    finally:
        coroutine.close()


def refused_forms() -> dict[str, Callable[[], None]]:
    """Enters the ledger refuses (the TF32 state is mixed): each swallows the refusal only."""
    spec = fast_math(tf32=True, device="cpu", label="refused")

    @spec
    def call() -> None:
        work()

    @spec
    def generator() -> Generator[None, None, None]:
        yield

    def run_with() -> None:
        try:
            with spec:
                work()
        except MixedTF32APIError:
            pass

    def run_call() -> None:
        try:
            call()
        except MixedTF32APIError:
            pass

    def run_generator() -> None:
        it = generator()
        try:
            for _ in it:
                pass
        except MixedTF32APIError:
            pass
        finally:
            it.close()

    return {
        "refused with": run_with,
        "refused call": run_call,
        "refused step": run_generator,
    }


def forms() -> dict[str, tuple[Callable[[], None], bool]]:
    """Every form by name, with whether it runs in a mixed TF32 state."""
    found: dict[str, tuple[Callable[[], None], bool]] = {}
    for name, run in decorated_forms(fast_math(**LEVERS, label="stress")).items():
        found[f"fast_math {name}"] = (run, False)
    for name, run in decorated_forms(speedup(**LEVERS, inference=True)).items():
        found[f"speedup {name}"] = (run, False)
    if HAS_MIXED_STATE:
        for name, run in refused_forms().items():
            found[name] = (run, True)
    return found


def make_mixed() -> None:
    """A mixed TF32 state: the new API's matmul node says TF32, the legacy one 'highest'."""
    torch.backends.cuda.matmul.fp32_precision = "tf32"  # type: ignore[attr-defined]


def unmix() -> None:
    torch.backends.cuda.matmul.fp32_precision = "none"  # type: ignore[attr-defined]


def state() -> tuple[Any, ...]:
    """What a trial must leave as it found: every lever and guarded setting (as
    :func:`speedflags.snapshot` describes them), inference mode, and the ledger's open
    frames."""
    return (
        speedflags.snapshot(),
        torch.is_inference_mode_enabled(),
        len(speedflags.ledger().open_frames()),
    )


def raw_state() -> list[Any]:
    """Every lever's and guarded setting's raw state, to put back after a leak."""
    return [domain.lever.read() for domain in DOMAINS]


def reset(raw: list[Any]) -> None:
    """After a leak or a held interrupt: forget the open frames, put every setting back with
    its own restore, leave inference mode; so that the next trial starts clean and one leak
    is counted once."""
    speedflags.ledger()._forget_frames()
    PENDING.clear()
    for domain, was in zip(DOMAINS, raw, strict=True):
        now = domain.lever.read()
        if now != was:
            domain.lever.restore(was, now)
    if torch.is_inference_mode_enabled():  # a guard left entered: enter one that undoes it,
        guard = torch._C._InferenceMode(False)  # and keep it (its exit would undo it again)
        guard.__enter__()
        KEPT.append(guard)


class Outcome:
    """What one form's trials found."""

    def __init__(self) -> None:
        self.trials = self.arrived = self.interrupted = self.lost = self.leaks = 0
        self.in_package = self.deferred = 0
        self.examples: list[str] = []

    def to_dict(self) -> dict[str, Any]:
        return {
            "trials": self.trials,
            "interrupts": self.arrived,
            "in_speedflags": self.in_package,
            "deferred": self.deferred,
            "raised": self.interrupted,
            "lost": self.lost,
            "leaks": self.leaks,
            "examples": self.examples[:3],
        }


class Timer:
    """A one-shot SIGALRM per trial; its handler raises KeyboardInterrupt, plain or through
    ``signal_safe``, and counts each call made while a trial is armed."""

    def __init__(self, safe: bool) -> None:
        self.armed = False
        self.arrived = 0
        self.in_package = 0  # landed in speedflags' own code
        self.deferred = 0  # held back by signal_safe (in the ledger's critical code)

        def interrupt(signum: int, frame: FrameType | None) -> None:
            raise KeyboardInterrupt

        handler = speedflags.signal_safe(interrupt) if safe else interrupt

        def on_alarm(signum: int, frame: FrameType | None) -> Any:
            if not self.armed:  # outside a trial (after it ended): not this trial's
                return None
            self.armed = False
            self.arrived += 1
            if frame is not None and frame.f_code.co_filename.startswith(PACKAGE):
                self.in_package += 1
            handler(signum, frame)
            self.deferred += 1  # signal_safe queued it: it runs once the section is done

        self.on_alarm = on_alarm

    def __enter__(self) -> Timer:
        self.previous = signal.signal(signal.SIGALRM, self.on_alarm)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.armed = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, self.previous)


def one_trial(run: Callable[[], None], timer: Timer, delay: float) -> tuple[bool, str]:
    """Whether the handler was called during the trial, and what came out of the trial:
    ``"interrupted"`` (a KeyboardInterrupt), ``""`` (nothing), or the name of another
    exception that came out instead."""
    arrived = timer.arrived
    outcome = ""
    timer.armed = True
    try:
        signal.setitimer(signal.ITIMER_REAL, delay)  # may fire before it returns
        run()
    except KeyboardInterrupt:
        outcome = "interrupted"
    except BaseException as exc:  # what came out instead of the interrupt, if anything
        outcome = type(exc).__name__
    timer.armed = False  # no check point between the run's end and here: nothing lands
    signal.setitimer(signal.ITIMER_REAL, 0)
    return timer.arrived > arrived, outcome


def run_time(run: Callable[[], None]) -> float:
    """The seconds the fastest of 25 uninterrupted runs takes.

    The fastest, not the median: load only makes a run slower, so a timer set within 1.2x
    the fastest lands inside nearly every run however busy the machine was while they were
    timed. A median taken during a burst of load sent the timers past the runs once the
    burst was over (a CI run: half of one form's trials were never interrupted)."""
    times = []
    for _ in range(25):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def stress(
    name: str, run: Callable[[], None], mixed: bool, safe: bool, trials: int, rng: random.Random
) -> Outcome:
    """``trials`` runs of one form, each under a timer set to a random instant within it."""
    outcome = Outcome()
    if mixed:
        make_mixed()
    try:
        span = run_time(run) * 1.2
        before = state()
        raw = raw_state()
        with Timer(safe) as timer:
            for i in range(trials):
                arrived, came_out = one_trial(run, timer, rng.uniform(1e-6, span))
                outcome.trials += 1
                outcome.arrived += arrived
                outcome.interrupted += came_out == "interrupted"
                held = bool(PENDING)
                if arrived and (held or came_out != "interrupted"):
                    outcome.lost += 1
                    why = "held" if held else f"replaced by {came_out}" if came_out else "swallowed"
                    outcome.examples.append(f"trial {i}: lost ({why})")
                elif came_out not in ("", "interrupted"):
                    raise RuntimeError(f"{name}: trial {i} raised {came_out} uninterrupted")
                after = state()
                if after != before:
                    outcome.leaks += 1
                    outcome.examples.append(f"trial {i}: leaked {diff(before, after)}")
                if held or after != before:
                    reset(raw)
            outcome.in_package, outcome.deferred = timer.in_package, timer.deferred
    finally:
        if mixed:
            unmix()
    return outcome


def diff(before: tuple[Any, ...], after: tuple[Any, ...]) -> str:
    changed = [k for k in before[0] if before[0][k] != after[0].get(k)]
    if before[1] != after[1]:
        changed.append("inference_mode")
    if before[2] != after[2]:
        changed.append(f"{after[2]} open frames")
    return ", ".join(changed)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10_000, help="trials per form and handler")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--forms", default=None, help="comma-separated form names (default all)")
    parser.add_argument("--json", action="store_true", help="print the counts as JSON")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)  # noqa: S311 - a reproducible schedule, not a secret
    chosen = forms()
    if args.forms:
        chosen = {k: v for k, v in chosen.items() if k in args.forms.split(",")}
    results: dict[str, dict[str, Any]] = {}
    started = time.perf_counter()
    for name, (run, mixed) in chosen.items():
        for safe in (False, True):
            key = f"{name}, {'signal_safe' if safe else 'plain'} handler"
            results[key] = stress(name, run, mixed, safe, args.trials, rng).to_dict()
    seconds = time.perf_counter() - started
    bad = sum(r["lost"] + r["leaks"] for r in results.values())
    if args.json:
        print(json.dumps({"python": sys.version.split()[0], "torch": torch.__version__,
                          "seconds": seconds, "results": results}))  # fmt: skip
        return 1 if bad else 0
    print(f"Python {sys.version.split()[0]}, torch {torch.__version__}: "
          f"{args.trials} trials per row, {seconds:.0f} s")  # fmt: skip
    print(f"{'form, handler':<58} {'interrupts':>10} {'in speedflags':>13} {'deferred':>8} "
          f"{'raised':>7} {'lost':>5} {'leaks':>6}")  # fmt: skip
    for key, r in results.items():
        print(f"{key:<58} {r['interrupts']:>10} {r['in_speedflags']:>13} {r['deferred']:>8} "
              f"{r['raised']:>7} {r['lost']:>5} {r['leaks']:>6}")  # fmt: skip
        for example in r["examples"]:
            print(f"    {example}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
