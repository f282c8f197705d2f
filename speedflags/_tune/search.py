"""The search behind ``tune``: candidates from the registry, successive halving, the choice.

1. **Reference.** The step runs once in plain fp32 with every lever off (the bench's
   baseline frame, ``fast_math(**baseline_levers())``); its outputs are the reference.
2. **Candidates.** Each lever's ``candidates`` from the registry (or the user's), less those
   with no effect on the device or that this PyTorch refuses (``Lever.available``), with
   the reason kept in the row. One that runs emulated (bf16 autocast on a CPU without bf16
   instructions) is timed once beside fp32 after the singles (:mod:`.emulated`), marked
   so and never accepted: the table shows what it would cost.
3. **Accuracy first.** One call per candidate: its error against the reference. Over the
   budget, not finite, or raising: rejected, never timed.
4. **Successive halving.** A short timing of every survivor beside fp32; the slower half
   (keeping three at least) and whatever is slower than fp32 beyond the noise are dropped;
   the rest get a longer timing beside fp32, in interleaved passes (fp32, A, B, fp32, A,
   B, ...), so a neighbour's load hits all alike. A candidate is accepted when it is
   faster than fp32 beyond the noise: compared pass by pass, its gain must exceed both
   :data:`MIN_GAIN` and 2.5 standard errors, on the scale the table's ``~`` (within the
   noise) is judged on, so that no row is both (:mod:`speedflags._tune.compare`).
5. **Combinations** of the accepted levers (one value per lever) go through steps 3 and 4,
   re-timed beside the accepted single levers. When a top candidate's noise is large, the
   top three and fp32 are timed again call by call, paired, until clear
   (:mod:`speedflags._tune.duel`). The choice is the fastest accepted candidate, replaced by
   a smaller accepted one while it is not faster than that one beyond the noise: every
   lever in the choice earns its place; ``confidence`` says whether a rival is within noise.
6. **Compile** (where ``torch.compile`` works, last, and only with time left):
   ``speedup(compile=..., **choice)`` timed beside the choice (whose row keeps the figures
   it was chosen on, as ``reference_s`` keeps fp32's from that timing), with inductor's
   ``fallback_random`` (compiled dropout otherwise draws other numbers than eager's, and
   the error would measure the masks, not the arithmetic).
7. **CUDA graphs** (on a GPU, for a launch-bound step, with time left):
   ``speedup(cuda_graphs=True, **choice)`` the same way (:mod:`speedflags._tune.graphs`
   says how launch-bound is judged).

Timing is the bench's (:mod:`speedflags._measure.timing`, the runner's warm-up and rounds):
every clock read waits for the device, and the step's state is put back before each call,
outside the timed region (:mod:`speedflags._tune.state`).
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._fast_math import fast_math
from .._measure.rounds import measure_rounds, warm_up
from .._measure.timing import Timing, plan_rounds, synchronize, timer_for
from .._measure.vocabulary import EMULATED
from .._status import snapshot
from .._warn import measuring
from ..errors import CudaGraphsError
from ..levers.lever_sets import with_baseline
from ..levers.registry import check_levers, lever_spec
from .candidates import calls_of, can_compile, candidates, combinations
from .compare import Effort, compare, faster
from .duel import confidence, contenders, duel, rotated
from .emulated import time_once
from .entry import Candidate, StepRunner
from .graphs import judge
from .result import TuneResult, ms
from .state import Outputs, StepState, check_reference, error_against, reference_outputs

__all__ = ["COMPILE", "COMPILE_MIN_S", "KEEP_AT_LEAST", "Search"]

COMPILE = "compile"
COMPILE_MIN_S = 30.0  # compiling is not interruptible: try it only with this much time left
KEEP_AT_LEAST = 3  # halving keeps the faster half, but never fewer than this
DRIFT_STEPS = 5  # param_dtype's candidates: the output's gap to fp32 after this many steps


@dataclass(frozen=True)
class _Figures:
    """An entry's timing and its row's figures, kept while another timing runs beside it."""

    timing: Timing | None
    against: Timing | None
    speedup: float | None
    noise: float | None
    median_s: float | None
    rounds: int
    accepted: bool
    note: str

    @classmethod
    def of(cls, entry: Candidate) -> _Figures:
        row = entry.row
        return cls(
            entry.timing, entry.against, row.speedup, row.noise, row.median_s, row.rounds,
            row.accepted, row.note,
        )  # fmt: skip

    def put_back(self, entry: Candidate) -> None:
        entry.timing, entry.against = self.timing, self.against
        row = entry.row
        row.speedup, row.noise, row.median_s = self.speedup, self.noise, self.median_s
        row.rounds, row.accepted, row.note = self.rounds, self.accepted, self.note


class Search:
    """One tuning run (see the module docstring); :meth:`run` returns the :class:`TuneResult`.

    ``clock`` replaces the device-synchronising clock (tests inject a fake one), and
    ``progress`` receives one line per step.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        *,
        budget: float,
        seconds: float | None,
        device: torch.device,
        wanted: Mapping[str, Sequence[Any]] | None = None,
        try_compile: bool = True,
        model: torch.nn.Module | None = None,
        plan: Effort | None = None,
        clock: Callable[[], float] | None = None,
        progress: Callable[[str], None] | None = None,
    ) -> None:
        self.fn, self.args, self.kwargs = fn, tuple(args), dict(kwargs)
        self.budget, self.seconds, self.device = budget, seconds, device
        self.wanted, self.try_compile, self.plan = wanted, try_compile, plan or Effort()
        self.model = model
        self.clock = clock or timer_for(device)
        self.say = progress or (lambda line: None)
        self.started = time.perf_counter()
        self.state = StepState(fn, self.args, self.kwargs)
        self.reference: Outputs | None = None
        self.first_s = 0.0  # the reference call's time: the estimate for an untimed candidate
        self.notes: list[str] = []

    # --- time ---------------------------------------------------------------------------

    def left(self) -> float:
        if self.seconds is None:
            return math.inf
        return self.seconds - (time.perf_counter() - self.started)

    def _share(self, nominal: float, fraction: float, units: int) -> float:
        return min(nominal, max(0.0, self.left()) * fraction / max(units, 1))

    # --- one candidate --------------------------------------------------------------------

    def _wrap(self, entry: Candidate) -> Candidate:
        """Give ``entry`` its call: the step under one frame per call, as ``@speedup`` runs it.

        One frame per call, not one around all calls: autocast caches its casts of the
        weights until the outermost autocast exits, so a frame held open across calls would
        time stale casts (and, in a train step, compute with them).
        """
        levers: dict[str, Any] = with_baseline(entry.levers)
        # the model, for a frame that sets a model lever (fast_math refuses it without one)
        model = self.model if any(lever_spec(name).per_model for name in levers) else None
        if entry.compile:
            from .._speedup import speedup  # local: speedup imports the compile machinery

            # eager's RNG in compiled code: dropout draws the numbers fp32 drew, so the
            # error measures the arithmetic, not other random masks
            options = {"options": {"fallback_random": True}}
            entry.call = speedup(
                compile=options,
                cuda_graphs=entry.cuda_graphs,
                device=self.device,
                model=model,
                **levers,
            )(self.fn)
        else:
            label = f"speedflags tune {entry.row.label if entry.levers else 'fp32'}"
            spec = fast_math(**levers, device=self.device, label=label, model=model)
            entry.call = spec(self.fn)
        return entry

    def _step(self, entry: Candidate) -> Callable[..., Any]:
        call = entry.call if entry.call is not None else self._wrap(entry).call
        if call is None:  # pragma: no cover - _wrap always sets it
            raise RuntimeError(f"tune: no call for {entry.row.label}")
        return call

    def _runner(self, entry: Candidate) -> StepRunner:
        # ``entry``'s step as a runner: each call from the step's state and arguments
        return StepRunner(self._step(entry), self)

    def _call(self, entry: Candidate) -> Any:
        self.state.restore()
        out = self._step(entry)(*self.args, **self.kwargs)
        synchronize(self.device)
        return out

    def _check(self, entry: Candidate) -> None:
        """One call: its error against the reference; reject it if over the budget."""
        reference = self.reference or []
        try:
            out = self._call(entry)
        except Exception as exc:
            entry.rejected = True
            entry.row.note = f"raised {type(exc).__name__}: {_first_line(exc)}"
            return
        error, why = error_against(out, reference)
        entry.row.error = error
        if not math.isfinite(error):
            entry.rejected, entry.row.note = True, f"rejected: {why}"
        elif error > self.budget:
            entry.rejected = True
            entry.row.note = f"rejected: error over the budget {self.budget:g}"
        shown = " (rejected)" if entry.rejected else ""
        self.say(f"{entry.row.label}: error {error:.1e}{shown}")

    def _time(
        self,
        entries: Sequence[Candidate],
        seconds: float,
        rounds: int,
        passes: int,
        rotate: bool = False,
    ) -> None:
        """Time ``entries`` (fp32 first) in interleaved passes; keep the speedups.

        As the bench runner does: each pass times every entry in turn, after one untimed
        call, as a block of rounds (one configuration at a time, as a training loop runs
        it); each round is ``measure_rounds``, the state put back outside the timer. The
        passes pair every entry with fp32 (:func:`~speedflags._tune.compare.compare`).
        ``rotate`` (one pass): the rounds go call by call, the entries in turn, so that a
        burst of load hits all of them (:func:`~speedflags._tune.duel.rotated`).
        """
        runners = [self._runner(entry) for entry in entries]
        blocks: list[int] = []
        for entry, runner in zip(entries, runners, strict=True):
            if entry.estimate is None:
                entry.estimate = warm_up(
                    runner, self.clock, self.plan.warmup_rounds, self.plan.warmup_s
                )
            total = plan_rounds(entry.estimate, rounds, seconds)
            blocks.append(max(2, math.ceil(total / passes)))
        done: list[list[list[float]]] = [[] for _ in entries]
        if rotate:
            passes = 0  # the one pass is taken call by call
            done = [[times] for times in rotated(self.clock, runners, blocks)]
        for index in range(passes):
            if index and self.left() <= 0:
                break  # out of time: what the passes so far measured
            for runner, block, got in zip(runners, blocks, done, strict=True):
                warm_up(runner, self.clock, 1, 0.0)
                got.append(measure_rounds(runner, self.clock, block))
        fp32 = Timing.of(done[0])
        for entry, got in zip(entries, done, strict=True):
            entry.timing, entry.against = Timing.of(got), fp32
            row = entry.row
            row.median_s, row.rounds = entry.timing.median, entry.timing.rounds
            speedup, spread = compare(entry.timing, fp32)
            row.speedup = speedup if math.isfinite(speedup) else None
            row.noise = spread if math.isfinite(spread) else None
        shown = ", ".join(f"{e.row.label} {e.row.speedup or 0:.2f}x" for e in entries[1:])
        self.say(f"timed {len(entries) - 1} beside fp32 ({ms(fp32.median)}): {shown}")

    def _fit(
        self, entries: Sequence[Candidate], rounds: int, passes: int
    ) -> tuple[int, int] | None:
        """``(rounds, passes)`` for a long timing that fits in most of the time left.

        Fewer rounds first, then three passes of two rounds; ``None`` if even that does not
        fit (every pass also costs one untimed call per entry).
        """
        per_round = sum((e.estimate or self.first_s) for e in entries)
        budget = 0.8 * self.left()
        if per_round * (rounds + passes) <= budget:
            return rounds, passes
        rounds = int(budget / per_round) - passes if per_round > 0 else rounds
        if rounds >= 2 * passes:
            return rounds, passes
        return (6, 3) if per_round * 9 <= budget else None

    def _affordable(self, entries: Sequence[Candidate], calls: int) -> bool:
        cost = sum((e.estimate or self.first_s) for e in entries) * calls
        return self.left() > cost

    # --- stages ---------------------------------------------------------------------------

    def _halve(self, fp32: Candidate, entries: list[Candidate]) -> list[Candidate]:
        """Short timing for all; the faster half (at least three) goes on, less what is slower
        than fp32.

        Slower beyond the noise: a short timing on a busy machine is noisy, and a candidate
        dropped here is never measured again.
        """
        plan = self.plan
        if not entries or not self._affordable([fp32, *entries], plan.short_rounds + 2):
            for entry in entries:
                entry.row.note = "not timed: out of time"
            return []
        seconds = self._share(plan.short_s, 0.25, len(entries) + 1)
        self._time([fp32, *entries], seconds, plan.short_rounds, 1, rotate=True)
        ranked = sorted(entries, key=lambda e: -(e.row.speedup or 0.0))
        keep = max(KEEP_AT_LEAST, math.ceil(len(ranked) / 2))
        going = []
        for rank, entry in enumerate(ranked):
            if rank >= keep:
                entry.row.note = "dropped after the short timing: not in the faster half"
            elif faster(fp32.timing, entry.timing):
                entry.row.note = "dropped after the short timing: slower than fp32"
            else:
                going.append(entry)
        return going

    def _settle(
        self, fp32: Candidate, entries: list[Candidate], also: Sequence[Candidate] = ()
    ) -> None:
        """Long timing beside fp32 (and ``also``); set ``accepted``."""
        plan = self.plan
        timed = [fp32, *also, *entries]
        if not entries:
            return
        fits = self._fit(timed, plan.long_rounds, plan.passes)
        if fits is None:
            self.notes.append("note: out of time before the long timing; short timings used")
        else:
            seconds = self._share(plan.long_s, 0.5, len(timed))
            self._time(timed, seconds, *fits)
        for entry in [*also, *entries]:
            entry.row.accepted = faster(entry.timing, entry.against)
            if not entry.row.accepted:
                entry.row.note = entry.row.note or "not faster than fp32 beyond the noise"
            elif entry.row.note.startswith("not faster"):
                entry.row.note = ""

    def _choose(self, entries: Sequence[Candidate]) -> Candidate | None:
        """The fastest accepted candidate, less every lever that does not earn its place."""
        accepted = [e for e in entries if e.row.accepted and not e.compile]
        if not accepted:
            return None

        def rank(entry: Candidate) -> tuple[float, int]:
            return (entry.row.speedup or 0.0, -len(entry.levers))  # a tie: fewer levers

        best = max(accepted, key=rank)
        while True:
            smaller = [
                e
                for e in accepted
                if set(e.levers) < set(best.levers) and e.against is best.against
                and not faster(best.timing, e.timing)
            ]  # fmt: skip
            if not smaller:
                break
            best = max(smaller, key=rank)
        for entry in accepted:
            if entry is best:
                continue
            if set(best.levers) < set(entry.levers):
                entry.row.note = f"not faster than {best.row.label} beyond the noise"
            else:
                entry.row.note = f"accepted, but {best.row.label} is chosen"
        return best

    def _drift(self, fp32: Candidate, entry: Candidate) -> None:
        """The gap between ``entry``'s output and fp32's after :data:`DRIFT_STEPS` steps in a
        row from the same start (a train step's loss: what the lower precision, and the
        float32 master weights it keeps, do over several optimizer steps); the step's state
        is put back before each run and after."""
        reference: Outputs = []
        gap = math.inf
        for each in (fp32, entry):
            self.state.restore()
            step = self._step(each)
            out = None
            for _ in range(DRIFT_STEPS):
                out = step(*self.args, **self.kwargs)
            synchronize(self.device)
            if each is fp32:
                reference = reference_outputs(out)
            else:
                gap, _ = error_against(out, reference)
        self.state.restore()
        entry.row.drift = gap
        self.say(f"{entry.row.label}: output gap to fp32 after {DRIFT_STEPS} steps {gap:.1e}")

    def _compile(self, fp32: Candidate, best: Candidate | None) -> Candidate | None:
        if self.left() < COMPILE_MIN_S:
            self.notes.append(f"note: compile not tried: less than {COMPILE_MIN_S:.0f} s left")
            return None
        entry = Candidate(best.levers if best is not None else (), "compile", True)
        return self._race_compiled(fp32, best, entry, "torch.compile")

    def _cuda_graphs(self, fp32: Candidate, best: Candidate | None) -> Candidate | None:
        """``speedup(cuda_graphs=True, **choice)`` on a GPU, for a launch-bound step."""
        from .._compile.graph_policy import unavailable  # local: compile/ loads with it

        if unavailable(self.device) is not None:
            return None  # a CPU, or no CUDA: no effect here, not a candidate
        if self.left() < COMPILE_MIN_S:
            self.notes.append(f"note: CUDA graphs not tried: less than {COMPILE_MIN_S:.0f} s left")
            return None
        step_s = fp32.timing.median if fp32.timing is not None else self.first_s
        self.state.restore()
        bound, figures = judge(lambda: self._step(fp32)(*self.args, **self.kwargs), self.device,
                               step_s)  # fmt: skip
        self.state.restore()
        if not bound:
            self.notes.append(f"note: CUDA graphs not tried: not launch-bound: {figures}")
            return None
        self.notes.append(f"note: CUDA graphs tried: launch-bound: {figures}")
        levers = best.levers if best is not None else ()
        entry = Candidate(levers, "cuda_graphs", compile=True, cuda_graphs=True)
        # two more untimed calls after the check: the graphs recorded, then replayed
        return self._race_compiled(fp32, best, entry, "torch.compile with CUDA graphs", calls=2)

    def _race_compiled(
        self, fp32: Candidate, best: Candidate | None, entry: Candidate, what: str, calls: int = 0
    ) -> Candidate:
        """Check a compiled candidate, make ``calls`` more untimed calls, time it beside fp32
        and the choice; accepted when faster than both beyond the noise."""
        entry = self._wrap(entry)
        step = entry.call
        self.say(f"compiling {entry.row.label} ({what})")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a fallback or a skip is reported in the row
            self._check(entry)
            for _ in range(0 if entry.rejected else calls):
                try:
                    self._call(entry)
                except Exception as exc:
                    entry.rejected = True
                    entry.row.note = f"raised {type(exc).__name__}: {_first_line(exc)}"
                    break
            stats = getattr(step, "stats", None)
            graphs = getattr(stats, "cuda_graphs", None)
            mode = getattr(stats, "mode", None)
            if mode == "fallback" or (mode != "compiled" and not entry.rejected):
                entry.rejected = True
                entry.row.note = f"compile fell back: {getattr(stats, 'fallback_reason', None)}"
            elif entry.cuda_graphs and not entry.rejected and getattr(graphs, "state", "") != "on":
                entry.rejected = True
                entry.row.note = f"CUDA graphs skipped: {getattr(graphs, 'reason', None)}"
            if not entry.rejected:
                # The choice was made on its own timing: this one only compares compile with
                # it, and its row keeps the figures its acceptance was judged on.
                kept = _Figures.of(best) if best is not None else None
                self._settle(fp32, [entry], also=[best] if best is not None else [])
                if best is not None and kept is not None:
                    if entry.row.accepted and not faster(entry.timing, best.timing):
                        entry.row.accepted = False
                        entry.row.note = f"not faster than {best.row.label} beyond the noise"
                    kept.put_back(best)
            if graphs is not None and graphs.skips and not entry.row.note:
                entry.row.note = f"inductor did not record: {'; '.join(graphs.skips)}"
        return entry

    # --- the run --------------------------------------------------------------------------

    def run(self) -> TuneResult:
        """Tune; put every flag and the step's state back as they were, whatever happens."""
        try:
            with measuring():  # emulated candidates are entered on purpose: their rows say so
                return self._run()
        finally:
            self.state.finish()

    def _run(self) -> TuneResult:
        before = snapshot()
        fp32 = Candidate((), "reference")
        # A priming call in fp32: it records the torch functions the step calls, and
        # creates what a train step creates lazily (optimizer moments) before the copy
        # that every later call starts from.
        began = time.perf_counter()
        _, calls = calls_of(lambda: self._step(fp32)(*self.args, **self.kwargs))
        synchronize(self.device)
        self.first_s = time.perf_counter() - began
        self.state.settle()
        self.reference = reference_outputs(self._call(fp32))
        self.say(f"reference: plain fp32; state reset before each call: {self.state.describe()}")
        check_reference(self.reference)
        singles, rows = candidates(self.device, self.wanted, calls, model=self.model is not None)
        entries = [Candidate(levers, "lever") for levers in singles]
        for entry in entries:
            self._check(entry)
        self._settle(fp32, self._halve(fp32, [e for e in entries if not e.rejected]))
        emulated = []
        for row in [r for r in rows if r.verdict == EMULATED]:
            once = Candidate(check_levers("tune", row.levers), "lever")
            once.row.note = row.note.removeprefix(f"{EMULATED}: ")
            time_once(
                fp32, once, runner=self._runner, check=self._check, clock=self.clock,
                left=self.left, say=self.say,
            )  # fmt: skip
            emulated.append(once.row)
        rows = [r for r in rows if r.verdict != EMULATED]
        accepted = [e for e in entries if e.row.accepted]
        pairs = [(e.levers, e.row.speedup or 0.0) for e in accepted]
        combos = [Candidate(levers, "combination") for levers in combinations(pairs)]
        for entry in combos:
            self._check(entry)
        going = self._halve(fp32, [e for e in combos if not e.rejected])
        if going:
            self._settle(fp32, going, also=accepted)
        entries += combos
        top = contenders(entries)  # noise that large: the top candidates paired, call by call
        if top and self.left() > 0:
            duel(
                fp32, top, runner=self._runner, clock=self.clock, plan=self.plan,
                left=self.left, say=self.say,
            )  # fmt: skip
        best = self._choose(entries)
        for entry in entries:  # what computing in a lower dtype does to a run of steps
            if not entry.rejected and dict(entry.levers).get("param_dtype") is not None:
                self._drift(fp32, entry)
        sure, why = confidence(entries, best)
        reference = fp32.timing  # what the rows chosen among were timed beside
        compiled = graphed = None
        if self.try_compile and can_compile():
            compiled = self._compile(fp32, best)
            graphed = self._cuda_graphs(fp32, best)
        entries.extend(e for e in (compiled, graphed) if e is not None)
        if snapshot() != before:  # pragma: no cover - the frames restore everything
            self.notes.append("warning: some lever reads differently than before tuning")
        return TuneResult(
            best=dict(best.row.levers) if best is not None else {},
            rows=[e.row for e in entries] + emulated + rows,
            budget=self.budget,
            device=str(self.device),
            reference_s=reference.median if reference is not None else None,
            elapsed_s=time.perf_counter() - self.started,
            compile=None if compiled is None else compiled.row.accepted,
            cuda_graphs=None if graphed is None else graphed.row.accepted,
            state=self.state.describe(),
            torch_version=torch.__version__,
            notes=self.notes,
            confidence=sure,
            confidence_note=why,
        )


def _first_line(exc: Exception) -> str:
    """What a row's note says of an error: its first line, cut to 120 characters; a step
    refused for CUDA graphs whole, without the step's label (the row names it): the fix is
    the point of it."""
    text = (str(exc).strip().splitlines() or [""])[0]
    if isinstance(exc, CudaGraphsError):
        return text.split("cuda_graphs=True: ", 1)[-1]
    return text[:120]
