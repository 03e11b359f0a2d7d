"""A torchrun worker: every rank scores a local HellaSwag file with the same seeded model (plain,
or FSDP-sharded: every forward a collective); rank 0 prints the metrics as JSON.

    python -m torch.distributed.run ... task_worker.py ITEMS.jsonl plain|fsdp
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from evals.tasks import load_task, score_task, task_config
from hardware.distributed import DistInfo, destroy, main_first, wrap_model
from tests.conftest import CPU, GPT2, model_for

dist.init_process_group("gloo")
model = model_for()
if sys.argv[2] == "fsdp":
    model = wrap_model(model, "fsdp", DistInfo.from_env(), torch.device("cpu"))
# Rank 0 builds the datasets cache first, as the Trainer loads tasks: two ranks building it at
# once race (a rank once aborted there under CI's load).
with main_first():
    task = load_task({**task_config("hellaswag"), "data_files": sys.argv[1]}, GPT2, 64)
metrics = score_task(model, task, CPU, dist.get_rank(), dist.get_world_size())
if dist.get_rank() == 0:
    print(json.dumps(metrics))
destroy()  # once both ranks are past the last collective
