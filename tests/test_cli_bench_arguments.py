"""``uccl-ep bench`` checks every argument before it spawns anything: a user mistake is one line naming the
argument and the rule, exit code 2, no traceback."""

import pytest

from tests.multiprocess import needs_feature
from uccl_ep_plugin.cli.main import main


@pytest.mark.parametrize("argv, message", [
    (["--ranks", "0"], "--ranks 0 must be at least 1"),
    (["--ranks", "-3", "--mode", "transport"], "--ranks -3 must be at least 1"),
    (["--hidden", "1000"], "--hidden 1000 must be a positive multiple of 128 (the fp8 cases scale each 128 channels)"),
    (["--tokens", "0"], "--tokens 0 must be at least 1"),
    (["--ll-tokens", "-1"], "--ll-tokens -1 must be at least 1"),
    (["--topk", "0"], "--topk 0 must be in 1..the number of experts"),
    (["--topk", "300"], "--topk 300 must be in 1..the number of experts"),
    (["--experts", "255"], "--experts 255 must be a positive multiple of the 2 ranks"),
    (["--ll-experts", "9"], "--ll-experts 9 must be a positive multiple of the 2 ranks"),
    (["--num-sms", "7"], "--num-sms 7 must be an even number of at least 2"),
    (["--gpus-per-node", "3"], "--gpus-per-node 3 must divide the 2 ranks"),
    (["--gpus-per-node", "0"], "--gpus-per-node 0 must divide the 2 ranks"),
    (["--warmup", "-1"], "--warmup -1 must be at least 0"),
    (["--iters", "0"], "--iters 0 must be at least 1"),
])
def test_bad_argument_is_one_line(argv, message, capsys, monkeypatch):
    import uccl_ep_plugin.cli.bench as bench
    monkeypatch.setattr(bench.mp, "get_context", lambda *a: pytest.fail("ranks were spawned for a bad argument"))
    assert main(["bench", "--device", "cpu", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"uccl-ep bench: {message}", err


@pytest.mark.parametrize("transport,path", [("", "rail-gloo"),
                                            pytest.param("tcp", "rail-tcp", marks=needs_feature("tcp_transport"))])
def test_gpus_per_node_runs_the_normal_mode_in_two_hops(tmp_path, monkeypatch, transport, path):
    """4 CPU ranks as 2 hosts: the normal-mode cases go through the two hops and are checked like every case; with
    UCCL_EP_PROXY_TRANSPORT=tcp the bench gives the Buffer num_rdma_bytes for the hop between hosts, which then goes
    over tcp."""
    import json
    monkeypatch.setenv("UCCL_EP_GPUS_PER_NODE", "")   # restored after the run sets it for its ranks
    monkeypatch.setenv("UCCL_EP_PROXY_TRANSPORT", transport)
    monkeypatch.setenv("UCCL_SOCKET_IFNAME", "lo" if transport else "")
    results_file = tmp_path / "bench.json"
    assert main(["bench", "--device", "cpu", "--ranks", "4", "--gpus-per-node", "2", "--mode", "normal",
                 "--tokens", "48", "--hidden", "256", "--topk", "4", "--experts", "16", "--warmup", "0",
                 "--iters", "1", "--no-baselines", "--json", str(results_file)]) == 0
    results = json.loads(results_file.read_text())
    assert results and all(r["engine"] == "two_level" and r["path"] == path and r["correct"]
                           for r in results), results
    # Each hop's time, the rail's bandwidth to the other host, and its writes: over tcp one with the rows and one
    # giving the slot back per host (2 hosts) for a dispatch's or a combine's one exchange; none over gloo.
    for r in results:
        assert r["rail_us"] > 0 and r["forward_us"] > 0 and r["rail_gbps"] > 0, r
        assert r["rail_writes"] == (4 if transport else 0), r
