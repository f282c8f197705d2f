"""Lever files: ``TuneResult.save`` writes them, :func:`load_levers` reads them back.

One layout in three formats, chosen by the suffix: ``.json``, ``.toml`` or ``.yaml``
(``.yml``). The ``levers`` table holds ``fast_math`` keyword arguments in the words a user
writes (``amp = "bf16"``, ``sdpa = ["flash"]``), so they survive every format and read back
to the same values; the other tables describe the run. A hand-written file may also hold
the levers alone, at its top level.

TOML is written here (the standard library reads TOML from Python 3.11 on, through
``tomllib``, and writes none; the layout is simple enough not to need a dependency). YAML
needs PyYAML, an optional extra: ``pip install '.[yaml]'`` in a checkout of speedflags.
"""

from __future__ import annotations

import errno
import importlib
import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Union

import torch

from .._short_repr import SHOWN_CHARS, short_repr
from .._version import install_hint
from ..errors import InvalidTypeError, InvalidValueError, LeverFileNotFoundError
from ..levers import registry
from ..levers.autocast import _BY_NAME as _AMP_NAMES
from ..levers.registry import check_levers, lever_spec
from .output_paths import make_parent_folder

__all__ = [
    "FORMATS",
    "YAML_MISSING",
    "LeversArg",
    "load_levers",
    "named_levers",
    "plain_levers",
    "read_file",
    "write_file",
]

# What tune() and verify() take as levers=: a name, names, or names with the values to try.
LeversArg = str | Iterable[str] | Mapping[str, Any] | None


def named_levers(call: str, levers: LeversArg, choices: str) -> list[tuple[Any, Any]]:
    """``levers=`` (not None) as ``(name, values or None)`` pairs, names not yet checked.

    Example:
        >>> from speedflags._measure.lever_files import named_levers
        >>> named_levers("tune", ["tf32", "amp"], "tf32, amp")
        [('tf32', None), ('amp', None)]
    """
    if isinstance(levers, str):
        return [(levers, None)]
    if isinstance(levers, Mapping):
        return list(levers.items())
    if isinstance(levers, Iterable):
        return [(name, None) for name in levers]
    raise InvalidTypeError(
        f"{call}(levers={short_repr(levers)}): expected None, a lever name, a list of them or a "
        f"dict of name to values; names: {choices}"
    )


FORMATS = (".json", ".toml", ".yaml", ".yml")
YAML_MISSING = (
    "reading or writing .yaml lever files needs PyYAML, an optional extra of speedflags: "
    + install_hint("yaml")
)
_DTYPE_WORDS = {dtype: word for word, dtype in _AMP_NAMES.items()}

PathLike = Union[str, "os.PathLike[str]"]


def plain_value(name: str, value: Any) -> Any:
    """A validated lever value in the words a user writes (and every file format keeps).

    Example:
        >>> import torch
        >>> from speedflags._measure.lever_files import plain_value
        >>> plain_value("amp", torch.bfloat16), plain_value("sdpa", ("flash",))
        ('bf16', ['flash'])
    """
    if isinstance(value, torch.dtype):
        return _DTYPE_WORDS[value]
    if name == "amp" and value is None:
        return False
    if isinstance(value, (tuple, list)):
        return list(lever_spec(name).describe_value(tuple(value)))
    return value


def plain_levers(checked: Sequence[tuple[str, Any]]) -> dict[str, Any]:
    """``check_levers`` output back in users' words, in the registry's order.

    Example:
        >>> from speedflags.levers.registry import check_levers
        >>> from speedflags._measure.lever_files import plain_levers
        >>> plain_levers(check_levers("fast_math", {"amp": "bf16", "sdpa": "flash"}))
        {'sdpa': ['flash'], 'amp': 'bf16'}
    """
    return {name: plain_value(name, value) for name, value in checked}


def _text_path(path: object, call: str) -> str:
    """``path`` as a str, or ``InvalidTypeError`` naming ``call`` and its ``path`` argument."""
    given = os.fspath(path) if isinstance(path, os.PathLike) else path
    if not isinstance(given, str):
        raise InvalidTypeError(
            f"{call}(path={short_repr(path)}): expected a str or os.PathLike path to a "
            f".json, .toml or .yaml file, got {type(path).__name__}"
        )
    return given


