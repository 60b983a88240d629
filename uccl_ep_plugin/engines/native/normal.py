"""Native normal-mode dispatch and combine between the GPUs of one host: kernels that store
straight into the peers' IPC-mapped ``num_nvl_bytes`` buffers (csrc/kernels/intranode.h
describes the layout and the protocol).

Results equal the reference engine's bit for bit. A dispatch without handle syncs the host once
to read the counts, unless ``num_worst_tokens > 0``; cached dispatch and combine never sync. A
kernel that waits too long for a peer, or finds that some rank's share does not fit, records it in
host-mapped memory and exits; the call that reads the counts, or else the next call, raises it.

Two ways to move the rows (``UCCL_EP_NORMAL_COPY``): ``engine`` lets the copy engines carry the NVLink
traffic (csrc/kernels/intranode_copy.h), which needs every rank's counts on the host: a dispatch that
read them keeps them on its handle's rank_prefix_matrix, so its cached dispatches and its combine go
the same way. ``sm``, and calls whose counts stay on the device (num_worst_tokens), use the SM path's
channels (csrc/kernels/intranode.h). ``sends``: every SM stores the rows into their receivers' buffers and
the copy engines copy them out (its handle's cached dispatches and combine then go the copy engines' way).
``auto`` (the default) picks by the ranks and the call's SMs (NormalRowPath in csrc/kernels/intranode.h:
the copy engines at 2 ranks; from 4 ranks on SMs with 16 SMs or more, sends with fewer).

Each operation is one call of the extension's NormalLauncher (csrc/kernels/intranode_launcher.h), which
checks for recorded failures, decides the path, allocates the outputs (with torch's allocator, from C++)
and launches. A fresh dispatch allocates its outputs as soon as it has read how many rows arrive; the copy
engines' gather runs meanwhile. The copy engines' calls after that (pulls, copies, stream waits) are queued
by the launcher's own thread, and the caller's stream waits for them: the call returns once its outputs
exist.
"""

import os
from typing import Callable, Optional, Sequence, Tuple

import torch

from ..reference.collectives import CommTimeoutError
from ..reference.normal import DispatchResult
from .settings import mode_setting

_PHASE_NAMES = {1: "dispatch (notify: sending the layout)", 2: "dispatch (notify: receiving the layout)",
                3: "dispatch (sending rows)", 4: "dispatch (receiving rows)",
                5: "combine (sending rows)", 6: "combine (receiving rows)"}
_SEND_PHASES = (1, 3, 5)
_TIMEOUT, _TOO_MANY_ROWS, _AREA_TOO_SMALL, _SETTINGS_DIFFER = 1, 2, 3, 4
_STALE = "this Buffer's normal-mode buffers are now stale: destroy it and make a new one on every rank"
COPY_ENV = "UCCL_EP_NORMAL_COPY"   # what carries the rows between ranks
OWN_ROWS_ENV = "UCCL_EP_NORMAL_OWN_ROWS"   # the copy-engine dispatch: what copies a rank's rows to itself
DISPATCH_ROWS_ENV = "UCCL_EP_NORMAL_DISPATCH_ROWS"   # the copy-engine dispatch: peers' rows pulled, or pushed
LAUNCH_THREAD_ENV = "UCCL_EP_NORMAL_LAUNCH_THREAD"   # the copy engines' calls made by a thread of the launcher's
# Each mode setting's values, its default first.
_MODES = {COPY_ENV: ("auto", "engine", "sm", "sends"), OWN_ROWS_ENV: ("auto", "engine", "sm"),
          DISPATCH_ROWS_ENV: ("pull", "push"), LAUNCH_THREAD_ENV: ("off", "on")}
