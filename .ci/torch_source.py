"""Say which torch a leg installed and from where: `torch_source.py REPORT.json`.

REPORT.json is the `pip install --report` that `make setup` writes when it installs the pinned
torch. "disk" means a wheel on this machine (a `file:` link or a local index); "registry"
means it was downloaded. Prints one line; exit 1 if the report names no torch.

`torch_source.py --keep NEW.json REPORT.json` is what `make setup` runs: when NEW.json
installs torch it replaces REPORT.json; when it installs nothing (the environment already had
the pinned torch, e.g. set up again after setup.cfg changed) REPORT.json, from the install
that did, is kept and described.

`torch_source.py --show REPORT.json` is what `make torch-source` (and so `make test`) runs:
the leg's line for the CI log, `=== leg: Python 3.10.13, torch 2.1.2 (registry) ===`, then
where torch came from.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from collections.abc import Mapping


def torch_install(report: Mapping[str, object]) -> tuple[str, str, str]:
    """(version, "disk" | "registry" | "unknown", url) of the torch a pip report installs."""
    installs = report.get("install", [])
    for item in installs if isinstance(installs, list) else []:
        metadata = item.get("metadata", {})
        if metadata.get("name", "").lower() != "torch":
            continue
        url = item.get("download_info", {}).get("url", "")
        source = "disk" if url.startswith("file:") else "registry" if url else "unknown"
        return metadata.get("version", "?"), source, url
    raise LookupError("the pip report installs no torch")


def describe(report: Mapping[str, object]) -> str:
    version, source, url = torch_install(report)
    return f"torch {version} installed from {source}: {url or '?'}"


def main(path: str) -> None:
    """Print where the torch of ``path``'s install came from (exit 1 if it names none)."""
    with open(path, encoding="utf-8") as fh:
        report = json.load(fh)
    try:
        print(describe(report))
    except LookupError as exc:
        print(f"torch_source: {path}: {exc}", file=sys.stderr)
        sys.exit(1)


def leg_line(report: Mapping[str, object]) -> str:
    """``=== leg: Python 3.10.13, torch 2.1.2 (registry) ===``: this Python, the report's torch."""
    version, source, _ = torch_install(report)
    return f"=== leg: Python {platform.python_version()}, torch {version} ({source}) ==="


def show(path: str) -> None:
    """Print this environment's leg line and where its torch came from; never fails (it is only
    a log line)."""
    try:
        with open(path, encoding="utf-8") as fh:
            report = json.load(fh)
        print(leg_line(report))
        print(describe(report))
    except (OSError, ValueError, LookupError):
        print(f"=== leg: Python {platform.python_version()}, torch ? (not recorded) ===")
        print(f"torch_source: where this environment's torch came from is not recorded "
              f"({path}: none; `make clean` and set up again to record it)")  # fmt: skip


def keep(new: str, path: str) -> None:
    """Describe ``new`` and move it to ``path``; if it installs no torch, describe ``path``."""
    with open(new, encoding="utf-8") as fh:
        report = json.load(fh)
    try:
        line = describe(report)
    except LookupError:
        os.remove(new)
        show(path)
        return
    os.replace(new, path)
    print(line)


if __name__ == "__main__":
    if sys.argv[1] == "--keep":
        keep(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "--show":
        show(sys.argv[2])
    else:
        main(sys.argv[1])
