"""``python -m speedflags tune FILE.py:FACTORY``: tune the step a factory builds.

``FACTORY()`` returns ``(fn, args)`` or ``(fn, args, kwargs)``; the command tunes
``fn(*args, **kwargs)`` as :func:`speedflags.tune` does, prints the table (or JSON) on
stdout and its progress on stderr, and can save the choice (``--out``) and a plot
(``--plot``).

Exit status:

- 0: done.
- 2: bad usage, refused before anything is measured, in one line naming the option (the
  options by :mod:`speedflags._cli.options`, before the file is imported): an empty
  value, a missing file, a budget or time bound that is not a positive finite number,
  ``--levers`` naming no lever, an unknown one or one tune never tries
  (``deterministic``), an output (``--out``, ``--plot``) of the wrong file type or in a
  place that cannot be written, a process whose TF32 state is mixed; then a factory that
  does not exist, fails or returns the wrong shape. Also an output that could not be
  written after all (a full disk: the results are printed first).
- 3: the step itself raised (in the plain fp32 reference, or while fp32 was timed): its
  traceback is printed, as it is the user's code that failed. A candidate whose call
  raises is only rejected, with the reason in its row.
- 130: stopped with Ctrl-C; every flag is restored.

Output files: ``--out`` and ``--plot`` are checked before the run (their file type, and
that the file can be written); a missing folder is created, with its parents, when the
file is written, as ``bench --json`` and ``bench --plot`` do.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import traceback
from collections.abc import Callable
from types import ModuleType
from typing import Any

from .._measure.subcommands import UsageError
from .._short_repr import short_repr, short_str
from ..levers import registry
from ..levers.registry import lever_spec
from .search import COMPILE

__all__ = ["UsageError", "add_parser", "check_target", "command", "load_factory"]

STEP_RAISED = 3  # the exit status when the user's own step raises

EXAMPLE = """\
example (steps.py):
  import torch

  def mlp():
      model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.ReLU(),
                                  torch.nn.Linear(2048, 1024))
      return model, (torch.randn(256, 1024),)

  python -m speedflags tune steps.py:mlp --budget 0.05 --out levers.json

then, in the training script:
  levers = speedflags.load_levers("levers.json")
  if levers:
      step = speedflags.speedup(**levers)(step)
