"""Every third-party module the code imports is declared in pyproject.toml, so that
`pip install .` (or `pip install -e .[dev]` for the tests) is enough to run it."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
OURS = {p.stem for p in ROOT.iterdir() if p.suffix == ".py"} | {
    p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file() or p.name == "scripts"
}
OURS |= {p.stem for p in (ROOT / "benchmarks").glob("*.py")}  # benchmarks import each other


def _imports(paths: list[Path]) -> set[str]:
    """Top-level module names of absolute imports (including `__import__("name")`)."""
    names = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names.add(node.module.split(".")[0])
            elif (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", None) == "__import__"
                and isinstance(node.args[0], ast.Constant)
            ):
                names.add(node.args[0].value.split(".")[0])
    return names - set(sys.stdlib_module_names) - OURS - {"__future__"}


def _declared(requirements: list[str]) -> set[str]:
    names = (re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0] for r in requirements)
    return {name.lower().replace("_", "-") for name in names}


def _undeclared(paths: list[Path], declared: set[str]) -> dict[str, list[str]]:
    """Imported modules none of whose installed distributions is declared."""
    dists = importlib.metadata.packages_distributions()
    missing = {}
    for module in sorted(_imports(paths)):
        owners = [d.lower().replace("_", "-") for d in dists.get(module, [module])]
        if not declared & set(owners):
            missing[module] = owners
    return missing


PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
# The benchmarks are development tools, like the tests: they may use the dev extra.
DEV_ONLY = {"tests", "benchmarks", ".venv"}
CODE = [p for p in ROOT.rglob("*.py") if p.relative_to(ROOT).parts[0] not in DEV_ONLY]
CODE = [p for p in CODE if not any(part.startswith(".") for part in p.relative_to(ROOT).parts)]
TOOLS = [*(ROOT / "tests").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")]


# Optional imports, each where it runs, each in the dev extra for the tests (pyproject.toml):
# attention=triton's kernel, whose triton comes with a CUDA torch; and the causality audit of a
# transformers model, which its user has installed transformers to build
OPTIONAL = {
    ROOT / "model" / "triton_attention.py": "triton",
    ROOT / "model" / "causality.py": "transformers",
    ROOT / "check_causality.py": "transformers",
}


def test_every_import_of_the_code_is_a_declared_dependency():
    assert len(CODE) > 20 and "regex" in _imports(CODE)  # the scan sees the code
    base = _declared(PROJECT["dependencies"])
    assert _undeclared([p for p in CODE if p not in OPTIONAL], base) == {}
    for path, module in OPTIONAL.items():
        assert _undeclared([path], base) == {module: [module]}
        assert _undeclared([path], base | _declared(PROJECT["optional-dependencies"]["dev"])) == {}


def test_every_import_of_the_tests_and_benchmarks_is_declared_with_the_dev_extra():
    declared = _declared(PROJECT["dependencies"] + PROJECT["optional-dependencies"]["dev"])
    assert _undeclared(TOOLS, declared) == {}


def test_an_undeclared_import_is_caught(tmp_path):
    """Negative control: without `regex` in the list, data/tokenizer.py's import is reported."""
    declared = _declared(PROJECT["dependencies"]) - {"regex"}
    assert "regex" in _undeclared([ROOT / "data" / "tokenizer.py"], declared)
