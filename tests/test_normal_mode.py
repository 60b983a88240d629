"""Normal-mode ``get_dispatch_layout`` / ``dispatch`` / ``combine`` at 2 and 4 ranks.

One process group per rank count runs every case (random shapes, fresh random inputs, each
rank seeded differently) and records each section's failures; every section is its own
pytest item. Expected values come from a plain-Python model built from all ranks' inputs,
which every rank regenerates from the shared seeds.
"""

import math
import os
import time

import pytest
import torch

from tests.multiprocess import run_ranks
from tests.reference_checks import (check_event, SectionCache, all_reduce_sum, assert_section, choice, generator, quiet_rank,
                                    randint, random_bf16, random_topk_idx, random_weights)

SEED = 1201
FP8 = torch.float8_e4m3fn
BF16_RTOL = 2.0 ** -6          # a few bf16 roundings
F32_RTOL = 1e-6

SECTIONS = [
    "layout", "recv_counts", "recv_rows", "recv_topk", "handle_tables", "fp8_rows", "cached_dispatch",
    "dispatch_without_topk", "worst_tokens", "worst_tokens_overflow", "combine", "combine_scaled_rows",
    "combine_bias", "combine_topk_weights", "async_and_events", "internode_aliases", "set_num_sms",
    "default_size_hints",
]


# ---------------------------------------------------------------------------------------- cases and inputs
def _case(case_id: int, num_ranks: int) -> dict:
    """Shapes of one case, drawn from the generator every rank shares."""
    gen = generator(SEED * 100 + case_id + 10 * num_ranks)
    r = num_ranks
    spec = {"id": case_id, "fp8": None, "config": None, "expert_alignment": 1,
            "drop": float(torch.rand((), generator=gen)) * 0.4}
    if case_id == 0:      # one rank has no tokens
        spec.update(hidden=256, local_experts=2, num_topk=3, tokens=[0] + [randint(gen, 20, 60) for _ in range(r - 1)])
    elif case_id == 1:    # one token per rank, a non-power-of-two hidden, top-1
        spec.update(hidden=264, local_experts=1, num_topk=1, tokens=[1] * r)
    elif case_id == 2:    # token counts that divide nothing, top-9
        spec.update(hidden=512, local_experts=8, num_topk=9, tokens=[37, 101, 127, 61][:r])
    elif case_id == 3:    # fp8 with row-major float32 scales
        spec.update(hidden=256, local_experts=4, fp8="float32", tokens=[randint(gen, 1, 80) for _ in range(r)])
    elif case_id == 4:    # fp8 with column-major float32 scales, and a rank with no tokens
        spec.update(hidden=384, local_experts=3, fp8="float32_column_major",
                    tokens=[randint(gen, 1, 80) for _ in range(r - 1)] + [0])
    elif case_id == 5:    # fp8 with packed (UE8M0) int32 scales
        spec.update(hidden=512, local_experts=2, fp8="int32", tokens=[randint(gen, 1, 80) for _ in range(r)])
    elif case_id == 6:    # a custom Config (4 channels), expert alignment 4
        spec.update(hidden=136, local_experts=5, expert_alignment=4, tokens=[randint(gen, 40, 130) for _ in range(r)])
        spec["config"] = (8, 4, 64, 4, 32)
    elif case_id == 7:    # expert alignment 128, larger hidden
        spec.update(hidden=768, local_experts=5, expert_alignment=128, tokens=[randint(gen, 0, 100) for _ in range(r)])
    else:                 # fully random
        spec.update(hidden=choice(gen, [256, 264, 512, 136, 1024]), local_experts=randint(gen, 1, 8),
                    expert_alignment=choice(gen, [1, 2, 16]), tokens=[randint(gen, 0, 130) for _ in range(r)])
        if randint(gen, 0, 2) == 0 and spec["hidden"] % 128 == 0:
            spec["fp8"] = choice(gen, ["float32", "float32_column_major"])
    spec["num_experts"] = r * spec["local_experts"]
    # One expert nobody picks; top-k of distinct experts among the rest.
    spec["unpicked"] = randint(gen, 0, spec["num_experts"] - 1)
    if "num_topk" not in spec:
        spec["num_topk"] = randint(gen, 1, 9)
    spec["num_topk"] = min(spec["num_topk"], spec["num_experts"] - 1) if spec["num_experts"] > 1 else 1
    if spec["num_experts"] == 1:
        spec["unpicked"] = None
    return spec


NUM_CASES = 11


