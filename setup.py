"""Build script of uccl-ep-plugin: the Python package plus the pybind11 extension ``_C``.

Project metadata lives in pyproject.toml; this file only describes what needs code:
the package layout (``bench_serving/``, ``configs/`` and ``integrations/`` are installed as subpackages of
``uccl_ep_plugin``) and the
native extension.

Build modes of ``uccl_ep_plugin._C`` (it never links libtorch):
  * CUDA: nvcc was found and ``UCCL_EP_CPU_ONLY`` is not set. The ``*.cu`` files under
    csrc/ are compiled by nvcc and linked together with the C++ sources; cudart is
    linked statically, so importing ``_C`` works without a GPU or driver.
  * HIP (AMD GPUs): ``UCCL_EP_HIP=1``, or hipcc was found and nvcc was not. The same ``*.cu``
    files are compiled by hipcc for AMD GPUs (csrc/common/portability.h maps CUDA to HIP)
    and linked against libamdhip64.
  * CPU only: no GPU compiler, or ``UCCL_EP_CPU_ONLY=1``. Only the C++ sources are built.

Environment variables:
  CUDA_HOME / CUDA_PATH   CUDA toolkit root (else ``nvcc`` on PATH, else /usr/local/cuda)
  UCCL_EP_CPU_ONLY=1      build without a GPU even when nvcc or hipcc exists
  UCCL_EP_CUDA_ARCH       SM architectures, comma separated, e.g. ``90`` or ``80,90``
                          (default: what nvidia-smi reports for the local GPUs, else 90)
  UCCL_EP_HIP=1           build for AMD GPUs with hipcc (ROCM_PATH / HIP_PATH, else hipcc on PATH,
                          else /opt/rocm)
  UCCL_EP_HIP_ARCH        AMD GPU architectures, e.g. ``gfx942`` or ``gfx90a,gfx940``
                          (default: what rocminfo reports for the local GPUs, else gfx90a)
"""

import concurrent.futures
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension
from setuptools import find_namespace_packages, setup
from setuptools.command.build_ext import build_ext

try:  # setuptools >= 69 ships its own copy; older ones still have distutils
    from setuptools.modified import newer_group
except ImportError:  # pragma: no cover
    from distutils.dep_util import newer_group

ROOT = Path(__file__).resolve().parent
CSRC = "csrc"
DEFAULT_CUDA_ARCH = "90"
DEFAULT_HIP_ARCH = "gfx90a"
TRUE_WORDS = ("1", "true", "yes", "on")


def log(message):
    print(f"[uccl-ep build] {message}", flush=True)


def project_version():
    """The version declared in pyproject.toml (read with a regex: no tomllib on 3.9/3.10)."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    project = text.split("[project]", 1)[-1]
    match = re.search(r'^version\s*=\s*"([^"]+)"', project, re.MULTILINE)
    return match.group(1) if match else "unknown"


# --------------------------------------------------------------------------------------
# Finding CUDA
# --------------------------------------------------------------------------------------
def _find_nvcc():
    """Returns (path to nvcc or None, how it was found)."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if not home:
            continue
        candidate = Path(home) / "bin" / "nvcc"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate, f"${var}={home}"
        log(f"${var}={home} has no bin/nvcc; looking elsewhere")
    on_path = shutil.which("nvcc")
    if on_path:
        return Path(on_path), "nvcc on PATH"
    default = Path("/usr/local/cuda/bin/nvcc")
    if default.is_file() and os.access(default, os.X_OK):
        return default, "/usr/local/cuda"
    return None, "no nvcc in $CUDA_HOME, $CUDA_PATH, PATH or /usr/local/cuda"


def _cuda_home_candidates(nvcc):
    yield nvcc.parent.parent
    yield nvcc.resolve().parent.parent
    # nvcc may be a wrapper script somewhere else (e.g. /usr/local/bin); nvcc itself
    # tells where it really lives.
    try:
        # A dry run prints its variables (no file is read or written).
        out = subprocess.run([str(nvcc), "--dryrun", "-c", "probe.cu", "-o", "probe.o"],
                             capture_output=True, text=True, timeout=60).stderr
        here = re.search(r"^#\$ _HERE_=(.+)$", out, re.MULTILINE)
        if here:
            yield Path(here.group(1).strip()).parent
    except (OSError, subprocess.SubprocessError):
        pass


