#!/usr/bin/env bash
# Installs, from Debian's packages, what the verbs transport's build (rdma-core's headers) and its tests in
# the soft-RoCE guest (guest.sh) need. Without root or apt-get it says what is missing and leaves it: the
# build then has no verbs transport and run_tests.sh skips (in CI, where CI=true, both are errors).
set -euo pipefail
packages="libibverbs-dev ibverbs-providers qemu-system-x86 linux-image-amd64 busybox-static kmod cpio iproute2 xz-utils"
status=0
bash "$(dirname "$0")/../debian_packages.sh" install.sh $packages || status=$?
[ "$status" = 3 ] && exit 0   # said what is missing: the build has no verbs transport, run_tests.sh skips
exit "$status"
