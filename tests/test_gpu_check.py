"""scripts/gpu_check.sh --smoke: every step of the GPU check runs on a CPU and writes its table,
so that a lent GPU's few minutes are not lost to a step that broke unnoticed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="the GPU check runs the Triton kernel (Linux only)")

ROOT = Path(__file__).resolve().parents[1]
NANOGPT = ROOT.parent / "shared" / "anchors" / "nanoGPT"  # the script's default


def data_rows(file: Path) -> list[list[str]]:
    """The cells of the rows of a markdown file's tables: neither a |---| line nor a header."""
    lines = [line for line in file.read_text().splitlines() if line.startswith("|")]
    rules = {i for i, line in enumerate(lines) if line.startswith("|-")}  # each under a header
    rows = [line for i, line in enumerate(lines) if not {i, i + 1} & rules]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]


def number(cell: str) -> float:
    return float(cell.replace(",", ""))


@pytest.mark.slow
def test_the_smoke_run_writes_every_table_with_measured_rows(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable}
    result = subprocess.run(
        [ROOT / "scripts" / "gpu_check.sh", "--smoke", tmp_path / "out"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    checks = {  # file: a check of every row
        "kernel": lambda row: row[-1] == "ok",  # errors within bounds; one graph, no break
        "attention": lambda row: number(row[3]) > 0,  # fwd ms, not an error
        "nanogpt": lambda row: number(row[2]) > 0,  # tokens/s
        "step": lambda row: number(row[1]) > 0,  # tokens/s, not an error
        "isolation": lambda row: (
            row == ["page views beside batched decoding, float32", "cpu", "passed"]
        ),
    }
    if NANOGPT.is_dir():
        assert result.returncode == 0, result.stdout + result.stderr
    else:  # a checkout without the anchor beside it: that step alone fails, saying so
        assert result.returncode == 1 and "FAILED: nanogpt;" in result.stdout, result.stdout
        del checks["nanogpt"]
    assert result.stdout.splitlines()[-1].endswith(str(tmp_path / "out"))  # where the tables are
    for name, check in checks.items():
        rows = data_rows(tmp_path / "out" / f"{name}.md")
        assert rows and all(check(row) for row in rows), (name, rows)
    assert len(data_rows(tmp_path / "out" / "attention.md")) == 3  # sdpa, triton, its variants
    assert len(data_rows(tmp_path / "out" / "step.md")) == 4  # sdpa, unclipped, triton (+ all)


@pytest.mark.slow
def test_the_staged_directory_installs_what_the_gpu_machine_lacks(tmp_path):
    """scripts/gpu_stage.sh: nanoGPT beside the wheels of Hydra and OmegaConf (the GPU machine's
    image has neither, and cannot download), which install from the directory alone."""
    anchor = tmp_path / "anchor"
    anchor.mkdir()
    (anchor / "bench.py").write_text("# nanoGPT's benchmark\n")
    stage, env = tmp_path / "stage", {**os.environ, "PYTHON": sys.executable}
    missing = subprocess.run(
        [ROOT / "scripts" / "gpu_stage.sh", stage], capture_output=True, text=True,
        env={**env, "NANOGPT": str(tmp_path / "none")},
    )  # fmt: skip
    assert missing.returncode == 2 and "no nanoGPT bench.py in" in missing.stderr
    staged = subprocess.run(
        [ROOT / "scripts" / "gpu_stage.sh", stage], capture_output=True, text=True,
        env={**env, "NANOGPT": str(anchor)}, timeout=300,
    )  # fmt: skip
    assert staged.returncode == 0, staged.stdout + staged.stderr
    assert (stage / "nanoGPT" / "bench.py").read_text() == "# nanoGPT's benchmark\n"
    assert "scripts/gpu_check.sh $OUT/gpu" in staged.stdout  # the device command
    wheels = sorted(str(w) for w in (stage / "whl").glob("*.whl"))
    site = tmp_path / "site"
    install = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps"]
    device = ["--python-version", "3.12", "--platform", "manylinux_2_17_x86_64"]  # the GPU's
    device += ["--implementation", "cp", "--only-binary=:all:"]
    subprocess.run([*install, *device, "--target", site, *wheels], check=True)
    assert {"hydra", "omegaconf", "antlr4"} <= {p.name for p in site.iterdir()}
    assert {"fastapi", "uvicorn", "pydantic_core", "pytest"} <= {p.name for p in site.iterdir()}
    # ignored, so it travels only with carry=[".gpu"] and never lands in a commit
    assert "/.gpu/" in (ROOT / ".gitignore").read_text().split()


def test_the_ablation_has_every_variant_of_the_kernel(monkeypatch):
    """bench_attention.py names the variants for its command line without importing Triton: a
    variant added to the kernel and not there would have no ablation row on the next GPU."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_attention

    from model.triton_attention import VARIANTS

    assert tuple(VARIANTS) == bench_attention.VARIANTS
    assert f"triton+{'+'.join(VARIANTS)}" in bench_attention.TRITON  # and all of them together
