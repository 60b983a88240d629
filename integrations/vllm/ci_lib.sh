# Shell shared by the vLLM CI scripts (ci.sh, cpu_e2e.sh); source it after setting:
#   CI_NAME     the prefix of progress lines
#   ENGINE_DIST ENGINE_VERSION   the engine's distribution and version (pip's "left unmet" lines name it)
#   VENV STAMP  the cached environment and the hash of its pins
HERE="$(cd "$(dirname "${BASH_SOURCE[1]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
CACHE="${UCCL_EP_CI_CACHE:-$HOME/.cache/uccl-ep-ci}"
PYTHON="${PYTHON:-python3}"
START=$SECONDS

step() { printf '[%s %4ds] %s\n' "$CI_NAME" "$((SECONDS - START))" "$*"; }

# Runs a pip command quietly. The engine is installed with --no-deps and some of its requirements are
# left out on purpose; pip lists each of them: count them instead of printing them.
quiet_resolver() {
  local log; log="$(mktemp)"
  if ! "$@" > "$log" 2>&1; then cat "$log"; rm -f "$log"; return 1; fi
  local unmet="^$ENGINE_DIST $ENGINE_VERSION requires "
  grep -v -e "$unmet" -e "dependency resolver does not currently" -e "^WARNING: Location .* is ignored" "$log" || true
  local skipped; skipped="$(grep -c "$unmet" "$log" || true)"
  [[ "$skipped" == 0 ]] || echo "  (pip: $skipped requirements of $ENGINE_DIST left unmet on purpose, see this script)"
  rm -f "$log"
}

# True when $VENV was built from the pins hashed in $STAMP.
venv_is_current() { [[ -x "$VENV/bin/python" && "$(cat "$VENV/.uccl-ci-stamp" 2>/dev/null)" == "$STAMP" ]]; }

# A new $VENV with torch ($1, a CPU build from local disk) kept by a constraints file, plus the test tools ($2...).
create_venv() {
  local torch_pin="$1"; shift
  step "creating $VENV"
  rm -rf "$VENV"
  mkdir -p "$CACHE"
  "$PYTHON" -m venv "$VENV"
  PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
  CONSTRAINTS="$VENV/ci-constraints.txt"
  echo "$torch_pin" > "$CONSTRAINTS"      # nothing installed later may replace this torch
  step "installing $torch_pin (CPU build) and test tools"
  quiet_resolver "${PIP[@]}" "$torch_pin" "$@"
}

mark_venv_current() { echo "$STAMP" > "$VENV/.uccl-ci-stamp"; }

# Installs this repository's package into $VENV and shows what the tests in $1 will import (from there,
# so the repository's own uccl_ep_plugin/, which has no integrations/, is not the one imported).
install_plugin() {
  step "installing uccl-ep-plugin from $REPO (CPU parts only: these tests run no kernel)"
  UCCL_EP_CPU_ONLY=1 quiet_resolver "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps \
    --force-reinstall "$REPO"
  (cd "$1" && "$VENV/bin/python" - <<'PY'
import torch, vllm, uccl_ep_plugin.integrations.vllm as plugin
print(f"  torch {torch.__version__}, vllm {vllm.__version__}, plugin {plugin.__file__}")
PY
  )
}

# Runs pytest in $1 (its pytest.ini keeps the repository root off sys.path) and exits with its status.
run_tests_and_exit() {
  local dir="$1"; shift
  step "running ${dir#$REPO/}"
  cd "$dir"
  set +e
  "$VENV/bin/python" -m pytest -q -W ignore::DeprecationWarning "$@"
  local status=$?
  set -e
  step "done (exit $status)"
  exit $status
}
