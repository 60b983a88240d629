"""Comparing one engine's low-latency dispatch/combine with the reference engine's, call by call.

Each rank holds two Buffers on the same group: the *candidate* (the native engine on GPUs) and the
*oracle* (the reference engine). Both get the same fresh random inputs, and the candidate's
outputs are compared with the oracle's: ``recv_count``, ``layout_range`` and the valid rows of
``src_info`` equal, bf16 rows bit-equal, fp8 scales equal and fp8 bytes equal (or within one fp8
step: counted, printed, tolerated), combine results within a relative error. Rows past
``recv_count`` are unspecified and never compared.

Before every candidate call the memory the engine could be handed is poisoned with 0xFF bytes
(NaN for bf16/float32, -1 for integers) so an output the engine forgets to write cannot pass by
holding stale correct values; ``out=`` tensors are filled with NaN.

The same body runs reference-vs-reference on CPU ranks (gloo). There, *tampers* corrupt copies
of the candidate's outputs just before they are compared, to prove each comparison can fail.
"""

import os
import re
import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from tests.multiprocess import environment
from tests.reference_checks import Recorder, check_event, generator, random_topk_idx, random_weights
from uccl_ep_plugin import Buffer, CommTimeoutError, build_info
from uccl_ep_plugin.engines import ENGINE_ENV
from uccl_ep_plugin.engines.reference.quantize import dequantize_fp8, unpack_ue8m0

LOW_LATENCY_OPERATIONS = ("low_latency_dispatch", "low_latency_combine")
NATIVE_FEATURE = "low_latency_nvlink"
TIMEOUT_ENV = "UCCL_EP_TIMEOUT_SECONDS"
COMBINE_REL_ERROR = 1e-2
LOGFMT_REL_ERROR = 2e-2
FP8_STEP = 1.0 / 8               # e4m3 has 3 mantissa bits: one step is at most 1/8 of the value
FP8_SUBNORMAL_STEP = 2.0 ** -9   # the smallest e4m3 step, times the scale

SECTIONS = (
    "engines", "dispatch_bf16", "dispatch_fp8", "dispatch_fp8_round_scale", "dispatch_fp8_ue8m0",
    "combine", "combine_out", "combine_logfmt", "combine_zero_copy", "recv_hook", "async_finish", "stats",
    "double_buffer", "clean_buffer", "mask", "cuda_graph",
)
DISPATCH_VARIANTS = (
    ("dispatch_bf16", dict(use_fp8=False)),
    ("dispatch_fp8", dict(use_fp8=True)),
    ("dispatch_fp8_round_scale", dict(use_fp8=True, round_scale=True)),
    ("dispatch_fp8_ue8m0", dict(use_fp8=True, round_scale=True, use_ue8m0=True)),
)


# ---------------------------------------------------------------------------------------- cases
@dataclass(frozen=True)
class Case:
    name: str
    max_tokens: int                  # num_max_dispatch_tokens_per_rank (T)
    tokens: Tuple[int, ...]          # tokens of each rank (N <= T)
    hidden: int
    num_experts: int
    num_topk: int
    drop: float                      # probability that a top-k entry is -1
    seed: int

    def local_experts(self, num_ranks: int) -> int:
        return self.num_experts // num_ranks

    def tokens_of(self, rank: int) -> int:
        """N of ``rank``: the pattern of ``tokens`` repeats over groups of more ranks (EP4, EP8)."""
        return self.tokens[rank % len(self.tokens)]

    def describe(self, seed: int) -> str:
        return (f"case {self.name} (seed {seed}, T={self.max_tokens}, N={list(self.tokens)}, H={self.hidden}, "
                f"E={self.num_experts}, K={self.num_topk}, drop={self.drop})")

    def rdma_bytes(self, num_ranks: int) -> int:
        return Buffer.get_low_latency_rdma_size_hint(self.max_tokens, self.hidden, num_ranks, self.num_experts)

    def output_bytes(self, num_ranks: int) -> Dict[str, int]:
        """Bytes of each tensor one dispatch allocates (the largest variant: bf16 rows, float scales)."""
        rows = self.local_experts(num_ranks) * num_ranks * self.max_tokens
        return {"recv_x": rows * self.hidden * 2, "scales": rows * self.hidden // 128 * 4, "src_info": rows * 4,
                "layout_range": self.local_experts(num_ranks) * num_ranks * 8,
                "recv_count": self.local_experts(num_ranks) * 4}


# Issue 5's coverage on 2 GPUs: H 2048..8192, T 1..256 (N < T, N = 0 on one rank), top-k 1..11, experts 16..288.
GPU_CASES = (
    Case("deepseek", 128, (128, 128), 7168, 288, 8, 0.2, seed=501),
    Case("one-token", 1, (1, 1), 2048, 16, 1, 0.1, seed=502),
    Case("full-256-top11", 256, (256, 256), 4096, 64, 11, 0.3, seed=503),
    Case("partial-288-h8192", 256, (173, 256), 8192, 288, 11, 0.15, seed=504),
    Case("rank0-empty", 64, (0, 41), 7168, 16, 4, 0.25, seed=505),
    Case("rank1-empty", 96, (77, 0), 2048, 32, 8, 0.1, seed=506),
    Case("few-tokens-128-experts", 32, (3, 29), 4096, 128, 6, 0.3, seed=507),
)
GPU_MASK_CASES = (GPU_CASES[0], GPU_CASES[6])
GPU_GRAPH_CASES = (Case("graph-deepseek", 128, (128, 97), 7168, 288, 8, 0.2, seed=511),
                   Case("graph-small", 16, (16, 16), 2048, 16, 4, 0.3, seed=512))
TIMEOUT_CASE = Case("missing-peer", 32, (32, 32), 2048, 16, 4, 0.1, seed=521)

# Small enough for the reference engine on CPU ranks; still an empty rank, N < T, -1 entries and ue8m0.
SELF_CHECK_CASES = (Case("cpu-small", 8, (0, 6), 512, 8, 3, 0.2, seed=531),)
SELF_CHECK_MASK_CASES = SELF_CHECK_CASES


# ---------------------------------------------------------------------------------------- inputs
class Inputs(NamedTuple):
    x: torch.Tensor             # bf16 [N, H]
    topk_idx: torch.Tensor      # int64 [N, K], -1 = dropped
    topk_weights: torch.Tensor  # float32 [N, K]


