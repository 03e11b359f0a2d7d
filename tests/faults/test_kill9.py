"""kill -9 inside every stage of a checkpoint write, at exact points (see `arm` in zygote.py),
and at seeded random instants: every restart with train.resume=auto succeeds,
every checkpoint on disk verifies, and no more work is lost than the steps since the last
checkpoint written before the kill.

A negative control makes exact kills into a checkpoint writer that is not atomic (it writes in
place: no temporary directory, no rename), and the same checks must catch every one of them.
No kill's place depends on the clock where an assertion depends on it: the random instants
only add coverage (start-up, resume, training, evaluation), and anything is valid there."""

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

from checkpoints.store import MANIFEST_FILE, CheckpointError, load_checkpoint, verify_checkpoint
from tests.conftest import HANG_SECONDS, TINY

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(sys.platform != "linux", reason="uses fork, prctl and /proc"),
]

ZYGOTE = Path(__file__).with_name("zygote.py")
SEED = 20240917
# The stages of checkpoints.store's write (zygote.arm says what each leaves on disk), each hit
# at its 1st, 2nd and 3rd arrival in a process: a `last` or a `best` write, first or not.
STAGES = ("partial", "complete", "swap", "replaced")
FAULTS = [f"checkpoint.{stage}:{n}" for n in (1, 2, 3) for stage in STAGES]
# The negative control: an in-place writer killed mid-write (its only torn stage), in a fresh
# run directory each time, at each of its first three writes with each checkpoint interval.
CONTROL = [(f"checkpoint.partial:{n}", interval) for n in (1, 2, 3) for interval in (1, 2, 3)]
MAX_RANDOM_DELAY = 1.5  # seconds after the start: start-up, resume, training and writes
# A process aimed at a fault point trains at most this many steps: if it never reaches the point
# it ends by itself (exit 0, a clear failure) instead of training forever. With ckpt_interval <=
# 3 and eval_interval 2 the 3rd arrival at any stage comes by step 12 of the process.
FAULT_STEPS = 30
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

    def train(
        self, args: list[str], out: Path, writer: str = "atomic", fault: str | None = None
    ) -> int:
        """Start `train.py <args>` writing to out.stdout / out.stderr; returns its pid.
        writer="in_place": the negative control's checkpoint writer (see zygote.py); fault:
        `checkpoint.<stage>:<n>`, where the process kills itself (zygote.arm)."""
        request = {"run": args, "stdout": f"{out}.stdout", "stderr": f"{out}.stderr"}
        if writer != "atomic":
            request["writer"] = writer
        if fault is not None:
            request["fault"] = fault
        pid = self._ask(request)["pid"]
        self.started.append(pid)
        self.unwaited.add(pid)
        return pid

    def wait(self, pid: int) -> int:
        """Its exit code (-9: SIGKILL). A process still running after HANG_SECONDS is killed."""
        self.unwaited.discard(pid)
        watchdog = threading.Timer(HANG_SECONDS, os.kill, (pid, signal.SIGKILL))
        watchdog.start()
        try:
            return self._ask({"wait": pid})["returncode"]
        finally:
            watchdog.cancel()

    def close(self) -> list[int]:
        """End the server, which kills and reaps every child not waited for (and a child of a
        server that died is killed by the kernel). Returns the children still alive: none,
        unless that machinery is broken. (Both waits end at an event, the server's exit and
        its children's; HANG_SECONDS only bounds a broken server.)"""
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=HANG_SECONDS)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()
        deadline = time.monotonic() + HANG_SECONDS
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


def run_killed(
    server: ForkServer,
    out: Path,
    args: list[str],
    fault: str | None = None,
    delay: float = 0.0,
    writer: str = "atomic",
) -> tuple[str, str]:
    """Run train.py until it dies by SIGKILL: at `fault` (it kills itself there), or else
    `delay` seconds after its start. Returns what it printed on stdout and stderr."""
    pid = server.train(args, out, writer, fault)
    if fault is None:
        # The clock only picks where this kill lands; every instant is a valid place for a kill
        # and no assertion depends on which one it is (max_steps=100000: it is still running).
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)
    returncode = server.wait(pid)
    stdout, stderr = read(Path(f"{out}.stdout")), read(Path(f"{out}.stderr"))
    context = f"{stdout[-2000:]}\n{stderr[-3000:]}"
    assert returncode == -signal.SIGKILL, f"exit code {returncode}:\n{context}"
    if fault is not None:
        point = fault.rsplit(":", 1)[0]
        assert f"fault: SIGKILL at {point} ({fault})" in stderr, (
            f"not killed at {fault}:\n{context}"
        )
    return stdout, stderr


