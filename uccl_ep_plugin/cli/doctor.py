"""``uccl-ep doctor``: what this machine and this build offer to UCCL-EP.

Every probe is a small function returning plain data and catching its own errors,
so the command works (and says what is missing) on machines without GPUs or NICs.
Probes that read the filesystem take a ``root`` so tests can point them at a fake tree;
probes that use torch accept the module as an argument for the same reason.
"""

import argparse
import json
import os
import platform as _platform
import re
import sys
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from uccl_ep_plugin.platform_config import resolve_config
from uccl_ep_plugin.platform_config.detect import (detect_platform, detect_rdma_devices, gpu_pci_address,
                                                   infiniband_dir, nearest_rdma_device)

PEER_MEMORY_MODULES = ("nvidia_peermem", "efa_nv_peermem", "ib_peer_mem")
DMABUF_MIN_KERNEL = (5, 12)
ENGINE_ENV_VAR = "UCCL_EP_ENGINE"


def _error_text(exc: BaseException) -> str:
    return "%s: %s" % (type(exc).__name__, exc)


def _import_torch():
    import torch
    return torch


# --------------------------------------------------------------------------- probes


def probe_python() -> Dict[str, Any]:
    return {"version": _platform.python_version(), "executable": sys.executable}


def probe_torch(torch_module=None) -> Dict[str, Any]:
    try:
        torch = torch_module if torch_module is not None else _import_torch()
        version = getattr(torch, "version", None)
        return {
            "version": str(getattr(torch, "__version__", "unknown")),
            "cuda": getattr(version, "cuda", None),
            "hip": getattr(version, "hip", None),
        }
    except Exception as exc:
        return {"error": _error_text(exc)}


def probe_gpus(torch_module=None) -> Dict[str, Any]:
    """GPU count, names and compute capabilities as torch sees them."""
    try:
        torch = torch_module if torch_module is not None else _import_torch()
        if not torch.cuda.is_available():
            return {"count": 0, "devices": []}
        devices = []
        for index in range(torch.cuda.device_count()):
            entry: Dict[str, Any] = {"index": index}
            try:
                entry["name"] = torch.cuda.get_device_name(index)
                major, minor = torch.cuda.get_device_capability(index)
                entry["capability"] = "%d.%d" % (major, minor)
            except Exception as exc:
                entry["error"] = _error_text(exc)
            devices.append(entry)
        return {"count": len(devices), "devices": devices}
    except Exception as exc:
        return {"count": 0, "devices": [], "error": _error_text(exc)}


def _nvml_handle(pynvml, torch, index: int):
    """NVML handle of CUDA device ``index``, matched by PCI address when possible.

    CUDA and NVML may number devices differently (CUDA_VISIBLE_DEVICES, ordering).
    """
    try:
        props = torch.cuda.get_device_properties(index)
        bus_id = "%08x:%02x:%02x.0" % (props.pci_domain_id, props.pci_bus_id,
                                       props.pci_device_id)
        return pynvml.nvmlDeviceGetHandleByPciBusId(bus_id)
    except Exception:
        return pynvml.nvmlDeviceGetHandleByIndex(index)


def _nvlink_checker(torch) -> Tuple[Callable[[int, int], Any], Optional[Callable[[], None]]]:
    """A function (a, b) -> True/False/"reason" telling whether a and b share NVLink."""
    if getattr(getattr(torch, "version", None), "hip", None):
        return (lambda a, b: "unknown (ROCm: xGMI not probed)"), None
    try:
        import pynvml
    except Exception:
        return (lambda a, b: "unknown (pynvml not installed)"), None
    try:
        pynvml.nvmlInit()
    except Exception as exc:
        message = "unknown (NVML init failed: %s)" % exc
        return (lambda a, b: message), None

    def check(a: int, b: int):
        try:
            status = pynvml.nvmlDeviceGetP2PStatus(
                _nvml_handle(pynvml, torch, a), _nvml_handle(pynvml, torch, b),
                pynvml.NVML_P2P_CAPS_INDEX_NVLINK)
            return status == pynvml.NVML_P2P_STATUS_OK
        except Exception as exc:
            return "unknown (%s)" % _error_text(exc)

    def close():
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass

    return check, close


def probe_peer_access(torch_module=None) -> Dict[str, Any]:
    """For each ordered GPU pair: peer access (torch) and NVLink (NVML)."""
    try:
        torch = torch_module if torch_module is not None else _import_torch()
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception as exc:
        return {"pairs": [], "error": _error_text(exc)}
    if count < 2:
        return {"pairs": [], "note": "fewer than two GPUs"}
    check_nvlink, close = _nvlink_checker(torch)
    pairs = []
    try:
        for a in range(count):
            for b in range(count):
                if a == b:
                    continue
                try:
                    peer: Any = bool(torch.cuda.can_device_access_peer(a, b))
                except Exception as exc:
                    peer = "unknown (%s)" % _error_text(exc)
                pairs.append({"src": a, "dst": b, "peer_access": peer,
                              "nvlink": check_nvlink(a, b)})
    finally:
        if close is not None:
            close()
    return {"pairs": pairs}


