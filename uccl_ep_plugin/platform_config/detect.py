"""Auto-detection of the RDMA platform from the names of the devices in sysfs.

Every RDMA device appears as an entry of ``<root>/sys/class/infiniband/``; its name
tells which driver (and so which NIC family) created it:

=============  ==================
name prefix    platform
=============  ==================
``rdmap``      ``efa``
``bnxt_re``    ``broadcom-thor2``
``ionic``      ``amd-pollara``
``mlx5``       ``nvidia-connectx``
=============  ==================

When NICs of several kinds are present, the platform is chosen by the fixed order
of :data:`PLATFORM_PRIORITY`: efa, amd-pollara, broadcom-thor2, nvidia-connectx.
ConnectX comes last because ConnectX ports often serve as front-end or storage NICs
next to the NICs meant for GPU traffic, and its settings are the defaults anyway.

:func:`nearest_rdma_device` picks, for a GPU, the RDMA device closest to it in the PCIe
tree (the verbs transport's default device where ``UCCL_IB_HCA`` is unset).
"""

import os
from typing import List, Optional, Tuple

#: (device name prefix, platform name).
DEVICE_PREFIXES: Tuple[Tuple[str, str], ...] = (
    ("rdmap", "efa"),
    ("bnxt_re", "broadcom-thor2"),
    ("ionic", "amd-pollara"),
    ("mlx5", "nvidia-connectx"),
)

#: Which platform wins when devices of several kinds are found (first wins).
PLATFORM_PRIORITY: Tuple[str, ...] = ("efa", "amd-pollara", "broadcom-thor2", "nvidia-connectx")

SYSFS_INFINIBAND = os.path.join("sys", "class", "infiniband")


def infiniband_dir(root: str = "/") -> str:
    """Path of the sysfs folder listing RDMA devices, under ``root``."""
    return os.path.join(root, SYSFS_INFINIBAND)


def platform_for_device(name: str) -> Optional[str]:
    """Platform a device name belongs to, or None for an unrecognised device."""
    for prefix, platform in DEVICE_PREFIXES:
        if name.startswith(prefix):
            return platform
    return None


def detect_rdma_devices(root: str = "/") -> List[Tuple[str, Optional[str]]]:
    """All RDMA devices under ``root``, sorted by name, as ``(name, platform_or_None)``.

    A missing or unreadable sysfs folder means no devices.
    """
    try:
        names = sorted(os.listdir(infiniband_dir(root)))
    except OSError:
        return []
    return [(name, platform_for_device(name)) for name in names if not name.startswith(".")]


def choose_platform(platforms) -> Optional[str]:
    """The platform to use among those found, following :data:`PLATFORM_PRIORITY`."""
    found = set(p for p in platforms if p)
    for platform in PLATFORM_PRIORITY:
        if platform in found:
            return platform
    return None


def detect_platform(root: str = "/") -> Optional[str]:
    """Platform of the RDMA NICs under ``root``, or None when no known NIC is present."""
    return choose_platform(platform for _, platform in detect_rdma_devices(root))


def detected_platforms(root: str = "/") -> List[str]:
    """Every distinct platform found under ``root``, in priority order."""
    found = set(platform for _, platform in detect_rdma_devices(root) if platform)
    return [platform for platform in PLATFORM_PRIORITY if platform in found]


def _pci_path(path: str) -> Optional[List[str]]:
    """The PCIe path (root complex, bridges, device) of a sysfs device link, or None if it is not there."""
    try:
        real = os.path.realpath(path)
    except OSError:
        return None
    if not os.path.exists(real):
        return None
    parts = real.split(os.sep)
    roots = [i for i, part in enumerate(parts) if part.startswith("pci")]
    return parts[roots[0]:] if roots else parts


def _numa_node(path: str) -> int:
    try:
        with open(os.path.join(path, "numa_node")) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return -1


def gpu_pci_address(domain: int, bus: int, device: int) -> str:
    """The sysfs name of a GPU's PCI function 0 (``0000:1b:00.0``) from its PCI domain, bus and device."""
    return "%04x:%02x:%02x.0" % (domain, bus, device)


def nearest_rdma_device(gpu_address: str, devices: Optional[List[str]] = None, root: str = "/") -> Optional[str]:
    """The RDMA device (of ``devices``, default every one under ``root``) closest to the GPU at PCI address
    ``gpu_address`` (as :func:`gpu_pci_address` writes it): the fewest PCIe hops between them (behind the same
    switch beats the same root complex, which beats another one), then the same NUMA node, then the name. None
    without devices; the first by name when the GPU's or no device's PCIe path can be read."""
    names = sorted(devices) if devices is not None else [name for name, _ in detect_rdma_devices(root)]
    if not names:
        return None
    gpu_link = os.path.join(root, "sys", "bus", "pci", "devices", gpu_address.lower())
    gpu = _pci_path(gpu_link)
    if gpu is None:
        return names[0]
    gpu_numa = _numa_node(gpu_link)

    def distance(name: str):
        link = os.path.join(infiniband_dir(root), name, "device")
        nic = _pci_path(link)
        if nic is None:
            return (1 << 30, 1, name)
        shared = 0
        while shared < min(len(gpu), len(nic)) and gpu[shared] == nic[shared]:
            shared += 1
        return (len(gpu) + len(nic) - 2 * shared, 0 if _numa_node(link) == gpu_numa >= 0 else 1, name)

    return min(names, key=distance)
