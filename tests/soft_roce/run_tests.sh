#!/usr/bin/env bash
# The verbs transport's and the proxy's verbs tests against a real verbs provider: soft-RoCE in the qemu guest of guest.sh,
# with this checkout's virtual environment (.venv, built with rdma-core's headers). Ranks fork instead of
# spawning and the exchange runs at 1/16 of its sizes: the guest's CPU is emulated.
set -euo pipefail
cd "$(dirname "$0")/../.."
skip() {
    echo "run_tests.sh: the verbs tests cannot run here: $1" >&2
    [ "${CI:-}" = true ] && exit 1   # CI must run them
    exit 0
}
.venv/bin/python -c 'import sys; from uccl_ep_plugin import _C; sys.exit("verbs_transport" not in _C.build_info()["features"])' \
    || skip "the extension was built without the verbs transport (tests/soft_roce/install.sh, then rebuild)"
command -v qemu-system-x86_64 > /dev/null || skip "no qemu-system-x86_64 (tests/soft_roce/install.sh)"
python=$PWD/.venv/bin/python   # the venv's own link to a real interpreter (a pyenv shim starts slowly in the guest)
exec tests/soft_roce/guest.sh --timeout "${UCCL_EP_GUEST_TIMEOUT_S:-420}" -- \
    env UCCL_EP_TEST_START_METHOD=fork UCCL_EP_TEST_TRANSPORT_SCALE=16 \
    "$python" -m pytest -q -p no:cacheprovider tests/test_verbs_transport.py tests/test_transport_exchange.py \
    tests/test_proxy.py tests/test_uccl_lifecycle.py tests/test_two_level.py -k verbs