def _device_driver(root: str, name: str) -> Optional[str]:
    link = os.path.join(infiniband_dir(root), name, "device", "driver")
    try:
        return os.path.basename(os.path.realpath(link)) if os.path.exists(link) else None
    except OSError:
        return None


def probe_rdma(root: str = "/") -> Dict[str, Any]:
    """RDMA devices with the platform their name implies and their kernel driver."""
    try:
        devices = [{"name": name, "platform": platform, "driver": _device_driver(root, name)}
                   for name, platform in detect_rdma_devices(root)]
        return {"devices": devices, "platform": detect_platform(root)}
    except Exception as exc:
        return {"devices": [], "platform": None, "error": _error_text(exc)}


def probe_verbs() -> Dict[str, Any]:
    """The RDMA devices as libibverbs sees them (the verbs transport's view): per device its atomics and per port
    its state, link layer, GID entries and the GID index the transport would use. A note where the build has no
    verbs transport or libibverbs cannot be loaded."""
    try:
        from uccl_ep_plugin import _C
    except ImportError as exc:
        return {"devices": [], "note": "the extension is not importable (%s)" % _error_text(exc)}
    if not hasattr(_C, "verbs_devices"):
        return {"devices": [], "note": "this build has no verbs transport (rdma-core's headers were missing)"}
    if not _C.verbs_available():
        return {"devices": [], "note": "libibverbs.so.1 cannot be loaded (install rdma-core's libibverbs)"}
    try:
        return {"devices": _C.verbs_devices()}
    except Exception as exc:
        return {"devices": [], "error": _error_text(exc)}


def probe_gpu_nics(root: str = "/", environ: Optional[Mapping[str, str]] = None, torch_module=None) -> Dict[str, Any]:
    """Which RDMA device each local GPU's rank would use over verbs: UCCL_IB_HCA where set, else the device
    nearest to the GPU in the PCIe tree."""
    env = os.environ if environ is None else environ
    try:
        torch = torch_module if torch_module is not None else _import_torch()
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not detect_rdma_devices(root):
            return {"gpus": [], "note": "no RDMA devices"}
        chosen = env.get("UCCL_IB_HCA", "").strip()
        gpus = []
        for index in range(count):
            props = torch.cuda.get_device_properties(index)
            address = gpu_pci_address(props.pci_domain_id, props.pci_bus_id, props.pci_device_id)
            gpus.append({"gpu": index, "pci": address, "device": chosen or nearest_rdma_device(address, root=root),
                         "why": "UCCL_IB_HCA" if chosen else "nearest in the PCIe tree"})
        return {"gpus": gpus}
    except Exception as exc:
        return {"gpus": [], "error": _error_text(exc)}


def probe_peer_memory(root: str = "/") -> Dict[str, Any]:
    """Which GPU peer-memory kernel modules are loaded (``/sys/module/<name>``)."""
    modules: Dict[str, Any] = {}
    for name in PEER_MEMORY_MODULES:
        try:
            modules[name] = os.path.isdir(os.path.join(root, "sys", "module", name))
        except Exception as exc:  # pragma: no cover - isdir does not normally raise
            modules[name] = "unknown (%s)" % _error_text(exc)
    return {"modules": modules, "any_loaded": any(v is True for v in modules.values())}


def parse_kernel_version(release: str) -> Optional[Tuple[int, int]]:
    match = re.match(r"(\d+)\.(\d+)", release or "")
    return (int(match.group(1)), int(match.group(2))) if match else None


def probe_dmabuf(release: Optional[str] = None) -> Dict[str, Any]:
    """Whether DMA-BUF GPU memory registration is likely possible (kernel >= 5.12)."""
    try:
        release = _platform.release() if release is None else release
        version = parse_kernel_version(release)
        possible = version is not None and version >= DMABUF_MIN_KERNEL
        return {
            "kernel": release,
            "possible": possible,
            "note": "heuristic: kernel >= %d.%d supports DMA-BUF; the GPU driver and NIC "
                    "driver must support it too" % DMABUF_MIN_KERNEL,
        }
    except Exception as exc:
        return {"kernel": None, "possible": False, "error": _error_text(exc)}


