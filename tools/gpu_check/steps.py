"""The steps of ``make gpu-check`` (:mod:`tools.gpu_check.check`): what each runs, in
which order, with which cap, and which of them a call chooses.

The CPU suite is the one step that is more than a command: with pytest-xdist it is one
pytest of ``--suite-workers`` processes that take the next file as they finish one, the
heaviest first; without it, eight processes of a fixed share of the files each.

The steps, most valuable first:

1. ``suite``: the whole test suite with the GPU present (on a GPU machine only; ``make
   unit`` runs it elsewhere), in ``--suite-workers`` pytest-xdist processes, each taking
   the next file as it finishes one, the heaviest files first; without pytest-xdist,
   ``suite-1`` to ``suite-8``, eight processes of a share of the files each. Started at
   once and run beside ``gpu-tests``: none of them is timed;
2. ``gpu-tests``: the GPU-only tests (``tests/test_gpu_*.py``; they skip without a GPU);
3. ``verify``: ``python -m speedflags verify`` on the device, into ``verify.json`` (from here
   on, each step has the machine to itself);
4. ``verify-tf32-override``: the same for TF32 under ``NVIDIA_TF32_OVERRIDE=0`` (on a GPU it
   must report TF32 not in effect and exit 1);
5. ``fp8-headroom``: ``benchmarks/fp8_headroom.py``: a float8 e4m3 scaled matmul against
   bf16 and fp32 at 4096³ and 8192³, into ``fp8-headroom.json``;
6. ``train-step``: ``benchmarks/train_step_interleaved.py`` on the device: fp32 eager,
   ``@speedup(amp="bf16")``, the same compiled and the same through CUDA Graphs, timed
   round-robin, into ``train-step.json``;
7. ``overhead``: ``benchmarks/overhead_interleaved.py``: the enter+exit cost on this
   machine's CPU against plain torch and the 1.5x goal, into ``overhead.json``;
8. ``bench``: ``python -m speedflags bench`` on the device (``--bench-workloads`` and
   ``--bench-args`` choose and tune it), into ``bench.json`` (last of the timed steps: the
   longest, and a Ctrl-C still leaves its results so far);
9. ``benchmarks``: the pytest-benchmark suites once, untimed.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

__all__ = [
    "PRESETS",
    "STEP_NAMES",
    "Step",
    "plan",
    "select",
    "suite_files",
    "suite_shards",
]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# the benchmarks as `make test` runs them (no leak check: the plain-torch overhead baseline
# writes flags on purpose)
BENCHMARKS = ["-m", "pytest", "-p", "no:cacheprovider", "-q", "benchmarks", "--benchmark-disable"]
# Without pytest-xdist the CPU suite runs as this many processes of a share of its files.
SUITE_SHARDS = 8
PYTEST = [
    "-m",
    "pytest",
    "-p",
    "speedflags.pytest_plugin",
    "--speedflags-leaks=fail",
    "-p",
    "no:cacheprovider",
    "-q",
]
# Seconds each of the heaviest test files took in one process on the 2-core development
# machine (a loaded AMD EPYC, PyTorch 2.13, 2026-11-26; the whole suite 849 s of test time).
# Only the order counts: these start first, so that no worker starts one of them last.
SUITE_SECONDS = {
    "tests/test_compile_matrix.py": 77,
    "tests/test_speedup.py": 76,
    "tests/test_release.py": 64,
    "tests/test_pytest_plugin_report.py": 59,
    "tests/test_bench.py": 49,
    "tests/test_examples.py": 46,
    "tests/test_tune_noise.py": 42,
    "tests/test_compile_in_graph.py": 38,
    "tests/test_pytest_plugin.py": 34,
    "tests/test_interrupt_stress.py": 32,
    "tests/test_lazy_import.py": 32,
    "tests/test_distributed.py": 25,
    "tests/test_tune_files.py": 24,
    "tests/test_tf32.py": 23,
    "tests/test_abandoned.py": 20,
    "tests/test_tools_gpu_check.py": 18,
    "tests/test_compile_levers.py": 17,
}
# The suite's processes: two threads each for torch and OpenMP (eight processes and the GPU
# tests share the machine's cores), and inductor compiling in the process itself rather
# than in a pool of one worker process per core (each importing torch) per test process.
SUITE_ENV = {
    "OMP_NUM_THREADS": "2",
    "MKL_NUM_THREADS": "2",
    "TORCHINDUCTOR_COMPILE_THREADS": "1",
}
# One test's most, where pytest-timeout is installed (xdist replaces the worker it ends). The
# longest, test_release's run of the unpacked sdist's tests, took 234 s beside another worker
# on two loaded cores (its whole file, 64 s in one process).
SUITE_TEST_TIMEOUT_S = 170
STEP_NAMES = (
    "suite",
    "gpu-tests",
    "verify",
    "verify-tf32-override",
    "fp8-headroom",
    "train-step",
    "overhead",
    "bench",
    "benchmarks",
)
# A lent machine's calls: (steps, budget in seconds, the suite's cap). The second call's
# steps are the GPU tests and those --steps adds.
PRESETS: dict[str, tuple[tuple[str, ...], float, float]] = {
    "first": (STEP_NAMES[:-1], 400.0, 230.0),
    "second": (("gpu-tests",), 220.0, 200.0),
}


@dataclass
class Step:
    """One subprocess of the check.

    Attributes:
        name: its name (and its log's, ``<name>.log``).
        argv: the Python arguments (after the interpreter).
        cap_s: the most seconds it may take.
        expect: the exit status that counts as passing.
        env: extra environment variables.
        why_skipped: set to skip it from the start (with this reason).
        alongside: start it at once and let the steps after it run beside it, until one
            that is ``quiet``.
        quiet: needs the machine to itself (it times something): every step running
            alongside is waited for first.
        group: the name ``--steps`` and ``--skip`` know it by (``suite`` for ``suite-3``).
        gpu_state: read the GPU's clocks and power (``nvidia-smi``) when it ends.

    Example:
        >>> from tools.gpu_check.check import Step
        >>> Step("suite-3", ["-m", "pytest"], 300, alongside=True).group
        'suite'
    """

    name: str
    argv: list[str]
    cap_s: float
    expect: int = 0
    env: dict[str, str] = field(default_factory=dict)
    why_skipped: str = ""
    alongside: bool = False
    quiet: bool = False
    group: str = ""
    gpu_state: bool = False

    def __post_init__(self) -> None:
        if not self.group:
            self.group = "suite" if self.name.startswith("suite-") else self.name


def plan(
    out: str,
    gpu: bool,
    *,
    bench_args: Sequence[str] = (),
    suite_workers: int | None = None,
    suite_cap_s: float = 300.0,
    suite_tests: Sequence[str] = (),
) -> list[Step]:
    """The steps for a machine with (``gpu``) or without a CUDA GPU.

    Args:
        out: the folder the steps write into.
        gpu: whether a CUDA GPU was found (else the same steps, small, on the CPU).
        bench_args: more arguments for ``python -m speedflags bench``.
        suite_workers: pytest-xdist processes for the suite; 0 for the eight shard
            processes; None for the default (about half the cores, at most 8, where
            pytest-xdist is installed; else the shards).
        suite_cap_s: the suite's time cap.
        suite_tests: test files or test ids for the suite to run instead of every file
            (a second call that reruns what failed in the first).

    Example:
        >>> from tools.gpu_check.check import plan
        >>> steps = plan("out", gpu=False, suite_workers=4)
        >>> [s.name for s in steps]  # doctest: +NORMALIZE_WHITESPACE
        ['suite', 'gpu-tests', 'verify', 'verify-tf32-override', 'fp8-headroom', 'train-step',
         'overhead', 'bench', 'benchmarks']
        >>> next(s for s in plan("out", gpu=True) if s.name == "verify-tf32-override").expect
        1
    """
    device = "cuda" if gpu else "cpu"
    gpu_tests = _test_files(gpu_only=True)
    verify = ["-m", "speedflags", "verify", "--device", device]
    bench = ["-m", "speedflags", "bench", "--device", device, "--json", f"{out}/bench.json"]
    fp8 = ["benchmarks/fp8_headroom.py", "--device", device, "--json", f"{out}/fp8-headroom.json"]
    train = ["benchmarks/train_step_interleaved.py", "--device", device, "--rounds", "30"]
    train += ["--json", f"{out}/train-step.json"]
    overhead = ["benchmarks/overhead_interleaved.py", "--rounds", "20", "--calls", "1000"]
    overhead += ["--json", f"{out}/overhead.json"]
    if not gpu:  # the same commands, small: the dry run proves the path, not the speed
        bench += ["--sizes", "96", "--passes", "1", "--min-time", "0.02"]
        fp8 += ["--sizes", "32,64", "--rounds", "2"]
        train[train.index("--rounds") + 1] = "1"
        # compiling a train step takes minutes on a small CPU; `make test` compiles it
        train += ["--variants", "fp32-eager,speedup-bf16,speedup-bf16-graphs"]
        train += ["--check-steps", "2"]
        overhead[overhead.index("--rounds") + 1 : overhead.index("--calls") + 2] = [
            "2", "--calls", "100",
        ]  # fmt: skip
    bench += list(bench_args)
    return [
        *_suite_steps(out, gpu, suite_workers, suite_cap_s, list(suite_tests) or suite_files()),
        Step("gpu-tests", [*PYTEST, "-rs", f"--junitxml={out}/gpu-tests.xml", *gpu_tests], 300),
        Step("verify", [*verify, "--json", f"{out}/verify.json"], 90, quiet=True),
        Step(
            "verify-tf32-override",
            [*verify, "--levers", "tf32", "--json", f"{out}/verify-tf32-override.json"],
            60,
            expect=1 if gpu else 0,
            env={"NVIDIA_TF32_OVERRIDE": "0"},
        ),
        Step("fp8-headroom", fp8, 90, gpu_state=gpu),
        # perf_hints: inductor says why it records a graph without CUDA Graphs, if it does
        Step("train-step", train, 150, env={"TORCH_LOGS": "perf_hints"}, gpu_state=gpu),
        Step("overhead", overhead, 60),
        Step("bench", bench, 240, gpu_state=gpu),
        Step("benchmarks", [*BENCHMARKS, f"--junitxml={out}/benchmarks.xml"], 240),
    ]


def _suite_steps(
    out: str, gpu: bool, workers: int | None, cap_s: float, tests: list[str]
) -> list[Step]:
    """The CPU suite (``tests``: files or test ids): one pytest-xdist step, or the eight
    shard steps without xdist (fewer for fewer files)."""
    why = "" if gpu else "no GPU: `make unit` runs the CPU suite"
    if workers is None:
        workers = _default_workers() if importlib.util.find_spec("xdist") else 0
    base = [*PYTEST, "-m", "not cuda", "--durations=25"]
    if workers:
        timeout = []
        if importlib.util.find_spec("pytest_timeout"):  # a hung test ends its worker only
            timeout = [f"--timeout={SUITE_TEST_TIMEOUT_S}", "--timeout-method=thread"]
        argv = [*base, "-n", str(workers), "--dist", "loadfile", *timeout]
        argv += [f"--junitxml={out}/suite.xml", *tests]
        return [Step("suite", argv, cap_s, env=dict(SUITE_ENV), why_skipped=why, alongside=True)]
    return [
        Step(
            f"suite-{i + 1}",
            [*base, f"--junitxml={out}/suite-{i + 1}.xml", *files],
            cap_s,
            env=dict(SUITE_ENV),
            why_skipped=why,
            alongside=True,
        )
        for i, files in enumerate(suite_shards(min(SUITE_SHARDS, len(tests)), tests))
    ]


def _default_workers() -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(2, min(8, (cores or 2) // 2))


def suite_files() -> list[str]:
    """The CPU suite's files (``tests/test_*.py`` less the GPU ones), the heaviest first
    (:data:`SUITE_SECONDS`), then the rest in name order.

    Example:
        >>> from tools.gpu_check.check import suite_files
        >>> files = suite_files()
        >>> files[0], "tests/test_gpu_kernels.py" in files
        ('tests/test_compile_matrix.py', False)
    """
    files = _test_files(gpu_only=False)
    return sorted(files, key=lambda f: -SUITE_SECONDS.get(f, 0))  # stable: names otherwise


def suite_shards(count: int = SUITE_SHARDS, tests: Sequence[str] | None = None) -> list[list[str]]:
    """The CPU suite's files (or ``tests``, files or test ids) in ``count`` groups of about
    equal weight (each heaviest in turn to the lightest group; one not in
    :data:`SUITE_SECONDS` weighs 2 s): each group runs as a process of its own.

    Example:
        >>> from tools.gpu_check.check import suite_shards
        >>> shards = suite_shards(3)
        >>> len(shards), "tests/test_gpu_kernels.py" in sum(shards, [])
        (3, False)
    """
    shards: list[list[str]] = [[] for _ in range(count)]
    weights = [0.0] * count
    for name in suite_files() if tests is None else tests:
        lightest = weights.index(min(weights))
        shards[lightest].append(name)
        weights[lightest] += SUITE_SECONDS.get(name, 2)
    return shards


def _test_files(gpu_only: bool) -> list[str]:
    """``tests/test_gpu_*.py`` (``gpu_only``), or every other ``tests/test_*.py``, sorted."""
    return sorted(
        os.path.join("tests", name)
        for name in os.listdir(os.path.join(ROOT, "tests"))
        if name.startswith("test_")
        and name.endswith(".py")
        and name.startswith("test_gpu_") is gpu_only
    )


def select(steps: list[Step], chosen: Iterable[str] | None, skipped: Iterable[str] = ()) -> None:
    """Skip (``why_skipped``) every step whose group is not ``chosen`` (None: all) or is in
    ``skipped``; a name that is no step's group raises ValueError.

    Example:
        >>> from tools.gpu_check.check import plan, select
        >>> steps = plan("out", gpu=True, suite_workers=8)
        >>> select(steps, ["gpu-tests", "bench"], skipped=["bench"])
        >>> [s.name for s in steps if not s.why_skipped]
        ['gpu-tests']
    """
    known = {s.group for s in steps}
    chosen_set = None if chosen is None else set(chosen)
    skipped_set = set(skipped)
    unknown = ((chosen_set or set()) | skipped_set) - known
    if unknown:
        names = ", ".join(dict.fromkeys(s.group for s in steps))
        raise ValueError(f"no step {', '.join(sorted(unknown))}; steps: {names}")
    for step in steps:
        if step.why_skipped:
            continue
        if step.group in skipped_set:
            step.why_skipped = "not chosen (--skip)"
        elif chosen_set is not None and step.group not in chosen_set:
            step.why_skipped = "not chosen (--steps, --preset)"
