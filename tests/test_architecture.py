"""Imports run one way, down the floors of docs/architecture.md, and no loop joins packages.

A module may import its own package and the packages on lower floors, never one on its own
floor or above: model/ and data/ stand side by side and do not import each other. The entry
points (train.py, sample.py, evaluate.py) and benchmarks/ stand on top.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FLOORS = {
    "base": 0,  # errors, config checks, the Hydra entry: imports nothing of ours
    "model": 1,
    "data": 1,
    "hardware": 2,  # devices, precision, probes, memory; processes under torchrun (DDP, FSDP)
    "checkpoints": 2,  # our checkpoints, sources, Hugging Face interchange
    "inference": 3,
    "evals": 3,  # loss and bits per byte, downstream tasks: evaluate.py's and training's
    "trainer": 4,
    "entry": 5,  # train.py, sample.py, evaluate.py, benchmarks/
}
TOP = "entry"


def package_of(path: Path) -> str:
    """The package a source file belongs to (path relative to ROOT)."""
    return path.parts[0] if len(path.parts) > 1 and path.parts[0] != "benchmarks" else TOP


def imported_packages(source: str) -> set[str]:
    """The top-level names of every absolute import in `source`, wherever it stands (lazy
    imports inside functions included)."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def upward_imports(modules: dict[str, str]) -> list[str]:
    """One line per import of a package on the importer's floor or above, for `modules`
    {path relative to ROOT: source}. Our packages are FLOORS' keys; other names are libraries."""
    problems = []
    for path, source in sorted(modules.items()):
        package = package_of(Path(path))
        if package not in FLOORS:
            problems.append(f"{path}: package {package}/ has no floor; add it to FLOORS")
            continue
        for imported in sorted(imported_packages(source) & FLOORS.keys() - {package}):
            if FLOORS[imported] >= FLOORS[package]:
                problems.append(f"{path} ({package}) imports {imported}, a floor not below it")
    return problems


def first_cycle(edges: dict[str, set[str]]) -> list[str]:
    """A loop in the graph `edges` (node: the nodes it imports), as [a, b, ..., a], or []."""

    def visit(node: str, trail: list[str]) -> list[str]:
        if node in trail:
            return [*trail[trail.index(node) :], node]
        for nxt in sorted(edges.get(node, ())):
            if cycle := visit(nxt, [*trail, node]):
                return cycle
        return []

    for start in sorted(edges):
        if cycle := visit(start, []):
            return cycle
    return []


def package_cycle(modules: dict[str, str]) -> list[str]:
    """A loop of packages importing each other (as [a, b, ..., a]), or [] if there is none."""
    edges: dict[str, set[str]] = {}
    for path, source in modules.items():
        package = package_of(Path(path))
        ours = {name for name in imported_packages(source) if name in FLOORS or name == package}
        edges.setdefault(package, set()).update(ours - {package})
    return first_cycle(edges)


def module_cycle(modules: dict[str, str]) -> list[str]:
    """A loop of modules importing each other, within a package too (lazy imports count: a
    module that imports another inside a function still needs it), or []."""
    names = {path: path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
             for path in modules}  # fmt: skip
    ours = set(names.values())
    edges = {}
    for path, source in modules.items():
        imported = set()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
        edges[names[path]] = (imported & ours) - {names[path]}
    return first_cycle(edges)


def project_modules() -> dict[str, str]:
    files = list(ROOT.glob("*.py"))
    for package in [*FLOORS, "benchmarks"]:
        files += (ROOT / package).rglob("*.py") if (ROOT / package).is_dir() else []
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests"}
    assert packages <= FLOORS.keys(), f"packages without a floor: {packages - FLOORS.keys()}"
    return {str(p.relative_to(ROOT)): p.read_text() for p in files}


def test_no_module_imports_from_its_floor_or_above():
    modules = project_modules()
    assert len(modules) > 40  # the walk found the project, not an empty directory
    assert upward_imports(modules) == []


def test_no_loop_between_packages():
    assert package_cycle(project_modules()) == []


