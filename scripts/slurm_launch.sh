#!/usr/bin/env bash
# Multi-node llmtune on SLURM: one `accelerate launch` per node, each starting one process per GPU.
#   sbatch scripts/slurm_launch.sh recipes/NAME.yaml [key=value ...]
#   CONFIG=recipes/accelerate/fsdp2.yaml sbatch scripts/slurm_launch.sh ...   # FSDP2 / deepspeed_zero{2,3}.yaml
# The engine comes from CONFIG (default: multinode.yaml, DDP); machines, processes, rank and address from SLURM,
# the same flags the two-machines-on-localhost test passes (tests/test_scale_out.py).
# An example, not run here (no SLURM cluster in CI).
#
# Pre-emption: 5 minutes before the time limit SLURM sends USR1 to this shell (--signal below), which passes it to
# every process of the job step; the llmtune workers then save a checkpoint at the next step boundary and exit 75.
# That 75 does not reach this script: torch elastic reports a worker's non-zero exit as a ChildFailedError and
# `accelerate launch` exits 1, as it does for a crash (and srun passes that on). So the script tells a resumable
# stop by what the run left in output_dir during this launch: a checkpoint completed after it forwarded the
# pre-emption signal, or an out_of_memory.json (an out-of-memory stop: the resume uses the smaller micro-batch it
# names). It then exits 75 itself (EX_TEMPFAIL: `sacct` shows 75; resubmit or `scontrol requeue` the job and
# `checkpoint.resume=auto` continues); any other failure exits with srun's status.
# Check on your cluster that the signal reaches the workers: proctrack/cgroup signals every process of the step
# (torch elastic starts the workers in sessions of their own, which a signal to the task's process group misses).
#SBATCH --job-name=llmtune
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1          # one launcher per node; it starts the per-GPU processes
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --signal=B:USR1@300          # 5 min before the time limit: llmtune checkpoints and stops (see above)
#SBATCH --requeue
set -euo pipefail
RECIPE=${1:?usage: sbatch scripts/slurm_launch.sh RECIPE [key=value ...]}; shift
GPUS_PER_NODE=${SLURM_GPUS_ON_NODE:-8}
CONFIG=${CONFIG:-recipes/accelerate/multinode.yaml}
MAIN_IP=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
EXIT_RESUMABLE=75 # llmtune's EXIT_PREEMPTED (llmtune/run/preemption.py)

# The run's output_dir, with the same overrides; empty when the recipe does not load (the launch then says why).
OUTPUT_DIR=$(python -c 'import sys; from llmtune.recipe import load_recipe
print(load_recipe(sys.argv[1], sys.argv[2:]).output_dir)' "$RECIPE" "$@" 2>/dev/null) || OUTPUT_DIR=

# The checkpoints (named step-N, with the manifest.json llmtune writes last), each with its manifest's inode: a
# checkpoint completed during the launch changes the list (llmtune renames a new one into place, so even a name
# written again gets a new inode). Step numbers would not tell: a run resumed from an older checkpoint writes lower
# ones than an abandoned branch beside it, and a user's `step-000100.bak` has none.
checkpoints_stamp() {
  local manifest
  for manifest in "$OUTPUT_DIR"/checkpoints/step-*/manifest.json; do
    [[ -f $manifest && ${manifest%/manifest.json} =~ /step-[0-9]+$ ]] || continue
    stat -c '%i %n' "$manifest"
  done
}

# out_of_memory.json's inode and mtime: llmtune writes it by renaming a new file over it, so both change on each
# stop. Compared before and after the launch rather than against a clock: nodes' and file servers' clocks differ.
oom_stamp() { stat -c '%i %Y' "$OUTPUT_DIR/out_of_memory.json" 2>/dev/null || echo none; }

checkpoints_before=$(checkpoints_stamp)
oom_before=$(oom_stamp)
preempted=0
# Pass the warning signal on to every process of the job step; llmtune coordinates the save across ranks.
trap 'trap "" USR1; preempted=1; scancel --signal=USR1 "$SLURM_JOB_ID"' USR1

# The launchers ignore USR1 (`trap ''` is inherited through exec): torch elastic does not handle it, so by default
# it would kill them at once, and SLURM would end the step, workers and all, in the middle of their save. The
# workers inherit the ignore too until llmtune installs its own handler for the training loop.
# What the user passed reaches that inner shell quoted (%q): pasted as it is, a space in the recipe's path or in an
# override would split it, and a `;` or `$(...)` in one would run as a command on every node.
printf -v CONFIG_ARG '%q' "$CONFIG"
printf -v MAIN_IP_ARG '%q' "$MAIN_IP"
printf -v TRAIN_ARGS ' %q' scripts/finetune.py --recipe "$RECIPE" checkpoint.resume=auto "$@"
srun --kill-on-bad-exit=1 bash -c "trap '' USR1; exec accelerate launch \
  --config_file $CONFIG_ARG --num_machines $SLURM_NNODES --num_processes $((SLURM_NNODES * GPUS_PER_NODE)) \
  --machine_rank \$SLURM_NODEID --main_process_ip $MAIN_IP_ARG --main_process_port 29500 \
  --rdzv_backend static$TRAIN_ARGS" &
launcher=$!
# The trap ends `wait` early (status 138) while srun runs on, saving: wait until srun itself has ended.
while kill -0 "$launcher" 2>/dev/null; do wait "$launcher" || true; done
status=0
wait "$launcher" || status=$? # bash keeps the status of a child it has already reaped

if ((status != 0)) && [[ -n $OUTPUT_DIR ]]; then
  if [[ $(oom_stamp) != "$oom_before" ]]; then
    echo "llmtune stopped out of memory; resubmit to resume from the last checkpoint with the micro-batch in" \
      "$OUTPUT_DIR/out_of_memory.json" >&2
    exit "$EXIT_RESUMABLE"
  fi
  if ((preempted)) && [[ $(checkpoints_stamp) != "$checkpoints_before" ]]; then
    echo "llmtune saved a checkpoint and stopped before the time limit; resubmit to resume" >&2
    exit "$EXIT_RESUMABLE"
  fi
fi
exit "$status"
