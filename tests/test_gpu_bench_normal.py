"""`uccl-ep bench --mode normal` on two GPUs: every row correct, and the num_worst_tokens rows captured in CUDA graphs
and replayed on the native engine's SM path (the dispatch and combine a serving engine replays)."""

import json

import pytest

from tests.multiprocess import needs_feature, needs_gpus, ranks_share_gpus
from uccl_ep_plugin.cli.main import main


pytestmark = [pytest.mark.gpu, needs_gpus(2), needs_feature("normal_nvlink"),
              pytest.mark.skipif(ranks_share_gpus(), reason="the bench runs one rank per GPU")]


def test_normal_bench_times_worst_token_calls_by_graph_replay(tmp_path):
    path = tmp_path / "normal.json"
    # 2048 tokens of 2048 channels: the exchange for num_worst_tokens (up to 2 x 4096 rows sent per rank) needs more
    # than every token to one rank and more than DeepEP's size hint, so the bench must size the Buffer for it.
    assert main(["bench", "--mode", "normal", "--ranks", "2", "--tokens", "2048", "--hidden", "2048",
                 "--warmup", "1", "--iters", "3", "--no-baselines", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())
    assert [(row["op"], row["dtype"]) for row in rows] == [
        ("dispatch", "fp8"), ("dispatch", "bf16"), ("dispatch (cached)", "bf16"), ("combine", "bf16"),
        ("dispatch (num_worst_tokens)", "fp8"), ("dispatch (num_worst_tokens)", "bf16"),
        ("combine (num_worst_tokens)", "bf16")]
    assert all(row["correct"] and row["engine"] == "native" for row in rows), rows
    eager, replayed = rows[:4], rows[4:]
    assert {row["timing"] for row in eager} == {"eager"}
    assert {row["path"] for row in eager} == {"nvlink-ce"}   # UCCL_EP_NORMAL_COPY=auto: copy engines at 2 ranks
    assert {row["timing"] for row in replayed} == {"cuda-graph"}
    assert {row["path"] for row in replayed} == {"nvlink-sm"}
    assert all(row["median_us"] > 0 for row in rows)
