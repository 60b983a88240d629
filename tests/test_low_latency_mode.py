"""Low-latency ``low_latency_dispatch`` / ``low_latency_combine`` at 2 and 4 ranks.

One process group per rank count runs every case (random T, N, hidden, experts and top-k,
fresh random inputs, each rank seeded differently) and records each section's failures;
every section is its own pytest item. Expected values come from a plain-Python model of
every rank's routing, which each rank regenerates from the shared seeds.
"""

import pytest
import torch

from tests.reference_checks import (check_event, SectionCache, all_reduce_sum, assert_section, generator, randint, random_bf16,
                                    random_topk_idx, random_weights)

SEED = 7331
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0

SECTIONS = [
    "recv_count", "layout_range", "src_info_and_rows_bf16", "rows_fp8", "round_scale", "ue8m0",
    "scales_layout", "stats", "recv_hook", "combine_identity", "combine_expert_transform", "combine_fp8",
    "combine_out", "zero_copy", "logfmt", "double_buffer", "async_finish", "clean_buffer", "mask",
]


# ---------------------------------------------------------------------------------------- cases and inputs
def _case(case_id: int, num_ranks: int) -> dict:
    gen = generator(SEED * 100 + case_id + 10 * num_ranks)
    r = num_ranks
    spec = {"id": case_id, "drop": float(torch.rand((), generator=gen)) * 0.3, "round_scale": bool(case_id % 2)}
    if case_id == 0:      # N == T everywhere
        t = randint(gen, 8, 24)
        spec.update(T=t, hidden=256, local_experts=randint(gen, 1, 8), tokens=[t] * r)
    elif case_id == 1:    # N < T
        t = randint(gen, 16, 40)
        spec.update(T=t, hidden=384, local_experts=randint(gen, 2, 6),
                    tokens=[randint(gen, 1, t - 1) for _ in range(r)])
    elif case_id == 2:    # one token per rank
        spec.update(T=randint(gen, 2, 8), hidden=640, local_experts=randint(gen, 1, 4), tokens=[1] * r)
    elif case_id == 3:    # a rank without tokens
        t = randint(gen, 4, 20)
        spec.update(T=t, hidden=512, local_experts=randint(gen, 2, 8),
                    tokens=[0] + [randint(gen, 1, t) for _ in range(r - 1)])
    elif case_id == 4:    # top-32 over 64 experts
        t = randint(gen, 8, 16)
        spec.update(T=t, hidden=512, local_experts=64 // r, num_topk=32, tokens=[randint(gen, 1, t) for _ in range(r)])
    elif case_id == 9:    # every token goes to rank 0's experts: the other ranks receive nothing
        t = randint(gen, 4, 12)
        el = randint(gen, 2, 4)
        spec.update(T=t, hidden=512, local_experts=el, num_topk=randint(gen, 1, el), only_to_rank0=True,
                    tokens=[randint(gen, 1, t) for _ in range(r)])
    elif case_id == 5:    # the largest hidden
        t = randint(gen, 4, 16)
        spec.update(T=t, hidden=1024, local_experts=randint(gen, 1, 16 // r * 2),
                    tokens=[t] + [randint(gen, 1, t) for _ in range(r - 1)])
    else:                 # fully random, T from 1
        t = randint(gen, 1, 48)
        spec.update(T=t, hidden=128 * randint(gen, 2, 8), local_experts=randint(gen, 1, 64 // r),
                    tokens=[randint(gen, 0, t) for _ in range(r)])
    spec["num_experts"] = r * spec["local_experts"]
    if "num_topk" not in spec:
        spec["num_topk"] = min(randint(gen, 1, 11), spec["num_experts"])
    spec["ue8m0"] = spec["hidden"] % 512 == 0
    return spec


NUM_CASES = 10


def _inputs(spec: dict, rank: int) -> dict:
    gen = generator(SEED * 100 + spec["id"], rank)
    n = spec["tokens"][rank]
    unpicked = range(spec["local_experts"], spec["num_experts"]) if spec.get("only_to_rank0") else ()
    topk_idx = random_topk_idx(gen, n, spec["num_experts"], spec["num_topk"], spec["drop"], unpicked)
    # Magnitudes below 1 (LogFMT only encodes such groups), never zero, different per rank and token; each
    # 128-channel group has its own range (2^-6 .. 1), so fp8 scales differ between groups.
    x = random_bf16(gen, (n, spec["hidden"]), 0.02, 0.99).float()
    group_range = torch.exp2(-6 * torch.rand((n, spec["hidden"] // 128, 1), generator=gen))
    x = (x.unflatten(-1, (-1, 128)) * group_range).flatten(-2).to(torch.bfloat16)
    return {"n": n, "x": x, "topk_idx": topk_idx, "topk_weights": random_weights(gen, n, spec["num_topk"])}


def _model(spec: dict, inputs: list, me: int, masked=frozenset()) -> dict:
    """tokens[e][s]: sorted tokens of source rank ``s`` routed to local expert ``e`` of ``me``. A masked rank
    neither receives nor is received from."""
    r, el = len(inputs), spec["local_experts"]
    tokens = [[[] for _ in range(r)] for _ in range(el)]
    for src in range(r):
        if src in masked or me in masked:
            continue
        for t, row in enumerate(inputs[src]["topk_idx"].tolist()):
            for v in row:
                if v >= 0 and v // el == me:
                    tokens[v % el][src].append(t)
    return {"tokens": tokens, "count": [sum(len(tokens[e][s]) for s in range(r)) for e in range(el)]}


def _expert_factor(local_expert: int) -> float:
    return 1.0 + 0.01 * local_expert


# ---------------------------------------------------------------------------------------- helpers
def _unpack_ue8m0(packed: torch.Tensor) -> torch.Tensor:
    """int32 ``[..., S/4]`` holding 4 exponent bytes each (little end first) -> float32 powers of two ``[..., S]``."""
    words = packed.to(torch.int64) & 0xFFFFFFFF
    exponents = torch.stack([(words >> (8 * i)) & 0xFF for i in range(4)], dim=-1).flatten(-2)
    return torch.pow(2.0, (exponents - 127).to(torch.float64)).to(torch.float32)


def _dequantize(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    values = data.float()
    return (values.unflatten(-1, (-1, 128)) * scales.unsqueeze(-1)).flatten(-2)


def _simulated_expert(recv_x: torch.Tensor, recv_count: torch.Tensor, transform: bool, seed: int) -> torch.Tensor:
    """The "expert": valid rows scaled by 1 + 0.01 * local expert (or unchanged); invalid rows get garbage,
    which combine must ignore."""
    out = random_bf16(generator(seed), tuple(recv_x.shape), 4.0, 8.0)
    for e in range(recv_x.size(0)):
        c = int(recv_count[e])
        rows = recv_x[e, :c].float()
        out[e, :c] = (rows * _expert_factor(e)).to(torch.bfloat16) if transform else rows.to(torch.bfloat16)
    return out


def _expected_combine(spec: dict, mine: dict, transform: bool, masked=frozenset()):
    """sum_k w[t, k] * bf16(x[t] * factor(k)) over valid, unmasked k; also sum_k w * factor (for bounds)."""
    el = spec["local_experts"]
    x = mine["x"].float()
    expected = torch.zeros_like(x)
    magnitude = torch.zeros((x.size(0), 1))
    for t, (row, weights) in enumerate(zip(mine["topk_idx"].tolist(), mine["topk_weights"].tolist())):
        for v, w in zip(row, weights):
            if v < 0 or (v // el) in masked:
                continue
            factor = _expert_factor(v % el) if transform else 1.0
            expected[t] += w * (x[t] * factor).to(torch.bfloat16).float()
            magnitude[t] += w * factor
    return expected, magnitude


def _valid_rows(result) -> list:
    """Per local expert, ``(source rank, token, row)`` of its valid rows in a canonical order (within one
    source the slot order is not specified), so two dispatches of the same input compare equal."""
    recv_x, handle = result[0], result[2]
    data = recv_x[0] if isinstance(recv_x, tuple) else recv_x
    out = []
    for e in range(handle[1].size(0)):
        entries = []
        for s in range(handle[1].size(1)):
            b, c = int(handle[1][e, s]) >> 32, int(handle[1][e, s]) & 0xFFFFFFFF
            for k in range(b, b + c):
                entries.append((s, int(handle[0][e, k]), data[e, k].view(torch.uint8).tolist()))
        out.append(sorted(entries))
    return out


def _calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepEP's similarity measure: 0 for identical tensors."""
    x, y = x.double() + 1, y.double() + 1
    denominator = (x * x + y * y).sum()
    return float(1 - 2 * (x * y).sum() / denominator)


# ---------------------------------------------------------------------------------------- per-dispatch checks
_ROUND_SCALE_ROWS_CHECKED = [0]            # rows whose round_scale scales were checked, in this process


def _check_dispatch(rec, spec, inputs, model, rank, num_ranks, result, tag, *, use_fp8, round_scale=False,
                    use_ue8m0=False, sections=None):
    """Counts, layout_range, src_info and rows of one low-latency dispatch against the model."""
    sections = sections or {}
    recv_x, recv_count, handle = result[0], result[1], result[2]
    el, t_max = spec["local_experts"], spec["T"]
    slots = num_ranks * t_max
    with rec.section(sections.get("count", "recv_count")):
        rec.equal(recv_count, torch.tensor(model["count"], dtype=torch.int32), f"{tag}: packed_recv_count")
    with rec.section(sections.get("layout", "layout_range")):
        layout_range = handle[1]
        rec.equal(tuple(layout_range.shape), (el, num_ranks), f"{tag}: layout_range shape")
        rec.equal(layout_range.dtype, torch.int64, f"{tag}: layout_range dtype")
        begin, count = layout_range >> 32, layout_range & 0xFFFFFFFF
        expected_count = torch.tensor([[len(model["tokens"][e][s]) for s in range(num_ranks)] for e in range(el)],
                                      dtype=torch.int64)
        rec.equal(count, expected_count, f"{tag}: layout_range counts")
        # Ranges tile [0, packed_recv_count[e]) in source-rank order.
        rec.equal(begin, torch.cumsum(count, 1) - count, f"{tag}: layout_range begins")
        rec.equal(count.sum(1), recv_count.to(torch.int64), f"{tag}: layout_range totals vs packed_recv_count")
    if use_fp8:
        data, scales = recv_x
        num_scales = spec["hidden"] // (512 if use_ue8m0 else 128)
        with rec.section(sections.get("scales", "scales_layout")):
            rec.equal(data.dtype, FP8, f"{tag}: fp8 data dtype")
            rec.equal(tuple(data.shape), (el, slots, spec["hidden"]), f"{tag}: fp8 data shape")
            rec.equal(scales.dtype, torch.int32 if use_ue8m0 else torch.float32, f"{tag}: scales dtype")
            rec.equal(tuple(scales.shape), (el, slots, num_scales), f"{tag}: scales shape")
            rec.equal(scales.stride(1), 1, f"{tag}: scales must be column-major in the last two dimensions")
            rec.equal(scales.stride(2), slots, f"{tag}: scales stride between scale columns")
        float_scales = _unpack_ue8m0(scales) if use_ue8m0 else scales
    src_info = handle[0]
    row_section = sections.get("rows", "rows_fp8" if use_fp8 else "src_info_and_rows_bf16")
    with rec.section(row_section):
        if not use_fp8:
            rec.equal(recv_x.dtype, torch.bfloat16, f"{tag}: bf16 recv_x dtype")
            rec.equal(tuple(recv_x.shape), (el, slots, spec["hidden"]), f"{tag}: recv_x shape")
        rec.equal(tuple(src_info.shape), (el, slots), f"{tag}: src_info shape")
        rec.equal(src_info.dtype, torch.int32, f"{tag}: src_info dtype")
        for e in range(el):
            for s in range(num_ranks):
                b, c = int(layout_range[e, s]) >> 32, int(layout_range[e, s]) & 0xFFFFFFFF
                src = src_info[e, b:b + c].long()
                rec.equal(sorted(src.tolist()), model["tokens"][e][s], f"{tag}: tokens of source {s} in expert {e}")
                if c == 0 or not bool(((src >= 0) & (src < inputs[s]["n"])).all()):
                    continue
                want = inputs[s]["x"][src]
                if not use_fp8:
                    rec.equal(recv_x[e, b:b + c], want, f"{tag}: rows of source {s} in expert {e}")
                    continue
                got = _dequantize(recv_x[0][e, b:b + c], float_scales[e, b:b + c])
                step = float_scales[e, b:b + c].repeat_interleave(128, dim=-1)
                bound = want.float().abs() * 2.0 ** -4 * 1.01 + step * 2.0 ** -10 * 1.01
                rec.close(got, want.float(), f"{tag}: dequantised rows of source {s} in expert {e}", 0.0, bound)
                amax = want.float().unflatten(-1, (-1, 128)).abs().amax(-1)
                if use_ue8m0:
                    pass
                elif round_scale:
                    with rec.section(sections.get("round", "round_scale")):
                        _ROUND_SCALE_ROWS_CHECKED[0] += c
                        mantissa, _ = torch.frexp(float_scales[e, b:b + c])
                        rec.expect(bool((mantissa == 0.5).all()), f"{tag}: round_scale scales not powers of two")
                        rec.expect(bool((float_scales[e, b:b + c] >= amax / FP8_MAX).all()),
                                   f"{tag}: round_scale scales below amax / 448 (values would clip)")
                        rec.expect(bool((float_scales[e, b:b + c] < 2 * amax / FP8_MAX).all()),
                                   f"{tag}: round_scale scales not the smallest power of two >= amax / 448")
                else:
                    rec.close(float_scales[e, b:b + c], amax / FP8_MAX, f"{tag}: scales = amax / 448", 1e-5, 0.0)


# ---------------------------------------------------------------------------------------- the body
def _body(rank, num_ranks, group, rec):
    from uccl_ep_plugin import Buffer, EventOverlap

    for case_id in range(NUM_CASES):
        spec = _case(case_id, num_ranks)
        inputs = [_inputs(spec, s) for s in range(num_ranks)]
        mine = inputs[rank]
        model = _model(spec, inputs, rank)
        t_max, hidden, e_total, el = spec["T"], spec["hidden"], spec["num_experts"], spec["local_experts"]
        tag = f"case {case_id} (T={t_max}, N={spec['tokens']}, H={hidden}, E={e_total}, K={spec['num_topk']})"
        buffer = Buffer(group, 0, Buffer.get_low_latency_rdma_size_hint(t_max, hidden, num_ranks, e_total),
                        low_latency_mode=True, num_qps_per_rank=el)
        with rec.section("clean_buffer"):
            rec.expect(buffer.clean_low_latency_buffer(t_max, hidden, e_total) is None, f"{tag}: clean returns None")

        def dispatch(**kwargs):
            return buffer.low_latency_dispatch(mine["x"], mine["topk_idx"], t_max, e_total, **kwargs)

        # ---- bf16 dispatch, with stats on some cases
        use_stats = case_id in (1, 3, 5)
        cumulative = torch.zeros(el, dtype=torch.int32) if use_stats else None
        wait_cost = torch.zeros(num_ranks, dtype=torch.int64) if use_stats else None
        hook_case = case_id in (0, 3)
        result = dispatch(use_fp8=False, cumulative_local_expert_recv_stats=cumulative,
                          dispatch_wait_recv_cost_stats=wait_cost, return_recv_hook=hook_case)
        with rec.section("recv_hook"):
            rec.equal(len(result), 5, f"{tag}: low_latency_dispatch tuple length")
            if hook_case:
                rec.expect(callable(result[4]), f"{tag}: return_recv_hook=True must return a callable hook")
                if callable(result[4]):
                    result[4]()                                              # receives
            else:
                rec.expect(result[4] is None, f"{tag}: hook must be None without return_recv_hook")
        with rec.section("recv_count"):
            reduced = torch.zeros(e_total, dtype=torch.int64)
            valid = mine["topk_idx"][mine["topk_idx"] >= 0]
            reduced += torch.bincount(valid, minlength=e_total)
            reduced = all_reduce_sum(reduced, group)
            rec.equal(result[1].to(torch.int64), reduced[rank * el:(rank + 1) * el],
                      f"{tag}: packed_recv_count vs all-reduced (token, slot) counts")
        _check_dispatch(rec, spec, inputs, model, rank, num_ranks, result, tag, use_fp8=False)
        bf16_result = result
        if hook_case and callable(result[4]):
            with rec.section("recv_hook"):
                before = result[0].clone(), result[1].clone(), result[2][0].clone()
                result[4]()                                                  # a second call changes nothing
                rec.equal(result[0], before[0], f"{tag}: recv_x after a second hook() call")
                rec.equal(result[2][0], before[2], f"{tag}: src_info after a second hook() call")

        if use_stats:
            with rec.section("stats"):
                first_cost = wait_cost.clone()
                rec.equal(cumulative, torch.tensor(model["count"], dtype=torch.int32), f"{tag}: cumulative stats")
                rec.expect(bool((wait_cost >= 0).all()), f"{tag}: negative wait cost {wait_cost.tolist()}")
                rec.equal(wait_cost.dtype, torch.int64, f"{tag}: wait cost dtype")
                dispatch(use_fp8=True, cumulative_local_expert_recv_stats=cumulative,
                         dispatch_wait_recv_cost_stats=wait_cost)
                rec.equal(cumulative, 2 * torch.tensor(model["count"], dtype=torch.int32),
                          f"{tag}: cumulative stats after two dispatches")
                rec.expect(bool((wait_cost >= first_cost).all()) and int(wait_cost.sum()) > int(first_cost.sum()),
                           f"{tag}: dispatch wait cost did not grow: {first_cost.tolist()} -> {wait_cost.tolist()}")
                combine_cost = torch.zeros(num_ranks, dtype=torch.int64)
                buffer.low_latency_combine(bf16_result[0], mine["topk_idx"], mine["topk_weights"], bf16_result[2],
                                           combine_wait_recv_cost_stats=combine_cost)
                first = combine_cost.clone()
                rec.expect(bool((first >= 0).all()), f"{tag}: negative combine wait cost {first.tolist()}")
                buffer.low_latency_combine(bf16_result[0], mine["topk_idx"], mine["topk_weights"], bf16_result[2],
                                           combine_wait_recv_cost_stats=combine_cost)
                rec.expect(bool((combine_cost >= first).all()) and int(combine_cost.sum()) > int(first.sum()),
                           f"{tag}: combine wait cost did not grow: {first.tolist()} -> {combine_cost.tolist()}")

        # ---- combine of the bf16 dispatch: identity expert (DeepEP's check) and a per-expert transform
        with rec.section("combine_identity"):
            expert_out = _simulated_expert(bf16_result[0], bf16_result[1], False, case_id * 10 + rank)
            combined, event, hook = buffer.low_latency_combine(expert_out, mine["topk_idx"], mine["topk_weights"],
                                                               bf16_result[2])
            rec.expect(hook is None, f"{tag}: combine hook must be None without return_recv_hook")
            rec.expect(isinstance(event, EventOverlap), f"{tag}: combine event type {type(event).__name__}")
            valid = mine["topk_idx"] >= 0
            weight_sum = torch.where(valid, mine["topk_weights"], torch.zeros_like(mine["topk_weights"])).sum(1, True)
            expected = mine["x"].float() * weight_sum
            rec.equal(combined.dtype, torch.bfloat16, f"{tag}: combined dtype")
            rec.close(combined, expected, f"{tag}: identity expert: x * sum of valid weights", 2.0 ** -7, 1e-6)
            if combined.numel() > 0:
                diff = _calc_diff(combined.float(), expected)
                rec.expect(diff < 1e-5, f"{tag}: calc_diff {diff} >= 1e-5")
            plain_combined = combined
        with rec.section("combine_expert_transform"):
            expert_out = _simulated_expert(bf16_result[0], bf16_result[1], True, case_id * 10 + rank + 1)
            combined, _, hook = buffer.low_latency_combine(expert_out, mine["topk_idx"], mine["topk_weights"],
                                                           bf16_result[2], return_recv_hook=hook_case)
            if hook_case:
                rec.expect(callable(hook), f"{tag}: combine with return_recv_hook must return a hook")
                hook()
                hook()
            expected, _ = _expected_combine(spec, mine, True)
            rec.close(combined, expected, f"{tag}: x[t] * sum_k w * (1 + 0.01 * local expert)", 2.0 ** -7, 1e-6)

        # ---- fp8 dispatch (float scales, round_scale alternating), then its combine
        fp8_result = dispatch(use_fp8=True, round_scale=spec["round_scale"])
        _check_dispatch(rec, spec, inputs, model, rank, num_ranks, fp8_result, tag + " fp8", use_fp8=True,
                        round_scale=spec["round_scale"])
        with rec.section("combine_fp8"):
            data, scales = fp8_result[0]
            deq = _dequantize(data, scales).to(torch.bfloat16)
            expert_out = _simulated_expert(deq, fp8_result[1], True, case_id * 10 + rank + 2)
            combined = buffer.low_latency_combine(expert_out, mine["topk_idx"], mine["topk_weights"],
                                                  fp8_result[2])[0]
            expected, weight_factor = _expected_combine(spec, mine, True)
            amax = mine["x"].float().unflatten(-1, (-1, 128)).abs().amax(-1).repeat_interleave(128, dim=-1)
            bound = (weight_factor * (mine["x"].float().abs() * 2.0 ** -4 + 2 * amax / FP8_MAX * 2.0 ** -10) * 1.05
                     + expected.abs() * 2.0 ** -7)
            rec.close(combined, expected, f"{tag}: combine after fp8 dispatch", 0.0, bound)

        # ---- UE8M0: the same powers of two as round_scale, packed
        if spec["ue8m0"]:
            with rec.section("ue8m0"):
                rounded = dispatch(use_fp8=True, round_scale=True)
                packed = dispatch(use_fp8=True, round_scale=True, use_ue8m0=True)
                _check_dispatch(rec, spec, inputs, model, rank, num_ranks, packed, tag + " ue8m0", use_fp8=True,
                                round_scale=True, use_ue8m0=True,
                                sections={"count": "ue8m0", "layout": "ue8m0", "rows": "ue8m0"})
                for e in range(el):
                    c = int(packed[1][e])
                    rec.equal(_unpack_ue8m0(packed[0][1][e, :c]), rounded[0][1][e, :c],
                              f"{tag}: unpacked UE8M0 scales vs round_scale scales, expert {e}")
                    rec.equal(packed[0][0][e, :c].view(torch.uint8), rounded[0][0][e, :c].view(torch.uint8),
                              f"{tag}: UE8M0 fp8 data vs round_scale data, expert {e}")
                    rec.equal(packed[2][0][e, :c], rounded[2][0][e, :c], f"{tag}: UE8M0 src_info, expert {e}")

        # ---- out=, zero_copy, LogFMT
        if case_id in (0, 2, 4):
            redo = dispatch(use_fp8=False)
            expert_out = _simulated_expert(redo[0], redo[1], True, case_id * 10 + rank + 3)
            reference = buffer.low_latency_combine(expert_out, mine["topk_idx"], mine["topk_weights"], redo[2])[0]
            with rec.section("zero_copy"):
                staging = buffer.get_next_low_latency_combine_buffer(redo[2])
                registered = buffer.get_local_buffer_tensor(torch.uint8, use_rdma_buffer=True)
                rec.equal(staging.untyped_storage().data_ptr(), registered.untyped_storage().data_ptr(),
                          f"{tag}: combine buffer is not a view of the registered buffer")
                rec.equal(tuple(staging.shape), (el, num_ranks * t_max, hidden), f"{tag}: combine buffer shape")
                rec.equal(staging.dtype, torch.bfloat16, f"{tag}: combine buffer dtype")
                staging.copy_(expert_out)
                garbage = random_bf16(generator(case_id, 50 + rank), tuple(expert_out.shape), 1.0, 2.0)
                zero_copied = buffer.low_latency_combine(garbage, mine["topk_idx"], mine["topk_weights"], redo[2],
                                                         zero_copy=True)[0]
                rec.equal(zero_copied, reference, f"{tag}: zero_copy combine vs combine of the same rows")
                expected, _ = _expected_combine(spec, mine, True)
                rec.close(zero_copied, expected, f"{tag}: zero_copy combine", 2.0 ** -7, 1e-6)
            with rec.section("combine_out"):
                out = random_bf16(generator(case_id, 60 + rank), (mine["n"], hidden), 3.0, 4.0)
                returned = buffer.low_latency_combine(expert_out, mine["topk_idx"], mine["topk_weights"], redo[2],
                                                      out=out)[0]
                rec.expect(returned.data_ptr() == out.data_ptr() or mine["n"] == 0,
                           f"{tag}: combine(out=...) must return out")
                rec.equal(out, reference, f"{tag}: values written into out")
            with rec.section("logfmt"):
                logfmt = buffer.low_latency_combine(expert_out, mine["topk_idx"], mine["topk_weights"], redo[2],
                                                    use_logfmt=True)[0]
                _, weight_factor = _expected_combine(spec, mine, True)
                bound = 1e-2 * weight_factor * mine["x"].float().abs().amax(1, keepdim=True) + \
                    reference.float().abs() * 2.0 ** -7
                rec.close(logfmt, reference.float(), f"{tag}: LogFMT combine vs plain combine", 0.0, bound)
                if bool((reference != 0).any()):
                    rec.expect(not torch.equal(logfmt, reference),
                               f"{tag}: LogFMT result bit-identical to the plain combine (values < 1 must be encoded)")

        # ---- the two alternating buffers
        if case_id in (0, 3):
            with rec.section("double_buffer"):
                first = dispatch(use_fp8=False)
                ptr_first = buffer.get_next_low_latency_combine_buffer(first[2]).data_ptr()
                second = dispatch(use_fp8=False)
                ptr_second = buffer.get_next_low_latency_combine_buffer(second[2]).data_ptr()
                rec.expect(ptr_first != ptr_second, f"{tag}: consecutive dispatches use the same combine buffer")
                third = dispatch(use_fp8=False)
                ptr_third = buffer.get_next_low_latency_combine_buffer(third[2]).data_ptr()
                rec.equal(ptr_third, ptr_first, f"{tag}: the third dispatch must reuse the first buffer")
                rec.expect(_valid_rows(second) == _valid_rows(first), f"{tag}: repeated dispatch rows differ")

        # ---- async_finish
        if case_id in (1, 4):
            with rec.section("async_finish"):
                got = dispatch(use_fp8=False, async_finish=True)
                check_event(rec, got[3], f"{tag}: dispatch event")
                rec.expect(_valid_rows(got) == _valid_rows(bf16_result), f"{tag}: async dispatch rows differ")
                rec.equal(got[1], bf16_result[1], f"{tag}: async dispatch counts")
                expert_out = _simulated_expert(got[0], got[1], False, case_id * 10 + rank)
                combined = buffer.low_latency_combine(expert_out, mine["topk_idx"], mine["topk_weights"], got[2],
                                                      async_finish=True)
                check_event(rec, combined[1], f"{tag}: combine event")
                rec.expect(combined[2] is None, f"{tag}: async combine hook must be None")
                rec.equal(combined[0], plain_combined, f"{tag}: async combine")
        del buffer

    with rec.section("round_scale"):
        rec.expect(_ROUND_SCALE_ROWS_CHECKED[0] > 0, "no received rows had their round_scale scales checked")
    _mask_checks(rec, rank, num_ranks, group)


def _mask_checks(rec, rank, num_ranks, group):
    """enable_shrink: every rank masks the last rank; dispatch and combine leave it out."""
    from uccl_ep_plugin import Buffer
    spec = _case(0, num_ranks)
    inputs = [_inputs(spec, s) for s in range(num_ranks)]
    mine = inputs[rank]
    t_max, hidden, e_total = spec["T"], spec["hidden"], spec["num_experts"]
    size = Buffer.get_low_latency_rdma_size_hint(t_max, hidden, num_ranks, e_total)
    with rec.section("mask"):
        plain = Buffer(group, 0, size, low_latency_mode=True)
        for call in (lambda: plain.low_latency_update_mask_buffer(0, True),
                     lambda: plain.low_latency_query_mask_buffer(torch.zeros(num_ranks, dtype=torch.int32)),
                     lambda: plain.low_latency_clean_mask_buffer()):
            with rec.raises(RuntimeError, "enable_shrink", "mask method without enable_shrink"):
                call()
        buffer = Buffer(group, 0, size, low_latency_mode=True, enable_shrink=True)
        status = torch.full((num_ranks,), 7, dtype=torch.int32)
        buffer.low_latency_query_mask_buffer(status)
        rec.equal(status, torch.zeros(num_ranks, dtype=torch.int32), "mask status of a fresh Buffer")
        masked_rank = num_ranks - 1
        buffer.low_latency_update_mask_buffer(masked_rank, True)
        buffer.low_latency_query_mask_buffer(status)
        expected_status = torch.zeros(num_ranks, dtype=torch.int32)
        expected_status[masked_rank] = 1
        rec.equal(status, expected_status, "mask status after masking the last rank")

        tag = f"masked rank {masked_rank} (T={t_max}, H={hidden}, E={e_total}, K={spec['num_topk']})"
        model = _model(spec, inputs, rank, masked={masked_rank})
        result = buffer.low_latency_dispatch(mine["x"], mine["topk_idx"], t_max, e_total, use_fp8=False)
        names = {"count": "mask", "layout": "mask", "rows": "mask", "scales": "mask"}
        _check_dispatch(rec, spec, inputs, model, rank, num_ranks, result, tag, use_fp8=False, sections=names)
        expert_out = _simulated_expert(result[0], result[1], True, 70 + rank)
        combined = buffer.low_latency_combine(expert_out, mine["topk_idx"], mine["topk_weights"], result[2])[0]
        if rank != masked_rank:
            expected, _ = _expected_combine(spec, mine, True, masked={masked_rank})
            rec.close(combined, expected, f"{tag}: combine without the masked rank's experts", 2.0 ** -7, 1e-6)

        # Unmasking restores the full exchange.
        buffer.low_latency_update_mask_buffer(masked_rank, False)
        buffer.low_latency_query_mask_buffer(status)
        rec.equal(status, torch.zeros(num_ranks, dtype=torch.int32), "mask status after unmasking")
        model = _model(spec, inputs, rank)
        result = buffer.low_latency_dispatch(mine["x"], mine["topk_idx"], t_max, e_total, use_fp8=False)
        _check_dispatch(rec, spec, inputs, model, rank, num_ranks, result, tag + " unmasked", use_fp8=False,
                        sections=names)
        expert_out = _simulated_expert(result[0], result[1], True, 80 + rank)
        combined = buffer.low_latency_combine(expert_out, mine["topk_idx"], mine["topk_weights"], result[2])[0]
        expected, _ = _expected_combine(spec, mine, True)
        rec.close(combined, expected, f"{tag}: combine after unmasking", 2.0 ** -7, 1e-6)

        # Clean unmasks everything.
        for r in range(num_ranks):
            buffer.low_latency_update_mask_buffer(r, True)
        buffer.low_latency_clean_mask_buffer()
        buffer.low_latency_query_mask_buffer(status)
        rec.equal(status, torch.zeros(num_ranks, dtype=torch.int32), "mask status after clean")


_CACHE = SectionCache(_body)


@pytest.mark.parametrize("section", SECTIONS)
@pytest.mark.parametrize("num_ranks", [2, 4])
def test_low_latency_mode(num_ranks, section):
    assert_section(_CACHE.get(num_ranks), section)
