"""Every command-line option checked in one place, before any work.

``speedflags bench``, ``tune``, ``verify`` and ``report`` parse their arguments with
argparse; :func:`check` runs next, before a user's file is imported (``tune
FILE.py:FACTORY``) and before anything is measured. It refuses, in one line naming the
option and what was typed (shortened), for exit status 2:

- an empty value: an option given as ``""`` is not "left out" (leave it out for its
  default);
- a number out of its bounds (``bench --rounds`` from 1 to 1000, ``--passes`` from 1 to
  100, ``--min-time`` finite, ``--threads`` at most the CPUs here);
- an unknown workload or lever, a lever ``tune`` never tries (``deterministic``), a size
  list that is not positive integers;
- a device this machine does not have, a size the device cannot hold;
- an output file that could not be written after the run (``bench --json/--plot``, ``tune
  --out/--plot``, ``verify --json``), tried for real by
  :func:`~speedflags._measure.output_paths.check_output`; a place that refuses only when
  written (a full disk) is said then, in one line
  (:func:`~speedflags._measure.output_paths.write_output`);
- for ``bench`` and ``tune``, a process whose TF32 state is mixed: the ledger would refuse
  every configuration (``report`` shows such a state; ``verify`` reports it per lever).

What it checked comes back on ``args``, normalised, so that no command parses it again:
``workloads`` and ``size_list`` (bench), ``lever_names`` (tune, verify),
``resolved_device`` and ``bench_file`` (bench).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import re
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from .._measure.output_paths import check_output
from .._measure.subcommands import UsageError
from .._measure.timing import MAX_ROUNDS
from .._short_repr import short_repr
from .._tune.search import COMPILE
from ..errors import SpeedflagsError
from ..levers import registry
from ..levers.registry import lever_spec

__all__ = ["MAX_PASSES", "Parser", "UsageError", "check", "tunable_levers"]

MAX_PASSES = 100  # interleaved passes of bench over its configurations


class Parser(argparse.ArgumentParser):
    """argparse's parser, whose errors are one line naming the option, as :func:`check`'s
    are (``speedflags tune: --budget '-1': must be a positive, finite number``), not its
    usage block; ``--help`` shows the usage. Sub-commands' parsers are of this class too.

    Example:
        >>> from speedflags._cli.options import Parser
        >>> parser = Parser(prog="speedflags tune")
        >>> _ = parser.add_argument("--budget", type=float)
        >>> try:
        ...     parser.parse_args(["--budget", "x"])
        ... except SystemExit as exc:
        ...     exc.code
        2
    """

    def error(self, message: str) -> NoReturn:
        found = re.match(r"argument (\S+?)(?:/\S+)?: (.*)", message, re.DOTALL)
        if found:  # "argument --budget: '-1': ..." -> "--budget '-1': ..."
            option, why = found.groups()
            if option == "command":  # the sub-command's positional: say what is wrong alone
                message = why
            else:
                message = f"{option}{' ' if why.startswith(chr(39)) else ': '}{why}"
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def check(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Refuse ``args`` of ``args.command`` now (:class:`UsageError`), or normalise them.

    ``parser`` is the command's own parser (``bench --config`` fills in what the command
    line left at its defaults).
    """
    _CHECKS[args.command](args, parser)


# --- what every command shares -------------------------------------------------------------


def _not_empty(args: argparse.Namespace, *options: str) -> None:
    for option in options:
        value = getattr(args, option.lstrip("-").replace("-", "_"))
        values = value if isinstance(value, list) else [value]
        for item in values:
            if isinstance(item, str) and not item.strip():
                raise UsageError(
                    f"{option} {short_repr(item)}: empty; give a value, or leave {option} "
                    "out for its default"
                )


