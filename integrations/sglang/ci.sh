#!/usr/bin/env bash
# Runs the SGLang plugin tests (integrations/sglang/tests) in SGLang 0.5.23's own environment.
#
# The venv is cached at ${UCCL_EP_CI_CACHE:-$HOME/.cache/uccl-ep-ci}/sglang-0.5.23 and reused
# while the dependency list below is unchanged. Our package is installed from a snapshot of
# the checkout (tracked and untracked, non-ignored files) so the build never writes into it;
# the snapshot is reinstalled only when its content changed.
#
# Usage: integrations/sglang/ci.sh [extra pytest arguments]
set -euo pipefail

SGLANG_VERSION=0.5.23
TORCH_VERSION=2.14.1        # sglang 0.5.23 pins torch==2.14.1
TORCHVISION_VERSION=0.29.1  # the torchvision built against torch 2.14.1
PYTHON=${PYTHON:-python3.11}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
CACHE=${UCCL_EP_CI_CACHE:-$HOME/.cache/uccl-ep-ci}
VENV=$CACHE/sglang-$SGLANG_VERSION
export PIP_DISABLE_PIP_VERSION_CHECK=1

# SGLang is installed with --no-deps: its full dependency list pulls CUDA-only packages
# (flashinfer, cutlass-dsl, deep-gemm, sgl-deep-ep, sglang-kernel, flash-attn...) that are
# huge and unused on a CPU machine. These are what the imports of the tested path need
# (sglang.srt.plugins, server_args and its resolution pipeline, layers.moe.utils,
# token_dispatcher.deepep, batch_overlap.two_batch_overlap), found by importing them one
# missing module at a time; versions pinned where sglang pins them.
#   numpy orjson psutil pybase64 requests packaging pillow msgspec pydantic pyzmq tqdm
#   IPython aiohttp starlette dill einops gguf partial_json_parser: imported at module level
#   transformers (+ tokenizers), sentencepiece, compressed-tensors: model/quantization configs
#   apache-tvm-ffi: sglang.kernels' communication ops (imported by layers.dp_attention)
#   openai: the OpenAI protocol types, imported by two_batch_overlap's dependencies
#   pyyaml: uccl_ep_plugin's platform configs; pytest, pytest-timeout: the test runner
SGLANG_IMPORT_DEPS=(
    numpy orjson psutil pybase64 requests packaging pillow msgspec pydantic pyzmq tqdm
    IPython aiohttp starlette dill einops gguf partial_json_parser
    "transformers==5.19.0" "tokenizers==0.23.2" "sentencepiece==0.2.1" "compressed-tensors==0.18.0"
    "apache-tvm-ffi==0.1.11" "openai==2.8.0"
    pyyaml pytest pytest-timeout
)
# torchvision: sglang.srt.configs imports torchvision.transforms (InternVL image utils) on
# every import of the MoE code; it is installed with --no-deps next to the local torch.
# torchaudio and torchcodec are not imported on this path and are left out.

START=$(date +%s)
step() { echo "[sglang-ci +$(( $(date +%s) - START ))s] $*"; }

# pip with only what a reader needs: SGLang is installed with --no-deps and only part of its requirements
# (above), so pip's resolver lists each one left out: they are counted instead; pip's notes that a local
# index has no page for a package say nothing about this step.
pip_quietly() {
    local log; log=$(mktemp)
    if ! "$VENV/bin/pip" "$@" > "$log" 2>&1; then cat "$log"; rm -f "$log"; return 1; fi
    grep -v -e "^sglang $SGLANG_VERSION requires " -e "dependency resolver does not currently" \
        -e "^WARNING: Location .* is ignored" "$log" || true
    local unmet; unmet=$(grep -c "^sglang $SGLANG_VERSION requires " "$log" || true)
    [[ $unmet == 0 ]] || echo "  (pip: $unmet requirements of sglang left unmet on purpose, see this script)"
    rm -f "$log"
}