COMBINE_CHUNKS_ENV = "UCCL_EP_NORMAL_COMBINE_CHUNKS"   # the copy engines' combine: pieces per peer block
PULL_CHUNKS_ENV = "UCCL_EP_NORMAL_PULL_CHUNKS"   # the copy engines' dispatch: most pieces per peer block
SM_PULL_ENV = "UCCL_EP_NORMAL_SM_PULL_PERCENT"   # the dispatch: share of each peer's rows SMs copy beside them
SM_PUSH_ENV = "UCCL_EP_NORMAL_SM_PUSH_PERCENT"   # the combine: share of the rows to each peer SMs store beside them
# Each chunk and share setting's default, by its name in the extension.
_CHUNK_DEFAULTS = {COMBINE_CHUNKS_ENV: "NORMAL_COMBINE_CHUNKS", PULL_CHUNKS_ENV: "NORMAL_PULL_CHUNKS"}
_SHARE_DEFAULTS = {SM_PULL_ENV: "NORMAL_SM_PULL_PERCENT", SM_PUSH_ENV: "NORMAL_SM_PUSH_PERCENT"}
# Kept on a handle's rank_prefix_matrix tensor, so they travel with the handle: the matrix read on the host
# (NormalHostCounts: the copy engines need it) and the dispatch's send positions (its cached dispatches and
# combine reuse them).
_HOST_COUNTS = "_uccl_ep_host_counts"
_SEND_POS = "_uccl_ep_send_pos"
# NormalLauncher's call statuses besides DONE (0): NormalCallStatus.
FAILED, TOO_LARGE = 1, 2


def copy_mode(env: str = COPY_ENV) -> str:
    """What copies the rows, from ``env``: COPY_ENV "auto" (the default: copy engines at 2 and 3 ranks and with
    few SMs, else SMs; the extension's NormalRowPath), "engine" (copy engines wherever the counts are on the host),
    "sm", or "sends" (where the counts are on the host every SM sends rows into the receivers' buffers and their copy
    engines copy them out; every rank must use the same); OWN_ROWS_ENV "auto" (the default: by the bytes each SM would copy), "engine" or "sm"; DISPATCH_ROWS_ENV
    "pull" (the default: receivers pull gathered rows) or "push" (senders push rows straight from x where they are a
    few runs of it, normal_pushes_rows; every rank must use the same); LAUNCH_THREAD_ENV "off" (the default: the
    caller's thread makes the copy engines' calls) or "on" (the calls after a call's outputs exist are made by the
    launcher's own thread, and the call returns sooner, but its work ends later on the GPU; each rank may choose)."""
    return mode_setting(env, _MODES[env])


def _int_setting(env: str, default: int, low: int, high: int) -> int:
    """An integer setting from ``env``, else ``default``; a value outside low..high raises naming ``env``."""
    text = os.environ.get(env, "").strip()
    if not text:
        return default
    if not text.isdigit() or not low <= int(text) <= high:
        raise ValueError(f"{env}={text!r}: expected an integer in {low}..{high}")
    return int(text)


def sm_share(env: str, extension) -> int:
    """The share (percent) of the rows between two ranks that SMs move beside the copy engines, from ``env``, else
    the extension's default: SM_PULL_ENV, of each peer's dispatch rows (each rank may use its own); SM_PUSH_ENV, of
    the rows a combine returns to each peer (every rank must use the same)."""
    return _int_setting(env, getattr(extension, _SHARE_DEFAULTS[env]), 0, 100)


def chunk_setting(env: str, extension) -> int:
    """The pieces the copy engines move a peer's block in, from ``env`` (COMBINE_CHUNKS_ENV or PULL_CHUNKS_ENV; every
    rank must use the same pull chunks, the combine chunks may differ), else the extension's default (for the
    combine 0: by the combine's SMs)."""
    return _int_setting(env, getattr(extension, _CHUNK_DEFAULTS[env]), 1, extension.NORMAL_MAX_CHUNKS)


class ExchangeTooLarge(Exception):
    """A dispatch (with the combine of its rows) does not fit the Buffer's num_nvl_bytes. Raised before
    any kernel of the call moved rows, and on every rank alike (it is decided from values all ranks
    share), so the Buffer can serve the call with the reference engine instead."""


