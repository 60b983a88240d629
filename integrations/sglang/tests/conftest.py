"""Shared setup of the SGLang plugin tests: they run in SGLang's own environment (ci.sh)."""

import pytest

pytest.importorskip("sglang.srt.plugins", reason="the SGLang plugin tests need sglang installed (run ci.sh)")


@pytest.fixture(scope="session")
def sglang_plugins_loaded():
    """SGLang's own loader, as every SGLang process calls it at start-up."""
    from sglang.srt.plugins import load_plugins

    load_plugins()
    return True