def interrupted(ckpt_dir: Path, stage: str, left: set[str]) -> bool:
    """Whether the checkpoint directory shows a write cut short at `stage` (`left`: the
    staging directories that appeared during the kill)."""
    if stage in ("partial", "complete"):  # a new temporary directory, not yet renamed
        return any(".tmp-" in name for name in left)
    # swap: the previous checkpoint moved aside, nothing in its place; replaced: both.
    return any(
        (ckpt_dir / f".{name}.old").is_dir() and (ckpt_dir / name).is_dir() == (stage == "replaced")
        for name in ("last", "best")
    )


def test_kill_9_inside_checkpoint_writes_loses_at_most_the_steps_since_the_last_checkpoint(
    tmp_path, corpus, server
):
    run_dir = tmp_path / "run"
    ckpt_dir = run_dir / "checkpoints"
    args = [*TINY, *corpus, *OVERRIDES, f"hydra.run.dir={run_dir}"]
    rng = random.Random(SEED)
    # Each exact kill followed by one at a random instant (the first, exact, prepares the data).
    kills = [kill for fault in FAULTS for kill in (fault, None)]
    ckpts: Checkpoints = {}
    random_in_writes = 0
    for cycle, fault in enumerate(kills):
        interval = rng.randint(1, 3)
        cycle_args = [*args, f"train.ckpt_interval={interval}"]
        delay = rng.uniform(0.0, MAX_RANDOM_DELAY)
        if fault is not None:  # ends by itself if the point is never reached
            cycle_args.append(f"train.max_steps={step_of(ckpts, 'last') + FAULT_STEPS}")
        debris = staging(ckpt_dir)
        where = f"at {fault}" if fault else f"{delay:.2f}s after the start"
        out = tmp_path / f"cycle-{cycle}"
        stdout, stderr = run_killed(server, out, cycle_args, fault, delay)
        left = staging(ckpt_dir) - debris
        context = (
            f"cycle {cycle} (ckpt_interval={interval}), killed {where}, left {left}:"
            f"\n{stdout[-2000:]}\n{stderr[-3000:]}"
        )
        if fault is not None:
            stage = fault.split(".")[1].split(":")[0]
            assert interrupted(ckpt_dir, stage, left), f"no write cut short at {stage}; {context}"
        try:
            ckpts, trained = check_kill(ckpt_dir, ckpts, stdout, interval)
        except (AssertionError, CheckpointError) as e:
            raise AssertionError(f"{e}\n{context}") from e
        assert trained or fault is None, f"a kill in a write before any step; {context}"
        random_in_writes += fault is None and bool(left)

    # The last restart runs to the end.
    final_step = step_of(ckpts, "last") + 2
    out = tmp_path / "final"
    pid = server.train([*args, "train.ckpt_interval=1", f"train.max_steps={final_step}"], out)
    returncode = server.wait(pid)
    stdout, stderr = read(Path(f"{out}.stdout")), read(Path(f"{out}.stderr"))
    assert returncode == 0, stdout[-2000:] + stderr
    assert int(RESUMED.findall(stdout)[0]) == step_of(ckpts, "last")
    assert json.loads(stdout.strip().splitlines()[-1])["step"] == final_step
    assert step_of(checkpoints(ckpt_dir), "last") == final_step
    assert not server.unwaited
    print(
        f"\n{len(FAULTS)} exact kills, each inside a checkpoint write; {random_in_writes} of "
        f"{len(FAULTS)} random instants also landed in one; final step {final_step}"
    )


def test_negative_control_the_same_checks_catch_every_kill_into_a_writer_that_is_not_atomic(
    tmp_path, corpus, server
):
    caught, missed = [], []
    for fault, interval in CONTROL:
        run_dir = tmp_path / f"run-{fault.replace(':', '-')}-{interval}"  # one verdict per kill
        args = [*TINY, *corpus, *OVERRIDES, f"hydra.run.dir={run_dir}"]
        args += [f"train.ckpt_interval={interval}", f"train.max_steps={FAULT_STEPS}"]
        out = run_dir.parent / f"{run_dir.name}-out"
        stdout, _ = run_killed(server, out, args, fault, writer="in_place")
        try:
            check_kill(run_dir / "checkpoints", {}, stdout, interval)
        except (AssertionError, CheckpointError) as e:
            caught.append(f"{fault}, ckpt_interval={interval}: {str(e).splitlines()[0]}")
        else:
            missed.append(f"{fault}, ckpt_interval={interval}")
    assert not server.unwaited
    assert not missed, (
        f"{len(missed)} of {len(CONTROL)} kills into in-place writes went unnoticed: {missed}"
    )
    print("\ncaught:\n" + "\n".join(caught))
