#!/usr/bin/env bash
# Multi-node llmtune on SLURM: one `accelerate launch` per node, each starting one process per GPU.
#   sbatch scripts/slurm_launch.sh recipes/NAME.yaml [key=value ...]
#   CONFIG=recipes/accelerate/fsdp2.yaml sbatch scripts/slurm_launch.sh ...   # FSDP2 / deepspeed_zero{2,3}.yaml
# The engine comes from CONFIG (default: multinode.yaml, DDP); machines, processes, rank and address from SLURM,
# the same flags the two-machines-on-localhost test passes (tests/test_scale_out.py).
# An example, not run here (no SLURM cluster in CI). llmtune workers checkpoint and exit 75 on SIGUSR1 or
# SIGTERM reaching any of them; check on your cluster that the pre-emption signal reaches the workers
# (e.g. `scancel --signal=USR1 --full JOBID`) and that `checkpoint.resume=auto` picks the run up after a requeue.
#SBATCH --job-name=llmtune
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1          # one launcher per node; it starts the per-GPU processes
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --signal=B:USR1@300          # 5 min before the time limit: llmtune checkpoints and exits 75
#SBATCH --requeue
set -euo pipefail
RECIPE=${1:?usage: sbatch scripts/slurm_launch.sh RECIPE [key=value ...]}; shift
GPUS_PER_NODE=${SLURM_GPUS_ON_NODE:-8}
CONFIG=${CONFIG:-recipes/accelerate/multinode.yaml}
MAIN_IP=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)

# Pass the warning signal on to every process of the job step; llmtune coordinates the save across ranks.
trap 'trap "" USR1; scancel --signal=USR1 "$SLURM_JOB_ID"' USR1

srun --kill-on-bad-exit=1 bash -c "accelerate launch \
  --config_file $CONFIG --num_machines $SLURM_NNODES --num_processes $((SLURM_NNODES * GPUS_PER_NODE)) \
  --machine_rank \$SLURM_NODEID --main_process_ip $MAIN_IP --main_process_port 29500 \
  --rdzv_backend static \
  scripts/finetune.py --recipe $RECIPE checkpoint.resume=auto $*" &
wait
# Exit 75 also follows an out-of-memory error on any process (all stop; out_of_memory.json in the output_dir
# names the smaller micro-batch): resubmitting the same job resumes from the last checkpoint with it.
