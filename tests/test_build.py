"""Tests of the native extension ``uccl_ep_plugin._C`` and ``uccl_ep_plugin.build_info``.

They use whichever ``uccl_ep_plugin`` Python imports: an installed one (``pip install .``),
an editable one (``pip install -e .``) or an in-place build in this checkout, made with

    python setup.py build_ext --inplace          # then run: python -m pytest tests/test_build.py

(``UCCL_EP_CPU_ONLY=1`` builds without CUDA; ``UCCL_EP_CUDA_ARCH=90`` picks the SM archs.)
Tests that need the extension are skipped when it is not built, unless
``UCCL_EP_REQUIRE_EXTENSION=1`` is set, which makes that a failure (for CI).
The test marked ``gpu`` also needs a CUDA GPU visible to torch and a CUDA build.
"""

import itertools
import os
import shutil
import struct
import subprocess
import sys

import pytest

try:
    from uccl_ep_plugin import _C
    _IMPORT_ERROR = None
except ImportError as error:  # not built
    _C = None
    _IMPORT_ERROR = error

REQUIRE_EXTENSION = os.environ.get("UCCL_EP_REQUIRE_EXTENSION", "") not in ("", "0")


@pytest.fixture
def ext():
    if _C is None:
        message = (f"uccl_ep_plugin._C is not built ({_IMPORT_ERROR}); "
                   "build it with `python setup.py build_ext --inplace` or `pip install -e .`")
        if REQUIRE_EXTENSION:
            pytest.fail(message)
        pytest.skip(message)
    return _C


@pytest.fixture
def cuda_ext(ext):
    if not hasattr(ext, "dispatch_layout"):
        pytest.skip("uccl_ep_plugin._C was built without CUDA")
    return ext


# --------------------------------------------------------------------------------------
# build_info
# --------------------------------------------------------------------------------------
EXPECTED_TYPES = {
    "version": str,
    "cuda": bool,
    "cuda_static_runtime": bool,
    "cuda_archs": list,
    "hip": bool,
    "hip_archs": list,
    "verbs": bool,
    "features": list,
    "compiler": str,
    "extension_path": str,
}


def test_build_info_keys_and_types(ext):
    from uccl_ep_plugin.build_info import build_info

    info = build_info()
    for key, kind in EXPECTED_TYPES.items():
        assert isinstance(info[key], kind), (key, info[key])
    assert set(info) == set(EXPECTED_TYPES) | {"cuda_runtime_version"}
    assert all(isinstance(arch, str) and arch[:2].isdigit() for arch in info["cuda_archs"])
    assert all(isinstance(feature, str) for feature in info["features"])
    # The verbs transport is there exactly where the build found rdma-core's headers.
    assert info["verbs"] == ("verbs_transport" in info["features"]) == hasattr(ext, "VerbsTransport")
    if os.environ.get("CI") == "true":   # CI installs the headers first (tests/soft_roce/install.sh)
        assert info["verbs"], "the CI build has no verbs transport"
    assert info["hip"] is False and info["hip_archs"] == []   # tests/amd_build checks a HIP build
    assert info["version"] == "0.1.0"
    if info["cuda"]:
        assert isinstance(info["cuda_runtime_version"], int)
        assert info["cuda_runtime_version"] >= 11000
        assert info["cuda_archs"]
        assert info["cuda_static_runtime"] is True
        assert "dispatch_layout" in info["features"]
    else:
        assert info["cuda_runtime_version"] is None
        assert info["cuda_archs"] == []
        assert "dispatch_layout" not in info["features"]
    # The CUDA mode, the feature list and the exported function agree.
    assert hasattr(ext, "dispatch_layout") == info["cuda"]
    assert os.path.samefile(info["extension_path"], ext.__file__)


def test_build_info_returns_a_copy(ext):
    from uccl_ep_plugin.build_info import build_info

    first = build_info()
    first["features"].append("bogus")
    first["cuda"] = "changed"
    second = build_info()
    assert "bogus" not in second["features"]
    assert isinstance(second["cuda"], bool)


