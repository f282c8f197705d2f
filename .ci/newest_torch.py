"""Print the newest torch release the package registry serves for this Python, or fail.

Used by `make test-newest` and .ci/run. Two steps, neither of which installs anything:

1. `pip index versions torch` names the newest release (pre-releases excluded, wheels for
   this Python and platform only).
2. A pinned `pip install --dry-run --no-deps torch==X` (metadata only) says where that
   release would come from. It must be the registry: a local wheel (a `file:` link, or a
   version with a local label such as `+cpu`, which registries do not serve) means the
   registry was not reached, and the "newest" leg would silently test something else.

Exit status 1, with the reason on stderr, whenever either step fails.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from typing import NoReturn

TIMEOUT_S = 300


def fail(message: str) -> NoReturn:
    print(f"newest_torch: {message}", file=sys.stderr)
    sys.exit(1)


def pip(*args: str) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            [sys.executable, "-m", "pip", *args],
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        fail(f"`pip {' '.join(args)}` did not finish in {TIMEOUT_S} s")


def newest_listed() -> str:
    result = pip("index", "versions", "torch")
    match = re.search(r"^torch \(([^)\s]+)\)", result.stdout, re.MULTILINE)
    if result.returncode != 0 or match is None:
        fail(
            "`pip index versions torch` gave no version "
            f"(exit {result.returncode}): {(result.stderr or result.stdout).strip()[-500:]}"
        )
    return match.group(1)


def check_source(version: str) -> None:
    if "+" in version:
        fail(f"the newest torch found is {version!r}, a local build: the registry was not reached")
    with tempfile.TemporaryDirectory() as tmp:
        report_path = os.path.join(tmp, "report.json")
        result = pip(
            "install",
            "--dry-run",
            "--no-deps",
            "--ignore-installed",
            "--quiet",
            "--report",
            report_path,
            f"torch=={version}",
        )
        if result.returncode != 0 or not os.path.exists(report_path):
            fail(f"torch=={version} cannot be resolved: {result.stderr.strip()[-500:]}")
        with open(report_path, encoding="utf-8") as fh:
            report = json.load(fh)
    installs = report.get("install", [])
    if len(installs) != 1:
        fail(f"expected one torch wheel for torch=={version}, pip reported {len(installs)}")
    url = installs[0].get("download_info", {}).get("url", "")
    resolved = installs[0].get("metadata", {}).get("version", "")
    if resolved != version:
        fail(f"asked pip for torch=={version}, it resolved {resolved!r}")
    if not url.startswith(("https://", "http://")):
        fail(f"torch=={version} would come from {url!r}, not from the registry")


def main() -> None:
    version = newest_listed()
    check_source(version)
    print(version)


if __name__ == "__main__":
    main()
