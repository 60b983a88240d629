#!/bin/sh
# In the guest, on this machine's own file system: two soft-RoCE devices over a veth pair, then the
# command; its output and exit status go to the share, and the guest powers off.
share=/run/uccl-ep-share
mkdir -p /dev/shm && mount -t tmpfs tmpfs /dev/shm
exec > "$share/output" 2>&1
# Both ends of the pair live in this one namespace: without policy routing the kernel would send the
# traffic between the two addresses through lo, and rxe's queue pairs could not reach RTR.
echo 1 > /proc/sys/net/ipv4/conf/all/accept_local
ip link add v0 type veth peer name v1
ip addr add 10.0.0.1/24 dev v0
ip addr add 10.0.0.2/24 dev v1
ip link set lo up
ip link set v0 up
ip link set v1 up
echo 1 > /proc/sys/net/ipv4/conf/v0/accept_local
echo 1 > /proc/sys/net/ipv4/conf/v1/accept_local
ip route add 10.0.0.2 dev v0 table 101
ip route add 10.0.0.1 dev v1 table 102
ip rule add pref 10 from 10.0.0.1 to 10.0.0.2 iif lo table 101
ip rule add pref 10 from 10.0.0.2 to 10.0.0.1 iif lo table 102
ip rule add pref 100 table local
ip rule del pref 0 table local
rdma link add rxe0 type rxe netdev v0
rdma link add rxe1 type rxe netdev v1
. "$share/environment"
cd "$(cat "$share/cwd")"
bash "$share/command"
echo $? > "$share/status"
sync
echo o > /proc/sysrq-trigger