def test_build_info_without_extension(monkeypatch):
    from uccl_ep_plugin.build_info import build_info

    monkeypatch.setitem(sys.modules, "uccl_ep_plugin._C", None)  # makes the import fail
    with pytest.raises(ImportError, match=r"uccl_ep_plugin\._C is not built; reinstall with pip install \."):
        build_info()


# --------------------------------------------------------------------------------------
# The shared object: no libtorch, no dynamic cudart, importable on its own
# --------------------------------------------------------------------------------------
def elf_needed(path):
    """DT_NEEDED entries of a 64-bit little-endian ELF shared object."""
    with open(path, "rb") as handle:
        data = handle.read()
    assert data[:4] == b"\x7fELF", "not an ELF file"
    assert data[4] == 2 and data[5] == 1, "only 64-bit little-endian ELF is handled"
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    needed = []
    for _name, sh_type, _flags, _addr, offset, size, link, _info, _align, entsize in sections:
        if sh_type != 6:  # SHT_DYNAMIC
            continue
        strtab_offset = sections[link][4]
        for pos in range(offset, offset + size, entsize or 16):
            tag, value = struct.unpack_from("<qQ", data, pos)
            if tag == 0:  # DT_NULL
                break
            if tag == 1:  # DT_NEEDED
                end = data.index(b"\0", strtab_offset + value)
                needed.append(data[strtab_offset + value:end].decode())
    return needed


FORBIDDEN = ("libtorch", "libc10", "libcudart.so", "libpython")


def test_shared_object_has_no_torch_or_dynamic_cudart(ext):
    needed = elf_needed(ext.__file__)
    assert needed, "the extension has no DT_NEEDED entries at all"
    for library in needed:
        assert not library.startswith(FORBIDDEN), (library, needed)


@pytest.mark.skipif(shutil.which("ldd") is None, reason="ldd not available")
def test_ldd_shows_no_torch_or_dynamic_cudart(ext):
    output = subprocess.run(["ldd", ext.__file__], capture_output=True, text=True).stdout
    assert "not found" not in output, output
    for library in FORBIDDEN:
        assert library not in output, output


