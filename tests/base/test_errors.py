"""Hydra's own errors (base/errors.py) are one `error:` line and exit code 2 in every entry point,
a train.py run that fails before it starts leaves no run directory behind, and a bug is not a
user's mistake: its traceback shows."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from base.errors import ConfigError, user_errors, user_path
from tests.conftest import ROOT, run_script

PRESETS = "gpt2, gpt2-large, gpt2-medium, gpt2-xl, mini, nano"


def assert_one_error_line(result, expected: str) -> None:
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(expected), result.stderr
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert "Traceback" not in result.stderr and "HYDRA_FULL_ERROR" not in result.stderr


@pytest.mark.parametrize(
    "override, expected",
    [
        (
            "train.bogus=1",  # an unknown key: its section's keys are listed
            "error: unknown config key train.bogus; known keys: train.batch_size, "
            "train.check_causality, train.ckpt_interval,",
        ),
        ("train.batch_size=[1", "error: cannot parse the override 'train.batch_size=[1'"),
        ("train.batch_size=", "error: train.batch_size must be a positive integer, got ''"),
        (
            "model=no_such_preset",  # an unknown group option: the valid choices are listed
            f"error: model=no_such_preset is not in configs/model/; choose one of: {PRESETS}\n",
        ),
        ("~train.nothing", "error: Could not delete from config. 'train.nothing' does not exist."),
        ("model=nan", f"error: model=nan is not in configs/model/; choose one of: {PRESETS}\n"),
        ("optim=1", "error: optim=1 is not in configs/optim/; choose one of: adamw, muon\n"),
    ],
)
def test_hydra_errors_in_train_py_are_one_line_and_leave_no_run_dir(tmp_path, override, expected):
    result = run_script("train.py", override, cwd=tmp_path)
    assert_one_error_line(result, expected)
    assert list(tmp_path.iterdir()) == []  # no outputs/<date>/<time>/ for a failed attempt


@pytest.mark.parametrize("script", ["sample.py", "evaluate.py", "serve.py", "export.py"])
def test_hydra_errors_in_the_other_scripts_are_one_line(tmp_path, script):
    result = run_script(script, "bogus=1", cwd=tmp_path)
    assert_one_error_line(result, "error: unknown config key bogus; known keys: ")
    assert "checkpoint" in result.stderr  # the script's own keys are the ones listed
    # train.py's config groups are not sample.py's: a group override is an unknown key
    result = run_script(script, "model=gpt2", cwd=tmp_path)
    assert_one_error_line(result, f"error: unknown config key model; `python {script} --help`")


def test_help_lists_only_the_keys_each_script_accepts(tmp_path):
    for script in ("sample.py", "evaluate.py"):
        result = run_script(script, "--help", cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        assert "checkpoint: null" in result.stdout
        assert "Configuration groups" not in result.stdout and "gpt2-xl" not in result.stdout
    for script in ("train.py", "check_causality.py"):  # they take the groups, task= aside
        control = run_script(script, "--help", cwd=tmp_path)
        assert f"model: {PRESETS}" in control.stdout
        assert "task= is evaluate.py's alone" in control.stdout


def test_ctrl_c_before_a_task_handles_it_is_one_line_and_exit_130(tmp_path):
    """A KeyboardInterrupt out of a task (train.py's start-up: preparing data, the guard) is
    `interrupted` and exit code 130, as the shell reports a Ctrl-C; no traceback."""
    (tmp_path / "configs").symlink_to(ROOT / "configs")  # Hydra reads configs/ beside a script
    script = tmp_path / "script.py"
    script.write_text(
        f"import sys\nsys.path.insert(0, {str(ROOT)!r})\nfrom base.errors import hydra_main\n\n"
        "@hydra_main('sample')\ndef main(cfg):\n    raise KeyboardInterrupt\n\nmain()\n"
    )
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    assert (result.returncode, result.stderr) == (130, "interrupted\n")


@pytest.mark.parametrize("users", [None, "0"])
def test_the_task_runs_in_the_users_environment(tmp_path, users):
    """hydra_main switches Hydra's errors to raising around Hydra alone: the task (and what it
    starts) sees HYDRA_FULL_ERROR as the user set it, and a Hydra error is still one line."""
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    script = tmp_path / "script.py"
    script.write_text(
        f"import os, sys\nsys.path.insert(0, {str(ROOT)!r})\nfrom base.errors import hydra_main\n\n"
        "@hydra_main('sample')\ndef main(cfg):\n    print(os.environ.get('HYDRA_FULL_ERROR'))\n\n"
        "main()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env |= {} if users is None else {"HYDRA_FULL_ERROR": users}
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env)
    assert (result.returncode, result.stdout) == (0, f"{users}\n"), result.stderr
    result = subprocess.run(
        [sys.executable, str(script), "no_such_key=1"], capture_output=True, text=True, env=env
    )
    assert result.returncode == 2 and result.stderr.startswith("error: ") and result.stdout == ""
    assert result.stderr.count("\n") == 1, result.stderr


@pytest.mark.parametrize(
    "error, exits",
    [
        (ConfigError("model.n_head must be a positive integer"), True),
        (FileNotFoundError(2, "No such file or directory", "corpus.txt"), False),  # a bug's
        (ValueError("a bug: not the user's mistake"), False),  # the project's errors are UserErrors
        (OSError(28, "No space left on device"), False),
        (KeyError("a bug"), False),
    ],
)
def test_user_errors_catches_the_users_mistakes_only(error, exits, capsys):
    if exits:
        with pytest.raises(SystemExit) as done, user_errors():
            raise error
        assert done.value.code == 2
        assert capsys.readouterr().err.startswith("error: ")
    else:
        with pytest.raises(type(error)), user_errors():
            raise error


def test_a_path_the_user_named_is_one_line_naming_the_key(tmp_path, capsys):
    missing = tmp_path / "missing.txt"
    with pytest.raises(SystemExit) as done, user_errors(), user_path("data.train_files"):
        missing.read_text()
    assert done.value.code == 2
    expected = f"error: data.train_files: No such file or directory: '{missing}'\n"
    assert capsys.readouterr().err == expected
    with pytest.raises(FileNotFoundError), user_errors():  # a path no user named: a bug
        missing.read_text()


def test_a_bug_inside_the_trainer_shows_its_traceback(tmp_path):
    """Negative control for the one-line errors: a ValueError raised by a bug while the Trainer
    is built is not dressed as a user mistake, and the run directory is still removed."""
    inject = (
        "import runpy, sys, trainer.loop as loop\n"
        "def bug(*args, **kwargs): raise ValueError('injected bug')\n"
        "loop.Trainer.__init__ = bug\n"
        f"sys.argv = ['train.py', 'model=nano', 'hydra.run.dir={tmp_path / 'run'}']\n"
        f"runpy.run_path({str(ROOT / 'train.py')!r}, run_name='__main__')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", inject], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 1, result.stderr
    assert "Traceback" in result.stderr and "ValueError: injected bug" in result.stderr
    assert "error: injected bug" not in result.stderr
    assert not (tmp_path / "run").exists()
