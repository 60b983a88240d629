#!/usr/bin/env bash
# CI for the vLLM plugin: a cached venv with vLLM 0.33.0, our package installed from this
# repository, and the tests in integrations/vllm/tests (CPU only, 2 gloo ranks, reference engine).
#
#   integrations/vllm/ci.sh [pytest args...]
#
# Cache: ${UCCL_EP_CI_CACHE:-$HOME/.cache/uccl-ep-ci}/vllm-0.33.0 (rebuilt when the pins below change).
# Wheels: a vllm-0.33.0 wheel in ${UCCL_EP_WHEELS:-/tmp/wheels} is used instead of downloading it.
set -euo pipefail

VLLM_VERSION=0.33.0
# torch: vLLM 0.33.0 pins torch==2.14.0 (a CUDA build of several GB). Its tested path here (config,
# CLI parser, communicator and all2all modules, fused_moe prepare/finalize, distributed state on
# gloo) runs on torch 2.13.0's CPU build, which installs quickly and keeps this environment on a
# different torch than SGLang's (2.14.1), so the two engines are tested against different torch
# versions. pip reports the torch pin as a conflict; that is expected. (Where pip would fetch
# torch 2.13.0 from PyPI, use the CPU index: PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu.)
TORCH_PIN="torch==2.13.0"
# vLLM is installed with --no-deps; these are the imports of the tested path, found by trial
# (import vllm.config, vllm.engine.arg_utils, vllm.entrypoints.common.cli_args,
# cuda_communicator, all2all, fused_moe.all2all_utils, the DeepEP prepare/finalize modules and
# vllm.distributed.parallel_state, adding the package each ModuleNotFoundError named). Version
# ranges are vLLM 0.33.0's own where it declares one. Left out on purpose: torchvision,
# torchaudio, torchcodec (fail to import beside this torch), flashinfer, the CUDA/video stack,
# the HTTP server (uvicorn; the parser is built without it) and tokenizer extras.
VLLM_DEPS=(
  "pydantic>=2.12.0"              # vllm.config (pydantic dataclasses)
  regex cbor2 psutil              # vllm.config -> vllm.utils
  "pyzmq>=25.0.0"                 # vllm.config -> vllm.utils.network_utils
  "transformers>=5.16.1,<5.21.0"  # vllm.config.model (pulls tokenizers, huggingface_hub, safetensors)
  "aiohttp>=3.14.4" "requests>=2.33.0" urllib3   # vllm.connections
  openai-harmony "openai>=2.25.0" # vllm.config -> entrypoints types (openai_harmony module)
  msgspec cloudpickle pybase64 cachetools uvloop py-cpuinfo "pillow>=13.0.0"  # vllm.engine.arg_utils
  "prometheus_client>=0.18.0"     # cuda_communicator -> vllm.v1 metrics
  "xgrammar==0.2.8" "llguidance>=1.7.0,<1.8.0" partial-json-parser "fastapi>=0.133.0,<0.137.0"  # structured outputs
  einops                          # fused_moe.all2all_utils
)
TEST_DEPS=(pytest pyyaml numpy)

CI_NAME=vllm-ci ENGINE_DIST=vllm ENGINE_VERSION=$VLLM_VERSION
VENV="${UCCL_EP_CI_CACHE:-$HOME/.cache/uccl-ep-ci}/vllm-$VLLM_VERSION"
STAMP="$(printf '%s\n' "$VLLM_VERSION" "$TORCH_PIN" "${VLLM_DEPS[@]}" "${TEST_DEPS[@]}" | sha256sum | cut -c1-16)"
WHEELS="${UCCL_EP_WHEELS:-/tmp/wheels}"
source "$(dirname "${BASH_SOURCE[0]}")/ci_lib.sh"

if venv_is_current; then
  step "reusing $VENV"
else
  create_venv "$TORCH_PIN" "${TEST_DEPS[@]}"
  step "installing vllm==$VLLM_VERSION --no-deps"
  if compgen -G "$WHEELS/vllm-$VLLM_VERSION-*.whl" > /dev/null; then
    quiet_resolver "${PIP[@]}" --no-deps --no-index --find-links "$WHEELS" "vllm==$VLLM_VERSION"
  else
    quiet_resolver "${PIP[@]}" --no-deps "vllm==$VLLM_VERSION"
  fi
  step "installing vLLM's dependencies for the tested path (${#VLLM_DEPS[@]} packages)"
  quiet_resolver "${PIP[@]}" -c "$CONSTRAINTS" "${VLLM_DEPS[@]}"
  mark_venv_current
fi

install_plugin "$HERE/tests"
run_tests_and_exit "$HERE/tests" "$@"