# SGLang finds the plugin only through this entry point; without it every test fails late.
if ! grep -Eq '^uccl *= *"uccl_ep_plugin\.integrations\.sglang:register"' "$REPO/pyproject.toml" \
   || ! grep -q '^\[project\.entry-points\."sglang\.srt\.plugins"\]' "$REPO/pyproject.toml"; then
    echo "[sglang-ci] error: $REPO/pyproject.toml does not declare the SGLang entry point:" >&2
    echo '  [project.entry-points."sglang.srt.plugins"]' >&2
    echo '  uccl = "uccl_ep_plugin.integrations.sglang:register"' >&2
    exit 1
fi

DEPS_STAMP="sglang=$SGLANG_VERSION torch=$TORCH_VERSION torchvision=$TORCHVISION_VERSION ${SGLANG_IMPORT_DEPS[*]}"
if [[ -f $VENV/.deps-stamp && "$(cat "$VENV/.deps-stamp")" == "$DEPS_STAMP" ]]; then
    step "reusing cached venv $VENV"
else
    step "creating venv $VENV ($PYTHON)"
    rm -rf "$VENV"
    mkdir -p "$CACHE"
    "$PYTHON" -m venv "$VENV"
    pip_quietly install -q --upgrade pip setuptools wheel
    step "installing torch==$TORCH_VERSION"
    pip_quietly install -q "torch==$TORCH_VERSION"
    step "installing sglang==$SGLANG_VERSION (--no-deps)"
    pip_quietly install -q --no-deps "sglang==$SGLANG_VERSION"
    step "installing the dependencies of the tested import path"
    pip_quietly install -q "${SGLANG_IMPORT_DEPS[@]}" "torch==$TORCH_VERSION"
    pip_quietly install -q --no-deps "torchvision==$TORCHVISION_VERSION"
    echo "$DEPS_STAMP" > "$VENV/.deps-stamp"
    rm -f "$VENV/.repo-stamp"
fi
"$VENV/bin/python" - <<EOF
import torch, torchvision, importlib.metadata as md
assert torch.__version__.startswith("$TORCH_VERSION"), torch.__version__
print(f"[sglang-ci] torch {torch.__version__}, torchvision {torchvision.__version__}, sglang {md.version('sglang')}")
EOF

# Snapshot of the checkout: what git would track, without build outputs.
SNAPSHOT=$(mktemp -d "${TMPDIR:-/tmp}/uccl-ep-sglang-ci.XXXXXX")
trap 'rm -rf "$SNAPSHOT"' EXIT
(cd "$REPO" && git ls-files -z --cached --others --exclude-standard \
    | while IFS= read -r -d '' f; do [[ -f $f ]] && printf '%s\0' "$f"; done \
    | tar --null -T - -cf -) | tar -xf - -C "$SNAPSHOT"
REPO_STAMP=$(cd "$SNAPSHOT" && find . -type f -print0 | sort -z | xargs -0 sha1sum | sha1sum | cut -d' ' -f1)
if [[ -f $VENV/.repo-stamp && "$(cat "$VENV/.repo-stamp")" == "$REPO_STAMP" ]]; then
    step "uccl-ep-plugin unchanged since the last install"
else
    step "installing uccl-ep-plugin from $REPO (snapshot; CPU parts only: these tests run no kernel)"
    UCCL_EP_CPU_ONLY=1 pip_quietly install -q --no-deps "$SNAPSHOT"
    echo "$REPO_STAMP" > "$VENV/.repo-stamp"
fi

step "running integrations/sglang/tests"
# The tests run from a copy outside the source tree: with the checkout (or its pyproject.toml)
# above them, pytest puts the checkout on sys.path and its uncompiled uccl_ep_plugin/ would
# shadow the installed package in the spawned ranks.
TESTS=$SNAPSHOT.tests
trap 'rm -rf "$SNAPSHOT" "$TESTS"' EXIT
mkdir -p "$TESTS" && cp -r "$SNAPSHOT/integrations/sglang/tests/." "$TESTS/"
cd "$TESTS"
# Silenced, as nothing here can act on them: SGLang's import-time notes that its GPU-only quantizations are absent
# on a CPU machine, and a SWIG-built dependency's deprecation notes (also printed at interpreter exit).
PYTHONWARNINGS="ignore:Only CUDA:UserWarning,ignore:builtin type swig:DeprecationWarning" \
    "$VENV/bin/python" -m pytest -p no:cacheprovider -q --timeout 900 --rootdir . . "$@"
step "done"
