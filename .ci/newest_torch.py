"""Resolve the newest torch release the package registry serves, and run the newest leg's pip.

Used by `make test-newest` and .ci/run:

    python3 .ci/newest_torch.py               print the newest release, or fail (exit 1)
    python3 .ci/newest_torch.py exec CMD...   run CMD with the newest leg's pip settings

Why the newest leg needs its own pip settings: a machine's pip configuration may carry a
constraints file (`pip config list` shows `global.constraint`, from a site-wide file such as
/etc/xdg/pip/pip.conf, a user file or a virtualenv's) that caps torch at the newest release on
its local disk. Under that cap `torch==<newest>` cannot resolve. For this leg's pip calls only,
the cap is lifted by one environment variable, `PIP_CONSTRAINT=/dev/null` (an empty
constraints file): pip reads environment variables after every configuration file, so it
replaces whatever constraint the files set and changes nothing else. Every file is still read,
so the indexes, certificates and find-links stay and the registry is reached exactly as before.
The other legs never see the variable; the machine's configuration is never edited.

Resolution, neither step installing anything:

1. `pip index versions torch` names the newest release (pre-releases excluded, wheels for
   this Python and platform only).
2. A pinned `pip install --dry-run --no-deps torch==X` (metadata only) says where that release
   would come from. It must be the registry: a local wheel (a `file:` link, or a version with a
   local label such as `+cpu`, which registries do not serve) means the registry was not
   reached, and the "newest" leg would silently test something else.

Exit status 1, with the reason on stderr, whenever either step fails. There is no fallback to
an older release.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping
from typing import NoReturn

TIMEOUT_S = 300

# Settings that cap what may be installed; the newest leg overrides them, and nothing else.
LIFTED_KEYS = frozenset({"constraint"})
CONSTRAINT_VAR = "PIP_CONSTRAINT"


def fail(message: str) -> NoReturn:
    print(f"newest_torch: {message}", file=sys.stderr)
    sys.exit(1)


def parse_config_list(text: str) -> list[tuple[str, str, str]]:
    """`pip config list` lines (`section.key='value'`) as (section, key, value) triples.

    Environment variables appear under the section ":env:".
    """
    items = []
    for line in text.splitlines():
        name, sep, raw = line.partition("=")
        section, dot, key = name.rpartition(".")
        if not sep or not dot:
            continue
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = raw
        items.append((section, key, str(value)))
    return items


def lifted_pip_env(
    environ: Mapping[str, str], config: Iterable[tuple[str, str, str]]
) -> tuple[dict[str, str], list[str]]:
    """The environment for the newest leg's pip calls, and the settings it lifts.

    `config` is what `pip config list` reports under `environ`, files and environment
    variables alike (variables appear under the section ":env:"). The returned environment is
    `environ` plus `PIP_CONSTRAINT` pointing at an empty file: it overrides every constraint
    the configuration sets (a caller's own `PIP_CONSTRAINT` too) and nothing else.
    """
    env = dict(environ)
    env[CONSTRAINT_VAR] = os.devnull
    lifted = [f"{section}.{key}={value!r}" for section, key, value in config if key in LIFTED_KEYS]
    return env, lifted


def newest_leg_env() -> tuple[dict[str, str], list[str]]:
    listed = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    if listed.returncode != 0:
        fail(f"`pip config list` failed: {listed.stderr.strip()[-500:]}")
    return lifted_pip_env(os.environ, parse_config_list(listed.stdout))


def pip(env: Mapping[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            [sys.executable, "-m", "pip", *args],
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            env=dict(env),
            check=False,
        )
    except subprocess.TimeoutExpired:
        fail(f"`pip {' '.join(args)}` did not finish in {TIMEOUT_S} s")


def newest_listed(index_output: str) -> str:
    """The version `pip index versions torch` names first, or fail."""
    match = re.search(r"^torch \(([^)\s]+)\)", index_output, re.MULTILINE)
    if match is None:
        fail(f"`pip index versions torch` gave no version: {index_output.strip()[-500:]}")
    return match.group(1)


def check_resolution(version: str, report: Mapping[str, object]) -> str:
    """Where `torch==version` would come from, per pip's install report; fail unless the
    registry serves exactly that version."""
    if "+" in version:
        fail(f"the newest torch found is {version!r}, a local build: the registry was not reached")
    installs = report.get("install", [])
    if not isinstance(installs, list) or len(installs) != 1:
        count = len(installs) if isinstance(installs, list) else 0
        fail(f"expected one torch wheel for torch=={version}, pip reported {count}")
    url = installs[0].get("download_info", {}).get("url", "")
    resolved = installs[0].get("metadata", {}).get("version", "")
    if resolved != version:
        fail(f"asked pip for torch=={version}, it resolved {resolved!r}")
    if not url.startswith(("https://", "http://")):
        fail(f"torch=={version} would come from {url!r}, not from the registry")
    return str(url)


def resolve(env: Mapping[str, str], version: str) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        report_path = os.path.join(tmp, "report.json")
        result = pip(
            env,
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
    return check_resolution(version, report)


def main(argv: list[str]) -> None:
    env, lifted = newest_leg_env()
    if lifted:
        print(f"newest_torch: lifted for this leg: {', '.join(lifted)}", file=sys.stderr)
    if argv[:1] == ["exec"] and len(argv) > 1:
        os.execvpe(argv[1], argv[1:], env)  # noqa: S606 - runs the caller's own command
    if argv:
        fail(f"unknown arguments {argv!r}; usage: newest_torch.py [exec CMD...]")
    listed = pip(env, "index", "versions", "torch")
    if listed.returncode != 0:
        fail(
            f"`pip index versions torch` failed (exit {listed.returncode}): "
            f"{(listed.stderr or listed.stdout).strip()[-500:]}"
        )
    version = newest_listed(listed.stdout)
    url = resolve(env, version)
    print(f"newest_torch: torch=={version} resolves from the registry: {url}", file=sys.stderr)
    print(version)


if __name__ == "__main__":
    main(sys.argv[1:])