def exchange_bytes(extension, rows: int, hidden: int, num_topk: int) -> int:
    """num_nvl_bytes for which the native engine serves a dispatch of at most ``rows`` rows to any rank and
    from any rank (bf16 or fp8 with float scales per 128 channels), and their combine; with
    DISPATCH_ROWS_ENV=push, room for the landing of pushed rows too (after the staging)."""
    dispatch = extension.normal_dispatch_area_bytes(rows, 2 * hidden, 4 * ((hidden + 127) // 128), num_topk)
    if copy_mode(DISPATCH_ROWS_ENV) == "push":
        dispatch += 16 * ((rows * 2 * hidden + 15) // 16)
    combine = extension.normal_combine_area_bytes(rows, 2 * hidden, num_topk)
    return extension.NORMAL_CONTROL_BYTES + max(dispatch, combine)


class NativeNormal:
    """``data_bytes``: the data area of every rank's buffer (the same on all ranks)."""

    def __init__(self, extension, peer_buffer, rank: int, num_ranks: int, device: torch.device,
                 timeout_s: float, aggressive_atomics: bool) -> None:
        self._C = extension
        self.peer_buffer = peer_buffer
        self.rank = rank
        self.num_ranks = num_ranks
        self.device = device
        self.timeout_s = timeout_s
        self.num_nvl_bytes = peer_buffer.tensor.numel()
        self.data_bytes = self.num_nvl_bytes - extension.NORMAL_CONTROL_BYTES
        # Its control words count the exchanges; its status block is the failure record both modes share.
        self.state = extension.LowLatencyState(device.index)
        self.region = extension.NormalRegion(
            peer_bases=peer_buffer.peer_bases, control=self.state.control(0), status=self.state.status_device,
            data_bytes=self.data_bytes, timeout_ns=int(timeout_s * 1e9), rank=rank, num_ranks=num_ranks,
            aggressive_atomics=aggressive_atomics)
        self.sm_push_percent = sm_share(SM_PUSH_ENV, extension)
        # Reads every dispatch's counts; carries the rows too unless UCCL_EP_NORMAL_COPY=sm.
        self.copy_engine = extension.NormalCopyEngine(
            device.index, [peer_buffer.memory.peer_base(peer) for peer in range(num_ranks)],
            combine_chunks=chunk_setting(COMBINE_CHUNKS_ENV, extension),
            pull_chunks=chunk_setting(PULL_CHUNKS_ENV, extension), sm_pull_percent=sm_share(SM_PULL_ENV, extension),
            sm_push_percent=self.sm_push_percent,
            own_rows=extension.NormalOwnRows.__members__[copy_mode(OWN_ROWS_ENV)],
            push_rows=copy_mode(DISPATCH_ROWS_ENV) == "push" and num_ranks <= extension.NORMAL_MAX_COMBINE_RANKS)
        # What moves the rows, per call (NormalRowPath: auto picks by ranks and SMs).
        self.row_path = extension.NormalRowPath.__members__[copy_mode()]
        # Each operation is one call of it (csrc/kernels/intranode_launcher.h).
        self.launcher = extension.NormalLauncher(self.region, self.copy_engine, self.state, device.index,
                                                 self.row_path, copy_mode(LAUNCH_THREAD_ENV) == "on")
        # The last dispatch notify's channels, num_worst_tokens and its combine's SM push share.
        self._last_notify = (0, 0, 0)

    # ------------------------------------------------------------------ errors
    def check(self) -> None:
        """Raise the first failure a kernel recorded (reads host memory; no sync)."""
        code, phase, peer, detail = self.state.status()
        if code == 0:
            return
        where = _PHASE_NAMES.get(phase, f"phase {phase}")
        if code == _TIMEOUT:
            what = "to finish reading the previous exchange" if phase in _SEND_PHASES else "to send its part"
            raise CommTimeoutError(f"rank {self.rank}: {where} timed out after {self.timeout_s:g} s waiting for "
                                   f"rank {peer} {what}; {_STALE}")
        if code == _TOO_MANY_ROWS:
            raise RuntimeError(f"uccl_ep_plugin: dispatch on rank {self.rank}: rank {peer} would receive {detail} "
                               f"tokens, more than num_worst_tokens; {_STALE}")
        if code == _AREA_TOO_SMALL:
            raise ValueError(f"rank {self.rank}: {where}: some rank's rows do not fit in num_nvl_bytes="
                             f"{self.num_nvl_bytes} (the whole exchange must fit; make the Buffer larger); {_STALE}")
        if code == _SETTINGS_DIFFER:
            num_channels, num_worst_tokens, sm_push_percent = self._last_notify
            gathers = num_worst_tokens == 0 and self.dispatch_by_copy_engine(2 * num_channels)
            sends = gathers and self.rows_by_sends(2 * num_channels)
            mine = self._C.normal_notify_settings_word(
                num_channels, self.copy_engine.pull_chunks(num_channels) if gathers and not sends else 0,
                sm_push_percent, gathers and not sends and self.copy_engine.pushes_rows(), sends)
            raise ValueError(f"rank {self.rank}: {where}: rank {peer} dispatches with "
                             f"{self._describe_settings(detail)}, this rank with {self._describe_settings(mine)}; "
                             f"every rank must pass the same config (num_sms) and num_worst_tokens (0 or not), "
                             f"with the same {COPY_ENV}, {PULL_CHUNKS_ENV}, {DISPATCH_ROWS_ENV} and {SM_PUSH_ENV}; "
                             f"{_STALE}")
        raise RuntimeError(f"rank {self.rank}: normal-mode kernel failed with code {code} in {where}; {_STALE}")

    def dispatch_by_copy_engine(self, num_sms: int) -> bool:
        """Whether the copy engines move the rows of a fresh dispatch with ``num_sms`` SMs and no num_worst_tokens
        (and so its combine's), else the SM path."""
        return self._C.normal_dispatch_by_copy_engine(self.row_path, self.num_ranks, num_sms)

    def rows_by_sends(self, num_sms: int) -> bool:
        """Of those dispatches, whether SMs send the rows (the copy engines then copy them out of the data area)."""
        return self._C.normal_rows_by_sends(self.row_path, self.num_ranks, num_sms)

    def cached_dispatch_by_copy_engine(self, num_sms: int) -> bool:
        """Whether the copy engines move the rows of a cached dispatch whose handle (of a fresh dispatch with
        ``num_sms`` SMs) kept its counts on the host, else SMs."""
        return self._C.normal_cached_dispatch_by_copy_engine(self.row_path, self.num_ranks, num_sms)

    def _describe_settings(self, word: int) -> str:
        """A notify's settings word (normal_notify_settings_word) in words."""
        num_channels, pull_chunks, sm_push_percent, push_rows, sends = self._C.normal_notify_settings(word)
        how = "pushed where they can be, else pulled" if push_rows else "pulled"
        rows = f"rows {how} by copy engines in {pull_chunks} pieces" if pull_chunks else "rows moved by SMs"
        if sends:
            rows = "rows sent by every SM and copied out by copy engines"
        return (f"{num_channels} channels (config.num_sms {2 * num_channels}), {rows}, "
                f"{sm_push_percent}% of the combine's rows stored by SMs")

    def destroy(self) -> None:
        if self.launcher is not None:
            self.launcher.release()   # its thread may still queue work on the copy engine's streams
            self.launcher = None
        if self.copy_engine is not None:
            self.copy_engine.release()
            self.copy_engine = None
        if self.state is not None:
            self.state.release()
            self.state = None
        if self.peer_buffer is not None:
            self.peer_buffer.release()
            self.peer_buffer = None

    def _send_positions(self, handle: Sequence[torch.Tensor], stream: int) -> torch.Tensor:
        """send_pos [N, R] of a handle's dispatch: each token's position among the tokens sent to each rank, -1
        where not sent. Kept by the dispatch that made the handle, else computed from its is_token_in_rank (a
        handle rebuilt by the caller: one more call)."""
        send_pos = getattr(handle[0], _SEND_POS, None)
        if send_pos is not None:
            return send_pos
        is_token_in_rank = handle[4]
        num_tokens = is_token_in_rank.size(0)
        send_pos = torch.empty((num_tokens, self.num_ranks), dtype=torch.int32, device=self.device)
        with torch.cuda.device(self.device):
            self._C.normal_send_layout(is_token_in_rank=is_token_in_rank.data_ptr(), num_tokens=num_tokens,
                                       num_ranks=self.num_ranks, num_channels=1, send_pos=send_pos.data_ptr(),
                                       channel_prefix_matrix=0, send_head=0, stream=stream)
        setattr(handle[0], _SEND_POS, send_pos)
        return send_pos

    # ------------------------------------------------------------------ operations
    def _raise_unless_done(self, status: int, too_large: str = "") -> None:
        if status == FAILED:
            self.check()
            raise RuntimeError(f"rank {self.rank}: a normal-mode kernel failed but recorded nothing; {_STALE}")
        if status == TOO_LARGE:
            raise ExchangeTooLarge(too_large)

    def dispatch(self, x: torch.Tensor, x_scales: Optional[torch.Tensor], *, is_token_in_rank: torch.Tensor,
                 num_tokens_per_rank: Optional[torch.Tensor], num_tokens_per_expert: Optional[torch.Tensor],
                 topk_idx: Optional[torch.Tensor], topk_weights: Optional[torch.Tensor], expert_alignment: int,
                 num_worst_tokens: int, num_channels: int, cached_handle: Optional[Sequence[torch.Tensor]],
                 stream: int, check: Callable[[], None]) -> DispatchResult:
        """``check``: the caller's checks of these arguments, which the extension runs (and lets raise) only for a
        kind of call it has not seen pass; it reads every tensor (contiguous, as the checks demand) as it is."""
        if cached_handle is not None:
            rank_prefix_matrix = cached_handle[0]
            status, outputs = self.launcher.cached_dispatch(
                (x, x_scales, topk_idx, topk_weights, self._send_positions(cached_handle, stream), rank_prefix_matrix,
                 cached_handle[2], cached_handle[3], cached_handle[4]), (expert_alignment, num_worst_tokens),
                num_channels, getattr(rank_prefix_matrix, _HOST_COUNTS, None), stream, check)
            self._raise_unless_done(status)
            return DispatchResult(outputs[0], outputs[1], None, None, [], tuple(cached_handle))
        self._last_notify = (num_channels, num_worst_tokens, self.sm_push_percent if num_worst_tokens == 0 else 0)
        status, outputs, expert_counts, host_counts, too_large = self.launcher.dispatch(
            (x, x_scales, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_rank, num_tokens_per_expert),
            (expert_alignment, num_worst_tokens), num_channels, stream, check)
        self._raise_unless_done(status, too_large)
        (send_pos, channel_prefix_matrix, send_head, recv_channel_prefix_matrix, rank_prefix_matrix,
         recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights, recv_src_idx) = outputs
        setattr(rank_prefix_matrix, _SEND_POS, send_pos)   # its cached dispatches and combine reuse them
        if host_counts is not None:
            setattr(rank_prefix_matrix, _HOST_COUNTS, host_counts)
        handle = (rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx,
                  is_token_in_rank, send_head)
        return DispatchResult(recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights, expert_counts, handle)

    def combine(self, x: torch.Tensor, handle: Sequence[torch.Tensor], topk_weights: Optional[torch.Tensor],
                biases: Sequence[torch.Tensor], num_channels: int, stream: int,
                check: Callable[[], None]) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``check`` as in :meth:`dispatch`; ``biases``: the caller's, as given (the checks allow at most two)."""
        rank_prefix_matrix = handle[0]
        bias0, bias1 = (list(biases) + [None, None])[:2]
        status, outputs = self.launcher.combine(
            (x, topk_weights, bias0, bias1, rank_prefix_matrix, handle[4], self._send_positions(handle, stream),
             handle[2], handle[3]), (len(biases),), num_channels, getattr(rank_prefix_matrix, _HOST_COUNTS, None),
            stream, check)
        self._raise_unless_done(status)
        return outputs[0], outputs[1]
