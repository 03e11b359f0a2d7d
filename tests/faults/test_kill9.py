"""kill -9 at seeded random instants, many of them during checkpoint writes: every restart with
train.resume=auto succeeds, every checkpoint on disk verifies, and no more work is lost than
the steps since the last checkpoint written before the kill.

A negative control makes the same kills and checks against a checkpoint writer that is not
atomic (it writes in place: no temporary directory, no rename), and they must catch it."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from core.checkpoint import MANIFEST_FILE, CheckpointError, load_checkpoint, verify_checkpoint
from tests.trainer.helpers import TINY, make_trainer

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(sys.platform != "linux", reason="uses fork, prctl and /proc"),
]

ZYGOTE = Path(__file__).with_name("zygote.py")
SEED = 20240917
KILLS = 20
CONTROL_KILLS = 8  # at most: the control stops at the first kill its checks catch
MAX_STARTUP_DELAY = 1.5  # seconds: the range of the random (untargeted) kill instants
STEP_LINE = re.compile(r"^step (\d+) \|", re.MULTILINE)  # training and evaluation lines
BEST_LINE = re.compile(r"^step (\d+) \| val loss .*\| best$", re.MULTILINE)
RESUMED = re.compile(r"^resumed from \S+ at step (\d+)$", re.MULTILINE)

# The byte-level tokenizer keeps a restart fast: a 0.03M-parameter model instead of gpt2's 1.6M
# (its 50257-token embedding), whose 20 MB checkpoints take most of a step to write.
OVERRIDES = [
    "data.tokenizer=bytes",
    "train.max_steps=100000",
    "train.eval_interval=2",  # `best` is written often too
    "train.eval_steps=1",
    "train.resume=auto",
    "train.keep_checkpoints=0",  # checks below expect last and best alone
]

Checkpoints = dict[str, tuple[int, str]]  # "last"/"best" -> (step, manifest.json's text)


class ForkServer:
    """tests/faults/zygote.py: train.py processes that start in milliseconds."""

    def __init__(self, cwd: Path):
        env = {
            **os.environ,
            "WANDB_MODE": "disabled",
            "PYTHONUNBUFFERED": "1",  # every line is on disk before the kill that follows it
            # One intra-op thread: the model is tiny, and on a busy 2-core machine OpenMP threads
            # that wait for a core make each step many times slower.
            "OMP_NUM_THREADS": "1",
        }
        self.proc = subprocess.Popen(
            [sys.executable, str(ZYGOTE)],
            cwd=cwd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.started: list[int] = []
        self.unwaited: set[int] = set()

    def _ask(self, request: dict) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"the fork server died (exit code {self.proc.poll()})"
        return json.loads(line)

    def train(self, args: list[str], out: Path, writer: str = "atomic") -> int:
        """Start `train.py <args>` writing to out.stdout / out.stderr; returns its pid.
        writer="in_place": the negative control's checkpoint writer (see zygote.py)."""
        request = {"run": args, "stdout": f"{out}.stdout", "stderr": f"{out}.stderr"}
        if writer != "atomic":
            request["writer"] = writer
        pid = self._ask(request)["pid"]
        self.started.append(pid)
        self.unwaited.add(pid)
        return pid

    def wait(self, pid: int) -> int:
        self.unwaited.discard(pid)
        return self._ask({"wait": pid})["returncode"]

    def close(self) -> list[int]:
        """End the server, which kills and reaps every child not waited for (and a child of a
        server that died is killed by the kernel). Returns the children still alive after 10
        s: none, unless that machinery is broken."""
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()
        deadline = time.monotonic() + 10
        while (alive := [pid for pid in self.started if is_child_alive(pid)]) and (
            time.monotonic() < deadline
        ):
            time.sleep(0.05)
        return alive


def proc_state(pid: int) -> str | None:
    """The state letter in /proc/<pid>/stat (R, S, D, Z...), or None for no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def is_child_alive(pid: int) -> bool:
    """A forked child of the server, still running (a forked child keeps the server's command
    line; a zombie has none, and a reused pid belongs to another program)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return proc_state(pid) not in (None, "Z", "X") and ZYGOTE.name.encode() in cmdline


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ForkServer]:
    server = ForkServer(tmp_path_factory.mktemp("zygote"))
    try:
        yield server
    finally:
        leaked = server.close()
    assert not leaked, f"train.py processes outlived the test: {leaked}"


@pytest.fixture(scope="module")
def write_seconds(tmp_path_factory: pytest.TempPathFactory, corpus: list[str]) -> float:
    """How long one `last` checkpoint of these runs takes to write here (the median of three),
    to aim kills into writes; also prepares the data once, so that kills land in training."""
    trainer = make_trainer(tmp_path_factory.mktemp("calibration"), corpus, *OVERRIDES)
    trainer.train_step()  # the optimizer state is created by its first step
    times = []
    for _ in range(3):
        start = time.perf_counter()
        trainer.save("last")
        times.append(time.perf_counter() - start)
    return sorted(times)[1]