def random_tokens(gen: torch.Generator, num_tokens: int, hidden: int) -> torch.Tensor:
    """Signed bf16, never zero; each 128-channel group has its own range 2^-6 .. 4, so fp8 scales differ and
    LogFMT both encodes groups (all below 1) and passes others through."""
    magnitude = torch.rand((num_tokens, hidden), generator=gen) * 0.97 + 0.02
    sign = torch.where(torch.rand((num_tokens, hidden), generator=gen) < 0.5, -1.0, 1.0)
    group_range = torch.exp2(torch.rand((num_tokens, hidden // 128, 1), generator=gen) * 8 - 6)
    return ((magnitude * sign).unflatten(-1, (-1, 128)) * group_range).flatten(-2).to(torch.bfloat16)


def make_inputs(case: Case, rank: int, seed: int, device: torch.device) -> Inputs:
    gen = generator(seed, rank)
    n = case.tokens_of(rank)
    x = random_tokens(gen, n, case.hidden)
    topk_idx = random_topk_idx(gen, n, case.num_experts, case.num_topk, case.drop)
    return Inputs(x.to(device), topk_idx.to(device), random_weights(gen, n, case.num_topk).to(device))


def valid_rows(recv_count: torch.Tensor, slots: int) -> torch.Tensor:
    """bool ``[El, slots]``: the first ``recv_count[e]`` rows of each local expert."""
    return torch.arange(slots, device=recv_count.device).unsqueeze(0) < recv_count.to(torch.int64).unsqueeze(1)


def float_scales(scales: torch.Tensor, use_ue8m0: bool) -> torch.Tensor:
    return unpack_ue8m0(scales) if use_ue8m0 else scales


def expert_factors(local_experts: int, device: torch.device) -> torch.Tensor:
    """The simulated expert of local expert ``e`` multiplies its rows by ``1 + 0.01 e``: ``[El, 1, 1]``."""
    return (1.0 + 0.01 * torch.arange(local_experts, device=device, dtype=torch.float32)).view(-1, 1, 1)


def expert_forward(recv_x) -> torch.Tensor:
    """Every row of a dispatch output (bf16, or fp8 with float scales, dequantized) times its expert's factor,
    as bf16; elementwise, so it can be captured in a CUDA graph."""
    if isinstance(recv_x, tuple):
        rows = dequantize_fp8(*recv_x)
    else:
        rows = recv_x.float()
    return (rows * expert_factors(rows.size(0), rows.device)).to(torch.bfloat16)


def expert_outputs(dispatched) -> torch.Tensor:
    """Combine input made from a dispatch result (bf16, or fp8 with float scales): the valid rows through the
    expert factors, every row past ``recv_count`` NaN (combine must never read those)."""
    recv_x, recv_count = dispatched[0], dispatched[1]
    data = recv_x[0] if isinstance(recv_x, tuple) else recv_x
    valid = valid_rows(recv_count, data.size(1))
    out = torch.full(tuple(data.shape), float("nan"), dtype=torch.bfloat16, device=data.device)
    expert, slot = valid.nonzero(as_tuple=True)
    if isinstance(recv_x, tuple):
        rows = dequantize_fp8(data[expert, slot], recv_x[1][expert, slot])
    else:
        rows = data[expert, slot].float()
    out[expert, slot] = (rows * expert_factors(data.size(0), data.device).view(-1, 1)[expert]).to(torch.bfloat16)
    return out


# ---------------------------------------------------------------------------------------- poisoning
POISON_BYTE = 0xFF
SMALL_POISON_SIZES = tuple(1 << k for k in range(20, 8, -1))    # 1 MiB .. 512 B: the small-block pool
SMALL_POISON_COPIES = 4


def poison_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """Overwrite every byte of ``tensor`` (any dtype, any strides) with 0xFF."""
    if tensor.numel() == 0:
        return tensor
    if tensor.dim() == 0:
        tensor = tensor.view(1)
    pattern = torch.full((*tensor.shape[:-1], tensor.size(-1) * tensor.element_size()), POISON_BYTE,
                         dtype=torch.uint8, device=tensor.device)
    return tensor.copy_(pattern.view(tensor.dtype))


def poison_allocator(device: torch.device, streams: Sequence, large_bytes: int) -> None:
    """Make the caching allocator hand out 0xFF-filled memory next on each of ``streams``.

    Cached free blocks are released first; then, per stream (blocks are cached per stream), one large block
    and a ladder of small ones are allocated, filled and freed, so the next allocations on that stream reuse
    poisoned memory. A no-op on CPU.
    """
    if device.type != "cuda":
        return
    # empty_cache frees with cudaFree, which waits for the device while holding a lock every other thread's
    # CUDA calls need: a proxy thread's copy for a kernel still in flight would wait for that kernel, which
    # waits for the copy. A plain synchronize first leaves cudaFree nothing to wait for.
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    for stream in streams:
        with torch.cuda.stream(stream):
            held = [torch.empty(large_bytes, dtype=torch.uint8, device=device)]
            held += [torch.empty(size, dtype=torch.uint8, device=device)
                     for size in SMALL_POISON_SIZES for _ in range(SMALL_POISON_COPIES)]
            for block in held:
                block.fill_(POISON_BYTE)
            del held


# ---------------------------------------------------------------------------------------- comparisons
def same_layout(rec: Recorder, got, want: torch.Tensor, what: str, strides: bool = False) -> bool:
    if not rec.expect(isinstance(got, torch.Tensor), f"{what}: expected a tensor, got {type(got).__name__}"):
        return False
    ok = rec.equal(got.dtype, want.dtype, f"{what}: dtype") and rec.equal(tuple(got.shape), tuple(want.shape),
                                                                         f"{what}: shape")
    if ok and strides:
        ok = rec.equal(got.stride(), want.stride(), f"{what}: strides (column-major in the last two dimensions)")
    return ok


def compare_dispatch(rec: Recorder, got, want, tag: str, *, use_fp8: bool, use_ue8m0: bool = False) -> None:
    """recv_count, layout_range, the handle's sizes and the valid rows of src_info and recv_x."""
    got_x, got_count, got_handle = got[0], got[1], got[2]
    want_x, want_count, want_handle = want[0], want[1], want[2]
    rec.equal(got_count, want_count, f"{tag}: recv_count")
    rec.equal(got_handle[1], want_handle[1], f"{tag}: layout_range")
    rec.equal(tuple(got_handle[2:]), tuple(want_handle[2:]), f"{tag}: handle sizes (T, H, E)")
    valid = valid_rows(want_count, want_handle[0].size(1))
    if same_layout(rec, got_handle[0], want_handle[0], f"{tag}: src_info"):
        rec.equal(got_handle[0][valid], want_handle[0][valid], f"{tag}: src_info of the valid rows")
    if not use_fp8:
        if same_layout(rec, got_x, want_x, f"{tag}: recv_x"):
            rec.equal(got_x[valid], want_x[valid], f"{tag}: bf16 rows (valid rows, bit-equal)")
        return
    if not rec.expect(isinstance(got_x, tuple) and len(got_x) == 2, f"{tag}: fp8 recv_x must be (data, scales)"):
        return
    compare_fp8_rows(rec, got_x, want_x, valid, tag, use_ue8m0)


def compare_fp8_rows(rec: Recorder, got, want, valid: torch.Tensor, tag: str, use_ue8m0: bool) -> None:
    """Scales equal; fp8 bytes equal, or (counted and printed) each differing value within one fp8 step."""
    (got_data, got_scales), (want_data, want_scales) = got, want
    if not (same_layout(rec, got_data, want_data, f"{tag}: fp8 data")
            and same_layout(rec, got_scales, want_scales, f"{tag}: scales", strides=True)):
        return
    rec.equal(got_scales[valid], want_scales[valid], f"{tag}: scales of the valid rows")
    got_bytes, want_bytes = got_data.view(torch.uint8)[valid], want_data.view(torch.uint8)[valid]
    num_differ = int((got_bytes != want_bytes).sum())
    got_values = dequantize_fp8(got_bytes.view(torch.float8_e4m3fn), float_scales(got_scales[valid], use_ue8m0))
    want_scale = float_scales(want_scales[valid], use_ue8m0)
    want_values = dequantize_fp8(want_bytes.view(torch.float8_e4m3fn), want_scale)
    step = (FP8_STEP * torch.maximum(got_values.abs(), want_values.abs())
            + FP8_SUBNORMAL_STEP * want_scale.repeat_interleave(128, dim=-1))
    off = ((got_values - want_values).abs() > step) | ~torch.isfinite(got_values)
    num_off = int(off.sum())
    max_diff = float((got_values - want_values).abs().nan_to_num(float("inf")).max()) if off.numel() else 0.0
    sys.stdout.write(f"[fp8 rank {rec.rank}] {tag}: {num_differ} of {want_bytes.numel()} fp8 bytes differ from the "
                     f"reference, {num_off} by more than one fp8 step; max |dequantized diff| {max_diff:.4g}\n")
    sys.stdout.flush()
    if num_off:
        first = tuple(off.nonzero()[0].tolist())
        rec.fail(f"{tag}: {num_off} dequantized fp8 values are more than one fp8 step off ({num_differ} bytes "
                 f"differ); first at valid row/channel {first}: got {got_values[first].item()!r}, "
                 f"expected {want_values[first].item()!r}")


def compare_combine(rec: Recorder, got, want: torch.Tensor, tag: str, rel: float = COMBINE_REL_ERROR) -> None:
    """Finite, and max |got - want| <= rel * max |want|."""
    if not same_layout(rec, got, want, f"{tag}: combined"):
        return
    bad = int((~torch.isfinite(got.float())).sum())
    if not rec.expect(bad == 0, f"{tag}: combined has {bad} non-finite values (poisoned memory or rows past "
                                f"recv_count read)"):
        return
    if want.numel() == 0:
        return
    error = float((got.float() - want.float()).abs().max())
    scale = float(want.float().abs().max())
    rec.expect(error <= rel * scale, f"{tag}: combined relative error {error / max(scale, 1e-30):.3g} > {rel} "
                                     f"(max |diff| {error:.4g}, max |reference| {scale:.4g})")


# ---------------------------------------------------------------------------------------- tampers (CPU self-check)
def _first_valid(recv_count: torch.Tensor) -> Optional[int]:
    nonzero = (recv_count > 0).nonzero()
    return int(nonzero[0]) if nonzero.numel() else None


def _replace_dispatch(result, recv_x=None, recv_count=None, src_info=None, layout_range=None):
    handle = result[2]
    new_handle = (src_info if src_info is not None else handle[0],
                  layout_range if layout_range is not None else handle[1]) + tuple(handle[2:])
    return (recv_x if recv_x is not None else result[0], recv_count if recv_count is not None else result[1],
            new_handle) + tuple(result[3:])


def _fp8_byte_to_bump(data: torch.Tensor, expert: int, count: int) -> Optional[Tuple[int, int]]:
    """A (slot, channel) whose fp8 value is normal and far from the range ends, with mantissa <= 5, so two
    encoding steps up stay within its binade."""
    raw = data.view(torch.uint8)[expert, :count]
    magnitude = raw & 0x7F
    usable = (magnitude >= 0x30) & (magnitude <= 0x70) & ((raw & 0x7) <= 5)
    where = usable.nonzero()
    return tuple(where[0].tolist()) if where.numel() else None


def _bump_fp8(result, steps: int):
    (data, scales), count = result[0], result[1]
    expert = _first_valid(count)
    target = None if expert is None else _fp8_byte_to_bump(data, expert, int(count[expert]))
    if target is None:
        return result
    data = data.clone()
    data.view(torch.uint8)[expert, target[0], target[1]] += steps
    return _replace_dispatch(result, recv_x=(data, scales))


def _tamper_recv_count(result):
    return _replace_dispatch(result, recv_count=result[1] + 1)


def _tamper_layout_range(result):
    return _replace_dispatch(result, layout_range=result[2][1] + 1)


def _tamper_src_info(result):
    expert = _first_valid(result[1])
    if expert is None:
        return result
    src_info = result[2][0].clone()
    src_info[expert, 0] += 1
    return _replace_dispatch(result, src_info=src_info)


def _tamper_bf16_row(result):
    expert = _first_valid(result[1])
    if expert is None or isinstance(result[0], tuple):
        return result
    rows = result[0].clone()
    rows.view(torch.int16)[expert, 0, 0] ^= 1          # one ulp
    return _replace_dispatch(result, recv_x=rows)


def _tamper_scales(result):
    expert = _first_valid(result[1])
    if expert is None or not isinstance(result[0], tuple):
        return result
    data, scales = result[0]
    scales = scales.clone()                             # keeps the transposed layout
    scales[expert, 0, 0] += 1 if scales.dtype == torch.int32 else scales[expert, 0, 0]
    return _replace_dispatch(result, recv_x=(data, scales))


def _tamper_rows_past_count(result):
    """Garbage in every unspecified row: must go unnoticed."""
    recv_x, count, src_info = result[0], result[1], result[2][0]
    past = ~valid_rows(count, src_info.size(1))
    src_info = src_info.masked_fill(past, 12345)
    if isinstance(recv_x, tuple):
        data, scales = recv_x[0].clone(), recv_x[1].clone()
        data.view(torch.uint8)[past] = 0x7F
        scales[past] = 7
        recv_x = (data, scales)
    else:
        recv_x = recv_x.masked_fill(past.unsqueeze(-1), float("nan"))
    return _replace_dispatch(result, recv_x=recv_x, src_info=src_info)


def _perturb_combined(combined: torch.Tensor) -> torch.Tensor:
    if combined.numel() == 0:
        return combined
    changed = combined.clone()
    changed[0, 0] += 0.05 * float(combined.float().abs().max()) + 1e-3
    return changed


DISPATCH_TAMPERS: Dict[str, Callable] = {
    "recv_count": _tamper_recv_count, "layout_range": _tamper_layout_range, "src_info": _tamper_src_info,
    "bf16_row": _tamper_bf16_row, "fp8_one_step": lambda r: _bump_fp8(r, 1) if isinstance(r[0], tuple) else r,
    "fp8_two_steps": lambda r: _bump_fp8(r, 2) if isinstance(r[0], tuple) else r, "scales": _tamper_scales,
    "rows_past_count": _tamper_rows_past_count,
}
COMBINE_TAMPERS: Dict[str, Callable] = {"combined": _perturb_combined}
STATS_TAMPERS: Dict[str, Callable] = {"stats": lambda stats: stats - 1}
# What each tamper must make fail (at least one rank); None and the tolerated tampers must fail nothing.
TAMPER_DETECTED_BY: Dict[Optional[str], Tuple[str, ...]] = {
    None: (), "fp8_one_step": (), "rows_past_count": (),
    "recv_count": ("dispatch_bf16", "dispatch_fp8", "recv_hook", "mask"),
    "layout_range": ("dispatch_bf16", "dispatch_fp8_ue8m0", "double_buffer"),
    "src_info": ("dispatch_bf16", "dispatch_fp8", "async_finish", "clean_buffer"),
    "bf16_row": ("dispatch_bf16", "recv_hook", "stats"),
    "fp8_two_steps": ("dispatch_fp8", "dispatch_fp8_round_scale", "dispatch_fp8_ue8m0"),
    "scales": ("dispatch_fp8", "dispatch_fp8_round_scale", "dispatch_fp8_ue8m0"),
    "combined": ("combine", "combine_out", "combine_logfmt", "combine_zero_copy", "double_buffer", "mask"),
    "stats": ("stats",),
}


# ---------------------------------------------------------------------------------------- the two Buffers
def make_buffer(group, engine: str, num_rdma_bytes: int, **kwargs) -> Buffer:
    """A low-latency Buffer served by ``engine`` (``UCCL_EP_ENGINE`` is read at construction)."""
    with environment(ENGINE_ENV, engine):
        return Buffer(group, num_rdma_bytes=num_rdma_bytes, low_latency_mode=True, **kwargs)


class Harness:
    """The candidate and oracle Buffers of one rank, the poisoning before candidate calls, and the checks
    (through the current tamper, if any)."""

    def __init__(self, rec: Recorder, group, rank: int, num_ranks: int, candidate: str, cases: Sequence[Case],
                 **buffer_kwargs) -> None:
        self.rec, self.group, self.rank, self.num_ranks = rec, group, rank, num_ranks
        self.candidate_engine = candidate
        num_rdma_bytes = max(case.rdma_bytes(num_ranks) for case in cases)
        self.candidate = make_buffer(group, candidate, num_rdma_bytes, **buffer_kwargs)
        self.oracle = make_buffer(group, "reference", num_rdma_bytes, **buffer_kwargs)
        self.device = self.candidate.device
        self.poison_bytes = max(2 * sum(case.output_bytes(num_ranks).values()) for case in cases) + (1 << 20)
        self.tamper: Optional[str] = None

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    def section(self, name: str):
        return self.rec.section(name if self.tamper is None else f"{self.tamper}/{name}")

    def poison(self) -> None:
        """Before a candidate call: the memory it allocates from (on either stream) holds 0xFF bytes."""
        streams = [torch.cuda.current_stream(self.device), self.candidate.get_comm_stream()] if self.on_gpu else []
        poison_allocator(self.device, streams, self.poison_bytes)

    def before(self, buffer: Buffer) -> None:
        """Before a call: poison for the candidate; for the oracle, whose engine runs NCCL collectives, let the
        candidate's kernels and proxy finish first (a collective's kernel holds up the proxy's copies that a
        peer still waits for: KERNEL_NOTES.md, the proxy path)."""
        if buffer is self.candidate:
            self.poison()
        else:
            self.candidate.synchronize()

    # ---- calls on both Buffers
    def clean(self, case: Case) -> None:
        for buffer in (self.candidate, self.oracle):
            self.before(buffer)
            buffer.clean_low_latency_buffer(case.max_tokens, case.hidden, case.num_experts)

    def dispatch(self, buffer: Buffer, case: Case, inputs: Inputs, **kwargs):
        self.before(buffer)
        return buffer.low_latency_dispatch(inputs.x, inputs.topk_idx, case.max_tokens, case.num_experts, **kwargs)

    def dispatch_both(self, case: Case, inputs: Inputs, **kwargs):
        """(candidate result, oracle result); with ``return_recv_hook`` both hooks have been called."""
        got = self.dispatch(self.candidate, case, inputs, **kwargs)
        want = self.dispatch(self.oracle, case, inputs, **kwargs)
        if kwargs.get("return_recv_hook"):
            for result in (got, want):
                if self.rec.expect(callable(result[4]), "return_recv_hook=True must return a callable hook"):
                    result[4]()
        return got, want

    def combine(self, buffer: Buffer, dispatched, inputs: Inputs, expert_out: torch.Tensor, **kwargs):
        self.before(buffer)
        return buffer.low_latency_combine(expert_out.clone(), inputs.topk_idx, inputs.topk_weights, dispatched[2],
                                          **kwargs)

    def combine_both(self, got_dispatch, want_dispatch, inputs: Inputs):
        """Both combine the same expert outputs (made from the oracle's dispatch); returns the two results."""
        expert_out = expert_outputs(want_dispatch)
        got = self.combine(self.candidate, got_dispatch, inputs, expert_out)[0]
        want = self.combine(self.oracle, want_dispatch, inputs, expert_out)[0]
        return got, want

    # ---- checks
    def check_dispatch(self, got, want, tag: str, *, use_fp8: bool, use_ue8m0: bool = False, **_) -> None:
        if self.tamper in DISPATCH_TAMPERS:
            got = DISPATCH_TAMPERS[self.tamper](got)
        compare_dispatch(self.rec, got, want, tag, use_fp8=use_fp8, use_ue8m0=use_ue8m0)

    def check_combine(self, got, want: torch.Tensor, tag: str, rel: float = COMBINE_REL_ERROR) -> None:
        if self.tamper in COMBINE_TAMPERS and isinstance(got, torch.Tensor):
            got = COMBINE_TAMPERS[self.tamper](got)
        compare_combine(self.rec, got, want, tag, rel)

    def check_stats_added(self, stats: torch.Tensor, before: torch.Tensor, added: torch.Tensor, tag: str) -> None:
        if self.tamper in STATS_TAMPERS:
            stats = STATS_TAMPERS[self.tamper](stats)
        self.rec.equal(stats, before + added.to(before.dtype), f"{tag}: cumulative_local_expert_recv_stats must "
                                                               "grow by recv_count")

    def check_cost_grew(self, cost: torch.Tensor, before: torch.Tensor, tag: str) -> None:
        self.rec.expect(bool((cost >= before).all()),
                        f"{tag}: wait-cost stats must only grow (non-negative ns): {before.tolist()} -> "
                        f"{cost.tolist()}")

    def check_event(self, event, tag: str) -> None:
        check_event(self.rec, event, tag)
        if self.on_gpu and event is not None and event.event is not None:
            self.rec.expect(isinstance(event.event.event, torch.cuda.Event),
                            f"{tag}: async_finish=True must carry a torch.cuda.Event")


# ---------------------------------------------------------------------------------------- sections
def engines_section(h: Harness, cases: Sequence[Case]) -> None:
    with h.section("engines"):
        for op in LOW_LATENCY_OPERATIONS:
            h.rec.equal(h.candidate.engine_by_operation[op], h.candidate_engine,
                        f"candidate Buffer serves {op} with (reasons: {h.candidate.engine_reasons})")
            h.rec.equal(h.oracle.engine_by_operation[op], "reference", f"oracle Buffer serves {op} with")
        if h.candidate_engine == "native":
            h.rec.expect(NATIVE_FEATURE in build_info().get("features", []),
                         f"build feature {NATIVE_FEATURE!r} missing from {build_info().get('features')}")
            for op in LOW_LATENCY_OPERATIONS:
                h.rec.expect(op not in h.candidate.engine_reasons,
                             f"the native engine cannot run {op}: {h.candidate.engine_reasons.get(op)}")
        if h.on_gpu:
            check_poison_reaches_allocations(h, cases)


def check_poison_reaches_allocations(h: Harness, cases: Sequence[Case]) -> None:
    """Harness self-test: after poisoning, allocations of every output size on both streams come back 0xFF."""
    sizes = {name: max(case.output_bytes(h.num_ranks)[name] for case in cases)
             for name in cases[0].output_bytes(h.num_ranks)}
    for stream_name, stream in (("current", torch.cuda.current_stream(h.device)),
                                ("communication", h.candidate.get_comm_stream())):
        h.poison()
        with torch.cuda.stream(stream):
            probes = {name: torch.empty(size, dtype=torch.uint8, device=h.device) for name, size in sizes.items()}
            for name, probe in probes.items():
                clean = int((probe != POISON_BYTE).sum())
                h.rec.expect(clean == 0, f"harness: poisoning missed {clean} of {probe.numel()} bytes of a "
                                         f"{name}-sized allocation on the {stream_name} stream")
            del probes


def dispatch_sections(h: Harness, case: Case, inputs: Inputs, tag: str) -> None:
    for section, options in DISPATCH_VARIANTS:
        with h.section(section):
            if options.get("use_ue8m0") and case.hidden % 512 != 0:
                continue
            got, want = h.dispatch_both(case, inputs, **options)
            h.check_dispatch(got, want, f"{tag} {section}", **options)


def combine_sections(h: Harness, case: Case, inputs: Inputs, tag: str) -> None:
    with h.section("combine"):
        for options in (dict(use_fp8=False), dict(use_fp8=True), dict(use_fp8=True, round_scale=True)):
            got_d, want_d = h.dispatch_both(case, inputs, **options)
            got, want = h.combine_both(got_d, want_d, inputs)
            h.check_combine(got, want, f"{tag} combine after dispatch {options}")
        # A handle rebuilt as a plain tuple has lost the native dispatch's record of row positions.
        got_d, want_d = h.dispatch_both(case, inputs, use_fp8=False)
        plain = got_d[:2] + (tuple(got_d[2]),) + got_d[3:]
        got, want = h.combine_both(plain, want_d, inputs)
        h.check_combine(got, want, f"{tag} combine with the handle as a plain tuple")
    with h.section("combine_out"):
        got_d, want_d = h.dispatch_both(case, inputs, use_fp8=False)
        expert_out = expert_outputs(want_d)
        out = torch.full((case.tokens_of(h.rank), case.hidden), float("nan"), dtype=torch.bfloat16, device=h.device)
        returned = h.combine(h.candidate, got_d, inputs, expert_out, out=out)[0]
        want = h.combine(h.oracle, want_d, inputs, expert_out)[0]
        h.rec.expect(returned is out or (returned.data_ptr() == out.data_ptr() and returned.shape == out.shape),
                     f"{tag}: combine(out=...) must return out itself")
        h.check_combine(out, want, f"{tag} combine into out=")
    with h.section("combine_logfmt"):
        got_d, want_d = h.dispatch_both(case, inputs, use_fp8=False)
        expert_out = expert_outputs(want_d)
        got = h.combine(h.candidate, got_d, inputs, expert_out, use_logfmt=True)[0]
        want_logfmt = h.combine(h.oracle, want_d, inputs, expert_out, use_logfmt=True)[0]
        want_plain = h.combine(h.oracle, want_d, inputs, expert_out)[0]
        h.check_combine(got, want_logfmt, f"{tag} LogFMT combine", rel=LOGFMT_REL_ERROR)
        h.rec.expect(bool((want_plain == 0).all()) or not torch.equal(want_logfmt, want_plain),
                     f"{tag}: the reference LogFMT combine is bit-identical to the plain one (inputs not encoded?)")
    with h.section("combine_zero_copy"):
        got_d, want_d = h.dispatch_both(case, inputs, use_fp8=False)
        expert_out = expert_outputs(want_d)
        h.poison()
        staging = h.candidate.get_next_low_latency_combine_buffer(got_d[2])
        if same_layout(h.rec, staging, expert_out, f"{tag}: get_next_low_latency_combine_buffer"):
            staging.copy_(expert_out)
            ignored = torch.full_like(expert_out, float("nan"))      # zero_copy sends the staged rows instead
            got = h.candidate.low_latency_combine(ignored, inputs.topk_idx, inputs.topk_weights, got_d[2],
                                                  zero_copy=True)[0]
            want = h.combine(h.oracle, want_d, inputs, expert_out)[0]
            h.check_combine(got, want, f"{tag} zero_copy combine")


def recv_hook_section(h: Harness, case: Case, inputs: Inputs, tag: str) -> None:
    with h.section("recv_hook"):
        for use_fp8 in (False, True):
            got_d = h.dispatch(h.candidate, case, inputs, use_fp8=use_fp8, return_recv_hook=True)
            want_d = h.dispatch(h.oracle, case, inputs, use_fp8=use_fp8)
            h.rec.expect(want_d[4] is None, f"{tag}: without return_recv_hook the hook must be None")
            if not h.rec.expect(callable(got_d[4]), f"{tag}: return_recv_hook=True must return a callable hook"):
                continue
            got_d[4]()
            got_d[4]()   # a second call receives nothing more (a second receive would wait for a send in vain)
            h.check_dispatch(got_d, want_d, f"{tag} dispatch through the hook (fp8={use_fp8})", use_fp8=use_fp8)
            expert_out = expert_outputs(want_d)
            got, _, hook = h.combine(h.candidate, got_d, inputs, expert_out, return_recv_hook=True)
            want = h.combine(h.oracle, want_d, inputs, expert_out)[0]
            if h.rec.expect(callable(hook), f"{tag}: combine with return_recv_hook=True must return a hook"):
                hook()
                hook()
                h.check_combine(got, want, f"{tag} combine through the hook (fp8={use_fp8})")


def async_section(h: Harness, case: Case, inputs: Inputs, tag: str) -> None:
    with h.section("async_finish"):
        got_d = h.dispatch(h.candidate, case, inputs, use_fp8=True, async_finish=True)
        h.check_event(got_d[3], f"{tag}: async dispatch event")
        h.rec.expect(got_d[4] is None, f"{tag}: async dispatch hook must be None")
        want_d = h.dispatch(h.oracle, case, inputs, use_fp8=True)
        h.check_dispatch(got_d, want_d, f"{tag} async fp8 dispatch", use_fp8=True)
        expert_out = expert_outputs(want_d)
        got, event, _ = h.combine(h.candidate, got_d, inputs, expert_out, async_finish=True)
        h.check_event(event, f"{tag}: async combine event")
        want = h.combine(h.oracle, want_d, inputs, expert_out)[0]
        h.check_combine(got, want, f"{tag} async combine")


def stats_section(h: Harness, case: Case, inputs: Inputs, tag: str, seed: int) -> None:
    gen = generator(seed, 100 + h.rank)
    el = case.local_experts(h.num_ranks)
    with h.section("stats"):
        for return_recv_hook in (False, True):
            what = f"{tag} stats ({'hook' if return_recv_hook else 'no hook'})"
            cumulative = torch.randint(0, 1000, (el,), generator=gen, dtype=torch.int32).to(h.device)
            dispatch_cost = torch.randint(0, 10 ** 6, (h.num_ranks,), generator=gen).to(h.device)
            combine_cost = torch.randint(0, 10 ** 6, (h.num_ranks,), generator=gen).to(h.device)
            before = cumulative.clone(), dispatch_cost.clone(), combine_cost.clone()
            got_d = h.dispatch(h.candidate, case, inputs, use_fp8=False, return_recv_hook=return_recv_hook,
                               cumulative_local_expert_recv_stats=cumulative,
                               dispatch_wait_recv_cost_stats=dispatch_cost)
            if return_recv_hook and h.rec.expect(callable(got_d[4]), f"{what}: no hook"):
                got_d[4]()
            want_d = h.dispatch(h.oracle, case, inputs, use_fp8=False)
            h.check_dispatch(got_d, want_d, what, use_fp8=False)
            h.check_stats_added(cumulative, before[0], want_d[1], what)
            h.check_cost_grew(dispatch_cost, before[1], f"{what}: dispatch_wait_recv_cost_stats")
            expert_out = expert_outputs(want_d)
            got, _, hook = h.combine(h.candidate, got_d, inputs, expert_out, return_recv_hook=return_recv_hook,
                                     combine_wait_recv_cost_stats=combine_cost)
            if return_recv_hook and h.rec.expect(callable(hook), f"{what}: no combine hook"):
                hook()
            h.check_cost_grew(combine_cost, before[2], f"{what}: combine_wait_recv_cost_stats")
            h.check_combine(got, h.combine(h.oracle, want_d, inputs, expert_out)[0], f"{what}: combine")


def double_buffer_section(h: Harness, case: Case, inputs: Inputs, tag: str, seed: int) -> None:
    """Two results alive at once: dispatch A, dispatch B, combine A, combine B; then the same with hooks
    (send A, send B, receive A, receive B), the two-micro-batch overlap pattern."""
    second = make_inputs(case, h.rank, seed + 1, h.device)
    pair = (("A", inputs), ("B", second))
    with h.section("double_buffer"):
        for use_hooks in (False, True):
            how = "sends then hooks" if use_hooks else "back to back"
            got_d = [h.dispatch(h.candidate, case, x, use_fp8=False, return_recv_hook=use_hooks) for _, x in pair]
            want_d = [h.dispatch(h.oracle, case, x, use_fp8=False) for _, x in pair]
            if use_hooks:
                _call_hooks(h, [d[4] for d in got_d], f"{tag} {how}: dispatch")
            for (name, _), got, want in zip(pair, got_d, want_d):
                h.check_dispatch(got, want, f"{tag} {how}: dispatch {name}", use_fp8=False)
            expert_out = [expert_outputs(want) for want in want_d]
            got_c = [h.combine(h.candidate, got, x, out_x, return_recv_hook=use_hooks)
                     for (_, x), got, out_x in zip(pair, got_d, expert_out)]
            if use_hooks:
                _call_hooks(h, [c[2] for c in got_c], f"{tag} {how}: combine")
            for (name, x), got, want, out_x in zip(pair, got_c, want_d, expert_out):
                h.check_combine(got[0], h.combine(h.oracle, want, x, out_x)[0], f"{tag} {how}: combine {name}")


def _call_hooks(h: Harness, hooks, what: str) -> None:
    for hook in hooks:
        if h.rec.expect(callable(hook), f"{what}: return_recv_hook=True must return a hook"):
            hook()


def exchange_round(h: Harness, case: Case, inputs: Inputs, tag: str) -> None:
    """One bf16 and one fp8 dispatch, each combined: all compared."""
    for use_fp8 in (False, True):
        got_d, want_d = h.dispatch_both(case, inputs, use_fp8=use_fp8)
        h.check_dispatch(got_d, want_d, f"{tag} dispatch (fp8={use_fp8})", use_fp8=use_fp8)
        got, want = h.combine_both(got_d, want_d, inputs)
        h.check_combine(got, want, f"{tag} combine (fp8={use_fp8})")


def clean_section(h: Harness, case: Case, inputs: Inputs, tag: str) -> None:
    with h.section("clean_buffer"):
        h.clean(case)
        exchange_round(h, case, inputs, f"{tag} after clean_low_latency_buffer")


def mask_sections(h: Harness, cases: Sequence[Case], pass_seed: int) -> None:
    """Every rank masks the last rank on both Buffers; compare; unmask with clean_mask_buffer; compare again."""
    masked = h.num_ranks - 1
    with h.section("mask"):
        for case in cases:
            seed = case.seed + pass_seed
            inputs = make_inputs(case, h.rank, seed, h.device)
            tag = f"{case.describe(seed)} with rank {masked} masked"
            h.clean(case)
            for buffer in (h.candidate, h.oracle):
                buffer.low_latency_update_mask_buffer(masked, True)
            expected = torch.zeros(h.num_ranks, dtype=torch.int32, device=h.device)
            expected[masked] = 1
            check_mask_status(h, expected, tag)
            exchange_round(h, case, inputs, tag)
            for buffer in (h.candidate, h.oracle):
                buffer.low_latency_clean_mask_buffer()
            check_mask_status(h, torch.zeros_like(expected), f"{tag}, after low_latency_clean_mask_buffer")
            exchange_round(h, case, inputs, f"{case.describe(seed)} after low_latency_clean_mask_buffer")


def check_mask_status(h: Harness, expected: torch.Tensor, tag: str) -> None:
    status = torch.full_like(expected, -1)
    h.candidate.low_latency_query_mask_buffer(status)
    h.rec.equal(status, expected, f"{tag}: low_latency_query_mask_buffer")


def graph_sections(h: Harness, cases: Sequence[Case], pass_seed: int, num_replays: int = 3) -> None:
    """dispatch + expert + combine captured in one CUDA graph, replayed on fresh inputs copied into the
    static tensors; each replay is compared with the oracle on the same inputs."""
    with h.section("cuda_graph"):
        if not h.on_gpu:
            return
        for case in cases:
            for use_fp8 in (False, True):
                check_graph_replays(h, case, case.seed + pass_seed, use_fp8, num_replays)


def check_graph_replays(h: Harness, case: Case, seed: int, use_fp8: bool, num_replays: int) -> None:
    tag = f"{case.describe(seed)} CUDA graph (fp8={use_fp8})"
    h.clean(case)
    static = make_inputs(case, h.rank, seed, h.device)

    def step():
        dispatched = h.candidate.low_latency_dispatch(static.x, static.topk_idx, case.max_tokens, case.num_experts,
                                                      use_fp8=use_fp8)
        combined = h.candidate.low_latency_combine(expert_forward(dispatched[0]), static.topk_idx,
                                                   static.topk_weights, dispatched[2])[0]
        return dispatched, combined

    side = torch.cuda.Stream(h.device)
    side.wait_stream(torch.cuda.current_stream(h.device))
    with torch.cuda.stream(side):
        step()                                                   # warm-up, outside the capture
    torch.cuda.current_stream(h.device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dispatched, combined = step()
    outputs = _graph_outputs(dispatched, combined)
    for replay in range(num_replays):
        fresh = make_inputs(case, h.rank, seed + 1 + replay, h.device)
        for static_tensor, value in zip(static, fresh):
            static_tensor.copy_(value)
        for tensor in outputs:
            poison_tensor(tensor)
        graph.replay()
        torch.cuda.synchronize(h.device)
        want_d = h.dispatch(h.oracle, case, fresh, use_fp8=use_fp8)
        want = h.combine(h.oracle, want_d, fresh, expert_forward(want_d[0]))[0]
        h.check_dispatch(dispatched, want_d, f"{tag} replay {replay}", use_fp8=use_fp8)
        h.check_combine(combined, want, f"{tag} replay {replay}")
    del graph


def _graph_outputs(dispatched, combined):
    recv_x = dispatched[0] if isinstance(dispatched[0], tuple) else (dispatched[0],)
    return recv_x + (dispatched[1], dispatched[2][0], dispatched[2][1], combined)


# ---------------------------------------------------------------------------------------- the body
def comparison_body(rank: int, num_ranks: int, group, rec: Recorder, *, candidate: str, cases: Sequence[Case],
                    mask_cases: Sequence[Case], graph_cases: Sequence[Case],
                    tampers: Sequence[Optional[str]] = (None,), environment: Optional[Dict[str, str]] = None,
                    two_hosts: bool = False) -> None:
    """Every section of :data:`SECTIONS` for each tamper (None: untampered; section names get a
    ``"<tamper>/"`` prefix otherwise), candidate engine against the reference engine. ``environment``
    is set in this rank's process first (e.g. UCCL_EP_FORCE_PROXY=1 for the proxy path); ``two_hosts``
    cuts the machine into two hosts of half the ranks' GPUs each (UCCL_EP_GPUS_PER_NODE), so each half
    reaches the other through the proxies and its own ranks over NVLink."""
    os.environ.update(environment or {})
    if two_hosts:
        os.environ["UCCL_EP_GPUS_PER_NODE"] = str(max(1, num_ranks // 2))
    h = Harness(rec, group, rank, num_ranks, candidate, cases)
    # A second Buffer, with enable_shrink, only where mask cases ask for it.
    shrink = Harness(rec, group, rank, num_ranks, candidate, mask_cases, enable_shrink=True) if mask_cases else None
    if not h.on_gpu:
        torch.set_num_threads(1)      # CPU ranks share the machine's cores; more threads only contend
    for pass_index, tamper in enumerate(tampers):
        h.tamper = tamper
        pass_seed = 1000 * pass_index
        engines_section(h, cases)
        for case in cases:
            seed = case.seed + pass_seed
            inputs = make_inputs(case, rank, seed, h.device)
            tag = case.describe(seed)
            with h.section("clean_buffer"):
                h.clean(case)                    # the Buffer is sized for the largest case; sizes change here
            dispatch_sections(h, case, inputs, tag)
            combine_sections(h, case, inputs, tag)
            recv_hook_section(h, case, inputs, tag)
            async_section(h, case, inputs, tag)
            stats_section(h, case, inputs, tag, seed)
            double_buffer_section(h, case, inputs, tag, seed)
            clean_section(h, case, inputs, tag)
        graph_sections(h, graph_cases, pass_seed)
        if shrink is not None:
            shrink.tamper = tamper
            mask_sections(shrink, mask_cases, pass_seed)
    if h.on_gpu:
        torch.cuda.synchronize(h.device)


# ---------------------------------------------------------------------------------------- a peer that never comes
def missing_peer_body(rank: int, num_ranks: int, group, rec: Recorder, *, candidate: str, enable_shrink: bool,
                      timeout_s: float, in_combine: bool = False, settings: Optional[Dict[str, str]] = None) -> None:
    """Rank 0 calls low_latency_dispatch; no other rank does. Without enable_shrink rank 0 must get a
    CommTimeoutError naming itself, the operation and a silent rank; with it, every silent rank is masked and
    rank 0 carries on alone. The silent ranks wait on a gloo barrier until rank 0 is done.

    ``in_combine`` (without enable_shrink): every rank dispatches, then only rank 0 calls low_latency_combine
    (its receive waits for the peers' rows; pre-reduced, its send first waits for their routing records).
    ``settings``: environment variables this rank sets first."""
    os.environ.update(settings or {})
    side = dist.new_group(backend="gloo")
    case = TIMEOUT_CASE
    silent = list(range(1, num_ranks))
    section = ("missing_peer_masked" if enable_shrink else
               "missing_combine_peer_raises" if in_combine else "missing_peer_raises")
    with rec.section(section):
        with environment(TIMEOUT_ENV, str(timeout_s)):
            buffer = make_buffer(group, candidate, case.rdma_bytes(num_ranks), enable_shrink=enable_shrink)
        inputs = make_inputs(case, rank, case.seed, buffer.device)
        dispatched = None
        if in_combine:
            dispatched = buffer.low_latency_dispatch(inputs.x, inputs.topk_idx, case.max_tokens, case.num_experts,
                                                     use_fp8=False)
            _sync(buffer)
        tag = (f"{case.describe(case.seed)}, ranks {silent} silent{' in the combine' if in_combine else ''}, "
               f"timeout {timeout_s:g} s")
        if rank == 0 and enable_shrink:
            check_silent_peer_masked(rec, buffer, case, inputs, tag, timeout_s, silent)
        elif rank == 0:
            check_silent_peer_raises(rec, buffer, case, inputs, tag, timeout_s, silent, dispatched)
    dist.barrier(group=side)


def hook_after_destroy_body(rank: int, num_ranks: int, group, rec: Recorder, *, candidate: str) -> None:
    """Every rank sends a dispatch and a combine with return_recv_hook, destroys its Buffer, then calls the
    hooks: each raises a RuntimeError saying the Buffer was destroyed (a receive then would read freed memory)."""
    case = TIMEOUT_CASE
    with rec.section("hook_after_destroy"):
        buffer = make_buffer(group, candidate, case.rdma_bytes(num_ranks), explicitly_destroy=True)
        inputs = make_inputs(case, rank, case.seed, buffer.device)
        dispatched = buffer.low_latency_dispatch(inputs.x, inputs.topk_idx, case.max_tokens, case.num_experts,
                                                 use_fp8=False, return_recv_hook=True)
        dispatched[4]()
        expert_out = torch.randn(dispatched[0].shape, dtype=torch.bfloat16, device=buffer.device)
        combine_hook = buffer.low_latency_combine(expert_out, inputs.topk_idx, inputs.topk_weights, dispatched[2],
                                                  return_recv_hook=True)[2]
        dispatch_hook = buffer.low_latency_dispatch(inputs.x, inputs.topk_idx, case.max_tokens, case.num_experts,
                                                    use_fp8=False, return_recv_hook=True)[4]
        buffer.destroy()
        for name, hook in (("dispatch", dispatch_hook), ("combine", combine_hook)):
            try:
                hook()
                rec.expect(False, f"rank {rank}: the {name} hook of a destroyed Buffer received")
            except RuntimeError as error:
                rec.expect("destroyed" in str(error), f"rank {rank}: the {name} hook raised {error!r}")


def _sync(buffer: Buffer) -> None:
    if buffer.device.type == "cuda":
        torch.cuda.synchronize(buffer.device)


def check_silent_peer_raises(rec: Recorder, buffer: Buffer, case: Case, inputs: Inputs, tag: str, timeout_s: float,
                             silent: List[int], dispatched=None) -> None:
    """The first call's kernel gives up after the timeout; the error surfaces by the next call. The call is a
    dispatch, or with ``dispatched`` (every rank's dispatch done) a combine of it."""
    operation = "low_latency_dispatch" if dispatched is None else "low_latency_combine"
    start = time.monotonic()
    try:
        for _ in range(2):
            if dispatched is None:
                buffer.low_latency_dispatch(inputs.x, inputs.topk_idx, case.max_tokens, case.num_experts,
                                            use_fp8=False)
            else:
                buffer.low_latency_combine(expert_outputs(dispatched), inputs.topk_idx, inputs.topk_weights,
                                           dispatched[2])
            _sync(buffer)
    except CommTimeoutError as error:
        elapsed = time.monotonic() - start
        message = str(error)
        for needed in ("rank 0", operation):
            rec.expect(needed in message, f"{tag}: the CommTimeoutError does not mention {needed!r}: {message}")
        rec.expect(any(re.search(rf"\brank {peer}\b", message) for peer in silent),
                   f"{tag}: the CommTimeoutError names none of the silent ranks: {message}")
        rec.expect(timeout_s * 0.9 <= elapsed <= timeout_s + 5,
                   f"{tag}: CommTimeoutError after {elapsed:.1f} s, expected {timeout_s:g} .. {timeout_s + 5:g} s")
    except Exception as error:  # noqa: BLE001 - any other failure is what the check reports
        rec.fail(f"{tag}: raised {type(error).__name__} ({error}) instead of CommTimeoutError")
    else:
        rec.fail(f"{tag}: two {operation} calls with ranks {silent} absent raised no CommTimeoutError "
                 f"({time.monotonic() - start:.1f} s)")


def check_silent_peer_masked(rec: Recorder, buffer: Buffer, case: Case, inputs: Inputs, tag: str, timeout_s: float,
                             silent: List[int]) -> None:
    """No error; the silent ranks show as masked; rank 0's own rows are dispatched and combined correctly."""
    start = time.monotonic()
    dispatched = buffer.low_latency_dispatch(inputs.x, inputs.topk_idx, case.max_tokens, case.num_experts,
                                             use_fp8=False)
    _sync(buffer)
    elapsed = time.monotonic() - start
    rec.expect(elapsed <= timeout_s + 5, f"{tag}: the dispatch took {elapsed:.1f} s (timeout {timeout_s:g} s)")
    status = torch.full((buffer.group_size,), -1, dtype=torch.int32, device=buffer.device)
    buffer.low_latency_query_mask_buffer(status)
    expected_status = torch.zeros_like(status)
    expected_status[silent] = 1
    rec.equal(status, expected_status, f"{tag}: mask status after the silent ranks timed out")
    compare_dispatch(rec, dispatched, self_only_dispatch(case, inputs, buffer.group_size), f"{tag}: dispatch",
                     use_fp8=False)
    start = time.monotonic()
    combined = buffer.low_latency_combine(expert_outputs(dispatched), inputs.topk_idx, inputs.topk_weights,
                                          dispatched[2])[0]
    _sync(buffer)
    elapsed = time.monotonic() - start
    rec.expect(elapsed < timeout_s, f"{tag}: the combine after masking took {elapsed:.1f} s: it must not wait "
                                    f"for the masked ranks again")
    compare_combine(rec, combined, self_only_combine(case, inputs, buffer.group_size), f"{tag}: combine")


def self_only_dispatch(case: Case, inputs: Inputs, num_ranks: int, rank: int = 0):
    """What rank ``rank`` receives when every other rank is masked: its own (token, slot) pairs for its local
    experts, per expert in token then slot order, as a dispatch result tuple (bf16)."""
    el = case.local_experts(num_ranks)
    slots = num_ranks * case.max_tokens
    device = inputs.x.device
    flat = inputs.topk_idx.reshape(-1)
    position = ((flat >= 0) & (flat // el == rank)).nonzero().reshape(-1)      # in (token, slot) order
    order = torch.sort(flat[position] % el, stable=True).indices
    position = position[order]
    expert, token = flat[position] % el, position // case.num_topk
    count = torch.bincount(expert, minlength=el)
    slot = torch.arange(expert.numel(), device=device) - (count.cumsum(0) - count)[expert]
    recv_x = torch.zeros((el, slots, case.hidden), dtype=torch.bfloat16, device=device)
    recv_x[expert, slot] = inputs.x[token]
    src_info = torch.full((el, slots), -1, dtype=torch.int32, device=device)
    src_info[expert, slot] = token.to(torch.int32)
    begin = torch.zeros((el, num_ranks), dtype=torch.int64, device=device)
    begin[:, rank + 1:] = count.unsqueeze(1)
    counts = torch.zeros_like(begin)
    counts[:, rank] = count
    handle = (src_info, (begin << 32) | counts, case.max_tokens, case.hidden, case.num_experts)
    return recv_x, count.to(torch.int32), handle


def self_only_combine(case: Case, inputs: Inputs, num_ranks: int, rank: int = 0) -> torch.Tensor:
    """The combine of :func:`expert_outputs` when only rank ``rank``'s own experts answer."""
    el = case.local_experts(num_ranks)
    idx = inputs.topk_idx
    local = (idx >= 0) & (idx // el == rank)
    factor = torch.where(local, 1.0 + 0.01 * (idx % el).float(), torch.zeros_like(inputs.topk_weights))
    expert_rows = (inputs.x.float().unsqueeze(1) * factor.unsqueeze(-1)).to(torch.bfloat16).float()
    return (expert_rows * inputs.topk_weights.unsqueeze(-1)).sum(1).to(torch.bfloat16)
