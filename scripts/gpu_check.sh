#!/usr/bin/env bash
# Check the single-GPU path in minutes: 20 RL steps of configs/qwen2.5-0.5b_gsm8k.yaml, then
# print peak GPU memory (MemoryMonitor's memory/*/peak_gb), seconds per step (perf/step_seconds)
# and reward (reward/mean), read back from the run's TensorBoard event files.
#
#   MODEL=/models/Qwen2.5-0.5B-Instruct scripts/gpu_check.sh [extra `logra fit` arguments]
#   scripts/gpu_check.sh --summarize RUN_DIR     # only print the summary of an earlier run
#
# Environment:
#   MODEL    model directory, or a Hub id already in the local HF cache (default Qwen/Qwen2.5-0.5B-Instruct)
#   CONFIG   config to run (default configs/qwen2.5-0.5b_gsm8k.yaml)
#   STEPS    RL steps (default 20)
#   RUN_DIR  where logs go (default runs/gpu_check/<date-time>)
#
# Without a CUDA GPU (no nvidia-smi, or torch.cuda.is_available() is False) it exits 1 at once.
# The run's logger is replaced by a TensorBoardLogger under RUN_DIR so the summary knows where to look.
set -euo pipefail

cd "$(dirname "$0")/.."
PY=.venv/bin/python

die() { echo "gpu_check: $*" >&2; exit 1; }

summarize() {
    # Reads every event file under $1; exit 2 if a required metric is missing.
    "$PY" - "$1" <<'EOF'
import os, statistics, sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

root = sys.argv[1]
scalars = {}
for d, _, files in sorted(os.walk(root)):
    if any(f.startswith("events.out.tfevents") for f in files):
        acc = EventAccumulator(d, size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            scalars.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
if not scalars:
    sys.exit(f"gpu_check: no TensorBoard scalars under {root}")
series = {tag: [v for _, v in sorted(points)] for tag, points in scalars.items()}
missing = []

mem = {t: max(v) for t, v in series.items() if t.startswith("memory/") and t.endswith("/peak_gb")}
print(f"run: {root}")
if mem:
    print("peak GPU memory (GB, max over steps):")
    for tag, value in sorted(mem.items()):
        print(f"  {tag:<40s} {value:8.2f}")
else:
    missing.append("memory/*/peak_gb (is the MemoryMonitor callback in the config?)")

steps = series.get("perf/step_seconds", [])
if steps:
    warm = steps[1:] or steps  # the first step includes compilation and engine warm-up
    print(f"seconds per step: median {statistics.median(warm):.2f}, mean {statistics.mean(warm):.2f} "
          f"over {len(warm)} steps (first step {steps[0]:.2f} s, excluded)")
else:
    missing.append("perf/step_seconds")

rewards = series.get("reward/mean", [])
if rewards:
    tail = rewards[-5:]
    print(f"reward/mean: first {rewards[0]:.3f}, last {rewards[-1]:.3f}, "
          f"mean of last {len(tail)} {statistics.mean(tail):.3f} ({len(rewards)} steps logged)")
else:
    missing.append("reward/mean")

if missing:
    print("missing metrics: " + "; ".join(missing), file=sys.stderr)
    sys.exit(2)
EOF
}

if [[ "${1:-}" == "--summarize" ]]; then
    [[ -d "${2:-}" ]] || die "usage: $0 --summarize RUN_DIR (a directory with TensorBoard event files)"
    summarize "$2"
    exit $?
fi

# Fail fast, before importing torch, when there is plainly no GPU.
command -v nvidia-smi >/dev/null 2>&1 \
    || die "no NVIDIA GPU on this machine (nvidia-smi not found); run this on a machine with one CUDA GPU"
nvidia-smi -L >/dev/null 2>&1 || die "nvidia-smi found no usable GPU (nvidia-smi -L failed)"
[[ -x .venv/bin/logra ]] || die ".venv/bin/logra not found; run 'make venv' first"
"$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' \
    || die "torch.cuda.is_available() is False; install a CUDA build of torch in .venv"

MODEL=${MODEL:-Qwen/Qwen2.5-0.5B-Instruct}
CONFIG=${CONFIG:-configs/qwen2.5-0.5b_gsm8k.yaml}
STEPS=${STEPS:-20}
RUN_DIR=${RUN_DIR:-runs/gpu_check/$(date +%Y%m%d-%H%M%S)}
[[ -f "$CONFIG" ]] || die "config $CONFIG not found"
if [[ ! -d "$MODEL" ]]; then
    echo "gpu_check: MODEL=$MODEL is not a local directory; it must already be in the Hugging Face cache" >&2
fi
mkdir -p "$RUN_DIR"

echo "gpu_check: $STEPS steps of $CONFIG with $MODEL on $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); logs in $RUN_DIR"
start=$(date +%s)
.venv/bin/logra fit --config "$CONFIG" \
    --trainer.max_steps "$STEPS" \
    --model.model "$MODEL" \
    --trainer.default_root_dir "$RUN_DIR" \
    --trainer.logger=lightning.pytorch.loggers.TensorBoardLogger \
    --trainer.logger.save_dir="$RUN_DIR" \
    --trainer.logger.name=gpu_check \
    "$@" 2>&1 | tee "$RUN_DIR/fit.log" \
    || die "logra fit failed; see $RUN_DIR/fit.log"
echo "gpu_check: fit finished in $(( $(date +%s) - start )) s (including model load and engine start-up)"
summarize "$RUN_DIR"
