"""``uccl-ep bench`` checks every argument before it spawns anything: a user mistake is one line naming the
argument and the rule, exit code 2, no traceback."""

import pytest

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
    (["--warmup", "-1"], "--warmup -1 must be at least 0"),
    (["--iters", "0"], "--iters 0 must be at least 1"),
])
def test_bad_argument_is_one_line(argv, message, capsys, monkeypatch):
    import uccl_ep_plugin.cli.bench as bench
    monkeypatch.setattr(bench.mp, "get_context", lambda *a: pytest.fail("ranks were spawned for a bad argument"))
    assert main(["bench", "--device", "cpu", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"uccl-ep bench: {message}", err
