#!/usr/bin/env bash
# debian_packages.sh WHO PACKAGE...: installs, from Debian's packages, those of PACKAGE... that are missing.
# Exit status: 0 when they are all there; without root or apt-get it names the missing ones and exits 3 (the
# caller then skips what needs them), or 1 in CI (CI=true), where that is an error.
set -euo pipefail
who=$1
shift
missing=""
for package in "$@"; do
    dpkg-query -W -f='${Status}' "$package" 2> /dev/null | grep -q "install ok installed" || missing="$missing $package"
done
[ -z "$missing" ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get > /dev/null; then
    echo "$who: missing Debian packages:$missing (needs root and apt-get to install them)" >&2
    [ "${CI:-}" = true ] && exit 1
    exit 3
fi
echo "$who: installing$missing"
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing > /dev/null
