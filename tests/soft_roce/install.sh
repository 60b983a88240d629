#!/usr/bin/env bash
# Installs, from Debian's packages, what the verbs transport's build (rdma-core's headers) and its tests in
# the soft-RoCE guest (guest.sh) need. Without root or apt-get it says what is missing and leaves it: the
# build then has no verbs transport and run_tests.sh skips (in CI, where CI=true, both are errors).
set -euo pipefail
packages="libibverbs-dev ibverbs-providers qemu-system-x86 linux-image-amd64 busybox-static kmod cpio iproute2 xz-utils"
missing=""
for package in $packages; do
    dpkg-query -W -f='${Status}' "$package" 2> /dev/null | grep -q "install ok installed" || missing="$missing $package"
done
[ -z "$missing" ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get > /dev/null; then
    echo "install.sh: missing Debian packages:$missing (needs root and apt-get to install them)" >&2
    [ "${CI:-}" = true ] && exit 1
    exit 0
fi
echo "install.sh: installing$missing"
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing > /dev/null
