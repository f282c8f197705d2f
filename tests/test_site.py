"""The documentation site: its pages and navigation, the API page, the figures of the measured
results, and (where the docs extra is installed) the site itself, built with --strict."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import speedflags

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
# pages the site makes from files outside docs/ (docs/_hooks/site.py)
GENERATED = {"index.md": "README.md", "results.md": "benchmarks/RESULTS.md"}

needs_sources = pytest.mark.skipif(
    not (ROOT / "mkdocs.yml").is_file() or not (ROOT / "benchmarks" / "plot_results.py").is_file(),
    reason="no source checkout next to the tests (installed without sources)",
)


def _nav_pages() -> list[str]:
    text = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    nav = text.split("\nnav:\n", 1)[1].split("\n\n", 1)[0]
    return re.findall(r":\s*([\w./-]+\.md)\s*$", nav, re.MULTILINE)


def _plot_results() -> Any:
    spec = importlib.util.spec_from_file_location(
        "plot_results", ROOT / "benchmarks" / "plot_results.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being made
    spec.loader.exec_module(module)
    return module


@needs_sources
def test_every_page_is_in_the_navigation_once_and_every_entry_exists() -> None:
    pages = _nav_pages()
    assert len(pages) == len(set(pages)), sorted(p for p in pages if pages.count(p) > 1)
    on_disk = {p.name for p in DOCS.glob("*.md")}
    assert on_disk <= set(pages), f"not in mkdocs.yml's nav: {sorted(on_disk - set(pages))}"
    for page in pages:
        source = ROOT / GENERATED[page] if page in GENERATED else DOCS / page
        assert source.is_file(), f"mkdocs.yml's nav names {page}, which is not there"


@needs_sources
def test_the_api_page_documents_every_public_name_once() -> None:
    text = (DOCS / "api.md").read_text(encoding="utf-8")
    listed = re.findall(r"^::: speedflags\.(\w+)$", text, re.MULTILINE)
    public = set(speedflags.__all__)
    assert sorted(public - set(listed)) == [], "add each to docs/api.md"
    assert sorted(n for n in set(listed) - public if n != "training") == []
    assert len(listed) == len(set(listed))


@needs_sources
def test_the_figures_never_credit_a_lever_with_no_effect(tmp_path: Path) -> None:
    plot = _plot_results()
    results = ROOT / "benchmarks" / "results"
    (figure,) = plot.figures([results / "cpu-1-thread-quiet.json"])  # an AMD EPYC, 1 thread
    assert figure.title == "AMD EPYC (family 25 model 17, AVX512-BF16), 1 thread"
    bars = {(p.workload, p.size): [b.label for b in p.bars] for p in figure.panels}
    # TF32 and "high" (TF32 too) do nothing on a CPU: no bar, and said so under the panel
    assert bars["matmul", 2048] == ["precision-medium", "amp-bf16", "pure-bf16"]
    matmul = next(p for p in figure.panels if (p.workload, p.size) == ("matmul", 2048))
    assert "tf32, precision-high: no effect on cpu" in matmul.not_drawn
    # in a set, the speedup is amp's: tf32 is named with its verdict
    assert bars["mlp-train", 2048] == ["amp-bf16 (tf32: no effect here)"]
    assert figure.absent == ["conv: conv runs on cuda only"]


def _bench_file(path: Path, verdicts: dict[str, str], rows: list[dict[str, Any]]) -> Path:
    env = {"device": "cuda:0", "device_name": "NVIDIA Test GPU", "date": "2026-01-01"}
    env["verdicts"] = verdicts
    base = {"workload": "conv", "device": "cuda", "size": 56, "group": "conv cuda 56"}
    run = {
        "format": "speedflags-bench/1",
        "environment": env,
        "settings": {},
        "results": [{**base, **row} for row in rows],
    }
    path.write_text(json.dumps(run), encoding="utf-8")
    return path


@needs_sources
def test_a_lever_verify_found_without_effect_gets_no_credit_in_a_figure(tmp_path: Path) -> None:
    plot = _plot_results()
    passes = (0.010, 0.011, 0.0105)
    rows = [
        {"config": "fp32", "baseline": True, "median_s": 0.0105, "pass_medians_s": passes},
        # verify said cudnn_benchmark had no effect on this device: a faster median alone
        # earns it nothing, alone or in a set
        {"config": "cudnn-benchmark", "median_s": 0.005, "pass_medians_s": (0.005,) * 3},
        {"config": "tf32+cudnn-benchmark", "median_s": 0.002, "pass_medians_s": (0.002,) * 3},
        {"config": "tf32", "median_s": 0.0105, "pass_medians_s": (0.0104, 0.0106, 0.0105)},
    ]
    verdicts = {"cudnn_benchmark=True": "no effect here (cuDNN is disabled)"}
    (figure,) = plot.figures([_bench_file(tmp_path / "run.json", verdicts, rows)])
    (panel,) = figure.panels
    labels = {b.label: b for b in panel.bars}
    assert sorted(labels) == ["tf32", "tf32 (cudnn_benchmark: no effect here)"]
    assert panel.not_drawn == ["cudnn-benchmark: no effect here"]
    assert labels["tf32"].within_noise  # 1.0x: grey, marked ~
    assert labels["tf32 (cudnn_benchmark: no effect here)"].speedup == pytest.approx(5.25)


@needs_sources
def test_the_measured_page_shows_each_device_and_links_every_raw_file() -> None:
    plot = _plot_results()
    page = (DOCS / "measured.md").read_text(encoding="utf-8")
    made = plot.figures(plot.bench_files())
    assert {f.slug for f in made} >= {"nvidia-h200", "nvidia-h100-80gb-hbm3"}
    shown = set(re.findall(r"\]\(measured/([\w.-]+)\.png\)", page))
    assert shown == {f.slug for f in made}, "docs/measured.md: one figure per device"
    for figure in made:
        for source in figure.sources:
            assert f"(../benchmarks/results/{source.name})" in page, source.name
    for raw in (ROOT / "benchmarks" / "results").glob("*.json"):
        assert f"(../benchmarks/results/{raw.name})" in page, f"link {raw.name}"


@needs_sources
def test_the_plot_script_draws_one_png_per_device(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the plot extra: pip install '.[plot]'")
    plot = _plot_results()
    (tmp_path / "gone.png").write_bytes(b"a device no longer measured")
    results = ROOT / "benchmarks" / "results"
    chosen = tmp_path / "results"
    chosen.mkdir()
    for name in ("cpu-1-thread-quiet.json", "xeon-amx-linear-infer.json", "tune-sdpa-512-1t.json"):
        shutil.copy(results / name, chosen / name)
    assert plot.main(["--out", str(tmp_path), "--results", str(chosen)]) == 0
    made = sorted(p.name for p in tmp_path.glob("*.png"))
    assert made == [
        "amd-epyc-family-25-model-17-1-thread.png",
        "intel-xeon-family-6-model-207-16-threads.png",
    ]
    assert all(p.read_bytes().startswith(b"\x89PNG") for p in tmp_path.glob("*.png"))


def _site_tools_missing() -> str | None:
    for module in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python"):
        try:
            found = importlib.util.find_spec(module)
        except ModuleNotFoundError:
            found = None
        if found is None:
            return f"{module} is not installed (the docs extra: pip install '.[docs]')"
    return None


@needs_sources
@pytest.mark.skipif(_site_tools_missing() is not None, reason=str(_site_tools_missing()))
def test_the_site_builds_strict_with_every_public_name_on_the_api_page(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the plot extra: pip install '.[plot]'")
    figures, site = tmp_path / "figures", tmp_path / "site"
    drawn = subprocess.run(
        [sys.executable, "benchmarks/plot_results.py", "--out", str(figures)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert drawn.returncode == 0, drawn.stderr[-3000:]
    env = {"SPEEDFLAGS_DOCS_FIGURES": str(figures), "NO_MKDOCS_2_WARNING": "1"}
    import os

    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, **env},
    )  # fmt: skip
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    api = (site / "api" / "index.html").read_text(encoding="utf-8")
    missing = [n for n in speedflags.__all__ if f'id="speedflags.{n}"' not in api]
    assert not missing, f"not on the built API page: {missing}"
    # the README is the landing page, its links turned into the site's
    index = (site / "index.html").read_text(encoding="utf-8")
    assert 'href="levers/"' in index and "docs/levers.md" in index
    measured = (site / "measured" / "index.html").read_text(encoding="utf-8")
    assert 'src="nvidia-h200.png"' in measured  # the page is measured/index.html
    assert (site / "measured" / "nvidia-h200.png").is_file()
    assert (site / "measured" / "gpu-h200-run2-bench.json").is_file()
    assert (site / "results" / "index.html").is_file()
