"""The native normal mode's environment settings: UCCL_EP_NORMAL_COPY, UCCL_EP_NORMAL_OWN_ROWS,
UCCL_EP_NORMAL_COMBINE_CHUNKS, UCCL_EP_NORMAL_PULL_CHUNKS and the SM shares (UCCL_EP_NORMAL_SM_PULL_PERCENT,
UCCL_EP_NORMAL_SM_PUSH_PERCENT) are read as documented, and a bad value raises naming the variable (CPU only: the
bounds come from the extension, here a stand-in with the extension's attribute names)."""

from types import SimpleNamespace

import pytest

from uccl_ep_plugin.engines.native.normal import (COMBINE_CHUNKS_ENV, COPY_ENV, OWN_ROWS_ENV, PULL_CHUNKS_ENV,
                                                 SM_PULL_ENV, SM_PUSH_ENV, chunk_setting, copy_mode, sm_share)

EXTENSION = SimpleNamespace(NORMAL_COMBINE_CHUNKS=4, NORMAL_PULL_CHUNKS=3, NORMAL_MAX_CHUNKS=63,
                            NORMAL_SM_PULL_PERCENT=12, NORMAL_SM_PUSH_PERCENT=7)
DEFAULTS = {COMBINE_CHUNKS_ENV: 4, PULL_CHUNKS_ENV: 3, SM_PULL_ENV: 12, SM_PUSH_ENV: 7}


@pytest.mark.parametrize("env,value,expected",
                         [(COPY_ENV, None, "auto"), (COPY_ENV, "", "auto"), (COPY_ENV, "sm", "sm"),
                          (COPY_ENV, " Engine ", "engine"), (COPY_ENV, "AUTO", "auto"), (OWN_ROWS_ENV, None, "auto"),
                          (OWN_ROWS_ENV, "", "auto"),
                          (OWN_ROWS_ENV, "SM", "sm"), (OWN_ROWS_ENV, "engine", "engine"),
                          (OWN_ROWS_ENV, " auto", "auto")])
def test_copy_mode(monkeypatch, env, value, expected):
    if value is None:
        monkeypatch.delenv(env, raising=False)
    else:
        monkeypatch.setenv(env, value)
    assert copy_mode(env) == expected


@pytest.mark.parametrize("env,value", [(COPY_ENV, "dma"), (COPY_ENV, "pull"), (OWN_ROWS_ENV, "dma")])
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


@pytest.mark.parametrize("env", [SM_PULL_ENV, SM_PUSH_ENV])
@pytest.mark.parametrize("value,expected", [(None, None), ("", None), ("0", 0), ("30", 30), (" 100 ", 100)])
def test_sm_shares(monkeypatch, env, value, expected):
    other = SM_PUSH_ENV if env == SM_PULL_ENV else SM_PULL_ENV
    monkeypatch.setenv(other, "55")   # each setting reads its own variable only
    if value is None:
        monkeypatch.delenv(env, raising=False)
    else:
        monkeypatch.setenv(env, value)
    assert sm_share(env, EXTENSION) == (DEFAULTS[env] if expected is None else expected)


@pytest.mark.parametrize("env", [SM_PULL_ENV, SM_PUSH_ENV])
@pytest.mark.parametrize("value", ["101", "-1", "half", "2.5"])
def test_sm_shares_reject_out_of_range(monkeypatch, env, value):
    monkeypatch.setenv(env, value)
    with pytest.raises(ValueError, match=env):
        sm_share(env, EXTENSION)