def _between(option: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise UsageError(f"{option} {short_repr(value)}: must be from {low} to {high}")


def _device(text: str | None, command: str) -> Any:
    """``--device`` as a torch.device (None: the command's default), refused if this
    machine does not have it."""
    from .._hardware import missing_cuda, normalize_device

    try:
        device = normalize_device(text, command)
    except SpeedflagsError as exc:
        raise UsageError(f"--device {short_repr(text)}: {_reason(exc)}") from None
    missing = None if device is None else missing_cuda(device)
    if missing is not None:
        raise UsageError(f"--device {short_repr(text)}: {missing}")
    return device


def _reason(exc: Exception) -> str:
    # "bench(device='gpu'): not a device ..." -> "not a device ...": the option names it
    return str(exc).split("): ", 1)[-1]


def _names(
    option: str, text: str | None, valid: Sequence[str], why: Callable[[str], str] | None = None
) -> list[str] | None:
    # ``why``: what is said of a lever name that is not among ``valid`` (default: tune's)
    if text is None:
        return None
    names = [name.strip() for name in text.split(",") if name.strip()]
    shown = f"{option} {short_repr(text)}"
    if not names:
        raise UsageError(f"{shown}: names no lever; valid: {', '.join(valid)}")
    for name in names:
        if name not in valid:
            known = option == "--levers" and name in registry.lever_names()
            reason = (why or _never_tried)(name) if known else f"unknown lever {short_repr(name)}"
            raise UsageError(f"{shown}: {reason}; valid: {', '.join(valid)}")
    return names


def _never_tried(name: str) -> str:
    return (
        f"tune never tries {name} (it is never faster; speedflags.tune(levers={{{name!r}: "
        "[...]}) times values you give it)"
    )


def _output(option: str, path: str | None, suffixes: Sequence[str] | None) -> None:
    if path is None:
        return
    try:
        check_output(path, option, suffixes)
    except SpeedflagsError as exc:
        raise UsageError(str(exc)) from None


def _tf32_consistent(command: str) -> None:
    from .._status import tf32_status

    status = tf32_status()
    if status.consistent:
        return
    details = "; ".join(status.conflicts) or "a legacy TF32 getter raises"
    raise UsageError(
        f"the TF32 state of this process is mixed ({details}): every configuration {command} "
        "measures would be refused (MixedTF32APIError). Nothing was measured. Call "
        "speedflags.heal_tf32() first; `speedflags report` shows both API families"
    )


def _plot(args: argparse.Namespace) -> None:
    from .._measure.plot_axes import MISSING, PLOT_SUFFIXES, have_matplotlib

    if args.plot is None:
        return
    if not have_matplotlib():  # before a long run, not after it
        raise UsageError(MISSING)
    _output("--plot", args.plot, PLOT_SUFFIXES)


# --- bench ---------------------------------------------------------------------------------


def _bench(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    _not_empty(args, "--compare")
    if args.compare:  # shows two files side by side; measures nothing (bench/cli.py reads them)
        return
    _not_empty(args, "--config", "--device", "--workload", "--sizes", "--json", "--plot")
    args.bench_file = None
    if args.config is not None:
        from ..bench.config_file import load_for_cli, overlay

        args.bench_file, why = load_for_cli(args.config)
        if args.bench_file is None:
            raise UsageError(why)
        overlay(args, parser, args.bench_file)
    _between("--passes", args.passes, 1, MAX_PASSES)
    _between("--rounds", args.rounds, 1, MAX_ROUNDS)
    # NaN passes "< 0" and infinity passes everything, then fail mid-run planning rounds
    if not math.isfinite(args.min_time) or args.min_time < 0:
        raise UsageError(
            f"--min-time {args.min_time}: must be a finite number of seconds, 0 or more"
        )
    if args.threads is not None:
        _between("--threads", args.threads, 1, os.cpu_count() or 1)
    args.workloads = _workloads(args.workload)
    args.size_list = None if args.sizes is None else _sizes(args.sizes)
    _plot(args)
    _output("--json", args.json, None)
    from .._hardware import resolve_device

    _device(args.device, "bench")  # refused as --device, before resolving the default
    args.resolved_device = resolve_device(args.device, "bench")
    if args.size_list is not None:
        _fits(args.workloads, args.size_list, args.resolved_device)
    _tf32_consistent("bench")


def _workloads(text: str) -> tuple[str, ...]:
    from ..bench.cli import WORKLOAD_NAMES

    workloads = tuple(w.strip() for w in text.split(",") if w.strip())
    unknown = [w for w in workloads if w not in WORKLOAD_NAMES]
    if unknown or not workloads:
        raise UsageError(
            f"--workload {short_repr(text)}: unknown "
            f"{', '.join(map(short_repr, unknown)) or 'none'}; "
            f"valid: {', '.join(WORKLOAD_NAMES)}"
        )
    return workloads


def _sizes(text: str) -> tuple[int, ...]:
    shown = f"--sizes {short_repr(text)}: expected comma-separated positive integers"
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:  # not a number, or too many digits to convert
        raise UsageError(shown) from None
    if not values or min(values) <= 0:
        raise UsageError(shown)
    return values


def _fits(workloads: tuple[str, ...], sizes: tuple[int, ...], device: Any) -> None:
    """Refuse sizes that no chosen workload can take in ``device``'s memory (estimated): then
    nothing would run. A size that only some cannot take skips those, each with its reason,
    when the run comes to them."""
    from .._measure.workloads import WORKLOADS

    chosen = [WORKLOADS[name] for name in workloads]
    chosen = [workload for workload in chosen if workload.unavailable(device) is None]
    reasons = [workload.too_big(size, device) for workload in chosen for size in sizes]
    if reasons and all(reasons):
        shown = ",".join(map(str, sizes))
        raise UsageError(f"--sizes {shown}: nothing fits: {'; '.join(map(str, reasons))}")


# --- tune ----------------------------------------------------------------------------------


def tunable_levers() -> list[str]:
    """What ``tune --levers`` accepts: the levers tune tries values of, and compile (the model
    levers are tried when the factory's step is the model itself)."""
    return sorted([*(n for n in registry.lever_names() if lever_spec(n).candidates), COMPILE])


def _tune(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    from .._tune.cli import check_target

    _not_empty(args, "--levers", "--device", "--out", "--plot")
    args.lever_names = _names("--levers", args.levers, tunable_levers())
    _device(args.device, "tune")
    if args.out is not None:
        from .._measure.lever_files import FORMATS, YAML_MISSING

        _output("--out", args.out, FORMATS)
        suffix = os.path.splitext(args.out)[1].lower()
        if suffix in (".yaml", ".yml") and importlib.util.find_spec("yaml") is None:
            raise UsageError(f"--out {short_repr(args.out)}: {YAML_MISSING}")
    _plot(args)
    _tf32_consistent("tune")
    check_target(args.target)  # the file exists; it is imported only after every check


# --- verify and report ---------------------------------------------------------------------


def _verify(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    _not_empty(args, "--device", "--levers", "--json")
    _device(args.device, "verify")
    from .._measure.verdicts import UNVERIFIABLE, verifiable_levers

    args.lever_names = _names(
        "--levers", args.levers, sorted(verifiable_levers()), lambda name: f"{name} {UNVERIFIABLE}"
    )
    _output("--json", args.json, None)


def _report(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    _not_empty(args, "--device")
    if args.restore and not args.apply:
        raise UsageError("--restore proves that --apply's changes come back; use it with --apply")
    _device(args.device, "report")


_CHECKS: dict[str, Callable[[argparse.Namespace, argparse.ArgumentParser], None]] = {
    "bench": _bench,
    "tune": _tune,
    "verify": _verify,
    "report": _report,
}
