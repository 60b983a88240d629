"""The native normal mode's environment settings: UCCL_EP_NORMAL_COPY and UCCL_EP_NORMAL_COMBINE_CHUNKS are read
as documented, and a bad value raises naming the variable (CPU only: the bounds come from the extension, here a
stand-in with the extension's attribute names)."""

from types import SimpleNamespace

import pytest

from uccl_ep_plugin.engines.native.normal import COMBINE_CHUNKS_ENV, COPY_ENV, combine_chunks, copy_mode

EXTENSION = SimpleNamespace(NORMAL_COMBINE_CHUNKS=4, NORMAL_MAX_COMBINE_CHUNKS=63)


@pytest.mark.parametrize("value,expected", [(None, "engine"), ("", "engine"), ("sm", "sm"), (" Engine ", "engine")])
def test_copy_mode(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv(COPY_ENV, raising=False)
    else:
        monkeypatch.setenv(COPY_ENV, value)
    assert copy_mode() == expected


def test_copy_mode_rejects_unknown(monkeypatch):
    monkeypatch.setenv(COPY_ENV, "dma")
    with pytest.raises(ValueError, match=COPY_ENV):
        copy_mode()


@pytest.mark.parametrize("value,expected", [(None, 4), ("", 4), ("1", 1), ("7", 7), (" 63 ", 63)])
def test_combine_chunks(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv(COMBINE_CHUNKS_ENV, raising=False)
    else:
        monkeypatch.setenv(COMBINE_CHUNKS_ENV, value)
    assert combine_chunks(EXTENSION) == expected


@pytest.mark.parametrize("value", ["0", "64", "-1", "four", "2.5"])
def test_combine_chunks_rejects_out_of_range(monkeypatch, value):
    monkeypatch.setenv(COMBINE_CHUNKS_ENV, value)
    with pytest.raises(ValueError, match=COMBINE_CHUNKS_ENV):
        combine_chunks(EXTENSION)