def _find_cuda_dirs(nvcc):
    """(include dir, lib dir holding libcudart_static.a) of the toolkit that owns nvcc."""
    for home in _cuda_home_candidates(nvcc):
        include = home / "include"
        if not (include / "cuda_runtime.h").is_file():
            continue
        for lib in ("lib64", "lib", "targets/x86_64-linux/lib", "targets/sbsa-linux/lib"):
            if (home / lib / "libcudart_static.a").is_file():
                return include, home / lib
    return None, None


def _gpu_archs_from_nvidia_smi():
    try:
        result = subprocess.run(
            ["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return []
    if result.returncode != 0:
        return []
    return [line.strip() for line in result.stdout.splitlines() if line.strip()]


def _normalise_archs(entries, source):
    archs = []
    for entry in entries:
        arch = entry.strip().lower().replace(".", "").replace("sm_", "")
        if not re.fullmatch(r"\d{2,3}[af]?", arch):
            raise SystemExit(f"[uccl-ep build] error: bad CUDA architecture {entry!r} in "
                             f"{source}; expected numbers such as 80, 90 or 90a")
        if arch not in archs:
            archs.append(arch)
    return sorted(archs, key=lambda a: (int(re.match(r"\d+", a).group()), a))


def _cuda_archs():
    """(list of archs such as ['80', '90'], where they came from)."""
    env = os.environ.get("UCCL_EP_CUDA_ARCH", "").strip()
    if env:
        entries = [e for e in re.split(r"[,;\s]+", env) if e]
        return _normalise_archs(entries, "UCCL_EP_CUDA_ARCH"), f"UCCL_EP_CUDA_ARCH={env}"
    found = _gpu_archs_from_nvidia_smi()
    if found:
        return _normalise_archs(found, "nvidia-smi"), "compute capability from nvidia-smi"
    return [DEFAULT_CUDA_ARCH], "default (no UCCL_EP_CUDA_ARCH, no GPU seen by nvidia-smi)"


def _find_hipcc():
    """(path to hipcc or None, how it was found)."""
    for var in ("ROCM_PATH", "HIP_PATH"):
        home = os.environ.get(var)
        if home and (Path(home) / "bin" / "hipcc").is_file():
            return Path(home) / "bin" / "hipcc", f"${var}={home}"
    on_path = shutil.which("hipcc")
    if on_path:
        return Path(on_path), "hipcc on PATH"
    default = Path("/opt/rocm/bin/hipcc")
    if default.is_file():
        return default, "/opt/rocm"
    return None, "no hipcc in $ROCM_PATH, $HIP_PATH, PATH or /opt/rocm"


def _hip_archs():
    """(list of AMD GPU architectures such as ['gfx90a'], where they came from)."""
    env = os.environ.get("UCCL_EP_HIP_ARCH", "").strip()
    if env:
        archs = [e for e in re.split(r"[,;\s]+", env) if e]
        for arch in archs:
            if not re.fullmatch(r"gfx[0-9a-f]+(:[a-z+-]+)*", arch):
                raise SystemExit(f"[uccl-ep build] error: bad AMD GPU architecture {arch!r} in UCCL_EP_HIP_ARCH; "
                                 "expected names such as gfx90a or gfx942")
        return archs, f"UCCL_EP_HIP_ARCH={env}"
    try:
        out = subprocess.run(["rocminfo"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    found = sorted(set(re.findall(r"\b(gfx[0-9a-f]{3,4})\b", out)) - {"gfx000"})
    if found:
        return found, "the local GPUs (rocminfo)"
    return [DEFAULT_HIP_ARCH], "default (no UCCL_EP_HIP_ARCH, no GPU seen by rocminfo)"


def _verbs_include():
    """(the folder holding rdma-core's infiniband/verbs.h or None, why): UCCL_EP_VERBS_INCLUDE, else the system's.
    UCCL_EP_WITHOUT_VERBS=1 leaves the verbs transport out."""
    if os.environ.get("UCCL_EP_WITHOUT_VERBS", "").strip().lower() in TRUE_WORDS:
        return None, "UCCL_EP_WITHOUT_VERBS is set"
    given = os.environ.get("UCCL_EP_VERBS_INCLUDE", "").strip()
    for folder in ([given] if given else ["/usr/include", "/usr/local/include"]):
        if (Path(folder) / "infiniband" / "verbs.h").is_file():
            return folder, f"rdma-core headers in {folder}"
    where = f"UCCL_EP_VERBS_INCLUDE={given}" if given else "/usr/include or /usr/local/include"
    return None, (f"no infiniband/verbs.h in {where} (install rdma-core's headers, e.g. Debian's libibverbs-dev, "
                  "for the verbs transport)")


class BuildConfig:
    """The mode chosen for this build and everything that follows from it."""

    def __init__(self):
        self.verbs_include, self.verbs_reason = _verbs_include()
        self.cuda = False
        self.hip = False
        self.reason = ""
        self.nvcc = None
        self.hipcc = None
        self.cuda_include = None
        self.cuda_lib = None
        self.archs = []
        self.arch_reason = ""
        if os.environ.get("UCCL_EP_CPU_ONLY", "").strip().lower() in TRUE_WORDS:
            self.reason = "UCCL_EP_CPU_ONLY is set"
            return
        want_hip = os.environ.get("UCCL_EP_HIP", "").strip().lower() in TRUE_WORDS
        nvcc, how = (None, "UCCL_EP_HIP is set") if want_hip else _find_nvcc()
        if nvcc is None:
            hipcc, hip_how = _find_hipcc()
            if hipcc is not None:
                self.hip, self.hipcc = True, hipcc
                self.reason = f"hipcc found: {hipcc} ({hip_how}; {how})"
                self.archs, self.arch_reason = _hip_archs()
            elif want_hip:
                raise SystemExit(f"[uccl-ep build] error: UCCL_EP_HIP is set but {hip_how}")
            else:
                self.reason = f"{how}; {hip_how}"
            return
        include, lib = _find_cuda_dirs(nvcc)
        if include is None:
            raise SystemExit(
                f"[uccl-ep build] error: found {nvcc} ({how}) but not the toolkit's "
                "include/cuda_runtime.h and libcudart_static.a next to it; set CUDA_HOME to "
                "the toolkit root, or UCCL_EP_CPU_ONLY=1 to build without CUDA")
        self.cuda = True
        self.nvcc, self.cuda_include, self.cuda_lib = nvcc, include, lib
        self.reason = f"nvcc found: {nvcc} ({how})"
        self.archs, self.arch_reason = _cuda_archs()

    @property
    def gpu(self):
        return self.cuda or self.hip

    def describe(self):
        verbs = f"verbs transport: {'yes' if self.verbs_include else 'no'} ({self.verbs_reason})"
        if self.hip:
            return [f"mode: HIP ({self.reason})", f"AMD GPU archs: {','.join(self.archs)} ({self.arch_reason})", verbs]
        if not self.cuda:
            return [f"mode: CPU only ({self.reason}); building the C++ parts without a GPU", verbs]
        return [
            f"mode: CUDA ({self.reason})",
            f"CUDA archs: {','.join(self.archs)} ({self.arch_reason})",
            f"CUDA include: {self.cuda_include}; static cudart from: {self.cuda_lib}",
            verbs,
        ]


# --------------------------------------------------------------------------------------
# The extension
# --------------------------------------------------------------------------------------
def _relative_files(pattern):
    return sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / CSRC).rglob(pattern))


def make_extension(config):
    cpp_sources = _relative_files("*.cpp")
    cu_sources = _relative_files("*.cu") if config.gpu else []
    headers = _relative_files("*.h") + _relative_files("*.cuh")
    macros = [("UCCL_EP_VERSION", f'"{project_version()}"')]
    include_dirs = [CSRC]
    library_dirs = []
    libraries = []
    if config.verbs_include:
        # libibverbs is opened at run time (dlopen), so the extension loads on hosts without it.
        macros.append(("UCCL_EP_WITH_VERBS", "1"))
        include_dirs.append(config.verbs_include)
        libraries.append("dl")
    if config.gpu:
        macros.append(("UCCL_EP_WITH_GPU", "1"))
    if config.hip:
        # The C++ sources include the HIP runtime's headers too (for the host compiler: the AMD platform).
        macros += [("UCCL_EP_WITH_HIP", "1"), ("__HIP_PLATFORM_AMD__", "1"),
                   ("UCCL_EP_HIP_ARCH_LIST", '"{}"'.format(",".join(config.archs)))]
        rocm = config.hipcc.resolve().parent.parent
        if (rocm / "include" / "hip").is_dir():
            include_dirs.append(str(rocm / "include"))
        if (rocm / "lib").is_dir():
            library_dirs.append(str(rocm / "lib"))
        libraries += ["amdhip64", "dl", "pthread"]
    if config.cuda:
        macros += [("UCCL_EP_WITH_CUDA", "1"),
                   ("UCCL_EP_CUDA_ARCH_LIST", '"{}"'.format(",".join(config.archs)))]
        include_dirs.append(str(config.cuda_include))
        library_dirs.append(str(config.cuda_lib))
        libraries += ["cudart_static", "dl", "rt", "pthread"]
    return Pybind11Extension(
        "uccl_ep_plugin._C",
        sources=cpp_sources + cu_sources,
        depends=headers + (_relative_files("*.cu") if config.gpu else []),
        include_dirs=include_dirs,
        define_macros=macros,
        library_dirs=library_dirs,
        libraries=libraries,
        cxx_std=17,
    )


def _run_gpu_compiler(job):
    """(source, command, the error or None, seconds) of one nvcc or hipcc run."""
    source, command = job
    start = time.monotonic()
    # Without HIP_PLATFORM, hipcc hands the job to nvcc where nvcc exists.
    env = dict(os.environ, HIP_PLATFORM="amd") if CONFIG.hip else None
    try:
        subprocess.run(command, check=True, env=env)
        error = None
    except (OSError, subprocess.CalledProcessError) as exc:
        error = exc
    return source, command, error, time.monotonic() - start


class BuildExtWithGpu(build_ext):
    """build_ext that compiles ``*.cu`` sources with nvcc or hipcc and links their objects in."""

    def build_extensions(self):
        for line in CONFIG.describe():
            log(line)
        super().build_extensions()

    def build_extension(self, ext):
        # setuptools skips an extension whose sources are older than the built library,
        # and pip reuses ./build: rebuild everything when the mode or archs changed.
        stamp = Path(self.build_temp) / "uccl_ep_build_config.txt"
        signature = "\n".join(CONFIG.describe() + [repr(sorted(ext.define_macros))]) + "\n"
        previous = stamp.read_text() if stamp.is_file() else None
        force = self.force
        if previous != signature:
            if previous is not None:
                log("build configuration changed since the last build: rebuilding everything")
            self.force = True
        try:
            self._build_extension(ext)
        finally:
            self.force = force
        stamp.parent.mkdir(parents=True, exist_ok=True)
        stamp.write_text(signature)

    def _build_extension(self, ext):
        sources = list(ext.sources)
        cu_sources = [s for s in sources if s.endswith(".cu")]
        extra_objects = list(ext.extra_objects or [])
        if cu_sources:
            if not CONFIG.gpu:
                raise SystemExit("[uccl-ep build] error: .cu sources in a CPU-only build")
            ext.extra_objects = extra_objects + self._compile_gpu_sources(ext, cu_sources)
        ext.sources = [s for s in sources if not s.endswith(".cu")]
        target = Path(self.get_ext_fullpath(ext.name))
        before = target.stat().st_mtime_ns if target.exists() else None
        start = time.monotonic()
        try:
            super().build_extension(ext)
        finally:
            ext.sources = sources
            ext.extra_objects = extra_objects
        if target.exists() and target.stat().st_mtime_ns != before:
            log(f"C++ compile and link of {ext.name}: {time.monotonic() - start:.1f}s")
        else:
            log(f"{ext.name} is up to date")

    def _host_compiler(self):
        """The C++ compiler that builds the rest of the extension. nvcc must use it as well: objects from two
        compilers can disagree on the C++ library's ABI (std::string, std::vector), and a .cu object that hands
        such a type to a .cpp one then crashes at run time."""
        compiler = getattr(self.compiler, "compiler_so", None) or []
        return compiler[0] if compiler and shutil.which(compiler[0]) else None

    def _gpu_flags(self):
        """The compiler and its flags for the mode: nvcc with the host compiler, or hipcc (clang, whose C++
        library is the host's libstdc++)."""
        if CONFIG.hip:
            flags = ["-x", "hip", "-O3", "-std=c++17", "-fPIC", "-fvisibility=hidden"]
            return str(CONFIG.hipcc), flags + [f"--offload-arch={arch}" for arch in CONFIG.archs]
        flags = ["-O3", "-std=c++17", "-Xcompiler", "-fPIC", "-Xcompiler", "-fvisibility=hidden"]
        host_compiler = self._host_compiler()
        if host_compiler is not None:
            flags += ["-ccbin", host_compiler]
        for arch in CONFIG.archs:
            flags += ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]
        return str(CONFIG.nvcc), flags

    def _compile_gpu_sources(self, ext, cu_sources):
        compiler, flags = self._gpu_flags()
        tool = Path(compiler).name
        for include in ext.include_dirs:
            flags.append(f"-I{include}")
        for name, value in ext.define_macros:
            flags.append(f"-D{name}" if value is None else f"-D{name}={value}")
        objects, commands = [], []
        for source in cu_sources:
            obj = Path(self.build_temp) / (os.path.splitext(source)[0] + ".cu.o")
            objects.append(str(obj))
            if not (self.force or newer_group([source] + list(ext.depends), str(obj))):
                log(f"{tool}: {source} is up to date")
                continue
            obj.parent.mkdir(parents=True, exist_ok=True)
            commands.append((source, [compiler] + flags + ["-c", source, "-o", str(obj)]))
        # The sources compile side by side, as the C++ ones do (UCCL_EP_BUILD_JOBS, default one per core).
        jobs = int(os.environ.get("UCCL_EP_BUILD_JOBS") or 0) or os.cpu_count() or 1
        log(f"{tool}: {len(commands)} source(s), {min(jobs, max(len(commands), 1))} at a time "
            f"(archs {','.join(CONFIG.archs)})")
        with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
            for source, command, error, seconds in pool.map(_run_gpu_compiler, commands):
                if error is not None:
                    raise SystemExit(f"[uccl-ep build] error: {tool} failed on {source}: {error}\n"
                                     f"command: {' '.join(command)}")
                log(f"{tool}: {source} took {seconds:.1f}s")
        return objects


CONFIG = BuildConfig()
# Compile the C++ sources in parallel (UCCL_EP_BUILD_JOBS, default: one per core).
ParallelCompile("UCCL_EP_BUILD_JOBS", default=0).install()

# Namespace-aware search: a folder still missing its __init__.py is packaged all the same.
PACKAGES = [
    name for name in find_namespace_packages(include=["uccl_ep_plugin", "uccl_ep_plugin.*"])
    if not name.endswith("__pycache__")
]
# Top-level folders installed as subpackages of uccl_ep_plugin.
FOLDER_PACKAGES = {
    "uccl_ep_plugin.bench_serving": "bench_serving",
    "uccl_ep_plugin.configs": "configs",
    "uccl_ep_plugin.integrations": "integrations",
    "uccl_ep_plugin.integrations.sglang": "integrations/sglang",
    "uccl_ep_plugin.integrations.vllm": "integrations/vllm",
}
FOLDER_PACKAGES = {name: folder for name, folder in FOLDER_PACKAGES.items() if (ROOT / folder).is_dir()}
PACKAGES += [name for name in FOLDER_PACKAGES if name not in PACKAGES]

setup(
    packages=PACKAGES,
    package_dir=FOLDER_PACKAGES,
    package_data={"uccl_ep_plugin.configs": ["*.yaml"]},
    ext_modules=[make_extension(CONFIG)],
    cmdclass={"build_ext": BuildExtWithGpu},
    zip_safe=False,
)
