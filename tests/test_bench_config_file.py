"""``speedflags bench --config FILE``: the example YAML (examples/configs/speed.yaml), a tune
lever file, bad files."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from speedflags.__main__ import main
from speedflags._tune.result import Row, TuneResult
from speedflags.bench.config_file import load_bench_file, load_for_cli
from speedflags.errors import InvalidValueError

ROOT = Path(__file__).resolve().parent.parent
SEED = ROOT / "examples" / "configs" / "speed.yaml"
TINY = ["--sizes", "16", "--passes", "1", "--rounds", "1", "--min-time", "0", "--device", "cpu"]
needs_yaml = pytest.mark.skipif(
    importlib.util.find_spec("yaml") is None, reason="needs PyYAML: pip install '.[yaml]'"
)


def _write(path: Path, data: dict[str, Any]) -> str:
    path.write_text(json.dumps(data))
    return str(path)


@needs_yaml
def test_the_seed_style_yaml_reads_as_configurations_workloads_and_settings() -> None:
    bench = load_bench_file(str(SEED))
    shown = {c.name: (dict(c.levers), c.dtype, c.baseline) for c in bench.configs}
    assert shown == {
        "fp32": ({"amp": False, "matmul_precision": "highest"}, None, True),
        "bf16-tf32": ({"amp": "bf16", "matmul_precision": "high"}, None, False),
        "medium": ({"matmul_precision": "medium"}, None, False),
        "pure-bf16": ({}, torch.bfloat16, False),
    }
    assert bench.workloads == ("mlp-train", "matmul")
    assert bench.sizes_for("mlp-train", "cuda") == (8192,)
    assert bench.sizes_for("matmul", "cpu") == (1024,)
    assert (bench.passes, bench.rounds, bench.min_time) == (3, 5, 0.25)


@needs_yaml
def test_bench_runs_the_seed_style_yaml(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "seed.json"
    assert main(["bench", "--config", str(SEED), *TINY, "--json", str(out)]) == 0
    err = capsys.readouterr().err
    assert "configurations from" in err and "bf16-tf32: fast_math(" in err
    data = json.loads(out.read_text())
    assert (
        data["settings"]["configs"]["bf16-tf32"] == "fast_math(amp='bf16', matmul_precision='high')"
    )
    assert data["settings"]["passes"] == 1  # the command line wins over the file's 3
    groups = {r["group"] for r in data["results"]}
    # a configuration that runs emulated here (bf16 on a CPU without bf16 instructions) is
    # measured once more, at a small size, in a group of its own
    bench_file, _ = load_for_cli(str(SEED))
    assert bench_file is not None
    emulated = any(c.emulated(torch.device("cpu")) for c in bench_file.configs)
    expected = {"mlp-train cpu 16", "matmul cpu 16"}
    assert groups == expected | ({f"{g} (emulated)" for g in expected} if emulated else set())
    baseline = [r for r in data["results"] if r["baseline"]]
    assert [r["config"] for r in baseline] == ["fp32"] * (4 if emulated else 2)  # one a group
    assert all(r["speedup"] == 1.0 for r in baseline)
    assert "amp='bf16'" in data["environment"]["verdicts"]


def _lever_file(path: Path) -> str:
    result = TuneResult({"sdpa": ["flash"]}, [Row({"sdpa": ["flash"]}, 1.5, 0.0, True)],
                        budget=0.01, device="cpu")  # fmt: skip
    result.save(str(path))
    return str(path)


def test_a_tune_lever_file_is_compared_with_fp32(tmp_path: Path) -> None:
    levers = _lever_file(tmp_path / "levers.toml")
    out = tmp_path / "tuned.json"
    assert main(["bench", "--config", levers, "--workload", "sdpa", *TINY, "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert [(r["config"], r["levers"]) for r in results] == [
        ("fp32", "fp32, TF32 off, matmul precision 'highest'"),
        ("levers", "fast_math(sdpa=['flash'])"),
    ]


def test_a_lever_file_can_be_one_configuration_among_others(tmp_path: Path) -> None:
    _lever_file(tmp_path / "tuned.json")
    configs = {"plain": {}, "tuned": "tuned.json", "flash": {"sdp_backend": "flash"}}
    path = _write(tmp_path / "bench.json", {"configs": configs})
    bench = load_bench_file(path)
    assert [(c.name, dict(c.levers)) for c in bench.configs] == [
        ("plain", {}), ("tuned", {"sdpa": ["flash"]}), ("flash", {"sdpa": "flash"})
    ]  # fmt: skip
    assert [c.baseline for c in bench.configs] == [True, False, False]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"configs": {"a": {}}, "pases": 3}, "pases=3: unknown key; valid: device, passes"),
        ({"configs": {"a": {"amp": "bf17"}}}, "configs.a(amp='bf17'): not an autocast dtype"),
        ({"configs": {"a": {"speed": 1}}}, "configs.a='speed': not a lever; valid: tf32, "),
        ({"configs": {"a": {"dtype": "fp8"}}}, "configs.a.dtype='fp8': valid: bf16, fp16"),
        ({"configs": {"a": "missing.toml"}}, "configs.a='missing.toml': no such lever file"),
        ({"configs": {"a": 3}}, "configs.a=3: expected a table of levers"),
        ({"configs": {}}, "configs={}: expected a table of configuration name to levers"),
        ({"configs": {"a": {}}, "baseline": "b"}, "baseline='b': not a configuration; valid: a"),
        ({"configs": {"a": {}}, "workloads": ["gemm"]}, "workloads='gemm': unknown workload"),
        ({"configs": {"a": {}}, "workloads": {"matmul": [0]}}, "workloads.matmul=[0]: expected"),
        ({"configs": {"a": {}}, "workloads": {"matmul": {"tpu": [8]}}}, "'tpu': unknown device"),
        ({"configs": {"a": {}}, "passes": 0}, "passes=0: expected an integer of at least 1"),
        ({"configs": {"a": {}}, "min_time": float("nan")}, "min_time=nan: expected a number"),
        ({"configs": {"a": {}}, "device": "tpu"}, "device='tpu': expected 'cpu', 'cuda'"),
        ({"configs": {"a": {"tf32": False, "matmul_precision": "high"}}}, "contradictory"),
    ],
)  # fmt: skip
def test_a_bad_file_names_the_file_the_key_the_value_and_the_choices(
    tmp_path: Path, data: dict[str, Any], message: str
) -> None:
    path = _write(tmp_path / "bad.json", data)
    with pytest.raises(InvalidValueError) as caught:
        load_bench_file(path)
    assert f"bench --config {path!r}" in str(caught.value)
    assert message in str(caught.value)


def test_the_command_line_refuses_a_bad_file_before_measuring(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "broken.json").write_text("{not json")
    assert main(["bench", "--config", str(tmp_path / "broken.json")]) == 2
    assert "not valid JSON" in capsys.readouterr().err
    assert main(["bench", "--config", str(tmp_path / "nowhere.yaml")]) == 2
    assert "nowhere.yaml" in capsys.readouterr().err
    assert main(["bench", "--config", str(tmp_path / "levers.ini")]) == 2
    assert "unknown file type '.ini'" in capsys.readouterr().err


@needs_yaml
def test_the_examples_take_their_levers_from_the_same_file(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_toy_transformer.py"), "--smoke",
         "--config", str(SEED)],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "levers from" in done.stdout and "bf16-tf32 = fast_math(amp='bf16'" in done.stdout
    assert "speedflags (amp='bf16', matmul_precision='high')" in done.stdout