def staging(ckpt_dir: Path) -> set[str]:
    """Directories a checkpoint write creates and removes: .last.tmp-*, .best.old, ..."""
    try:
        return {name for name in os.listdir(ckpt_dir) if name.startswith(".")}
    except FileNotFoundError:
        return set()


def checkpoints(ckpt_dir: Path) -> Checkpoints:
    """Verify every checkpoint on disk (sizes and sha256 of every file). After a kill between
    the two renames of a swap, the complete copy is `.<name>.old`, which the next save or load
    moves back; it is verified where it lies, without moving it."""
    found = {}
    for name in ("last", "best"):
        path = ckpt_dir / name
        if not path.exists() and (ckpt_dir / f".{name}.old").exists():
            path = ckpt_dir / f".{name}.old"
        if path.exists():
            step = verify_checkpoint(path)["meta"]["step"]
            found[name] = (step, (path / MANIFEST_FILE).read_text())
    if ckpt_dir.exists():
        visible = sorted(p.name for p in ckpt_dir.iterdir() if not p.name.startswith("."))
        expected = sorted(n for n in ("last", "best") if (ckpt_dir / n).exists())
        assert visible == expected, f"unexpected entries in {ckpt_dir}: {visible}"
    return found


def step_of(ckpts: Checkpoints, name: str) -> int:
    return ckpts[name][0] if name in ckpts else 0


