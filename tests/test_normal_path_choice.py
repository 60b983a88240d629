"""The native normal mode's path choice for a handle's cached dispatches and combines (CPU only: a stand-in
extension counts the staging computations): a handle without counts on the host goes by SMs, and a combine's
answer is kept on the handle, so its repeated combines compute nothing."""

from types import SimpleNamespace

import torch

from uccl_ep_plugin.engines.native import normal

DATA_BYTES = 1000


class _Extension:
    NormalStaging = SimpleNamespace(DISPATCH="dispatch", COMBINE="combine")

    def __init__(self, most_bytes):
        self.most_bytes = most_bytes
        self.calls = []

    def normal_staging_most_bytes(self, kind, rank_prefix_matrix, num_ranks, x_row_bytes, scale_row_bytes, num_topk):
        self.calls.append((kind, x_row_bytes, scale_row_bytes, num_topk))
        return self.most_bytes


def _engine(most_bytes):
    engine = normal.NativeNormal.__new__(normal.NativeNormal)   # only what the path choice reads
    engine._C, engine.num_ranks, engine.data_bytes = _Extension(most_bytes), 2, DATA_BYTES
    return engine


def _copy_engine_handle(hidden, num_topk):
    """A rank_prefix_matrix as a dispatch the copy engines carried leaves it."""
    matrix = torch.tensor([[3, 1], [5, 4]], dtype=torch.int32)
    setattr(matrix, normal._HOST_PREFIX, matrix.flatten().tolist())
    setattr(matrix, normal._COMBINE_FITS, {(hidden, num_topk): True})
    return matrix


def test_combine_of_the_dispatched_rows_computes_nothing():
    engine = _engine(most_bytes=10 * DATA_BYTES)
    matrix = _copy_engine_handle(64, 2)
    assert engine._copy_engine_serves(matrix, 64, 2)
    assert engine._C.calls == []


def test_another_combine_is_decided_once():
    engine = _engine(most_bytes=DATA_BYTES + 1)
    matrix = _copy_engine_handle(64, 2)
    assert not engine._copy_engine_serves(matrix, 128, 0)
    assert not engine._copy_engine_serves(matrix, 128, 0)
    assert engine._C.calls == [("combine", 256, 0, 0)]


def test_cached_dispatch_checks_its_own_rows():
    engine = _engine(most_bytes=DATA_BYTES)
    matrix = _copy_engine_handle(64, 2)
    for _ in range(2):
        assert engine._copy_engine_serves(matrix, 64, 0, (128, 8))
    assert engine._C.calls == [("combine", 128, 0, 0), ("dispatch", 128, 8, 0), ("dispatch", 128, 8, 0)]


def test_handle_without_counts_on_the_host_goes_by_sms():
    engine = _engine(most_bytes=0)
    assert not engine._copy_engine_serves(torch.zeros((2, 2), dtype=torch.int32), 64, 2)
    assert engine._C.calls == []