def probe_gpu_dmabuf(torch_module=None) -> Dict[str, Any]:
    """Which GPUs' drivers export their memory as DMA-BUF (what the verbs transport registers with a NIC first)."""
    try:
        from uccl_ep_plugin import _C
        if not hasattr(_C, "gpu_exports_dmabuf"):
            return {"gpus": {}, "note": "this build has no GPU support"}
        torch = torch_module if torch_module is not None else _import_torch()
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            return {"gpus": {}, "note": "no GPU"}
        return {"gpus": {index: bool(_C.gpu_exports_dmabuf(index)) for index in range(count)}}
    except Exception as exc:
        return {"gpus": {}, "error": _error_text(exc)}


def probe_build() -> Dict[str, Any]:
    """What the installed build contains, from ``uccl_ep_plugin.build_info``."""
    try:
        from uccl_ep_plugin.build_info import build_info
        info = build_info() if callable(build_info) else build_info
        return dict(info)
    except Exception as exc:
        return {"error": _error_text(exc)}


def probe_engine(environ: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:
    env = os.environ if environ is None else environ
    value = env.get(ENGINE_ENV_VAR, "") or "auto"
    return {ENGINE_ENV_VAR: value}


def probe_config(root: str = "/", environ: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:
    try:
        return resolve_config(environ=environ, root=root).to_dict()
    except Exception as exc:
        return {"error": _error_text(exc)}


def collect(root: str = "/", environ: Optional[Mapping[str, str]] = None,
            torch_module=None) -> Dict[str, Any]:
    """Run every probe; the dict printed by ``doctor --json``."""
    return {
        "python": probe_python(),
        "torch": probe_torch(torch_module),
        "gpus": probe_gpus(torch_module),
        "peer_access": probe_peer_access(torch_module),
        "rdma": probe_rdma(root),
        "verbs": probe_verbs() if root == "/" else {"devices": [], "note": "not probed under another root"},
        "gpu_nics": probe_gpu_nics(root, environ, torch_module),
        "peer_memory": probe_peer_memory(root),
        "dmabuf": probe_dmabuf(),
        "gpu_dmabuf": probe_gpu_dmabuf(torch_module),
        "build": probe_build(),
        "engine": probe_engine(environ),
        "config": probe_config(root, environ),
    }


# --------------------------------------------------------------------------- text output


def _yes_no(value: Any) -> str:
    if value is True:
        return "yes"
    if value is False:
        return "no"
    return str(value)


def _section(title: str, lines: List[str]) -> str:
    return "\n".join(["== %s ==" % title] + ["  " + line for line in lines])


def _built_for(build: Dict[str, Any]) -> str:
    """What the extension's GPU code targets, apart from what this machine has (the GPUs section)."""
    if build.get("cuda"):
        archs = ", ".join("sm_%s" % arch for arch in build.get("cuda_archs") or []) or "no architecture"
        return "built with CUDA for %s (runtime %s, linked statically)" % (archs, build.get("cuda_runtime_version"))
    if build.get("hip"):
        archs = ", ".join(build.get("hip_archs") or []) or "no architecture"
        return "built with HIP for %s (compiled in CI with ROCm 5.2; not yet run on an AMD GPU)" % archs
    return "built without GPU code (CPU parts only)"


def render(report: Dict[str, Any]) -> str:
    sections = []

    py = report["python"]
    sections.append(_section("Python", ["%s (%s)" % (py["version"], py["executable"])]))

    tv = report["torch"]
    if "error" in tv:
        torch_lines = ["not usable: %s" % tv["error"]]
    else:
        torch_lines = ["version %s, CUDA %s, HIP %s" % (tv["version"], tv["cuda"] or "no",
                                                      tv["hip"] or "no")]
    sections.append(_section("torch", torch_lines))

    gpus = report["gpus"]
    gpu_lines = []
    if gpus.get("error"):
        gpu_lines.append("error: %s" % gpus["error"])
    if not gpus["devices"]:
        gpu_lines.append("GPUs visible: none")
    for dev in gpus["devices"]:
        if "error" in dev:
            gpu_lines.append("[%d] error: %s" % (dev["index"], dev["error"]))
        else:
            gpu_lines.append("[%d] %s (compute capability %s)"
                             % (dev["index"], dev["name"], dev["capability"]))
    sections.append(_section("GPUs", gpu_lines))

    peers = report["peer_access"]
    peer_lines = []
    if peers.get("error"):
        peer_lines.append("error: %s" % peers["error"])
    elif not peers["pairs"]:
        peer_lines.append(peers.get("note", "no pairs"))
    for pair in peers["pairs"]:
        peer_lines.append("GPU %d -> GPU %d: peer access %s, NVLink %s"
                          % (pair["src"], pair["dst"], _yes_no(pair["peer_access"]),
                             _yes_no(pair["nvlink"])))
    sections.append(_section("GPU peer access", peer_lines))

    rdma = report["rdma"]
    rdma_lines = []
    if rdma.get("error"):
        rdma_lines.append("error: %s" % rdma["error"])
    if not rdma["devices"]:
        rdma_lines.append("no RDMA devices under /sys/class/infiniband")
    for dev in rdma["devices"]:
        rdma_lines.append("%s: platform %s, driver %s"
                          % (dev["name"], dev["platform"] or "unknown",
                             dev["driver"] or "unknown"))
    rdma_lines.append("detected platform: %s" % (rdma["platform"] or "none"))
    verbs = report["verbs"]
    for key in ("note", "error"):
        if verbs.get(key):
            rdma_lines.append("libibverbs: %s" % verbs[key])
    for dev in verbs["devices"]:
        if dev["error"]:
            rdma_lines.append("%s: %s" % (dev["name"], dev["error"]))
        for port in dev["ports"]:
            roce_v2 = [g for g in port["gids"] if g["type"] == "RoCE v2"]
            chosen = ("GID index %d (%s)" % (port["gid_index"], next(g["address"] for g in port["gids"]
                                                                     if g["index"] == port["gid_index"]))
                      if port["gid_index"] >= 0 else "no RoCE v2 IPv4 GID" if port["link_layer"] == "Ethernet"
                      else "LID %d" % port["lid"])
            rdma_lines.append("%s port %d: %s, %s, %d GID entries (%d RoCE v2), the verbs transport uses %s; "
                              "atomics: %s; queue pairs: %s"
                              % (dev["name"], port["port"], port["state"], port["link_layer"], len(port["gids"]),
                                 len(roce_v2), chosen, dev["atomics"], dev["queue_pairs"]))
    nics = report["gpu_nics"]
    if nics.get("error"):
        rdma_lines.append("which NIC each GPU uses: unknown (%s)" % nics["error"])
    for entry in nics["gpus"]:
        rdma_lines.append("GPU %d (%s) uses %s (%s)" % (entry["gpu"], entry["pci"], entry["device"], entry["why"]))
    sections.append(_section("RDMA NICs", rdma_lines))

    pm = report["peer_memory"]
    dm = report["dmabuf"]
    mem_lines = ["%s loaded: %s" % (name, _yes_no(loaded)) for name, loaded in pm["modules"].items()]
    if "error" in dm:
        mem_lines.append("DMA-BUF: unknown (%s)" % dm["error"])
    else:
        mem_lines.append("DMA-BUF possible: %s (kernel %s; %s)"
                         % (_yes_no(dm["possible"]), dm["kernel"], dm["note"]))
    gpu_dm = report["gpu_dmabuf"]
    for index, exported in gpu_dm["gpus"].items():
        mem_lines.append("GPU %s's driver exports DMA-BUF: %s" % (index, _yes_no(exported)))
    if not gpu_dm["gpus"]:
        mem_lines.append("GPU drivers exporting DMA-BUF: unknown (%s)" % (gpu_dm.get("note") or gpu_dm.get("error")))
    sections.append(_section("GPU memory registration", mem_lines))

    build = report["build"]
    if "error" in build:
        build_lines = ["build info unavailable: %s" % build["error"]]
    else:
        build_lines = ["version %s, compiled with %s" % (build.get("version"), build.get("compiler")),
                       _built_for(build),
                       "verbs transport: %s" % ("built in (libibverbs loaded at run time)" if build.get("verbs")
                                                else "not built (rdma-core's headers were missing)"),
                       "features: %s" % ", ".join(build.get("features") or ["none"])]
        if build.get("extension_path"):
            build_lines.append("extension: %s" % build["extension_path"])
    sections.append(_section("Build", build_lines))

    sections.append(_section("Engine", ["%s=%s" % item for item in report["engine"].items()]))

    config = report["config"]
    if "error" in config:
        config_lines = ["error: %s" % config["error"]]
    else:
        from uccl_ep_plugin.cli.config_cmd import render_table
        config_lines = ["platform: %s" % (config["platform"] or "none (defaults only)")]
        rows = [(key, "null" if value is None else str(value), config["sources"][key])
                for key, value in config["values"].items()]
        config_lines += render_table(rows).splitlines()
    sections.append(_section("Resolved config", config_lines))

    return "\n\n".join(sections)


# --------------------------------------------------------------------------- command


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "doctor", help="check GPUs, NICs, kernel modules, build and config",
        description="Report what this machine and this build offer to UCCL-EP.")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    # Filesystem root for sysfs probes; for tests and offline inspection.
    parser.add_argument("--root", default="/", help=argparse.SUPPRESS)
    parser.set_defaults(handler=run)


def run(args) -> int:
    report = collect(root=getattr(args, "root", "/"))
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        try:
            text = render(report)
        except Exception as exc:  # never fail to report: fall back to the raw data
            text = "(could not format the report: %s)\n%s" % (
                _error_text(exc), json.dumps(report, indent=2, default=str))
        print(text)
    return 0