def check_kill(
    ckpt_dir: Path, before: Checkpoints, stdout: str, interval: int
) -> tuple[Checkpoints, bool]:
    """What a process killed with SIGKILL must leave, given the checkpoints before it started
    and what it printed. Returns the checkpoints now, and whether it trained a step. Raises
    CheckpointError or AssertionError."""
    after = checkpoints(ckpt_dir)
    printed = [int(s) for s in STEP_LINE.findall(stdout)]
    # It resumed from exactly the checkpoint the previous kill left, or started fresh when there
    # was none (log_interval=1: its first step line is the step after the checkpoint's).
    if resumed := RESUMED.findall(stdout):
        assert int(resumed[0]) == step_of(before, "last"), "resumed from the wrong checkpoint"
    if printed:
        assert printed[0] == step_of(before, "last") + 1, "did not continue from `last`"
    else:
        assert after == before, "a process killed before its first step changed a checkpoint"
        return after, False
    # Work lost is at most the steps since the last checkpoint written before the kill: when
    # step P was printed, the save of every multiple of `interval` below P was done.
    floor = max(step_of(before, "last"), (printed[-1] - 1) // interval * interval)
    last = step_of(after, "last")
    assert floor <= last <= printed[-1], f"`last` is at step {last}: work lost (floor {floor})"
    # `best` is written before its evaluation line is printed. (Killed runs may leave a `best`
    # newer than `last`: the resumed run does not know of it.)
    best = step_of(after, "best")
    if after.get("best") != before.get("best"):
        assert best <= printed[-1], f"`best` is at step {best}, not yet trained"
    if marked := BEST_LINE.findall(stdout):
        assert best >= int(marked[-1]), f"`best` printed at step {marked[-1]} is lost"
    if (ckpt_dir / "last").exists():
        ckpt = load_checkpoint(ckpt_dir / "last", with_trainer_state=True)
        assert ckpt.trainer_state["train_state"]["step"] == last, "trainer state's step"
    return after, True


def read(path: Path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        return ""


def kill_at(server: ForkServer, pid: int, out: Path, target_step: int | None, delay: float) -> None:
    """SIGKILL `pid` `delay` seconds after it printed `target_step` (None: after its start)."""
    if target_step is not None:
        line = re.compile(rf"^step {target_step} \|", re.MULTILINE)
        stdout, deadline = Path(f"{out}.stdout"), time.monotonic() + 60
        while not line.search(read(stdout)):
            if proc_state(pid) in (None, "Z", "X") or time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                server.wait(pid)
                pytest.fail(
                    f"train.py {'ended' if time.monotonic() < deadline else 'stalled'} before "
                    f"step {target_step}:\n{read(stdout)[-2000:]}\n{read(Path(f'{out}.stderr'))}"
                )
            time.sleep(0.001)
    time.sleep(delay)
    os.kill(pid, signal.SIGKILL)


def kill_cycles(
    server: ForkServer,
    run_dir: Path,
    args: list[str],
    rng: random.Random,
    kills: int,
    write_seconds: float,
    writer: str = "atomic",
    targeted_only: bool = False,
) -> Iterator[tuple[str, Checkpoints, bool, set[str]]]:
    """Start train.py and kill it, `kills` times. Even cycles (all cycles if targeted_only):
    `delay` after the n-th checkpoint of this process (n random in 1..3), `delay` random within
    about two writes (an evaluation's `best` and the `last` after it), so many kills land in
    writes. Odd cycles: a random instant after the start (start-up, resume, training,
    evaluation or a write). Checks each kill (check_kill); yields (a description of the kill and
    what it printed, the checkpoints after it, whether it trained, the staging dirs it left)."""
    ckpt_dir = run_dir / "checkpoints"
    before: Checkpoints = {}
    for cycle in range(kills):
        interval = rng.randint(1, 3)
        out = run_dir.parent / f"{run_dir.name}-{cycle}"
        debris = staging(ckpt_dir)
        if targeted_only or cycle % 2 == 0:
            n, delay = rng.randint(1, 3), rng.uniform(0.0, 2 * write_seconds)
            target = (step_of(before, "last") // interval + n) * interval
            when = f"{delay * 1000:.0f} ms after step {target} (checkpoint {n} of the process)"
        else:
            target, delay = None, rng.uniform(0.0, MAX_STARTUP_DELAY)
            when = f"at {delay:.2f}s"
        pid = server.train([*args, f"train.ckpt_interval={interval}"], out, writer)
        kill_at(server, pid, out, target, delay)
        returncode = server.wait(pid)
        stdout, stderr = read(Path(f"{out}.stdout")), read(Path(f"{out}.stderr"))
        context = (
            f"cycle {cycle} (ckpt_interval={interval}), kill {when}, left {staging(ckpt_dir)}:"
            f"\n{stdout[-2000:]}\n{stderr[-3000:]}"
        )
        assert returncode == -signal.SIGKILL, f"exit code {returncode}, {context}"
        try:
            before, trained = check_kill(ckpt_dir, before, stdout, interval)
        except (AssertionError, CheckpointError) as e:
            raise AssertionError(f"{e}\n{context}") from e
        yield context, before, trained, staging(ckpt_dir) - debris


def test_kill_9_at_random_instants_loses_at_most_the_steps_since_the_last_checkpoint(
    tmp_path, corpus, server, write_seconds
):
    run_dir = tmp_path / "run"
    args = [*TINY, *corpus, *OVERRIDES, f"hydra.run.dir={run_dir}"]
    cycles = list(kill_cycles(server, run_dir, args, random.Random(SEED), KILLS, write_seconds))
    ckpts = cycles[-1][1]
    interrupted = [left for _, _, _, left in cycles if left]  # kills that cut a write short
    trained = sum(t for _, _, t, _ in cycles)

    # The last restart runs to the end.
    final_step = step_of(ckpts, "last") + 2
    out = tmp_path / "final"
    pid = server.train([*args, "train.ckpt_interval=1", f"train.max_steps={final_step}"], out)
    watchdog = threading.Timer(120, os.kill, (pid, signal.SIGKILL))  # never hang the suite
    watchdog.start()
    try:
        returncode = server.wait(pid)
    finally:
        watchdog.cancel()
    stdout, stderr = read(Path(f"{out}.stdout")), read(Path(f"{out}.stderr"))
    assert returncode == 0, stdout[-2000:] + stderr
    assert int(RESUMED.findall(stdout)[0]) == step_of(ckpts, "last")
    assert json.loads(stdout.strip().splitlines()[-1])["step"] == final_step
    assert step_of(checkpoints(run_dir / "checkpoints"), "last") == final_step
    assert not server.unwaited

    print(
        f"\n{len(interrupted)} of {KILLS} kills interrupted a checkpoint write "
        f"({sum(any('.tmp-' in n for n in left) for left in interrupted)} with its temporary "
        f"directory, {sum(any(n.endswith('.old') for n in left) for left in interrupted)} "
        f"in a swap); {trained} restarts trained; final step {final_step}; "
        f"one write takes {write_seconds * 1000:.0f} ms"
    )
    # Not a test of nothing: kills do land in writes (7 to 12 of the 20 in trial runs).
    assert trained >= KILLS // 2
    assert len(interrupted) >= 3, f"only {len(interrupted)} kills landed in a checkpoint write"


def test_negative_control_the_same_kills_catch_a_writer_that_is_not_atomic(
    tmp_path, corpus, server, write_seconds
):
    run_dir = tmp_path / "run"
    args = [*TINY, *corpus, *OVERRIDES, f"hydra.run.dir={run_dir}"]
    cycles = kill_cycles(
        server,
        run_dir,
        args,
        random.Random(SEED),
        CONTROL_KILLS,
        write_seconds,
        writer="in_place",
        targeted_only=True,
    )
    caught = None
    try:
        for _ in cycles:
            pass
    except AssertionError as e:
        caught = str(e)
    finally:
        cycles.close()
    assert not server.unwaited
    assert caught is not None, f"{CONTROL_KILLS} kills into in-place writes went unnoticed"
    print(f"\ncaught: {caught.splitlines()[0]}")
