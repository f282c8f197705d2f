"""The levers installed packages declare: the entry-point group ``speedflags.levers``.

A package that ships a lever names it in its metadata, one entry per lever, the entry's name
being the lever's (``pyproject.toml``)::

    [project.entry-points."speedflags.levers"]
    num_threads = "my_library.levers:num_threads"

where ``my_library.levers`` makes it with ``speedflags.lever("num_threads", ...)``. The
registry (:func:`~speedflags.levers.registry.load_installed`) loads such an entry the first
time a lever of its name is asked for, or every lever is (``report``, ``bench``, ``tune``,
``verify``, the pytest plugin's leak check, ``snapshot()``), so that a user never imports the
package for its levers to be known. The entry points are read once per process, as pytest
reads its plugins'.

Example:
    >>> from speedflags.levers.installed import GROUP, entry_points
    >>> GROUP, all(entry.group == GROUP for entry in entry_points())
    ('speedflags.levers', True)
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["GROUP", "entry_points", "importing_speedflags", "source"]

GROUP = "speedflags.levers"
_FOUND: list[tuple[Any, ...]] = []  # the entry points, once read


def entry_points() -> tuple[Any, ...]:
    """The installed entry points of :data:`GROUP` (``importlib.metadata.EntryPoint``),
    read once per process."""
    if not _FOUND:
        from importlib.metadata import entry_points as read  # local: few programs need it

        _FOUND.append(tuple(read(group=GROUP)))
    return _FOUND[0]


def source(entry: Any) -> str:
    """The package an entry point comes from, as its metadata names it (``"my-library
    1.0"``), or ``"a package"`` where the metadata does not say."""
    dist = getattr(entry, "dist", None)
    if dist is None:
        return "a package"
    return f"{dist.metadata['Name']} {dist.version}"


def importing_speedflags() -> bool:
    """Whether ``speedflags`` itself is being imported now: an installed lever's module
    imports it, so nothing is loaded before it is whole."""
    package = sys.modules.get("speedflags")
    spec = getattr(package, "__spec__", None)
    return package is None or bool(getattr(spec, "_initializing", False))
