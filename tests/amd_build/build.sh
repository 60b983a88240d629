#!/usr/bin/env bash
# Compiles the whole extension for AMD GPUs (HIP) with Debian's ROCm 5.2 toolchain (hipcc, libamdhip64 and the
# device libraries) for gfx90a (MI200-class) and gfx940 (CDNA3) into a scratch folder, then imports that build and
# checks what build_info() reports. Nothing runs on an AMD GPU (none is needed). Installs the packages as root
# (tests/debian_packages.sh); without root or apt-get it says what is missing and skips (in CI that is an error).
set -euo pipefail
cd "$(dirname "$0")/../.."
archs=${UCCL_EP_HIP_ARCH:-gfx90a,gfx940}
status=0
bash tests/debian_packages.sh amd_build hipcc libamdhip64-dev rocm-device-libs || status=$?
[ "$status" = 3 ] && exit 0   # said what is missing
[ "$status" = 0 ] || exit "$status"
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
start=$(date +%s)
UCCL_EP_HIP=1 UCCL_EP_HIP_ARCH=$archs .venv/bin/python setup.py build_ext --build-temp "$scratch/temp" \
    --build-lib "$scratch/lib" > "$scratch/build.log" 2>&1 || { tail -40 "$scratch/build.log"; exit 1; }
grep -E "^\[uccl-ep build\] (mode|AMD GPU archs)" "$scratch/build.log"
if grep -E "(error|warning):" "$scratch/build.log"; then
    echo "amd_build: the HIP build printed the errors or warnings above" >&2
    exit 1
fi
echo "amd_build: compiled and linked for $archs in $(( $(date +%s) - start )) s"
# The package's Python with the HIP build of _C beside it.
mkdir -p "$scratch/import"
cp -r uccl_ep_plugin "$scratch/import/"
rm -f "$scratch"/import/uccl_ep_plugin/_C*.so
cp "$scratch"/lib/uccl_ep_plugin/_C*.so "$scratch/import/uccl_ep_plugin/"
cd "$scratch/import"
UCCL_EP_HIP_ARCH=$archs "$OLDPWD/.venv/bin/python" - <<'PY'
import os

from uccl_ep_plugin import _C

info = _C.build_info()
archs = os.environ["UCCL_EP_HIP_ARCH"].split(",")
assert info["hip"] and not info["cuda"], info
assert info["hip_archs"] == archs, info
wanted = {"dispatch_layout", "gpu_channel", "low_latency_nvlink", "normal_nvlink", "cuda_copy_transport"}
assert wanted <= set(info["features"]), info
print(f"amd_build: the HIP build imports; build_info: hip, archs {info['hip_archs']}, features {info['features']}")
PY
