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
from pathlib import Path
from types import ModuleType

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
    assert env["PIP_CONFIG_FILE"] == os.devnull  # pip then loads no configuration file
    assert "PIP_CONSTRAINT" not in env
    assert env["PIP_CERT"] == "/etc/ssl/certs/ca-certificates.crt"
    assert env["PIP_EXTRA_INDEX_URL"] == "file:///opt/pypi/simple file:///opt/pypi-more/simple"
    assert env["PIP_FIND_LINKS"] == "/opt/wheels"
    assert environ["PIP_CONSTRAINT"] == "/etc/pip/my-cap.txt"  # the caller's mapping is left alone


def test_uncapped_config_lifts_nothing() -> None:
    env, lifted = newest_torch.lifted_pip_env(
        {"PIP_CERT": "/mine.pem"}, newest_torch.parse_config_list(UNCAPPED)
    )
    assert lifted == []
    assert env["PIP_CERT"] == "/mine.pem"  # an environment variable wins, as in pip
    assert env["PIP_EXTRA_INDEX_URL"].startswith("file:///opt/pypi/simple")


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


def test_real_pip_resolves_the_newest_only_with_the_cap_lifted(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for version in ("2.14.1", "2.15.0"):
        _fake_torch_wheel(wheels, version)
    cap = tmp_path / "cap.txt"
    cap.write_text("torch<=2.14.1\n")
    config = tmp_path / "pip.conf"
    config.write_text(f"[global]\nno-index = true\nfind-links = {wheels}\nconstraint = {cap}\n")
    machine = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    machine["PIP_CONFIG_FILE"] = str(config)

    def pip(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "pip", *args],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )

    def dry_run(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        report = tmp_path / "report.json"
        report.unlink(missing_ok=True)
        args = ("install", "--dry-run", "--no-deps", "--ignore-installed", "--report", str(report))
        result = pip(env, *args, "torch==2.15.0")
        result.stdout = report.read_text() if report.exists() else ""
        return result

    capped = dry_run(machine)
    assert capped.returncode != 0
    assert "torch<=2.14.1" in capped.stderr or "ResolutionImpossible" in capped.stderr

    listed = pip(machine, "config", "list")
    env, lifted = newest_torch.lifted_pip_env(
        machine, newest_torch.parse_config_list(listed.stdout)
    )
    # the test's cap is lifted (and a cap the machine's own pip configuration sets, if any)
    assert f"global.constraint={str(cap)!r}" in lifted
    lifted_run = dry_run(env)
    assert lifted_run.returncode == 0, lifted_run.stderr
    report = json.loads(lifted_run.stdout)
    assert report["install"][0]["metadata"]["version"] == "2.15.0"
    # The stand-in wheel is on disk, so the leg's own check refuses it: no silent local torch.
    with pytest.raises(SystemExit):
        newest_torch.check_resolution("2.15.0", report)


def test_torch_source_keeps_the_report_of_the_install_that_happened(tmp_path: Path) -> None:
    import json

    kept = tmp_path / "report.json"
    kept.write_text(json.dumps(_report("2.13.0+cpu", "file:///opt/wheels/t.whl")))
    new = tmp_path / "report.json.new"
    new.write_text(json.dumps({"install": []}))  # torch was already there: pip installs nothing
    torch_source.keep(str(new), str(kept))
    assert not new.exists()
    assert "from disk" in torch_source.describe(json.loads(kept.read_text()))
    new.write_text(json.dumps(_report("2.15.0", "https://x/t.whl")))
    torch_source.keep(str(new), str(kept))
    assert "2.15.0" in torch_source.describe(json.loads(kept.read_text()))
