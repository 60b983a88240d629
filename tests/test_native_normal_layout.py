"""Checks of the native normal mode's pieces: the send-layout kernel (on one GPU) against the reference
tables, the data-area byte layout, and which build feature the engine choice asks for."""

import pytest
import torch

from uccl_ep_plugin import engines
from uccl_ep_plugin.engines import native
from uccl_ep_plugin.engines.reference.layout import channel_layout
from uccl_ep_plugin.engines.reference.normal import _routed_pairs
from tests.fake_extension import FakeExtension


def _extension_with_normal():
    try:
        from uccl_ep_plugin import _C
    except ImportError:
        pytest.skip("the native extension is not built")
    if "normal_nvlink" not in _C.build_info()["features"]:
        pytest.skip("this build has no normal_nvlink (CPU-only build)")
    return _C


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_send_layout_kernel_matches_the_reference_tables():
    ext = _extension_with_normal()
    device = torch.device("cuda", 0)
    gen = torch.Generator().manual_seed(5)
    poison = -7
    for num_tokens, num_ranks, num_channels in ((0, 2, 3), (1, 3, 10), (37, 4, 5), (1000, 2, 1), (4113, 8, 24),
                                                (2050, 5, 2048)):
        in_rank = (torch.rand((num_tokens, num_ranks), generator=gen) < 0.6).to(device)
        send_pos, send_head = (torch.full((num_tokens, num_ranks), poison, dtype=torch.int32, device=device)
                               for _ in range(2))
        prefix = torch.full((num_ranks, num_channels), poison, dtype=torch.int32, device=device)
        ext.normal_send_layout(is_token_in_rank=in_rank.data_ptr(), num_tokens=num_tokens, num_ranks=num_ranks,
                               num_channels=num_channels, send_pos=send_pos.data_ptr(),
                               channel_prefix_matrix=prefix.data_ptr(), send_head=send_head.data_ptr(),
                               stream=torch.cuda.current_stream(device).cuda_stream)
        torch.cuda.synchronize(device)
        tag = f"N={num_tokens} R={num_ranks} C={num_channels}"
        want_prefix, want_head = channel_layout(in_rank.cpu(), num_channels)
        assert torch.equal(prefix.cpu(), want_prefix.to(torch.int32)), tag
        assert torch.equal(send_head.cpu(), want_head.to(torch.int32)), tag
        positions = send_pos.cpu()
        assert torch.equal(positions < 0, ~in_rank.cpu()), tag
        dst_rank, token = _routed_pairs(in_rank.cpu())
        for rank in range(num_ranks):
            # The reference sends a rank's tokens in token order: position k is the k-th of them.
            sent = token[dst_rank == rank]
            assert torch.equal(positions[sent, rank], torch.arange(sent.numel(), dtype=torch.int32)), tag


def test_data_area_fields_are_16_byte_aligned_arrays():
    ext = _extension_with_normal()
    # 3 rows of 32 x bytes, 8 scale bytes, 2 top-k: 96 + 32 (24) + 48 + 32 (24) + 16 (12)
    assert ext.normal_dispatch_area_bytes(3, 32, 8, 2) == 96 + 32 + 48 + 32 + 16
    assert ext.normal_dispatch_area_bytes(0, 14336, 224, 9) == 0
    # 3 rows of 32 bytes, 2 weights each: 96 + 32 (24)
    assert ext.normal_combine_area_bytes(3, 32, 2) == 96 + 32
    # the settings words of 2 sources (padded to 16 bytes), then 2 slots of 2 + 10 + 144 counts and the
    # source's token count
    assert ext.normal_notify_area_bytes(2, 10, 144) == 16 + 2 * 4 * 157
    assert ext.normal_notify_area_bytes(5, 1, 1) == 32 + 5 * 4 * 8
    # arrived, freed, chunk and sm_pushed words per rank, then the SM path's channel words
    assert ext.NORMAL_CONTROL_BYTES == 4 * 8 * ext.NORMAL_MAX_RANKS + 8 * ext.NORMAL_CHANNEL_WORDS


def test_channel_words_fit_the_control_area_and_rise_with_each_exchange():
    """The SM path's word of each (source, channel) lies after the four per-rank word arrays, inside the control
    area, apart from every other; a word of a later exchange is above any of an earlier one."""
    ext = _extension_with_normal()
    for num_ranks, num_channels in ((2, 12), (8, 1024), (256, 32)):   # the last two fill every word
        assert num_ranks * num_channels <= ext.NORMAL_CHANNEL_WORDS
        offsets = {ext.normal_channel_word_offset(src, channel, num_channels)
                   for src in range(num_ranks) for channel in range(num_channels)}
        assert len(offsets) == num_ranks * num_channels
        assert min(offsets) == 4 * 8 * ext.NORMAL_MAX_RANKS and max(offsets) + 8 <= ext.NORMAL_CONTROL_BYTES
        assert all(offset % 8 == 0 for offset in offsets)
    for epoch in (1, 2, 1000):
        assert ext.normal_channel_progress(epoch - 1, (1 << 32) - 1) < ext.normal_channel_progress(epoch, 0)
        assert ext.normal_channel_progress(epoch, 5) < ext.normal_channel_progress(epoch, 6)


