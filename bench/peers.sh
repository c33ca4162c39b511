#!/usr/bin/env bash
# The peers of bench/goodput.py in their own virtualenvs, so the project's .venv (and its
# torch) is untouched: nvidia-resiliency-ext (ft_launcher) and DLRover (dlrover-run), each
# from PyPI with the same CPU torch as the project's (`pip install torch==2.13.0`, as the
# Makefile's venv does). Idempotent: a venv that imports its launcher is left alone.
#
#   bash bench/peers.sh            # or: make bench-peers
#   sudo .venv/bin/python bench/goodput.py --launchers ftagent,torchrun,ft_launcher,dlrover-run
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DIR=${BENCH_VENVS:-.bench-venvs}
mkdir -p "$DIR"

peer() {  # peer NAME MODULE PACKAGE...
    local name=$1 module=$2
    shift 2
    local venv="$DIR/$name"
    if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import $module" 2>/dev/null; then
        echo "$name: ready ($venv)"
        return 0
    fi
    "$PY" -m venv "$venv"
    "$venv/bin/pip" install -q torch==2.13.0
    # the launcher must not replace the CPU torch: constrain it to the one installed
    "$venv/bin/pip" freeze | grep -i '^torch==' > "$venv/constraints.txt"
    "$venv/bin/pip" install -q -c "$venv/constraints.txt" "$@"
    "$venv/bin/python" -c "import $module, torch; print('$name: ready ($venv), torch', torch.__version__)"
}

status=0
peer nvrx nvidia_resiliency_ext nvidia-resiliency-ext || { echo "nvrx: install failed"; status=1; }
# dlrover[torch] alone lacks grpcio, which dlrover-run imports (0.6.1): the k8s extra has it;
# its job master (bench/goodput.py starts one) also reads protobuf's package metadata
peer dlrover 'dlrover.trainer.torch.elastic_run' 'dlrover[k8s,torch]' protobuf || { echo "dlrover: install failed"; status=1; }
exit $status