def _inputs(spec: dict, rank: int) -> dict:
    """One rank's inputs for a case (any rank can regenerate them)."""
    gen = generator(SEED * 100 + spec["id"], rank)
    n, h, k, e = spec["tokens"][rank], spec["hidden"], spec["num_topk"], spec["num_experts"]
    unpicked = [] if spec["unpicked"] is None else [spec["unpicked"]]
    topk_idx = random_topk_idx(gen, n, e, k, spec["drop"], unpicked)
    if n >= 3:
        topk_idx[n // 2] = -1                       # a token that goes nowhere
    # Rows identify (rank, token) in their first columns; the rest is random, never zero.
    x = random_bf16(gen, (n, h), 0.25, 2.0)
    tokens = torch.arange(n, dtype=torch.float32)
    x[:, 0] = float(rank + 1)
    x[:, 1] = (tokens % 128 + 1).to(torch.bfloat16)
    x[:, 2] = (tokens // 128 + 1).to(torch.bfloat16)
    out = {"n": n, "x": x, "topk_idx": topk_idx, "topk_weights": random_weights(gen, n, k),
           "x2": random_bf16(gen, (n, h), 0.25, 2.0), "bias0": random_bf16(gen, (n, h), 0.25, 2.0),
           "bias1": random_bf16(gen, (n, h), 0.25, 2.0)}
    if spec["fp8"] is not None:
        out["x_fp8"] = (torch.randn((n, h), generator=gen) * 64).clamp(-440, 440).to(FP8)
        if spec["fp8"] == "int32":
            out["scales"] = torch.randint(-2 ** 31, 2 ** 31 - 1, (n, h // 512), generator=gen, dtype=torch.int64
                                          ).to(torch.int32)
        else:
            scales = torch.rand((n, h // 128), generator=gen) + 0.5
            if spec["fp8"] == "float32_column_major":
                scales = scales.t().contiguous().t()
            out["scales"] = scales
    return out


# ---------------------------------------------------------------------------------------- the model
def _model(spec: dict, inputs: list, me: int, num_channels: int) -> dict:
    """What rank ``me`` should see, computed with plain loops over every rank's routing."""
    r, e = len(inputs), spec["num_experts"]
    el = e // r
    m = {"in_rank": [], "per_rank": [], "per_expert": [], "channel_prefix": [], "send_head": []}
    for src in range(r):
        idx = inputs[src]["topk_idx"].tolist()
        n = len(idx)
        in_rank = [[any(v >= 0 and v // el == j for v in row) for j in range(r)] for row in idx]
        per_expert = [0] * e
        for row in idx:
            for v in row:
                if v >= 0:
                    per_expert[v] += 1
        per_rank = [sum(in_rank[t][j] for t in range(n)) for j in range(r)]
        per_channel = math.ceil(n / num_channels) if n > 0 else 0
        channel_prefix = [[0] * num_channels for _ in range(r)]
        send_head = [[-1] * r for _ in range(n)]
        for j in range(r):
            total = 0
            for c in range(num_channels):
                begin, end = min(c * per_channel, n), min((c + 1) * per_channel, n)
                position = 0
                for t in range(begin, end):
                    if in_rank[t][j]:
                        send_head[t][j] = position
                        position += 1
                total += position
                channel_prefix[j][c] = total
        m["in_rank"].append(in_rank)
        m["per_rank"].append(per_rank)
        m["per_expert"].append(per_expert)
        m["channel_prefix"].append(channel_prefix)
        m["send_head"].append(send_head)
    # What `me` receives: sources in rank order, tokens in order.
    received = [(src, t) for src in range(r) for t in range(len(m["in_rank"][src])) if m["in_rank"][src][t][me]]
    m["received"] = received
    m["rank_prefix"] = [[sum(m["per_rank"][s][j] for s in range(i + 1)) for j in range(r)] for i in range(r)]
    m["recv_channel_prefix"] = [[0] + m["channel_prefix"][i][me][:-1] for i in range(r)]
    recv_idx, recv_w = [], []
    for src, t in received:
        idx_row = inputs[src]["topk_idx"][t].tolist()
        w_row = inputs[src]["topk_weights"][t].tolist()
        local = [v - me * el if v >= 0 and v // el == me else -1 for v in idx_row]
        recv_idx.append(local)
        recv_w.append([w if v >= 0 else 0.0 for v, w in zip(local, w_row)])
    m["recv_topk_idx"] = recv_idx
    m["recv_topk_weights"] = recv_w
    a = spec["expert_alignment"]
    m["recv_per_expert"] = [(sum(m["per_expert"][s][me * el + le] for s in range(r)) + a - 1) // a * a
                            for le in range(el)]
    return m


def _expected_rows(inputs: list, received: list, key: str, width: int, dtype) -> torch.Tensor:
    if not received:
        return torch.empty((0, width), dtype=dtype)
    return torch.stack([inputs[src][key][t] for src, t in received])


def _recv_tensor(x):
    return x[0] if isinstance(x, tuple) else x


# ---------------------------------------------------------------------------------------- the body
def _body(rank, num_ranks, group, rec):
    from uccl_ep_plugin import Buffer, Config, EventOverlap

    hidden_bytes_max = 1024 * 2
    buffer = Buffer(group, Buffer.get_dispatch_config(num_ranks).get_nvl_buffer_size_hint(hidden_bytes_max, num_ranks),
                    Buffer.get_dispatch_config(num_ranks).get_rdma_buffer_size_hint(hidden_bytes_max, num_ranks))
    overflow_checked = False
    for case_id in range(NUM_CASES):
        spec = _case(case_id, num_ranks)
        inputs = [_inputs(spec, s) for s in range(num_ranks)]
        mine = inputs[rank]
        tag = f"case {case_id} (N={spec['tokens']}, H={spec['hidden']}, E={spec['num_experts']}, " \
              f"K={spec['num_topk']}, fp8={spec['fp8']})"
        config = Config(*spec["config"]) if spec["config"] else None
        num_channels = (config or Buffer.get_dispatch_config(num_ranks)).num_sms // 2
        model = _model(spec, inputs, rank, num_channels)
        e, el = spec["num_experts"], spec["local_experts"]
        received = model["received"]
        n = mine["n"]

        # ---- layout, checked against the loops
        with rec.section("layout"):
            layout = buffer.get_dispatch_layout(mine["topk_idx"], e)
            rec.equal(len(layout), 5, f"{tag}: get_dispatch_layout tuple length")
            per_rank, per_rdma_rank, per_expert, in_rank, event = layout
            rec.equal(per_rank, torch.tensor(model["per_rank"][rank], dtype=torch.int32), f"{tag}: num_tokens_per_rank")
            rec.expect(per_rdma_rank is None, f"{tag}: num_tokens_per_rdma_rank must be None for <= 8 ranks")
            rec.equal(per_expert, torch.tensor(model["per_expert"][rank], dtype=torch.int32),
                      f"{tag}: num_tokens_per_expert")
            rec.equal(in_rank, torch.tensor(model["in_rank"][rank], dtype=torch.bool).reshape(n, num_ranks),
                      f"{tag}: is_token_in_rank")
            rec.expect(isinstance(event, EventOverlap), f"{tag}: layout event is {type(event).__name__}")
            if spec["unpicked"] is not None:
                rec.equal(int(per_expert[spec["unpicked"]]), 0, f"{tag}: tokens for the unpicked expert")

        # ---- the dispatch itself (bf16, or fp8 for fp8 cases)
        x_in = (mine["x_fp8"], mine["scales"]) if spec["fp8"] else mine["x"]
        result = buffer.dispatch(x_in, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                 num_tokens_per_expert=per_expert, topk_idx=mine["topk_idx"],
                                 topk_weights=mine["topk_weights"], expert_alignment=spec["expert_alignment"],
                                 config=config)
        recv_x, recv_topk_idx, recv_topk_weights, recv_per_expert, handle, event = result
        num_recv = len(received)

        with rec.section("recv_counts"):
            total_per_rank = all_reduce_sum(per_rank, group)
            total_per_expert = all_reduce_sum(per_expert, group)
            rec.equal(_recv_tensor(recv_x).size(0), int(total_per_rank[rank]),
                      f"{tag}: received rows vs all-reduced num_tokens_per_rank")
            rec.equal(_recv_tensor(recv_x).size(0), num_recv, f"{tag}: received rows vs the model")
            a = spec["expert_alignment"]
            reduced = [(int(v) + a - 1) // a * a for v in total_per_expert[rank * el:(rank + 1) * el]]
            rec.equal(list(recv_per_expert), reduced, f"{tag}: num_recv_tokens_per_expert_list vs all-reduced counts")
            rec.equal(list(recv_per_expert), model["recv_per_expert"], f"{tag}: num_recv_tokens_per_expert_list")
            rec.expect(all(isinstance(v, int) for v in recv_per_expert), f"{tag}: counts must be Python ints")

        with rec.section("recv_rows" if not spec["fp8"] else "fp8_rows"):
            rank_prefix, recv_src_idx = handle[0], handle[3]
            rec.equal(rank_prefix, torch.tensor(model["rank_prefix"], dtype=torch.int32), f"{tag}: rank_prefix_matrix")
            rec.equal(recv_src_idx, torch.tensor([t for _, t in received], dtype=torch.int32),
                      f"{tag}: recv_src_idx (handle[3])")
            if spec["fp8"]:
                data, scales = recv_x
                rec.equal(data.view(torch.uint8),
                          _expected_rows(inputs, received, "x_fp8", spec["hidden"], FP8).view(torch.uint8),
                          f"{tag}: fp8 bytes")
                expected_scales = _expected_rows(inputs, received, "scales", mine["scales"].size(1),
                                                 mine["scales"].dtype)
                rec.equal(scales.contiguous(), expected_scales, f"{tag}: received scales")
            else:
                rec.equal(recv_x, _expected_rows(inputs, received, "x", spec["hidden"], torch.bfloat16),
                          f"{tag}: received rows")
            # Every row of the block from source i, [prefix[i-1, me], prefix[i, me]), is that source's token
            # recv_src_idx[k], in token order; the identifying columns agree.
            rows = _recv_tensor(recv_x)
            for src in range(num_ranks):
                begin = int(rank_prefix[src - 1, rank]) if src > 0 else 0
                end = int(rank_prefix[src, rank])
                src_idx = recv_src_idx[begin:end].long()
                if not rec.expect(bool(((src_idx >= 0) & (src_idx < inputs[src]["n"])).all()),
                                  f"{tag}: recv_src_idx out of range for source {src}"):
                    continue
                key = "x_fp8" if spec["fp8"] else "x"
                got = rows[begin:end].view(torch.uint8)
                rec.equal(got, inputs[src][key][src_idx].view(torch.uint8), f"{tag}: rows of source {src}")
                rec.expect(bool((src_idx[1:] > src_idx[:-1]).all()), f"{tag}: source {src} rows not in token order")
                if not spec["fp8"] and end > begin:
                    rec.equal(rows[begin:end, 0].float(), torch.full((end - begin,), float(src + 1)),
                              f"{tag}: source rank column of source {src}")
                    token = (rows[begin:end, 1].float() - 1) + 128 * (rows[begin:end, 2].float() - 1)
                    rec.equal(token, src_idx.float(), f"{tag}: token column of source {src}")

        with rec.section("recv_topk"):
            rec.equal(recv_topk_idx, torch.tensor(model["recv_topk_idx"], dtype=torch.int64).reshape(
                num_recv, spec["num_topk"]), f"{tag}: recv_topk_idx")
            rec.equal(recv_topk_weights, torch.tensor(model["recv_topk_weights"], dtype=torch.float32).reshape(
                num_recv, spec["num_topk"]), f"{tag}: recv_topk_weights")

        with rec.section("handle_tables"):
            rec.equal(len(handle), 6, f"{tag}: handle length")
            rec.equal(handle[1], torch.tensor(model["channel_prefix"][rank], dtype=torch.int32).reshape(
                num_ranks, num_channels), f"{tag}: channel_prefix_matrix")
            rec.equal(handle[2], torch.tensor(model["recv_channel_prefix"], dtype=torch.int32).reshape(
                num_ranks, num_channels), f"{tag}: recv_channel_prefix_matrix")
            rec.equal(handle[4], torch.tensor(model["in_rank"][rank], dtype=torch.bool).reshape(n, num_ranks),
                      f"{tag}: handle is_token_in_rank")
            rec.equal(handle[5], torch.tensor(model["send_head"][rank], dtype=torch.int32).reshape(n, num_ranks),
                      f"{tag}: send_head")

        # ---- cached dispatch: same rows again, and new values along the same routes
        with rec.section("cached_dispatch"):
            again = buffer.dispatch(x_in, handle=handle, config=config)
            rec.equal(len(again), 6, f"{tag}: cached dispatch tuple length")
            rec.expect(all(v is None for v in again[1:5]), f"{tag}: cached dispatch must return None in slots 1-4, "
                                                          f"got {[type(v).__name__ for v in again[1:5]]}")
            if spec["fp8"]:
                rec.expect(isinstance(again[0], tuple) and len(again[0]) == 2, f"{tag}: cached fp8 recv_x is a pair")
                rec.equal(again[0][0].view(torch.uint8), recv_x[0].view(torch.uint8), f"{tag}: cached fp8 bytes")
                rec.equal(again[0][1].contiguous(), recv_x[1].contiguous(), f"{tag}: cached scales")
            else:
                rec.equal(again[0], recv_x, f"{tag}: cached dispatch rows")
            moved = buffer.dispatch(mine["x2"], handle=handle)[0]
            rec.equal(moved, _expected_rows(inputs, received, "x2", spec["hidden"], torch.bfloat16),
                      f"{tag}: cached dispatch of new values")
        # bf16 rows along this handle, for combine (fp8 cases dispatch bf16 through the handle)
        rows_bf16 = recv_x if not spec["fp8"] else buffer.dispatch(mine["x"], handle=handle)[0]

        if case_id in (0, 2, 6):
            with rec.section("dispatch_without_topk"):
                plain = buffer.dispatch(mine["x"], num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                        num_tokens_per_expert=per_expert, expert_alignment=spec["expert_alignment"],
                                        config=config)
                rec.equal(plain[0], _expected_rows(inputs, received, "x", spec["hidden"], torch.bfloat16),
                          f"{tag}: rows without topk")
                rec.expect(plain[1] is None and plain[2] is None, f"{tag}: recv_topk_idx/weights must be None "
                                                                   "when topk_idx is not given")
                rec.equal(plain[4][3], torch.tensor([t for _, t in received], dtype=torch.int32),
                          f"{tag}: recv_src_idx without topk")

        # ---- combine
        count = torch.tensor([sum(row) for row in model["in_rank"][rank]], dtype=torch.float32).reshape(n, 1)
        nowhere = (count == 0).reshape(-1)
        with rec.section("combine"):
            combined, combined_weights, event = buffer.combine(rows_bf16, handle)
            rec.expect(combined_weights is None, f"{tag}: combined_topk_weights without topk_weights must be None")
            rec.close(combined, mine["x"].float() * count, f"{tag}: combine of unchanged rows", BF16_RTOL, 0.0)
            rec.equal(combined.dtype, torch.bfloat16, f"{tag}: combined dtype")
            if bool(nowhere.any()):
                rec.equal(combined[nowhere], torch.zeros((int(nowhere.sum()), spec["hidden"]), dtype=torch.bfloat16),
                          f"{tag}: tokens sent nowhere")
            own = buffer.combine(rows_bf16, handle, config=Buffer.get_combine_config(num_ranks))[0]
            rec.equal(own, combined, f"{tag}: combine with an explicit config")

        with rec.section("combine_scaled_rows"):
            # Each receiving rank j scales its rows by 2^j: the sum tells which ranks' rows came back.
            scaled = (rows_bf16.float() * 2.0 ** rank).to(torch.bfloat16)
            factor = torch.tensor([sum(2.0 ** j for j in range(num_ranks) if row[j]) for row in model["in_rank"][rank]],
                                  dtype=torch.float32).reshape(n, 1)
            combined_scaled, weights_scaled, _ = buffer.combine(scaled, handle,
                                                                topk_weights=recv_topk_weights + (rank + 1))
            rec.close(combined_scaled, mine["x"].float() * factor, f"{tag}: combine of rows scaled by 2^rank",
                      BF16_RTOL, 0.0)
            valid = mine["topk_idx"] >= 0
            extra = torch.tensor([sum(j + 1 for j in range(num_ranks) if row[j]) for row in model["in_rank"][rank]],
                                 dtype=torch.float32).reshape(n, 1)
            expected_w = torch.where(valid, mine["topk_weights"], torch.zeros_like(mine["topk_weights"])) + extra
            rec.close(weights_scaled, expected_w, f"{tag}: combined topk_weights of shifted weights", F32_RTOL, 1e-6)

        with rec.section("combine_topk_weights"):
            _, combined_weights, _ = buffer.combine(rows_bf16, handle, topk_weights=recv_topk_weights)
            # Each valid expert lives on exactly one rank, which received the token: its weight comes back once.
            expected_w = torch.tensor([[w if v >= 0 else 0.0 for v, w in zip(ir, wr)] for ir, wr in
                                       zip(mine["topk_idx"].tolist(), mine["topk_weights"].tolist())],
                                      dtype=torch.float32).reshape(n, spec["num_topk"])
            rec.equal(combined_weights, expected_w, f"{tag}: combined_topk_weights")

        with rec.section("combine_bias"):
            one = buffer.combine(rows_bf16, handle, bias=mine["bias0"])[0]
            rec.close(one, mine["x"].float() * count + mine["bias0"].float(), f"{tag}: combine with one bias",
                      BF16_RTOL, 2.0 ** -5)
            two = buffer.combine(rows_bf16, handle, bias=(mine["bias0"], mine["bias1"]))[0]
            rec.close(two, mine["x"].float() * count + mine["bias0"].float() + mine["bias1"].float(),
                      f"{tag}: combine with two biases", BF16_RTOL, 2.0 ** -5)
            if bool(nowhere.any()):
                rec.equal(one[nowhere], mine["bias0"][nowhere], f"{tag}: tokens sent nowhere get the bias")
                rec.close(two[nowhere], mine["bias0"][nowhere].float() + mine["bias1"][nowhere].float(),
                          f"{tag}: tokens sent nowhere get both biases", BF16_RTOL, 0.0)

        # ---- num_worst_tokens
        all_recv = [sum(1 for s in range(num_ranks) for row in model["in_rank"][s] if row[j]) for j in range(num_ranks)]
        if case_id in (0, 2, 3, 7):
            with rec.section("worst_tokens"):
                worst = max(all_recv) + 3
                padded = buffer.dispatch(x_in, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                         num_tokens_per_expert=per_expert, topk_idx=mine["topk_idx"],
                                         topk_weights=mine["topk_weights"], expert_alignment=spec["expert_alignment"],
                                         num_worst_tokens=worst, config=config)
                p_x, p_idx, p_w, p_counts, p_handle, _ = padded
                rec.equal(_recv_tensor(p_x).size(0), worst, f"{tag}: padded recv_x rows")
                rec.equal(p_idx.size(0), worst, f"{tag}: padded recv_topk_idx rows")
                rec.equal(p_w.size(0), worst, f"{tag}: padded recv_topk_weights rows")
                rec.equal(list(p_counts), [], f"{tag}: count list with num_worst_tokens")
                rec.equal(_recv_tensor(p_x)[:num_recv].view(torch.uint8), _recv_tensor(recv_x).view(torch.uint8),
                          f"{tag}: first rows of the padded dispatch")
                if spec["fp8"]:
                    rec.equal(p_x[1][:num_recv].contiguous(), recv_x[1].contiguous(), f"{tag}: padded scales")
                rec.equal(p_idx[:num_recv], recv_topk_idx, f"{tag}: first padded recv_topk_idx")
                rec.equal(p_w[:num_recv], recv_topk_weights, f"{tag}: first padded recv_topk_weights")
                rec.equal(p_idx[num_recv:], torch.full((worst - num_recv, spec["num_topk"]), -1, dtype=torch.int64),
                          f"{tag}: padding rows' topk_idx")
                # Combine on the padded result, with garbage in the padding rows, equals combine on the unpadded.
                p_rows = buffer.dispatch(mine["x"], handle=p_handle)[0]
                rec.equal(p_rows.size(0), worst, f"{tag}: cached dispatch through a padded handle")
                p_rows = p_rows.clone()
                p_rows[num_recv:] = random_bf16(generator(case_id, 99 + rank), (worst - num_recv, spec["hidden"]),
                                                1.0, 2.0)
                p_weights = p_w.clone()
                p_weights[num_recv:] = 7.0
                got_x, got_w, _ = buffer.combine(p_rows, p_handle, topk_weights=p_weights)
                want_x, want_w, _ = buffer.combine(rows_bf16, handle, topk_weights=recv_topk_weights)
                rec.equal(got_x, want_x, f"{tag}: combine on the padded dispatch")
                rec.equal(got_w, want_w, f"{tag}: combined weights on the padded dispatch")

        if min(all_recv) >= 2 and not overflow_checked:
            overflow_checked = True
            with rec.section("worst_tokens_overflow"):
                with rec.raises((RuntimeError, ValueError), "num_worst_tokens", f"{tag}: more tokens than "
                                f"num_worst_tokens={min(all_recv) - 1}"):
                    buffer.dispatch(x_in, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                    num_tokens_per_expert=per_expert, topk_idx=mine["topk_idx"],
                                    topk_weights=mine["topk_weights"], num_worst_tokens=min(all_recv) - 1,
                                    config=config)

        # ---- events and aliases, on a few cases
        if case_id in (0, 5):
            with rec.section("async_and_events"):
                captured = Buffer.capture()
                rec.expect(isinstance(captured, EventOverlap), f"{tag}: capture() returns {type(captured).__name__}")
                got = buffer.get_dispatch_layout(mine["topk_idx"], e, previous_event=captured, async_finish=True,
                                                 allocate_on_comm_stream=True)
                check_event(rec, got[4], f"{tag}: layout event")
                for a, b, name in zip(got[:4], layout[:4], ("per_rank", "per_rdma_rank", "per_expert", "in_rank")):
                    if b is None:
                        rec.expect(a is None, f"{tag}: async layout {name}")
                    else:
                        rec.equal(a, b, f"{tag}: async layout {name}")
                got = buffer.dispatch(x_in, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                      num_tokens_per_expert=per_expert, topk_idx=mine["topk_idx"],
                                      topk_weights=mine["topk_weights"], expert_alignment=spec["expert_alignment"],
                                      config=config, previous_event=Buffer.capture(), async_finish=True,
                                      allocate_on_comm_stream=True)
                check_event(rec, got[5], f"{tag}: dispatch event")
                rec.equal(_recv_tensor(got[0]).view(torch.uint8), _recv_tensor(recv_x).view(torch.uint8),
                          f"{tag}: async dispatch rows")
                rec.equal(got[1], recv_topk_idx, f"{tag}: async recv_topk_idx")
                got = buffer.dispatch(mine["x"], handle=handle, previous_event=Buffer.capture(), async_finish=True)
                check_event(rec, got[5], f"{tag}: cached dispatch event")
                rec.equal(got[0], rows_bf16, f"{tag}: async cached dispatch rows")
                got = buffer.combine(rows_bf16, handle, topk_weights=recv_topk_weights, previous_event=Buffer.capture(),
                                     async_finish=True, allocate_on_comm_stream=True)
                check_event(rec, got[2], f"{tag}: combine event")
                want = buffer.combine(rows_bf16, handle, topk_weights=recv_topk_weights)
                rec.equal(got[0], want[0], f"{tag}: async combine")
                rec.equal(got[1], want[1], f"{tag}: async combined weights")
                sync_event = want[2]
                rec.expect(isinstance(sync_event, EventOverlap), f"{tag}: synchronous combine returns an EventOverlap")

            with rec.section("internode_aliases"):
                got = buffer.internode_dispatch(x_in, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                num_tokens_per_expert=per_expert, topk_idx=mine["topk_idx"],
                                                topk_weights=mine["topk_weights"],
                                                expert_alignment=spec["expert_alignment"], config=config)
                rec.equal(_recv_tensor(got[0]).view(torch.uint8), _recv_tensor(recv_x).view(torch.uint8),
                          f"{tag}: internode_dispatch rows")
                rec.equal(got[2], recv_topk_weights, f"{tag}: internode_dispatch weights")
                rec.equal(list(got[3]), list(recv_per_expert), f"{tag}: internode_dispatch counts")
                got_x, got_w, _ = buffer.internode_combine(rows_bf16, handle, topk_weights=recv_topk_weights)
                want = buffer.combine(rows_bf16, handle, topk_weights=recv_topk_weights)
                rec.equal(got_x, want[0], f"{tag}: internode_combine")
                rec.equal(got_w, want[1], f"{tag}: internode_combine weights")

    with rec.section("worst_tokens_overflow"):
        rec.expect(overflow_checked, "no case had every rank receive at least 2 tokens")

    with rec.section("set_num_sms"):
        # The default config follows Buffer.num_sms: 8 SMs give 4 channels.
        spec = _case(6, num_ranks)
        inputs = [_inputs(spec, s) for s in range(num_ranks)]
        previous = Buffer.num_sms
        Buffer.set_num_sms(8)
        try:
            rec.equal(Buffer.num_sms, 8, "Buffer.num_sms after set_num_sms(8)")
            rec.equal(Buffer.get_dispatch_config(num_ranks).num_sms, 8, "default dispatch config after set_num_sms")
            model = _model(spec, inputs, rank, 4)
            lay = buffer.get_dispatch_layout(inputs[rank]["topk_idx"], spec["num_experts"])
            out = buffer.dispatch(inputs[rank]["x"], num_tokens_per_rank=lay[0], is_token_in_rank=lay[3],
                                  num_tokens_per_expert=lay[2], topk_idx=inputs[rank]["topk_idx"],
                                  topk_weights=inputs[rank]["topk_weights"])
            n = inputs[rank]["n"]
            rec.equal(out[4][1], torch.tensor(model["channel_prefix"][rank], dtype=torch.int32).reshape(num_ranks, 4),
                      "channel_prefix_matrix with the default config after set_num_sms(8)")
            rec.equal(out[4][5], torch.tensor(model["send_head"][rank], dtype=torch.int32).reshape(n, num_ranks),
                      "send_head with the default config after set_num_sms(8)")
        finally:
            Buffer.set_num_sms(previous)

    with rec.section("default_size_hints"):
        # A Buffer sized by DeepEP's usual recipe (max of the dispatch and combine hints) runs a dispatch.
        hidden_bytes = 512 * 2
        nvl = max(Buffer.get_dispatch_config(num_ranks).get_nvl_buffer_size_hint(hidden_bytes, num_ranks),
                  Buffer.get_combine_config(num_ranks).get_nvl_buffer_size_hint(hidden_bytes, num_ranks))
        rdma = max(Buffer.get_dispatch_config(num_ranks).get_rdma_buffer_size_hint(hidden_bytes, num_ranks),
                   Buffer.get_combine_config(num_ranks).get_rdma_buffer_size_hint(hidden_bytes, num_ranks))
        rec.expect(nvl > 0, f"nvl size hint {nvl}")
        rec.equal(rdma, 0, "rdma size hint within one node")
        sized = Buffer(group, nvl, rdma)
        spec = _case(2, num_ranks)
        inputs = [_inputs(spec, s) for s in range(num_ranks)]
        model = _model(spec, inputs, rank, Buffer.get_dispatch_config(num_ranks).num_sms // 2)
        lay = sized.get_dispatch_layout(inputs[rank]["topk_idx"], spec["num_experts"])
        out = sized.dispatch(inputs[rank]["x"], num_tokens_per_rank=lay[0], is_token_in_rank=lay[3],
                             num_tokens_per_expert=lay[2], topk_idx=inputs[rank]["topk_idx"],
                             topk_weights=inputs[rank]["topk_weights"])
        rec.equal(out[0], _expected_rows(inputs, model["received"], "x", spec["hidden"], torch.bfloat16),
                  "rows through a Buffer sized by the hints")


_CACHE = SectionCache(_body)


@pytest.mark.parametrize("section", SECTIONS)
@pytest.mark.parametrize("num_ranks", [2, 4])
def test_normal_mode(num_ranks, section):
    assert_section(_CACHE.get(num_ranks), section)


# ---------------------------------------------------------------------------------------- overflow on one rank
def _overflow_on_one_rank(rank, num_ranks, group, queue_dir):
    """Rank 0 receives more than num_worst_tokens, the others do not: every rank must raise, none may hang."""
    quiet_rank("3")
    from uccl_ep_plugin import Buffer
    from uccl_ep_plugin.engines.reference import CommTimeoutError
    buffer = Buffer(group)
    gen = generator(SEED, rank)
    n, e, k = (6 if rank > 0 else 1), 2 * num_ranks, 2
    topk_idx = torch.full((n, k), -1, dtype=torch.int64)
    topk_idx[:, 0] = 0                                   # every token to expert 0, on rank 0
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, e)
    start = time.monotonic()
    outcome = "returned"
    try:
        buffer.dispatch(random_bf16(gen, (n, 256), 0.25, 2.0), num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                        num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=random_weights(gen, n, k),
                        num_worst_tokens=3)
    except CommTimeoutError as error:
        outcome = f"timed out after {time.monotonic() - start:.1f}s: {error}"
    except (RuntimeError, ValueError) as error:
        outcome = "raised" if "num_worst_tokens" in str(error) else f"raised without naming num_worst_tokens: {error}"
    with open(os.path.join(queue_dir, f"rank{rank}.txt"), "w") as file:
        file.write(outcome)
    # Stay in the group until every rank has an outcome (a rank leaving early would break its peers' wait).
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not all(
            os.path.exists(os.path.join(queue_dir, f"rank{r}.txt")) for r in range(num_ranks)):
        time.sleep(0.05)


def test_worst_tokens_overflow_on_one_rank_raises_on_every_rank(tmp_path):
    """Every rank knows every rank's receive count after the layout exchange, so a rank that would receive
    more than ``num_worst_tokens`` must not leave its peers waiting in the row exchange."""
    run_ranks(2, _overflow_on_one_rank, queue_dir=str(tmp_path))
    outcomes = {rank: (tmp_path / f"rank{rank}.txt").read_text() for rank in range(2)}
    assert outcomes == {0: "raised", 1: "raised"}, outcomes