@pytest.mark.parametrize("num_tokens,num_channels", [(4096, 12), (4113, 8), (7, 10), (0, 3), (1, 1)])
def test_channel_tokens_split_like_the_reference(num_tokens, num_channels):
    """A channel's tokens are DeepEP's: consecutive ranges of ceil(N / C), the last ones possibly empty."""
    ext = _extension_with_normal()
    ranges = [ext.normal_channel_tokens(num_channels, channel, num_tokens) for channel in range(num_channels)]
    assert ranges[0][0] == 0
    assert all(ranges[c][1] == ranges[c + 1][0] for c in range(num_channels - 1))
    # With every token sent to one rank, the reference's channel_prefix_matrix holds each channel's end.
    ends = channel_layout(torch.ones(num_tokens, 1, dtype=torch.bool), num_channels)[0][0].tolist()
    assert [end for _, end in ranges] == ends


def test_chunk_words_tell_the_rows_landed_whatever_the_writers_chunking():
    ext = _extension_with_normal()
    epoch = 7
    for rows in (0, 1, 5, 63, 64, 4113):
        for chunks in (1, 2, 6, 7, 12, ext.NORMAL_MAX_CHUNKS):
            words = [ext.normal_chunk_word(epoch, landed, chunks) for landed in range(chunks + 1)]
            landed_rows = [ext.normal_combine_rows_landed(word, epoch, rows) for word in words]
            assert landed_rows[0] == 0 and landed_rows[-1] == rows, (rows, chunks, landed_rows)
            assert landed_rows == sorted(landed_rows) and words == sorted(words), (rows, chunks)
            if rows >= 2 * chunks:   # every piece holds rows, the last about half as many as the others
                sizes = [b - a for a, b in zip(landed_rows, landed_rows[1:])]
                assert min(sizes) > 0 and sizes[-1] <= min(sizes[:-1] or sizes), (rows, chunks, sizes)
            # The last exchange's words count nothing, the next one's lie above, a failed writer's counts all.
            assert ext.normal_combine_rows_landed(ext.normal_chunk_word(epoch - 1, chunks, chunks), epoch, rows) == 0
            assert words[-1] < ext.normal_chunk_word(epoch + 1, 0, 1)
            assert ext.normal_combine_rows_landed(ext.NORMAL_CHUNK_WORDS_OPEN, epoch, rows) == rows
            # A dispatch's stream waits ask for at least `needed` pieces, whatever their count.
            for needed in range(1, chunks + 1):
                target = ext.normal_chunk_word(epoch, needed, 0)
                assert [word >= target for word in words] == [landed >= needed for landed in range(chunks + 1)]


def test_notify_settings_word_tells_every_setting_apart():
    ext = _extension_with_normal()
    seen = set()
    for num_channels in (1, 4, 10, 12, 66, 1000, (1 << 16) - 1):
        for pull_chunks in (0, 1, 3, ext.NORMAL_MAX_CHUNKS):
            for sm_push_percent in (0, 1, 30, 100):
                for push_rows, sends in ((False, False), (True, False), (False, True), (True, True)):
                    word = ext.normal_notify_settings_word(num_channels, pull_chunks, sm_push_percent, push_rows,
                                                           sends)
                    assert 0 <= word < 1 << 31
                    assert ext.normal_notify_settings(word) == (num_channels, pull_chunks, sm_push_percent,
                                                                push_rows, sends)
                    seen.add(word)
    assert len(seen) == 7 * 4 * 4 * 4


@pytest.mark.parametrize("mode,num_ranks,num_sms,fresh,cached,sends",
                         [("auto", 2, 24, True, True, False), ("auto", 3, 132, True, True, False),
                          ("auto", 4, 24, False, False, False), ("auto", 4, 16, False, False, False),
                          ("auto", 4, 14, True, True, True), ("auto", 8, 8, True, True, True),
                          ("auto", 8, 20, False, False, False), ("auto", 2, 8, True, True, False),
                          ("engine", 8, 24, True, True, False), ("engine", 4, 8, True, True, False),
                          ("sm", 2, 8, False, False, False), ("sends", 4, 8, True, True, True),
                          ("sends", 8, 24, True, True, True), ("sends", 2, 24, True, True, True)])
def test_copy_mode_picks_the_row_path(mode, num_ranks, num_sms, fresh, cached, sends):
    """UCCL_EP_NORMAL_COPY=auto: copy engines below 4 ranks; from 4 ranks on the SM path with 16 SMs or more
    (fresh and cached), else sends (SMs send the rows, copy engines copy them out, the handle's cached dispatches
    and combine going the copy engines' way); engine, sm and sends as named, at any ranks and SMs."""
    ext = _extension_with_normal()
    assert (ext.NORMAL_SM_ROWS_FROM_RANKS, ext.NORMAL_SM_ROWS_FROM_SMS) == (4, 16)
    path = ext.NormalRowPath.__members__[mode]
    assert ext.normal_dispatch_by_copy_engine(path, num_ranks, num_sms) is fresh
    assert ext.normal_cached_dispatch_by_copy_engine(path, num_ranks, num_sms) is cached
    assert ext.normal_rows_by_sends(path, num_ranks, num_sms) is sends


def test_normal_mode_needs_the_normal_nvlink_feature(monkeypatch):
    monkeypatch.setattr(native, "_load_extension", lambda: FakeExtension(["dispatch_layout", "low_latency_nvlink"]))
    choice = engines.choose("auto", torch.device("cuda"))
    for operation in native.NORMAL_OPERATIONS:
        assert choice.by_operation[operation] == "reference"
        assert "normal_nvlink" in choice.reasons[operation]
    monkeypatch.setattr(native, "_load_extension", lambda: FakeExtension(["normal_nvlink"]))
    choice = engines.choose("auto", torch.device("cuda"))
    assert all(choice.by_operation[op] == "native" and op not in choice.reasons for op in native.NORMAL_OPERATIONS)
