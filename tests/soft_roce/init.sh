#!/bin/sh
# The guest's first process (busybox): load the modules, mount this machine's file system from the
# 9p share read-only under a tmpfs overlay, and switch to it to run stage2.sh from the second share.
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
while read -r module; do
    insmod "/modules/$module" || echo "init: insmod $module failed"
done < /modules/order
mkdir -p /lower /upper
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=512000,cache=loose hostroot /lower
mount -t tmpfs tmpfs /upper
mkdir -p /upper/data /upper/work
mount -t overlay overlay -o lowerdir=/lower,upperdir=/upper/data,workdir=/upper/work /newroot
mkdir -p /newroot/run/uccl-ep-share
mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000 share /newroot/run/uccl-ep-share
for fs in proc sys dev; do mount --move /$fs /newroot/$fs; done
exec switch_root /newroot /bin/sh /run/uccl-ep-share/stage2.sh
