"""The native normal mode's environment settings: UCCL_EP_NORMAL_COPY, UCCL_EP_NORMAL_OWN_ROWS,
UCCL_EP_NORMAL_COMBINE_CHUNKS and UCCL_EP_NORMAL_PULL_CHUNKS are read as documented, and a bad value raises naming the variable (CPU only: the
bounds come from the extension, here a stand-in with the extension's attribute names)."""

from types import SimpleNamespace

import pytest

from uccl_ep_plugin.engines.native.normal import (COMBINE_CHUNKS_ENV, COPY_ENV, OWN_ROWS_ENV, PULL_CHUNKS_ENV,
                                                 SM_PULL_ENV, chunk_setting, copy_mode, sm_pull_percent)

EXTENSION = SimpleNamespace(NORMAL_COMBINE_CHUNKS=4, NORMAL_PULL_CHUNKS=3, NORMAL_MAX_CHUNKS=63,
                            NORMAL_SM_PULL_PERCENT=12)
DEFAULTS = {COMBINE_CHUNKS_ENV: 4, PULL_CHUNKS_ENV: 3}


@pytest.mark.parametrize("env,value,expected",
                         [(COPY_ENV, None, "engine"), (COPY_ENV, "", "engine"), (COPY_ENV, "sm", "sm"),
                          (COPY_ENV, " Engine ", "engine"), (OWN_ROWS_ENV, None, "auto"), (OWN_ROWS_ENV, "", "auto"),
                          (OWN_ROWS_ENV, "SM", "sm"), (OWN_ROWS_ENV, "engine", "engine"),
                          (OWN_ROWS_ENV, " auto", "auto")])
def test_copy_mode(monkeypatch, env, value, expected):
    if value is None:
        monkeypatch.delenv(env, raising=False)
    else:
        monkeypatch.setenv(env, value)
    assert copy_mode(env) == expected


@pytest.mark.parametrize("env,value", [(COPY_ENV, "dma"), (COPY_ENV, "auto"), (OWN_ROWS_ENV, "dma")])
def test_copy_mode_rejects_unknown(monkeypatch, env, value):
    monkeypatch.setenv(env, value)
    with pytest.raises(ValueError, match=env):
        copy_mode(env)


@pytest.mark.parametrize("env", [COMBINE_CHUNKS_ENV, PULL_CHUNKS_ENV])
@pytest.mark.parametrize("value,expected", [(None, None), ("", None), ("1", 1), ("7", 7), (" 63 ", 63)])
def test_chunk_settings(monkeypatch, env, value, expected):
    other = PULL_CHUNKS_ENV if env == COMBINE_CHUNKS_ENV else COMBINE_CHUNKS_ENV
    monkeypatch.setenv(other, "5")   # each setting reads its own variable only
    if value is None:
        monkeypatch.delenv(env, raising=False)
    else:
        monkeypatch.setenv(env, value)
    assert chunk_setting(env, EXTENSION) == (DEFAULTS[env] if expected is None else expected)


@pytest.mark.parametrize("env", [COMBINE_CHUNKS_ENV, PULL_CHUNKS_ENV])
@pytest.mark.parametrize("value", ["0", "64", "-1", "four", "2.5"])
def test_chunk_settings_reject_out_of_range(monkeypatch, env, value):
    monkeypatch.setenv(env, value)
    with pytest.raises(ValueError, match=env):
        chunk_setting(env, EXTENSION)


@pytest.mark.parametrize("value,expected", [(None, 12), ("", 12), ("0", 0), ("30", 30), (" 100 ", 100)])
def test_sm_pull_percent(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv(SM_PULL_ENV, raising=False)
    else:
        monkeypatch.setenv(SM_PULL_ENV, value)
    assert sm_pull_percent(EXTENSION) == expected


@pytest.mark.parametrize("value", ["101", "-1", "half", "2.5"])
def test_sm_pull_percent_rejects_out_of_range(monkeypatch, value):
    monkeypatch.setenv(SM_PULL_ENV, value)
    with pytest.raises(ValueError, match=SM_PULL_ENV):
        sm_pull_percent(EXTENSION)
