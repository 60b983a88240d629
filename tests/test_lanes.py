"""The kernels' warp and block collectives and lane maps (csrc/kernels/lanes.h) with 32 lanes (NVIDIA warps)
and 64 (AMD CDNA wavefronts), run on the host by tests/warp_model/lane_model.cpp (each lane a thread), against
plain Python on fresh random inputs."""

import itertools
import os
import random
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LANES = (32, 64)


@pytest.fixture(scope="module")
def lane_model(tmp_path_factory):
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.fail("no C++ compiler (set CXX): the extension's build needs one too")
    program = tmp_path_factory.mktemp("lane_model") / "lane_model"
    subprocess.run([compiler, "-std=c++17", "-O1", "-pthread", "-Wall", "-Wno-unknown-pragmas", "-Werror",
                    f"-I{ROOT / 'csrc'}", str(ROOT / "tests" / "warp_model" / "lane_model.cpp"), "-o", str(program)],
                   check=True)

    def ask(*lines: str):
        result = subprocess.run([str(program)], input="".join(line + "\n" for line in lines), capture_output=True,
                                text=True, check=True, timeout=120)
        answers = result.stdout.splitlines()
        assert len(answers) == len(lines), result.stdout
        for answer in answers:
            assert not answer.startswith("error"), answer
        return [[int(word) for word in answer.split()] for answer in answers]

    return ask


def _case(name: str, lanes: int, *values) -> str:
    return " ".join(str(v) for v in (name, lanes, *values))


@pytest.mark.parametrize("lanes", LANES)
def test_inclusive_sum_and_total(lane_model, lanes):
    rng = random.Random(f"sums-{lanes}")
    inputs = [[rng.randint(-10**6, 10**6) for _ in range(lanes)] for _ in range(4)]
    inputs.append([1] * lanes)
    questions = [_case("inclusive_sum", lanes, *values) for values in inputs]
    questions += [_case("total", lanes, *values) for values in inputs]
    answers = lane_model(*questions)
    for values, answer in zip(inputs, answers[:len(inputs)]):
        assert answer == list(itertools.accumulate(values))
    for values, answer in zip(inputs, answers[len(inputs):]):
        assert answer == [sum(values)] * lanes


@pytest.mark.parametrize("lanes", LANES)
@pytest.mark.parametrize("threads", [512, 1024])   # the normal-mode kernels' blocks
def test_block_exclusive_sum(lane_model, lanes, threads):
    rng = random.Random(f"block-{lanes}-{threads}")
    cases = [[rng.randint(0, 1) for _ in range(threads)], [rng.randint(-1000, 1000) for _ in range(threads)]]
    answers = lane_model(*(_case("block_sum", lanes, threads, *values) for values in cases))
    for values, answer in zip(cases, answers):
        before, totals = answer[0::2], answer[1::2]
        assert before == [0] + list(itertools.accumulate(values))[:-1]
        assert totals == [sum(values)] * threads


@pytest.mark.parametrize("lanes", LANES)
def test_compact_gives_lane_i_the_ith_present_item(lane_model, lanes):
    rng = random.Random(f"compact-{lanes}")
    cases = [[rng.random() < p for _ in range(lanes)] for p in (0.1, 0.5, 0.9)]
    cases += [[False] * lanes, [True] * lanes, [lane == lanes - 1 for lane in range(lanes)]]
    questions, expected = [], []
    for present in cases:
        items = [rng.randint(0, 2**40) for _ in range(lanes)]
        questions.append(_case("compact", lanes, *(int(p) for p in present), *items))
        chosen = [item for item, p in zip(items, present) if p]
        expected.append([len(chosen)] + chosen + [-1] * (lanes - len(chosen)))
    assert lane_model(*questions) == expected


@pytest.mark.parametrize("lanes", LANES)
@pytest.mark.parametrize("groups_per_block", (1, 2))
def test_group_positions_cover_every_unit_once(lane_model, lanes, groups_per_block):
    warps_per_group, num_blocks = 8, 3
    group_threads = warps_per_group * lanes
    (answer,) = lane_model(_case("groups", lanes, group_threads, groups_per_block, num_blocks))
    fields = [answer[i:i + 6] for i in range(0, len(answer), 6)]
    block_threads = group_threads * groups_per_block
    assert len(fields) == num_blocks * block_threads
    firsts = {}
    for n, (index, thread, warp, lane, first, stride) in enumerate(fields):
        block, t = divmod(n, block_threads)
        assert (index, thread) == divmod(t, group_threads)
        assert 0 <= lane < lanes and warp * lanes + lane == thread and warp < warps_per_group
        assert stride == num_blocks * groups_per_block
        firsts.setdefault((block, index), set()).add(first)
    assert all(len(seen) == 1 for seen in firsts.values())   # a group's threads agree on its unit
    units = sorted(next(iter(seen)) for seen in firsts.values())
    assert units == list(range(num_blocks * groups_per_block))
    # One group per block comes first (one per SM), then the blocks' second groups.
    assert {firsts[(block, 0)].pop() for block in range(num_blocks)} == set(range(num_blocks))


@pytest.mark.parametrize("lanes", LANES)
@pytest.mark.parametrize("block_threads", (512, 1024))
def test_warp_positions_cover_every_warp_once(lane_model, lanes, block_threads):
    num_blocks = 3
    (answer,) = lane_model(_case("warps", lanes, block_threads, num_blocks))
    fields = [answer[i:i + 3] for i in range(0, len(answer), 3)]
    warps = {}
    for n, (lane, first, stride) in enumerate(fields):
        block, thread = divmod(n, block_threads)
        assert lane == thread % lanes
        assert stride == num_blocks * block_threads // lanes
        warps.setdefault((block, thread // lanes), set()).add(first)
    assert all(len(seen) == 1 for seen in warps.values())
    assert sorted(seen.pop() for seen in warps.values()) == list(range(num_blocks * block_threads // lanes))