def _suffix(path: str, call: str) -> str:
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in FORMATS:
        raise InvalidValueError(
            f"{call}({short_repr(path)}): unknown file type {short_repr(suffix or '(none)')}; "
            f"valid: {', '.join(FORMATS)}"
        )
    return suffix


def _yaml() -> Any:
    try:
        return importlib.import_module("yaml")
    except ImportError:
        raise ImportError(YAML_MISSING) from None


def write_file(path: PathLike, data: Mapping[str, Any]) -> None:
    """Write ``data`` (tables of scalars, lists and flat tables) as JSON, TOML or YAML.

    A missing folder is created, with its parents, as ``bench --json`` does.
    """
    suffix = _suffix(_text_path(path, "TuneResult.save"), "TuneResult.save")
    if suffix == ".json":
        text = json.dumps(data, indent=2) + "\n"
    elif suffix == ".toml":
        text = to_toml(data)
    else:
        text = _yaml().safe_dump(dict(data), sort_keys=False)
    make_parent_folder(path)
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)


def read_file(path: PathLike, call: str = "load_levers") -> dict[str, Any]:
    """The mapping a JSON, TOML or YAML file holds.

    Every parse failure is an ``InvalidValueError`` naming the file: a syntax error, text
    that is not UTF-8, a number too long to convert, nesting too deep for the parser.
    """
    text_path = _text_path(path, call)
    suffix = _suffix(text_path, call)
    shown = f"{call}({short_repr(text_path)})"
    kind = "YAML" if suffix in (".yaml", ".yml") else suffix[1:].upper()
    try:
        if suffix == ".toml":
            with open(text_path, "rb") as fb:
                data = _tomllib().load(fb)
        else:
            loader = json.load if suffix == ".json" else _yaml().safe_load
            with open(text_path, encoding="utf-8") as fh:
                data = loader(fh)
    except ValueError as exc:  # JSON and TOML decode errors, bad UTF-8, too long an int
        raise InvalidValueError(f"{shown}: not valid {kind}: {exc}") from None
    except RecursionError:  # each parser recurses once per nesting level
        raise InvalidValueError(
            f"{shown}: not valid {kind}: nested too deeply to read (a lever file is two "
            "tables deep)"
        ) from None
    except FileNotFoundError:
        raise _missing(text_path, shown) from None
    except OSError as exc:  # the file as the user named it, shortened
        if len(text_path) <= SHOWN_CHARS:
            raise
        raise type(exc)(exc.errno, f"{exc.strerror}: {short_repr(text_path)}") from None
    except Exception as exc:
        if type(exc).__module__.startswith("yaml"):
            raise InvalidValueError(f"{shown}: not valid YAML: {exc}") from None
        raise
    if not isinstance(data, dict):
        raise InvalidValueError(f"{shown}: expected a table of levers, got {type(data).__name__}")
    return data


def _missing(path: str, shown: str) -> LeverFileNotFoundError:
    where = os.path.abspath(path)
    looked = "" if where == path else f" (looked for {short_repr(where)})"
    return LeverFileNotFoundError(
        errno.ENOENT,
        f"{shown}: no such file{looked}; `speedflags tune --out FILE` and TuneResult.save(FILE) "
        "write one",
        path,
    )


def _tomllib() -> Any:
    for name in ("tomllib", "tomli"):  # the standard library's from 3.11; tomli before
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ImportError("reading .toml lever files needs Python 3.11 or newer, or tomli")