def test_extension_imports_alone_without_torch(ext):
    # Load the .so by path, without the uccl_ep_plugin package (whose __init__ may import
    # torch), and check that doing so neither needs nor imports torch, and needs no GPU.
    code = (
        "import importlib.util, sys\n"
        "spec = importlib.util.spec_from_file_location('uccl_ep_plugin._C', sys.argv[1])\n"
        "module = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        "info = module.build_info()\n"
        "assert 'torch' not in sys.modules, 'importing _C imported torch'\n"
        "print(info['version'])\n"
    )
    result = subprocess.run([sys.executable, "-c", code, ext.__file__], capture_output=True, text=True,
                            env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "0.1.0"


# --------------------------------------------------------------------------------------
# dispatch_layout argument checks (they run before any CUDA call, so no GPU is needed)
# --------------------------------------------------------------------------------------
GOOD = dict(topk_idx_ptr=1 << 20, num_tokens=16, num_topk=4, num_ranks=4, num_experts=32,
            num_tokens_per_rank_ptr=2 << 20, num_tokens_per_expert_ptr=3 << 20,
            is_token_in_rank_ptr=4 << 20, stream=0)

BAD_ARGUMENTS = [
    ({"num_tokens": -1}, "num_tokens"),
    ({"num_tokens": 1 << 31}, "num_tokens"),
    ({"num_topk": -1}, "num_topk"),
    ({"num_topk": 33}, "num_topk"),
    ({"num_ranks": 0}, "num_ranks"),
    ({"num_ranks": -2}, "num_ranks"),
    ({"num_ranks": 1 << 18, "num_experts": 1 << 18}, "num_ranks"),
    ({"num_experts": 0}, "num_experts"),
    ({"num_experts": -4}, "num_experts"),
    ({"num_experts": 30}, "num_experts"),  # not divisible by 4 ranks
    ({"num_ranks": 3}, "num_experts"),  # 32 experts over 3 ranks
    ({"topk_idx_ptr": 0}, "topk_idx"),
    ({"topk_idx_ptr": (1 << 20) + 4}, "topk_idx"),  # misaligned int64
    ({"num_tokens_per_rank_ptr": 0}, "num_tokens_per_rank"),
    ({"num_tokens_per_rank_ptr": (2 << 20) + 2}, "num_tokens_per_rank"),
    ({"num_tokens_per_expert_ptr": 0}, "num_tokens_per_expert"),
    ({"num_tokens_per_expert_ptr": (3 << 20) + 1}, "num_tokens_per_expert"),
    ({"is_token_in_rank_ptr": 0}, "is_token_in_rank"),
]


@pytest.mark.parametrize("change, name", BAD_ARGUMENTS, ids=[",".join(f"{k}={v}" for k, v in c.items())
                                                               for c, _ in BAD_ARGUMENTS])
def test_dispatch_layout_rejects_bad_arguments(cuda_ext, change, name):
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        cuda_ext.dispatch_layout(**{**GOOD, **change})


def test_dispatch_layout_limits(cuda_ext):
    assert cuda_ext.DISPATCH_LAYOUT_MAX_TOPK == 32
    assert cuda_ext.DISPATCH_LAYOUT_MAX_RANKS >= 1024


@pytest.mark.parametrize("field", ["topk_idx_ptr", "stream", "num_tokens_per_rank_ptr"])
def test_dispatch_layout_rejects_non_integers(cuda_ext, field):
    with pytest.raises(TypeError):
        cuda_ext.dispatch_layout(**{**GOOD, field: "0x100"})
    with pytest.raises(TypeError):
        cuda_ext.dispatch_layout(**{**GOOD, field: -8})


# --------------------------------------------------------------------------------------
# dispatch_layout on a GPU, against a plain torch computation
# --------------------------------------------------------------------------------------
def _reference_layout(torch, topk_idx, num_ranks, num_experts):
    num_tokens, num_topk = topk_idx.shape
    topk_idx = topk_idx.cpu()
    valid = topk_idx >= 0
    per_expert = torch.bincount(topk_idx[valid], minlength=num_experts).to(torch.int32)
    ranks = torch.div(topk_idx, num_experts // num_ranks, rounding_mode="floor")
    tokens = torch.arange(num_tokens).unsqueeze(1).expand(num_tokens, num_topk)
    in_rank = torch.zeros(num_tokens, num_ranks, dtype=torch.bool)
    in_rank[tokens[valid], ranks[valid]] = True
    per_rank = in_rank.sum(dim=0, dtype=torch.int32)
    return per_rank, per_expert, in_rank


def _random_topk(torch, generator, num_tokens, num_topk, num_experts, distinct, empty_fraction):
    if distinct:  # like a router: distinct experts per token
        scores = torch.rand(num_tokens, num_experts, generator=generator)
        topk = scores.topk(num_topk, dim=1).indices
    else:  # repeats allowed
        topk = torch.randint(0, num_experts, (num_tokens, num_topk), generator=generator)
    empty = torch.rand(num_tokens, num_topk, generator=generator) < empty_fraction
    return topk.masked_fill(empty, -1).to(torch.int64)


def _run_layout(torch, ext, topk_idx, num_ranks, num_experts, stream, in_rank_offset=0):
    device = topk_idx.device
    num_tokens, num_topk = topk_idx.shape
    # Poison every output so that a missing write shows up.
    per_rank = torch.full((num_ranks,), -777, dtype=torch.int32, device=device)
    per_expert = torch.full((num_experts,), 0x5A5A5A5A, dtype=torch.int32, device=device)
    raw = torch.full((num_tokens * num_ranks + in_rank_offset,), 0xAB, dtype=torch.uint8, device=device)
    in_rank_bytes = raw[in_rank_offset:]
    in_rank = in_rank_bytes.view(torch.bool).view(num_tokens, num_ranks)
    stream.wait_stream(torch.cuda.current_stream())  # the poison is written on the current stream
    with torch.cuda.stream(stream):
        ext.dispatch_layout(topk_idx.data_ptr(), num_tokens, num_topk, num_ranks, num_experts,
                            per_rank.data_ptr(), per_expert.data_ptr(), in_rank.data_ptr(),
                            stream.cuda_stream)
    stream.synchronize()
    assert int(in_rank_bytes.max().item() if in_rank_bytes.numel() else 0) <= 1, "non-0/1 bool bytes"
    return per_rank.cpu(), per_expert.cpu(), in_rank.cpu()


def _layout_cases():
    cases = []
    for num_tokens, num_ranks, (num_topk, num_experts) in itertools.product(
            (0, 1, 4096 + 17), (2, 4, 8), ((1, 8), (2, 16), (4, 64), (6, 96), (8, 256), (9, 288))):
        cases.append((num_tokens, num_topk, num_ranks, num_experts))
    for num_topk in (3, 5, 7):  # the remaining top-k values
        cases.append((4096 + 17, num_topk, 8, 128))
    # Odd rank counts and row offsets, many tiles, the limits, num_topk == 0.
    cases += [(1000, 8, 1, 64), (777, 6, 3, 96), (513, 8, 12, 96), (300, 8, 16, 256),
              (300, 8, 48, 384), (129, 8, 64, 256), (100, 32, 1024, 4096), (64, 0, 8, 64),
              (20000, 8, 16, 256)]
    # Beyond the shared-memory counters (more than 4096 experts or 1024 ranks).
    cases += [(200, 8, 8, 8192), (700, 4, 2048, 2048)]
    return cases


@pytest.mark.gpu
def test_dispatch_layout_matches_torch(cuda_ext):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU visible to torch")
    generator = torch.Generator().manual_seed(1234)
    stream = torch.cuda.Stream()
    for index, (num_tokens, num_topk, num_ranks, num_experts) in enumerate(_layout_cases()):
        distinct = index % 3 != 2 and num_topk <= num_experts
        topk_cpu = _random_topk(torch, generator, num_tokens, num_topk, num_experts, distinct,
                                empty_fraction=(0.0, 0.2, 0.5)[index % 3])
        topk = topk_cpu.cuda()
        # Unaligned topk_idx (8- but not 16-byte aligned) and bool rows on odd addresses.
        if index % 4 == 3 and num_tokens * num_topk > 0:
            padded = torch.empty(num_tokens * num_topk + 1, dtype=torch.int64, device="cuda")
            padded[1:] = topk.flatten()
            topk = padded[1:].view(num_tokens, num_topk)
        offset = 1 if index % 5 == 4 else 0
        expected = _reference_layout(torch, topk_cpu, num_ranks, num_experts)
        got = _run_layout(torch, cuda_ext, topk, num_ranks, num_experts, stream, offset)
        label = dict(num_tokens=num_tokens, num_topk=num_topk, num_ranks=num_ranks,
                     num_experts=num_experts, distinct=distinct, in_rank_offset=offset)
        for name, want, have in zip(("num_tokens_per_rank", "num_tokens_per_expert",
                                     "is_token_in_rank"), expected, got):
            assert torch.equal(want, have), (name, label)


@pytest.mark.gpu
def test_dispatch_layout_counts_repeated_experts_per_listing(cuda_ext):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU visible to torch")
    # Token 0 lists expert 5 twice, token 1 lists experts 5 and 6 (same rank) and -1.
    topk = torch.tensor([[5, 5, -1], [5, 6, -1]], dtype=torch.int64, device="cuda")
    per_rank, per_expert, in_rank = _run_layout(torch, cuda_ext, topk, 2, 8, torch.cuda.current_stream())
    assert per_expert.tolist() == [0, 0, 0, 0, 0, 3, 1, 0]
    assert per_rank.tolist() == [0, 2]
    assert in_rank.tolist() == [[False, True], [False, True]]
