"""The RDMA device a GPU uses by default (UCCL_IB_HCA unset): the one closest to it in the PCIe tree, on a fake
sysfs tree shaped as a two-socket host with one PCIe switch per GPU pair."""

import os

from uccl_ep_plugin.platform_config.detect import gpu_pci_address, nearest_rdma_device


def _device(root, pci_path, numa):
    """A PCI function at ``pci_path`` (pciDDDD:BB/bridge/.../function) with its numa_node; returns its folder."""
    folder = os.path.join(root, "sys", "devices", *pci_path.split("/"))
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "numa_node"), "w") as f:
        f.write(f"{numa}\n")
    link = os.path.join(root, "sys", "bus", "pci", "devices", os.path.basename(folder))
    os.makedirs(os.path.dirname(link), exist_ok=True)
    os.symlink(folder, link)
    return folder


def _nic(root, name, pci_path, numa):
    folder = _device(root, pci_path, numa)
    ib = os.path.join(root, "sys", "class", "infiniband", name)
    os.makedirs(ib)
    os.symlink(folder, os.path.join(ib, "device"))


def _host(root):
    # Socket 0: root port 00:01.0 -> switch 0000:01:00.0 -> GPU 0000:03:00.0 and NIC mlx5_0 0000:04:00.0;
    # socket 1: root port 80:01.0 -> switch -> GPU 0000:83:00.0 and NIC mlx5_1 0000:84:00.0; plus a front-end NIC
    # mlx5_2 on socket 0's own root port.
    _device(root, "pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0/0000:03:00.0", 0)
    _nic(root, "mlx5_0", "pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:01.0/0000:04:00.0", 0)
    _device(root, "pci0000:80/0000:80:01.0/0000:81:00.0/0000:82:00.0/0000:83:00.0", 1)
    _nic(root, "mlx5_1", "pci0000:80/0000:80:01.0/0000:81:00.0/0000:82:01.0/0000:84:00.0", 1)
    _nic(root, "mlx5_2", "pci0000:00/0000:00:02.0/0000:05:00.0", 0)


def test_each_gpu_gets_the_nic_behind_its_switch(tmp_path):
    root = str(tmp_path)
    _host(root)
    assert nearest_rdma_device(gpu_pci_address(0, 0x03, 0), root=root) == "mlx5_0"
    assert nearest_rdma_device(gpu_pci_address(0, 0x83, 0), root=root) == "mlx5_1"
    # Among the devices one may use (e.g. the verbs transport's list): the same socket beats the other one.
    assert nearest_rdma_device("0000:03:00.0", devices=["mlx5_1", "mlx5_2"], root=root) == "mlx5_2"
    assert nearest_rdma_device("0000:83:00.0", devices=["mlx5_0", "mlx5_2"], root=root) == "mlx5_2"   # fewer hops


def test_numa_node_breaks_a_tie(tmp_path):
    root = str(tmp_path)
    _device(root, "pci0000:00/0000:00:01.0/0000:03:00.0", 1)
    _nic(root, "a_nic", "pci0000:00/0000:00:02.0/0000:04:00.0", 0)
    _nic(root, "b_nic", "pci0000:00/0000:00:03.0/0000:05:00.0", 1)
    assert nearest_rdma_device("0000:03:00.0", root=root) == "b_nic"


def test_without_paths_the_first_device_by_name(tmp_path):
    root = str(tmp_path)
    assert nearest_rdma_device("0000:03:00.0", root=root) is None   # no devices at all
    os.makedirs(os.path.join(root, "sys", "class", "infiniband", "rxe1"))
    os.makedirs(os.path.join(root, "sys", "class", "infiniband", "rxe0"))   # soft-RoCE: no PCI device
    assert nearest_rdma_device("0000:03:00.0", root=root) == "rxe0"
    _device(root, "pci0000:00/0000:00:01.0/0000:03:00.0", 0)
    assert nearest_rdma_device("0000:03:00.0", root=root) == "rxe0"
