"""A fork server for the kill -9 tests: `python tests/faults/zygote.py` (Linux).

Starting Python, torch, Hydra and `datasets` costs seconds; a test that kills training twenty
times would spend most of its time starting up. This process imports everything train.py needs
once, computes nothing (a forked child inherits no thread pools, so torch works in it), and runs
each requested `train.py <args>` in a forked child that is a real, separate process: its own pid,
signals and exit status, running train.py's `__main__` as `python train.py` would (without the
MFU figure: see `child`).

Protocol, one JSON object per line:
    stdin  {"run": [args], "stdout": path, "stderr": path}   stdout  {"pid": pid}
           (optional: "fault": "checkpoint.<stage>:<n>", see `arm`; "writer": "in_place",
           see `write_in_place`)
    stdin  {"wait": pid}                                     stdout  {"returncode": code}
where code is the exit status, or -N for a child ended by signal N (as subprocess reports it).

No child outlives the server: at the end of stdin the server kills and reaps every child not
yet waited for, and each child asks the kernel for SIGKILL when the server dies (even by
SIGKILL, when nothing of it runs to clean up).
"""

from __future__ import annotations

import ctypes
import json
import os
import runpy
import shutil
import signal
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TRAIN = str(ROOT / "train.py")
sys.path.insert(0, str(ROOT))

import hydra  # noqa: E402, F401
import torch._dynamo  # noqa: E402, F401 - the first optimizer step imports it: a second or more

import checkpoints.sharded  # noqa: E402
import checkpoints.store  # noqa: E402
import trainer.config  # noqa: E402, F401
import trainer.loop  # noqa: E402

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def arm(fault: str) -> None:
    """Make this process SIGKILL itself at the n-th arrival at one stage of a checkpoint write
    (`checkpoint.<stage>:<n>`, e.g. checkpoint.swap:2), by wrapping what the write calls:
        partial    checkpoints.store's save_file returned: the weights written, no manifest
                   (or checkpoints.sharded's: this rank's shard of a sharded checkpoint)
        complete   the swap's first os.replace is called: every file and the manifest written
                   and fsynced in the temporary directory, nothing moved yet
        swap       os.replace moved the previous checkpoint aside: nothing at its path
        replaced   os.replace renamed the new checkpoint in: the previous one not yet deleted
    Before dying it writes `fault: SIGKILL at <point> (<fault>)` to stderr. Nothing is timed:
    the kill lands at the same instant of the write every time."""
    point, n = fault.rsplit(":", 1)
    arrivals = 0
    moved_aside = False  # the write in progress has moved the previous checkpoint aside

    def arrive(stage: str) -> None:
        nonlocal arrivals
        if f"checkpoint.{stage}" == point:
            arrivals += 1
            if arrivals == int(n):
                os.write(2, f"fault: SIGKILL at {point} ({fault})\n".encode())
                os.kill(os.getpid(), signal.SIGKILL)

    real_save_file, real_replace = checkpoints.store.save_file, os.replace

    def save_file(*args, **kwargs) -> None:
        real_save_file(*args, **kwargs)
        arrive("partial")

    def replace(src, dst) -> None:
        nonlocal moved_aside
        src, dst = Path(src), Path(dst)
        swapping = dst.name.endswith(".old") or ".tmp-" in src.name  # base.files' names
        if dst.parent.name != "checkpoints" or not swapping:  # another file's rename
            return real_replace(src, dst)
        if not moved_aside:
            arrive("complete")
        real_replace(src, dst)
        moved_aside = dst.name.endswith(".old")
        arrive("swap" if moved_aside else "replaced")

    checkpoints.store.save_file = checkpoints.sharded.save_file = save_file
    os.replace = replace


def write_in_place(path: Path, fill) -> None:
    """The negative control's directory writer, in place of base.files.write_dir_atomic in
    checkpoints.store: the same files written by the same code (checkpoint.partial included),
    but straight into `path` after deleting the checkpoint there, with no temporary directory
    and no rename. A kill mid-write tears it."""
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    fill(path)


def child(server: int, request: dict) -> None:
    """Become `python train.py <args>` with stdout and stderr in files; never returns."""
    code = 1
    try:
        # Die with the server. The server may already be gone (then the parent is another).
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0 or os.getppid() != server:
            os._exit(1)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        # The one change to train.py: no CPU matmul benchmark for the MFU figure, which would
        # cost every one of these short-lived processes a second of its few.
        trainer.loop.peak_flops = lambda precision: (None, "nothing (MFU off in this test)")
        if "fault" in request:
            arm(request["fault"])
        if request.get("writer") == "in_place":
            checkpoints.store.write_dir_atomic = write_in_place
        sys.argv = [TRAIN, *request["run"]]
        try:
            runpy.run_path(TRAIN, run_name="__main__")
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: B036 - report anything, then exit with a status
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main() -> None:
    server = os.getpid()
    children: set[int] = set()  # started and not yet waited for
    try:
        for line in sys.stdin:
            request = json.loads(line)
            if "run" in request:
                sys.stdout.flush()
                pid = os.fork()
                if pid == 0:
                    child(server, request)
                children.add(pid)
                reply = {"pid": pid}
            else:
                children.discard(request["wait"])
                _, status = os.waitpid(request["wait"], 0)
                reply = {"returncode": os.waitstatus_to_exitcode(status)}
            print(json.dumps(reply), flush=True)
    finally:
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):  # already reaped
                pass


if __name__ == "__main__":
    main()
    os._exit(0)  # skip the interpreter's teardown of torch: a second or two
