"""``speedflags bench --config FILE``: the configurations, workloads and settings in one file.

A bench file (YAML, TOML or JSON, by suffix; YAML needs ``pip install '.[yaml]'``)
names what to compare and how hard::

    device: cuda              # optional: cpu, cuda or cuda:N (default: cuda if available)
    passes: 3                 # interleaved passes over the configurations
    rounds: 5                 # timed rounds per configuration and pass, at least
    min_time: 0.25            # timed seconds per configuration and pass, at least
    threads: 1                # optional: torch.set_num_threads for the run
    workloads:                # a list of names (their default sizes), or name -> sizes
      matmul: [4096, 8192]
      mlp-train: {cpu: [1024], cuda: [8192]}   # sizes per device type
    baseline: fp32            # optional: the configuration the others are compared with
    configs:                  # name -> fast_math levers, an input dtype, or a lever file
      fp32: {}                                  # every lever off (always the starting point)
      bf16-tf32: {tf32: true, amp: bf16}
      other-names: {precision: bf16, tf32_matmul_precision: high, sdp_backend: flash}
      pure-bf16: {dtype: bf16}                  # bf16 inputs and weights: the ceiling
      tuned: levers.toml                        # what `speedflags tune --out` saved

Knob names that hand-written speed configs often use are accepted beside speedflags' own:
``precision`` (``fp32``,
``bf16``, ``fp16``: autocast), ``tf32_matmul_precision`` (``matmul_precision``) and
``sdp_backend`` (``flash``, ``mem_efficient``, ``math``: ``sdpa``). A lever file saved by
``tune`` (a ``levers`` table) may also be given as the whole ``--config``: it is compared
with fp32 on the default workloads. Every configuration runs on top of the fp32 baseline
(every lever off), as the bench always measures. A bad file is refused before anything
runs, naming the file, the key, the value and the valid choices.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import numbers
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .._measure.configs import Config
from .._measure.lever_files import load_levers, read_file
from .._measure.workloads import WORKLOADS
from .._short_repr import short_repr
from ..errors import InvalidTypeError, InvalidValueError, SpeedflagsError
from ..levers import registry
from ..levers.registry import check_levers

__all__ = ["BenchFile", "load_bench_file"]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# other common knob names -> (lever, value translation)
OTHER_KNOBS: dict[str, tuple[str, dict[Any, Any]]] = {
    "precision": ("amp", {"fp32": False, "bf16": "bf16", "fp16": "fp16"}),
    "tf32_matmul_precision": ("matmul_precision", {}),
    "sdp_backend": ("sdpa", {"mem_efficient": "efficient"}),
}
TOP_KEYS = ("device", "passes", "rounds", "min_time", "threads", "workloads", "baseline", "configs")
DEVICE_TYPES = ("cpu", "cuda")


@dataclass(frozen=True)
class BenchFile:
    """What a bench file asks for (``None``: the command line's value or default).

    Example:
        >>> import os, tempfile
        >>> from speedflags.bench.config_file import load_bench_file
        >>> path = os.path.join(tempfile.mkdtemp(), "speed.json")
        >>> with open(path, "w") as fh:
        ...     _ = fh.write('{"workloads": {"matmul": [64]}, "passes": 1,'
        ...                  ' "configs": {"fp32": {}, "fast": {"precision": "bf16"}}}')
        >>> bench = load_bench_file(path)
        >>> [(c.name, dict(c.levers), c.baseline) for c in bench.configs]
        [('fp32', {}, True), ('fast', {'amp': 'bf16'}, False)]
        >>> bench.workloads, bench.sizes_for("matmul", "cpu"), bench.passes
        (('matmul',), (64,), 1)
    """

    path: str
    configs: tuple[Config, ...]
    workloads: tuple[str, ...] | None = None
    sizes: Mapping[str, Mapping[str, tuple[int, ...]]] = field(default_factory=dict)
    device: str | None = None
    passes: int | None = None
    rounds: int | None = None
    min_time: float | None = None
    threads: int | None = None

    def sizes_for(self, workload: str, device_type: str) -> tuple[int, ...] | None:
        """The sizes the file gives ``workload`` on ``device_type``, or None for the defaults."""
        return self.sizes.get(workload, {}).get(device_type)


class _Reader:
    """Reads one file, with errors that name it: ``bench --config 'speed.yaml': ...``."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.where = f"bench --config {short_repr(path)}"
        self.folder = os.path.dirname(os.path.abspath(path))

    def fail(self, key: str, value: Any, why: str) -> InvalidValueError:
        return InvalidValueError(f"{self.where}: {key}={short_repr(value)}: {why}")

    def number(self, data: Mapping[str, Any], key: str, kind: type, minimum: float) -> Any:
        value = data.get(key)
        if value is None:
            return None
        ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
        if ok and kind is int:
            ok = isinstance(value, numbers.Integral)
        if not ok or not math.isfinite(float(value)) or value < minimum:
            shown = "an integer" if kind is int else "a number"
            raise self.fail(key, value, f"expected {shown} of at least {minimum:g}")
        return kind(value)

    def device(self, data: Mapping[str, Any]) -> str | None:
        value = data.get("device")
        if value is None:
            return None
        try:
            device = torch.device(value) if isinstance(value, str) else None
        except RuntimeError:
            device = None
        if device is None or device.type not in DEVICE_TYPES:
            raise self.fail("device", value, "expected 'cpu', 'cuda' or 'cuda:N'")
        return str(value)

    def sizes(self, key: str, value: Any) -> tuple[int, ...]:
        items = value if isinstance(value, list) else [value]
        if not items or any(isinstance(v, bool) or not isinstance(v, int) or v <= 0 for v in items):
            raise self.fail(key, value, "expected a positive integer or a list of them")
        return tuple(items)

    def workloads(
        self, data: Mapping[str, Any]
    ) -> tuple[tuple[str, ...] | None, dict[str, dict[str, tuple[int, ...]]]]:
        value = data.get("workloads")
        if value is None:
            return None, {}
        entries = value if isinstance(value, dict) else dict.fromkeys(value or [], None)
        if not isinstance(value, (dict, list)) or not entries:
            raise self.fail("workloads", value, "expected a list of workload names or a table "
                            f"of name to sizes; workloads: {', '.join(WORKLOADS)}")  # fmt: skip
        sizes: dict[str, dict[str, tuple[int, ...]]] = {}
        for name, given in entries.items():
            if name not in WORKLOADS:
                valid = ", ".join(WORKLOADS)
                raise self.fail("workloads", name, f"unknown workload; valid: {valid}")
            if given is None:
                continue
            if isinstance(given, dict):
                unknown = [k for k in given if k not in DEVICE_TYPES]
                if unknown:
                    valid = ", ".join(DEVICE_TYPES)
                    why = f"unknown device type; valid: {valid}"
                    raise self.fail(f"workloads.{name}", unknown[0], why)
                sizes[name] = {k: self.sizes(f"workloads.{name}.{k}", v) for k, v in given.items()}
            else:
                both = self.sizes(f"workloads.{name}", given)
                sizes[name] = dict.fromkeys(DEVICE_TYPES, both)
        return tuple(entries), sizes

    def config(self, name: str, entry: Any) -> Config:
        key = f"configs.{name}"
        if isinstance(entry, str):  # a lever file saved by tune, relative to this file
            path = entry if os.path.isabs(entry) else os.path.join(self.folder, entry)
            try:
                return Config(name, load_levers(path))
            except FileNotFoundError:
                raise self.fail(key, entry, "no such lever file") from None
        if entry is None:
            entry = {}
        if not isinstance(entry, dict):
            raise self.fail(key, entry, "expected a table of levers, a 'dtype' or a lever file")
        levers: dict[str, Any] = {}
        dtype = None
        for knob, value in entry.items():
            if knob == "dtype":
                if value not in DTYPES:
                    raise self.fail(f"{key}.dtype", value, f"valid: {', '.join(DTYPES)}")
                dtype = DTYPES[value]
            elif knob in OTHER_KNOBS:
                lever, words = OTHER_KNOBS[knob]
                if isinstance(value, str) and value in words:
                    value = words[value]
                levers[lever] = value
            elif knob in registry.lever_names():
                levers[knob] = value
            else:
                valid = ", ".join((*registry.lever_names(), *OTHER_KNOBS, "dtype"))
                raise self.fail(key, knob, f"not a lever; valid: {valid}")
        try:
            check_levers(f"{self.where}: {key}", levers)
        except (InvalidValueError, InvalidTypeError) as exc:
            raise InvalidValueError(str(exc)) from None
        return Config(name, levers, dtype)

    def configs(self, data: Mapping[str, Any]) -> tuple[Config, ...]:
        value = data.get("configs")
        if not isinstance(value, dict) or not value:
            raise self.fail("configs", value, "expected a table of configuration name to levers")
        configs = [self.config(str(name), entry) for name, entry in value.items()]
        baseline = data.get("baseline", configs[0].name)
        names = [c.name for c in configs]
        if baseline not in names:
            raise self.fail("baseline", baseline, f"not a configuration; valid: {', '.join(names)}")
        return tuple(
            Config(c.name, c.levers, c.dtype, baseline=c.name == baseline) for c in configs
        )


def load_bench_file(path: str) -> BenchFile:
    """Read and check a bench file (see the module docstring); a tune lever file works too.

    Raises:
        InvalidValueError: a bad key or value (the message names the file, the key, the
            value and the valid choices), or a file that does not parse.
        InvalidTypeError: a lever value of the wrong type.
        LeverFileNotFoundError: no such file (a ``FileNotFoundError``).
        ImportError: ``.yaml`` without PyYAML.
    """
    reader = _Reader(path)
    data = read_file(path, reader.where)
    if "levers" in data or "tune" in data:  # what `speedflags tune --out` saved
        tuned = Config(os.path.splitext(os.path.basename(path))[0], load_levers(path))
        return BenchFile(path, (Config("fp32", {}, baseline=True), tuned))
    unknown = [k for k in data if k not in TOP_KEYS]
    if unknown:
        valid = ", ".join(TOP_KEYS)
        raise reader.fail(unknown[0], data[unknown[0]], f"unknown key; valid: {valid}")
    workloads, sizes = reader.workloads(data)
    return BenchFile(
        path,
        reader.configs(data),
        workloads,
        sizes,
        device=reader.device(data),
        passes=reader.number(data, "passes", int, 1),
        rounds=reader.number(data, "rounds", int, 1),
        min_time=reader.number(data, "min_time", float, 0),
        threads=reader.number(data, "threads", int, 1),
    )


def overlay(args: argparse.Namespace, parser: argparse.ArgumentParser, bench: BenchFile) -> None:
    """Put the file's settings into ``args`` where the command line left its defaults.

    Options given on the command line (with a value other than their default) win.
    """
    pairs = (("device", bench.device), ("passes", bench.passes), ("rounds", bench.rounds),
             ("min_time", bench.min_time), ("threads", bench.threads))  # fmt: skip
    for name, value in pairs:
        if value is not None and getattr(args, name) == parser.get_default(name):
            setattr(args, name, value)
    if bench.workloads is not None and args.workload == parser.get_default("workload"):
        args.workload = ",".join(bench.workloads)


def settings_with(settings: Any, bench: BenchFile) -> Any:
    """``settings`` (a :class:`~speedflags.bench.runner.Settings`) with the file's
    configurations and, unless ``--sizes`` was given, its sizes for the device type."""
    sizes = {}
    if settings.sizes is None:
        for name in settings.workloads:
            found = bench.sizes_for(name, settings.device.type)
            if found is not None:
                sizes[name] = found
    return dataclasses.replace(settings, configs=bench.configs, workload_sizes=sizes)


def describe(bench: BenchFile) -> str:
    """The configurations in words, one per line (the run's header)."""
    return "\n".join(
        f"  {c.name}: {c.describe()}" + (" (the baseline)" if c.baseline else "")
        for c in bench.configs
    )


def load_for_cli(path: str) -> tuple[BenchFile | None, str]:
    """``(file, "")``, or ``(None, the message)`` for an error the command line reports."""
    try:
        return load_bench_file(path), ""
    except (SpeedflagsError, OSError, ImportError) as exc:
        return None, str(exc)
