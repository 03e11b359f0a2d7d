#!/bin/bash
# Multi-node training on Slurm: one torchrun per node, which starts one worker per GPU.
#
#   sbatch scripts/slurm_train.sh model=gpt2 data=openwebtext   # any train.py overrides
#   sbatch --nodes=4 scripts/slurm_train.sh ...   # more nodes: nothing else changes
#
# The run directory must be on a filesystem every node sees (rank 0 writes the checkpoints, all
# ranks read them on resume). Resubmitting the same job name continues from its last checkpoint.
#SBATCH --job-name=causalgpt
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1          # one torchrun per node
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
#SBATCH --time=24:00:00
#SBATCH --signal=TERM@300            # SIGTERM 5 min before the limit: save and exit cleanly
#SBATCH --output=%x-%j.out

set -euo pipefail
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
RUN_DIR=${RUN_DIR:-outputs/$SLURM_JOB_NAME}

# torchrun restarts failed workers, which resume from the last checkpoint (train.resume=auto);
# restarts need stores of their own (docs/distributed.md, "Restarts")
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
srun --kill-on-bad-exit=1 torchrun \
    --max-restarts="${MAX_RESTARTS:-3}" \
    --nnodes="$SLURM_JOB_NUM_NODES" \
    --nproc_per_node="$GPUS_PER_NODE" \
    --rdzv_backend=c10d \
    --rdzv_endpoint="$HEAD:29500" \
    --rdzv_id="$SLURM_JOB_ID" \
    train.py hydra.run.dir="$RUN_DIR" train.resume=auto "$@"
