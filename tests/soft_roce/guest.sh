#!/usr/bin/env bash
# Runs a command inside a qemu guest whose kernel has soft-RoCE (rdma_rxe): two RDMA devices, rxe0 on
# 10.0.0.1 and rxe1 on 10.0.0.2, over a veth pair. The guest sees this machine's whole file system
# read-only (with a throwaway overlay on top), so the command runs this checkout's own Python and
# build; its output streams here and its exit status is this script's.
#
#   tests/soft_roce/guest.sh [--timeout SECONDS] -- COMMAND [ARGS...]
#
# Needs (Debian): qemu-system-x86 linux-image-amd64 busybox-static kmod ibverbs-providers iproute2
# (tests/soft_roce/install.sh installs them). The guest kernel and initramfs are cached under
# $UCCL_EP_GUEST_CACHE (default ~/.cache/uccl-ep/soft-roce). Software emulation (TCG): no KVM needed.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
timeout_s=600
while [ $# -gt 0 ]; do
    case "$1" in
        --timeout) timeout_s=$2; shift 2 ;;
        --) shift; break ;;
        *) break ;;
    esac
done
[ $# -gt 0 ] || { echo "usage: $0 [--timeout SECONDS] -- COMMAND [ARGS...]" >&2; exit 2; }

for tool in qemu-system-x86_64 busybox modprobe cpio python3; do
    command -v "$tool" > /dev/null || { echo "guest.sh: $tool is missing (run tests/soft_roce/install.sh)" >&2; exit 2; }
done
kernel_version=$(ls /lib/modules | sort -V | tail -1)
vmlinuz=/boot/vmlinuz-$kernel_version
[ -f "$vmlinuz" ] || { echo "guest.sh: no $vmlinuz (install linux-image-amd64)" >&2; exit 2; }

cache=${UCCL_EP_GUEST_CACHE:-$HOME/.cache/uccl-ep/soft-roce}/$kernel_version
mkdir -p "$cache"

# The uncompressed kernel boots directly (PVH), several seconds faster than vmlinuz through the BIOS.
if [ ! -s "$cache/vmlinux" ]; then
    python3 - "$vmlinuz" "$cache/vmlinux" <<'PY'
import lzma, sys
data = open(sys.argv[1], "rb").read()
start = data.find(b"\xfd7zXZ\x00")
if start < 0:
    sys.exit(f"guest.sh: no xz stream in {sys.argv[1]}")
out = lzma.LZMADecompressor(format=lzma.FORMAT_XZ).decompress(data[start:])
open(sys.argv[2], "wb").write(out)
PY
fi

# A tiny initramfs: static busybox, the modules soft-RoCE and the 9p root need, and init.sh.
if [ ! -s "$cache/initramfs.cpio" ] || [ "$here/init.sh" -nt "$cache/initramfs.cpio" ]; then
    root=$(mktemp -d)
    mkdir -p "$root"/{bin,dev,proc,sys,newroot,modules}
    cp "$(command -v busybox)" "$root/bin/busybox"
    ln -s busybox "$root/bin/sh"
    modprobe -a -S "$kernel_version" --show-depends \
        virtio_pci 9pnet_virtio 9p overlay crc32_generic rdma_rxe rdma_ucm veth \
        | awk '$1 == "insmod" {print $2}' | awk '!seen[$0]++' > "$root/modules/order"
    while read -r module; do
        cp "$module" "$root/modules/"
        case "$module" in
            *.ko.xz) xz -d "$root/modules/$(basename "$module")" ;;
            *.ko.zst) zstd -q -d --rm "$root/modules/$(basename "$module")" ;;
        esac
    done < "$root/modules/order"
    sed -i -e 's#.*/##' -e 's#\.ko\.\(xz\|zst\)$#.ko#' "$root/modules/order"
    cp "$here/init.sh" "$root/init"
    chmod +x "$root/init"
    (cd "$root" && find . | cpio -o -H newc --quiet > "$cache/initramfs.cpio.tmp")
    mv "$cache/initramfs.cpio.tmp" "$cache/initramfs.cpio"
    rm -rf "$root"
fi

# What the guest runs, its output and its exit status travel through a shared folder.
share=$(mktemp -d)
trap 'kill "${qemu_pid:-0}" 2> /dev/null || true; rm -rf "$share"' EXIT
printf '%q ' "$@" > "$share/command"
echo >> "$share/command"
pwd > "$share/cwd"
env | grep -E '^(UCCL_|PYTHON|CI=)' | sed 's/^/export /' > "$share/environment" || true
cp "$here/stage2.sh" "$share/stage2.sh"
: > "$share/output"

timeout --kill-after=10 "$timeout_s" qemu-system-x86_64 \
    -accel tcg,thread=multi -cpu max -smp 2 -m 2048 -nographic -no-reboot -nic none \
    -kernel "$cache/vmlinux" -initrd "$cache/initramfs.cpio" \
    -append "console=ttyS0 panic=-1" \
    -virtfs "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap" \
    -virtfs "local,path=$share,mount_tag=share,security_model=none,multidevs=remap" \
    > "$share/console" 2>&1 &
qemu_pid=$!
tail -n +1 -f "$share/output" --pid "$qemu_pid" &
tail_pid=$!
set +e
wait "$qemu_pid"
qemu_status=$?
set -e
wait "$tail_pid" 2> /dev/null || true
if [ ! -s "$share/status" ]; then
    echo "guest.sh: the guest ended without the command's status (qemu exit $qemu_status; timeout ${timeout_s}s?)." >&2
    echo "guest.sh: the console's last lines:" >&2
    tail -n 30 "$share/console" >&2
    exit 1
fi
exit "$(cat "$share/status")"
