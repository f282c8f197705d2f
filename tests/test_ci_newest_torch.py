"""The newest-PyTorch CI leg's decision logic (.ci/newest_torch.py), without the network.

The real-pip test builds two stand-in torch wheels (metadata only) in a local folder and a pip
configuration that caps torch with a constraints file, as some machines' site-wide config does.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / ".ci" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


newest_torch = _load("newest_torch")
torch_source = _load("torch_source")

CAPPED = """\
global.cert='/etc/ssl/certs/ca-certificates.crt'
global.constraint='/etc/pip/torch-cap.txt'
global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple'
:env:.find-links='/opt/wheels'
"""
UNCAPPED = "\n".join(line for line in CAPPED.splitlines() if "constraint" not in line)


def test_capped_config_lifts_the_constraint_and_keeps_everything_else() -> None:
    environ = {
        "PATH": "/bin",
        "PIP_FIND_LINKS": "/opt/wheels",
        "PIP_CONSTRAINT": "/etc/pip/my-cap.txt",
    }
    config = newest_torch.parse_config_list(CAPPED + ":env:.constraint='/etc/pip/my-cap.txt'\n")
    env, lifted = newest_torch.lifted_pip_env(environ, config)
    assert lifted == [
        "global.constraint='/etc/pip/torch-cap.txt'",
        ":env:.constraint='/etc/pip/my-cap.txt'",
    ]
    # one variable, read by pip after every file, replaces every constraint with an empty file
    assert env == {**environ, "PIP_CONSTRAINT": os.devnull}
    assert environ["PIP_CONSTRAINT"] == "/etc/pip/my-cap.txt"  # the caller's mapping is left alone


def test_uncapped_config_lifts_nothing_and_keeps_the_environment() -> None:
    env, lifted = newest_torch.lifted_pip_env(
        {"PIP_CERT": "/mine.pem"}, newest_torch.parse_config_list(UNCAPPED)
    )
    assert lifted == []
    assert env == {"PIP_CERT": "/mine.pem", "PIP_CONSTRAINT": os.devnull}


def test_config_list_lines_of_every_pip_layout_are_read() -> None:
    # pip >= 26 lists each file's values (a key may appear once per file); older pips one
    # merged line per key. Both read the same way, and values keep their quotes' contents.
    listed = "global.constraint='/a.txt'\nglobal.constraint='/b.txt'\n:env:.find-links='/w'\n"
    assert newest_torch.parse_config_list(listed) == [
        ("global", "constraint", "/a.txt"),
        ("global", "constraint", "/b.txt"),
        (":env:", "find-links", "/w"),
    ]


def _report(version: str, url: str) -> dict[str, object]:
    return {
        "install": [
            {"metadata": {"name": "torch", "version": version}, "download_info": {"url": url}}
        ]
    }


def test_registry_resolution_is_accepted() -> None:
    url = "https://files.example.org/torch-2.15.0-cp311-cp311-manylinux_2_28_x86_64.whl"
    assert newest_torch.check_resolution("2.15.0", _report("2.15.0", url)) == url


@pytest.mark.parametrize(
    ("version", "report", "message"),
    [
        ("2.13.0+cpu", _report("2.13.0+cpu", "file:///opt/wheels/t.whl"), "a local build"),
        ("2.14.1", _report("2.14.1", "file:///opt/pypi-more/files/t.whl"), "not from the registry"),
        ("2.15.0", _report("2.14.1", "https://x/t.whl"), "it resolved '2.14.1'"),
        ("2.15.0", {"install": []}, "pip reported 0"),
    ],
)
def test_a_local_build_only_fails_loudly(
    version: str, report: dict[str, object], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        newest_torch.check_resolution(version, report)
    assert exc.value.code == 1
    assert message in capsys.readouterr().err


def test_newest_listed_reads_pip_index_output() -> None:
    assert (
        newest_torch.newest_listed("torch (2.15.0)\nAvailable versions: 2.15.0, 2.14.1\n")
        == "2.15.0"
    )
    with pytest.raises(SystemExit):
        newest_torch.newest_listed("ERROR: No matching distribution found for torch")


def test_torch_source_says_disk_or_registry() -> None:
    assert torch_source.describe(_report("2.13.0+cpu", "file:///opt/wheels/t.whl")) == (
        "torch 2.13.0+cpu installed from disk: file:///opt/wheels/t.whl"
    )
    assert "from registry: https://" in torch_source.describe(_report("2.15.0", "https://x/t.whl"))
    with pytest.raises(LookupError):
        torch_source.describe({"install": []})


def _fake_torch_wheel(folder: Path, version: str) -> None:
    dist = f"torch-{version}.dist-info"
    with zipfile.ZipFile(folder / f"torch-{version}-py3-none-any.whl", "w") as whl:
        whl.writestr(
            f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n"
        )
        whl.writestr(
            f"{dist}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        whl.writestr(f"{dist}/RECORD", "")


def _pip(env: Mapping[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pip", *args],
        env=dict(env),
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )


def _listed(env: Mapping[str, str]) -> list[tuple[str, str, str]]:
    """What pip itself says its configuration is under ``env``."""
    result = _pip(env, "config", "list")
    assert result.returncode == 0, result.stderr
    return newest_torch.parse_config_list(result.stdout)


def _capped_by(listed: list[tuple[str, str, str]]) -> list[str]:
    return [value for _, key, value in listed if key == "constraint"]


def _machine(tmp_path: Path, layout: str, cap: Path) -> dict[str, str]:
    """An environment whose pip configuration has ``layout``.

    "as-is" is this machine's own configuration, untouched (on a fresh machine here its
    site-wide files cap torch). The others replace the site-wide and user folders that pip
    reads on Linux (XDG_CONFIG_DIRS, XDG_CONFIG_HOME and HOME) with folders of the test's
    own, holding a file that caps torch in the site-wide or the user folder, or none; pip's
    /etc/pip.conf is read in every layout and is whatever the machine has.
    """
    env = dict(os.environ)
    if env.get("PIP_CONSTRAINT") == os.devnull:
        del env["PIP_CONSTRAINT"]  # the newest leg's own lift, inherited by this test run
    if layout == "as-is":
        return env
    env = {k: v for k, v in env.items() if not k.startswith("PIP_")}
    site, home = tmp_path / "site", tmp_path / "home"
    folder = {"site-wide": site / "pip", "user": home / ".config" / "pip"}.get(layout)
    for path in (site, home / ".config"):
        path.mkdir(parents=True)
    if folder is not None:
        folder.mkdir(parents=True)
        (folder / "pip.conf").write_text(f"[global]\nconstraint = {cap}\n")
    env.update(XDG_CONFIG_DIRS=str(site), XDG_CONFIG_HOME=str(home / ".config"), HOME=str(home))
    return env


@pytest.mark.skipif(sys.platform != "linux", reason="the layouts are pip's Linux folders")
@pytest.mark.parametrize("layout", ["as-is", "site-wide", "user", "none"])
def test_real_pip_resolves_the_newest_only_with_the_cap_lifted(tmp_path: Path, layout: str) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for version in ("2.14.1", "2.15.0"):
        _fake_torch_wheel(wheels, version)
    cap = tmp_path / "cap.txt"
    cap.write_text("torch<=2.14.1\n")
    machine = _machine(tmp_path, layout, cap)

    def dry_run(env: Mapping[str, str]) -> tuple[int, str, dict[str, Any]]:
        report = tmp_path / "report.json"
        report.unlink(missing_ok=True)
        result = _pip(
            env, "install", "--dry-run", "--no-deps", "--ignore-installed", "--no-index",
            "--find-links", str(wheels), "--report", str(report), "torch==2.15.0",
        )  # fmt: skip
        parsed = json.loads(report.read_text()) if report.exists() else {}
        return result.returncode, result.stderr, parsed

    before = _listed(machine)
    if layout in ("site-wide", "user"):
        assert str(cap) in _capped_by(before), before  # pip reads the test's file...
        code, stderr, _ = dry_run(machine)
        assert code != 0  # ...and the cap holds
        assert "torch<=2.14.1" in stderr or "ResolutionImpossible" in stderr
    if layout == "none":
        assert str(cap) not in _capped_by(before)

    env, lifted = newest_torch.lifted_pip_env(machine, before)
    # what is lifted is what pip says caps it, wherever it was set
    assert [entry.partition("=")[2] for entry in lifted] == [repr(c) for c in _capped_by(before)]
    after = _listed(env)
    # pip's own answer: every setting of every file is still read, and one variable is added
    assert set(after) - set(before) == {(":env:", "constraint", os.devnull)}
    assert set(before) - set(after) <= {
        e for e in before if e[0] == ":env:" and e[1] == "constraint"
    }
    code, stderr, report = dry_run(env)
    assert code == 0, stderr
    assert report["install"][0]["metadata"]["version"] == "2.15.0"
    # The stand-in wheel is on disk, so the leg's own check refuses it: no silent local torch.
    with pytest.raises(SystemExit):
        newest_torch.check_resolution("2.15.0", report)
    assert _listed(machine) == before  # nothing outside the leg's own calls changed


def test_exec_lifts_the_cap_for_the_command_it_runs_only() -> None:
    show = "import os; print(os.environ.get('PIP_CONSTRAINT'))"
    parent = {k: v for k, v in os.environ.items() if k != "PIP_CONSTRAINT"}
    result = subprocess.run(
        [sys.executable, str(ROOT / ".ci" / "newest_torch.py"), "exec", sys.executable, "-c", show],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
        env=parent,
    )
    assert result.stdout.strip() == os.devnull