def test_no_loop_between_modules():
    assert module_cycle(project_modules()) == []


@pytest.mark.parametrize(
    "path, source",
    [
        ("model/gpt.py", "from trainer.loop import Trainer"),  # far up
        ("inference/generate.py", "import trainer.optim"),  # one floor up
        ("data/pipeline.py", "def f():\n    from model import GPT\n"),  # same floor, lazily
        ("checkpoints/store.py", "from inference import generate"),
        ("base/errors.py", "from hardware.device import resolve_device"),
    ],
)
def test_an_upward_import_is_reported(path, source):
    """Negative control: the checker sees each kind of violation."""
    assert len(upward_imports({path: source})) == 1


def test_downward_and_own_package_imports_are_allowed():
    """Positive control: the checker does not flag what the floors allow."""
    modules = {
        "train.py": "from trainer.loop import Trainer\nfrom base.errors import user_errors",
        "trainer/loop.py": "from inference.generate import generate\nfrom trainer import optim",
        "checkpoints/store.py": "from model import GPT\nfrom data.tokenizer import TOKENIZER_FILE",
        "model/gpt.py": "import torch\nfrom base.errors import check\nfrom model.gpt import x",
    }
    assert upward_imports(modules) == []


def test_a_loop_between_packages_is_reported():
    """Negative control: inference -> trainer -> inference, as before checkpoints/ existed."""
    modules = {
        "inference/cli.py": "from trainer.checkpoint import load_checkpoint",
        "trainer/loop.py": "from inference.generate import generate",
        "hardware/device.py": "from model import GPT",
    }
    assert package_cycle(modules) == ["inference", "trainer", "inference"]
    assert package_cycle({k: v for k, v in modules.items() if k != "inference/cli.py"}) == []


def test_a_loop_between_modules_is_reported_lazy_imports_too():
    """Negative control: the loop checkpoints/store.py and hf.py made until 2026-11-29, store's
    side inside a function."""
    modules = {
        "checkpoints/store.py": "def load_source():\n    from checkpoints.hf import load_hf_dir\n",
        "checkpoints/hf.py": "from checkpoints.store import Checkpoint\nfrom model import GPT",
        "model/__init__.py": "from model.gpt import GPT",
        "model/gpt.py": "import torch",
    }
    assert module_cycle(modules) == ["checkpoints.hf", "checkpoints.store", "checkpoints.hf"]
    del modules["checkpoints/hf.py"]
    assert module_cycle(modules) == []


def test_a_package_without_a_floor_is_reported():
    assert upward_imports({"plugins/x.py": "import torch"}) == [
        "plugins/x.py: package plugins/ has no floor; add it to FLOORS"
    ]


def test_the_line_accounting_names_only_code_that_exists():
    """benchmarks/bench_lines.py (docs/architecture.md's table) runs, every feature it names
    holds code, and its rows add up to its total: a renamed or deleted function fails here
    rather than leaving a stale row."""
    done = subprocess.run(
        [sys.executable, "benchmarks/bench_lines.py"], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    counts = [
        int(n.replace(",", "")) for n in re.findall(r"\| \**([\d,]+)\** \|$", done.stdout, re.M)
    ]
    *rows, total = counts
    assert len(rows) > 10 and all(n > 0 for n in rows)
    assert sum(rows) == total


def drawn_floors(text: str) -> dict[str, int]:
    """The floors docs/architecture.md draws: `<n>  pkg/  pkg/  ...` lines, package -> n."""
    return {
        name: int(floor)
        for floor, rest in re.findall(r"^(\d)  (.*)$", text, re.M)
        for name in re.findall(r"\b(\w+)/(?=\s|$)", rest)
    }


def test_the_drawn_floors_are_the_enforced_ones():
    drawn = drawn_floors((ROOT / "docs" / "architecture.md").read_text(encoding="utf-8"))
    assert drawn == {k: v for k, v in FLOORS.items() if k != TOP} | {"benchmarks": FLOORS[TOP]}
    assert drawn_floors("2  checkpoints/  hardware/   text\n") == {"checkpoints": 2, "hardware": 2}
