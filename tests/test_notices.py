"""The library's warnings: once per process, without a source line under them, still RuntimeWarnings."""

import warnings

from uccl_ep_plugin import notices


def test_once_per_process_and_no_source_line(monkeypatch):
    monkeypatch.setattr(notices, "_given", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        notices.warn_once("the reference engine serves dispatch because of a test")
        notices.warn_once("the reference engine serves dispatch because of a test")
        notices.warn_once("another message")
    assert [str(w.message) for w in caught] == ["the reference engine serves dispatch because of a test",
                                                "another message"]
    first = caught[0]
    assert issubclass(first.category, RuntimeWarning)
    text = warnings.formatwarning(first.message, first.category, first.filename, first.lineno)
    assert text == "uccl_ep_plugin:0: RuntimeWarning: the reference engine serves dispatch because of a test\n"


def test_filters_still_apply(monkeypatch):
    monkeypatch.setattr(notices, "_given", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("ignore", RuntimeWarning)
        notices.warn_once("silenced")
    assert not caught