"""


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{short_repr(text)} is not a number") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{short_repr(text)}: must be a positive, finite number")
    return value


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Add the ``tune`` subcommand to an ``add_subparsers()`` object."""
    parser: argparse.ArgumentParser = sub.add_parser(
        "tune",
        help="find the fastest levers that keep your own step accurate",
        description="Measure every lever on your own step (a forward, a loss or a train\n"
        "step) against plain fp32, and choose the fastest set whose relative error stays\n"
        "within the budget. FACTORY() returns (fn, args) or (fn, args, kwargs).",
        epilog=EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("target", metavar="FILE.py:FACTORY", help="the file and its factory")
    parser.add_argument(
        "--budget", type=_positive, default=1e-2, help="largest relative error (0.01)"
    )
    parser.add_argument(
        "--seconds", type=_positive, default=None, help="bound on the whole run (none)"
    )
    parser.add_argument(
        "--levers",
        default=None,
        help="comma-separated levers to try, at least one (default: all, and compile): "
        + ", ".join(sorted(name for name in (*registry.lever_names(), COMPILE) if _tried(name))),
    )
    parser.add_argument(
        "--device", default=None, help="cpu, cuda or cuda:N (default: the arguments' device)"
    )
    parser.add_argument(
        "--out",
        metavar="PATH",
        help="save the choice (.json, .toml, .yaml); checked before the run, a missing "
        "folder is created",
    )
    parser.add_argument(
        "--plot",
        metavar="PATH",
        help="write a speed-against-error plot (.png, .svg, .pdf; needs matplotlib); checked "
        "before the run, a missing folder is created",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    return parser


def _tried(name: str) -> bool:
    # a lever tune tries values of by itself (deterministic: never faster, never tried)
    return name == COMPILE or bool(lever_spec(name).candidates)


def _import_file(path: str) -> ModuleType:
    stem = os.path.splitext(os.path.basename(path))[0]
    name = f"_speedflags_tune_{stem}" if stem.isidentifier() else "_speedflags_tune_target"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise UsageError(f"{short_repr(path)} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look the module up by name
    folder = os.path.dirname(os.path.abspath(path))
    sys.path.insert(0, folder)  # so the file can import its neighbours
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        raise UsageError(
            f"{short_repr(path)} raised {type(exc).__name__} on import: {short_str(exc)}"
        ) from None
    finally:
        if folder in sys.path:
            sys.path.remove(folder)
    return module


def check_target(target: str) -> tuple[str, str]:
    """``FILE.py:FACTORY`` as ``(path, factory)``, the file found; nothing is imported.

    Raises:
        UsageError: not of that form, or no such file.
    """
    path, _, factory = target.rpartition(":")
    if not path or not factory.isidentifier():
        raise UsageError(
            f"{short_repr(target)}: expected FILE.py:FACTORY, such as steps.py:make_step"
        )
    if not os.path.isfile(path):
        raise UsageError(f"no such file: {short_repr(path)}")
    return path, factory


def load_factory(target: str) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
    """Import ``FILE.py:FACTORY``, call the factory, and check what it returns.

    Raises:
        UsageError: the file or the factory is missing, the factory raises, or it returns
            something other than ``(fn, args)`` or ``(fn, args, kwargs)``.
    """
    path, factory = check_target(target)
    module = _import_file(path)
    make = getattr(module, factory, None)
    if make is None:
        found = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise UsageError(
            f"{path} has no {short_repr(factory)}; its callables: {', '.join(found) or '(none)'}"
        )
    if not callable(make):
        raise UsageError(f"{path}:{factory} is a {type(make).__name__}, not a function")
    try:
        made = make()
    except Exception as exc:
        raise UsageError(f"{factory}() raised {type(exc).__name__}: {short_str(exc)}") from None
    shape = "(fn, args) or (fn, args, kwargs): fn callable, args a tuple or list, kwargs a dict"
    if not isinstance(made, tuple) or len(made) not in (2, 3):
        got = f"a {len(made)}-tuple" if isinstance(made, tuple) else type(made).__name__
        raise UsageError(f"{factory}() must return {shape}; it returned {got}")
    fn, args = made[0], made[1]
    kwargs = made[2] if len(made) == 3 else {}
    if not callable(fn) or not isinstance(args, (tuple, list)) or not isinstance(kwargs, dict):
        got = f"({type(fn).__name__}, {type(args).__name__}" + (
            f", {type(kwargs).__name__})" if len(made) == 3 else ")"
        )
        raise UsageError(f"{factory}() must return {shape}; it returned {got}")
    return fn, tuple(args), dict(kwargs)


def _write_outputs(args: argparse.Namespace, result: Any) -> int:
    """Save and plot as asked; 2 if a file could not be written after all (checked before
    the run: a full disk shows only now), said in one line per file."""
    from .._measure.output_paths import write_output

    status = 0
    if args.out:
        problem = write_output("--out", args.out, result.save)
        if problem is None:
            print(f"tune: levers saved to {args.out}", file=sys.stderr)
        else:
            print(f"speedflags tune: {problem}", file=sys.stderr)
            status = 2
    if args.plot:
        points: list[int] = []
        problem = write_output("--plot", args.plot, lambda path: points.append(result.plot(path)))
        if problem is None:
            print(f"tune: plot {args.plot} ({points[0]} points)", file=sys.stderr)
        else:
            print(f"speedflags tune: {problem}", file=sys.stderr)
            status = 2
    return status


def command(args: argparse.Namespace) -> int:
    """Run ``speedflags tune`` with arguments :func:`speedflags._cli.options.check` checked
    (``lever_names`` among them); return the exit status."""
    from ..errors import SpeedflagsError
    from . import run

    def progress(line: str) -> None:
        print(f"tune: {line}", file=sys.stderr, flush=True)

    try:  # the options were checked (speedflags._cli.options) before this imports the file
        fn, fn_args, fn_kwargs = load_factory(args.target)
    except (UsageError, SpeedflagsError) as exc:
        print(f"speedflags tune: {exc}", file=sys.stderr)
        return 2
    try:
        result = run(
            fn,
            fn_args,
            fn_kwargs,
            budget=args.budget,
            seconds=args.seconds,
            levers=args.lever_names,
            device=args.device,
            progress=progress,
        )
    except (UsageError, SpeedflagsError) as exc:
        print(f"speedflags tune: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("speedflags tune: interrupted (Ctrl-C); every flag is restored", file=sys.stderr)
        return 130
    except Exception as exc:  # the user's step raised: its traceback is theirs to read
        traceback.print_exc()
        print(
            f"speedflags tune: the step raised {type(exc).__name__} (traceback above); "
            "every flag is restored",
            file=sys.stderr,
        )
        return STEP_RAISED
    print(json.dumps(result.to_dict(), indent=2) if args.json else result)
    return _write_outputs(args, result)
