"""The test-only fault hook (data/faults.py): inert unless armed; armed, it kills the process
at exactly the named point's n-th arrival, and nowhere else."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from data.faults import ENV, fault_point
from tests.trainer.helpers import ROOT

# Reaches a.x, a.y, a.x, a.x, printing after each, as a writer reaches its stages. (faults.py
# imports only the standard library: run alone, it spares each process importing `datasets`.)
WRITER = """
import runpy, sys
fault_point = runpy.run_path(sys.argv[1])["fault_point"]
for i, name in enumerate(["a.x", "a.y", "a.x", "a.x"], 1):
    fault_point(name)
    print(i, name, flush=True)
"""


def run_writer(spec: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != ENV}
    if spec is not None:
        env[ENV] = spec
    return subprocess.run(
        [sys.executable, "-c", WRITER, str(ROOT / "data" / "faults.py")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )


@pytest.mark.parametrize(
    ("spec", "survived"),
    [
        (None, 4),  # unset: nothing happens
        ("", 4),
        ("a.x:1", 0),
        ("a.x:2", 2),  # the 2nd a.x is the 3rd point reached
        ("a.y:1", 1),
        ("a.x:4", 4),  # never reached: runs to the end
        ("a:1", 4),  # another point
    ],
)
def test_the_process_dies_at_the_named_points_nth_arrival(spec, survived):
    result = run_writer(spec)
    assert len(result.stdout.splitlines()) == survived, result.stderr
    if survived == 4:
        assert result.returncode == 0 and result.stderr == ""
    else:
        name = spec.split(":")[0]
        assert result.returncode == -signal.SIGKILL
        assert result.stderr == f"fault: SIGKILL at {name} ({spec})\n"


@pytest.mark.parametrize("spec", ["a.x", "a.x:", "a.x:two", ":1"])
def test_a_malformed_spec_is_an_error_not_ignored(monkeypatch, spec):
    monkeypatch.setenv(ENV, spec)
    with pytest.raises(ValueError, match=f"{ENV}=.*expected <point>:<n>"):
        fault_point("a.x")
