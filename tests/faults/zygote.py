"""A fork server for the kill -9 tests: `python tests/faults/zygote.py` (Linux).

Starting Python, torch, Hydra and `datasets` costs seconds; a test that kills training twenty
times would spend most of its time starting up. This process imports everything train.py needs
once, computes nothing (a forked child inherits no thread pools, so torch works in it), and runs
each requested `train.py <args>` in a forked child that is a real, separate process: its own pid,
signals and exit status, running train.py's `__main__` as `python train.py` would (without the
MFU figure: see `child`).

Protocol, one JSON object per line:
    stdin  {"run": [args], "stdout": path, "stderr": path}   stdout  {"pid": pid}
           (optional: "env": {name: value} set in the child, e.g. CAUSALGPT_FAULT (see
           data/faults.py); "writer": "in_place", see `write_in_place`)
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
import torch  # noqa: E402
import torch._dynamo  # noqa: E402, F401 - the first optimizer step imports it: a second or more
from safetensors.torch import save_file  # noqa: E402

import checkpoints.store  # noqa: E402
import trainer.cli  # noqa: E402, F401
import trainer.loop  # noqa: E402
from data.faults import fault_point  # noqa: E402

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def write_in_place(path, model, run_config, meta, trainer_state, tokenizer_file=None) -> None:
    """The negative control's checkpoint writer, in place of checkpoints.store's: the same
    files (fsynced, manifest last) and the same fault point after the first file
    (checkpoint.partial), but written straight into `path` after deleting the checkpoint there,
    with no temporary directory and no rename. A kill mid-write tears it."""
    ckpt = checkpoints.store
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    save_file(ckpt.model_state(model), str(path / ckpt.MODEL_FILE))
    fault_point("checkpoint.partial")
    config = {"model": model.config.to_dict(), "run": run_config, "meta": meta}
    (path / ckpt.CONFIG_FILE).write_text(json.dumps(config, indent=2))
    files = [ckpt.MODEL_FILE, ckpt.CONFIG_FILE]
    if trainer_state is not None:
        torch.save(trainer_state, path / ckpt.TRAINER_FILE)
        files.append(ckpt.TRAINER_FILE)
    if tokenizer_file is not None:
        shutil.copyfile(tokenizer_file, path / ckpt.TOKENIZER_FILE)
        files.append(ckpt.TOKENIZER_FILE)
    manifest = {
        name: {"bytes": (path / name).stat().st_size, "sha256": ckpt._sha256(path / name)}
        for name in files
    }
    (path / ckpt.MANIFEST_FILE).write_text(json.dumps(manifest, indent=2))
    for name in [*files, ckpt.MANIFEST_FILE]:
        with open(path / name, "rb") as f:
            os.fsync(f.fileno())


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
        os.environ.update(request.get("env", {}))
        if request.get("writer") == "in_place":
            checkpoints.store._write_checkpoint = write_in_place
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