def load_levers(path: PathLike) -> dict[str, Any]:
    """The ``fast_math`` keyword arguments a lever file holds, validated.

    Reads what :meth:`speedflags.TuneResult.save` wrote (its ``levers`` table), or a file
    holding the levers alone, in JSON, TOML or YAML (by suffix; YAML needs
    ``pip install '.[yaml]'``). The values are checked as ``fast_math`` checks
    them, and returned in the words a user writes (``{"amp": "bf16"}``): pass them to
    ``fast_math(**levers)`` or ``@speedup(**levers)``. An empty result means "plain fp32";
    note that a bare ``fast_math()`` applies the recommended levers instead, so give
    ``fast_math`` a non-empty choice only.

    Scope: reads a file; changes and restores no flag.

    Raises:
        InvalidValueError: an unknown suffix, a file that does not parse (any parse
            failure, nesting too deep for the parser included), or a bad value (the
            message names the file, the lever and the valid values).
        InvalidTypeError: a name that is not a lever, or a ``path`` that is not a str or
            ``os.PathLike`` (``load_levers(path=None): expected a str or os.PathLike path
            to a .json, .toml or .yaml file, got NoneType``).
        LeverFileNotFoundError: no such file (the message names the call and the file;
            also a ``FileNotFoundError``).
        ImportError: a ``.yaml`` file without PyYAML.

    Example:
        >>> import os, tempfile, torch, speedflags
        >>> path = os.path.join(tempfile.mkdtemp(), "levers.toml")
        >>> with open(path, "w") as fh:
        ...     _ = fh.write('[levers]\\namp = "bf16"\\n')
        >>> levers = speedflags.load_levers(path)
        >>> levers
        {'amp': 'bf16'}
        >>> with speedflags.fast_math(**levers, device="cpu"):
        ...     (torch.ones(2, 2) @ torch.ones(2, 2)).dtype  # autocast on
        torch.bfloat16
    """
    text_path = _text_path(path, "load_levers")
    call = f"load_levers({short_repr(text_path)})"
    data = read_file(text_path)
    levers = data.get("levers", data if "tune" not in data else {})
    if not isinstance(levers, dict):
        raise InvalidValueError(f"{call}: 'levers' must be a table, got {type(levers).__name__}")
    unknown = [name for name in levers if name not in registry.lever_names()]
    if unknown:
        raise InvalidTypeError(
            f"{call}: {short_repr(unknown[0])} is not a lever; "
            f"valid: {', '.join(sorted(registry.lever_names()))}"
        )
    return plain_levers(check_levers(call, levers))


# --- TOML ------------------------------------------------------------------------------


def _toml_key(key: str) -> str:
    if key and all(c.isalnum() or c in "_-" for c in key):
        return key
    return json.dumps(key)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        items = (f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items() if v is not None)
        return "{" + ", ".join(items) + "}"
    raise InvalidTypeError(f"TOML cannot hold {type(value).__name__} ({short_repr(value)})")


def to_toml(data: Mapping[str, Any]) -> str:
    """``data`` as TOML: scalars first, then tables, then arrays of tables; ``None`` left out.

    Example:
        >>> from speedflags._measure.lever_files import to_toml
        >>> print(to_toml({"levers": {"amp": "bf16", "sdpa": ["flash"]},
        ...                "rows": [{"speedup": 1.5, "levers": {"amp": "bf16"}}]}), end="")
        [levers]
        amp = "bf16"
        sdpa = ["flash"]
        <BLANKLINE>
        [[rows]]
        speedup = 1.5
        levers = {amp = "bf16"}
    """
    lines: list[str] = []
    tables = {k: v for k, v in data.items() if isinstance(v, Mapping)}
    arrays = {
        k: v
        for k, v in data.items()
        if isinstance(v, list) and v and all(isinstance(i, Mapping) for i in v)
    }
    for key, value in data.items():
        if key not in tables and key not in arrays and value is not None:
            lines.append(f"{_toml_key(key)} = {_toml_value(value)}")
    for key, table in tables.items():
        lines.extend(["", f"[{_toml_key(key)}]"] if lines else [f"[{_toml_key(key)}]"])
        lines.extend(
            f"{_toml_key(k)} = {_toml_value(v)}" for k, v in table.items() if v is not None
        )
    for key, items in arrays.items():
        for item in items:
            lines.extend(["", f"[[{_toml_key(key)}]]"] if lines else [f"[[{_toml_key(key)}]]"])
            lines.extend(
                f"{_toml_key(k)} = {_toml_value(v)}" for k, v in item.items() if v is not None
            )
    return "\n".join(lines) + "\n"
