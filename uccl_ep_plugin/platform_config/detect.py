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
