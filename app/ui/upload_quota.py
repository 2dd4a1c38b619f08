"""Uploads per request and per account: what Gradio's upload route does not bound.

Gradio streams a multipart upload to its temp folder and caps each file (`max_file_size`), but not
how many files one request carries (up to 1,000), nor, for a chunked body that declares no
`Content-Length`, how many bytes: 20 files of 15 MiB were accepted in one request. Its files stay
on disk until the server stops. So:

- `StreamedUpload` counts a request's bytes and files as they arrive (the ASGI `receive`) and
  stops it as soon as either passes its cap (`--max-upload-mib` for the whole request,
  `--max-upload-files`) or the account's quota would (`--account-upload-quota-mib`). It stops it by
  raising Gradio's own `MultiPartException` from `receive`: the one failure on which Gradio's parser
  deletes every temp file it has written so far (a plain disconnect leaves them behind, so a client
  that hangs up is stopped the same way).
- `UploadQuota` holds, per account, the files its uploads left on disk. A file counts at least
  `FILE_FLOOR` bytes (a 70-byte PNG still costs a file and a record). A file a job uses is removed
  when that job ends, unless the app's own page sent the job (the page shows the image and sends it
  again with the next Generate): then, like a file no job ever used, it is removed `UNUSED_TTL_S`
  after it was last uploaded or used.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import anyio
from gradio.route_utils import MultiPartException
from starlette.datastructures import Headers

FILE_FLOOR = 64 << 10
UNUSED_TTL_S = 3600.0
SWEEP_S = 1.0  # how often held files are checked for an ended job or an expired wait

Receive = Callable[[], Awaitable[dict]]


@dataclass
class HeldFile:
    """An uploaded file on disk: whose, how much it counts, which file (`inode`: an upload of the same
    picture under the same name gets the same path, a new file), until when it may wait unused, and
    the job that uses it (Gradio's event id) with whether the page will send it again."""

    account: str
    cost: int
    inode: int
    expires: float
    event: str | None = None
    page: bool = False


@dataclass
class UploadQuota:
    """The files each account's uploads hold on disk (see the module docstring). `live(event_id)`
    says whether a job is still queued or running (Gradio's queue keeps its events until they end)."""

    quota_bytes: int
    live: Callable[[str], bool]
    ttl_s: float = UNUSED_TTL_S
    clock: Callable[[], float] = time.monotonic
    files: dict[str, HeldFile] = field(default_factory=dict)
    in_flight: dict[str, int] = field(default_factory=dict)

    def used(self, account: str) -> int:
        return sum(held.cost for held in self.files.values() if held.account == account) + \
            self.in_flight.get(account, 0)

    def admit(self, account: str, size: int) -> bool:
        """Count `size` more bytes of an upload `account` is sending; False (nothing counted) when
        they would take the account past its quota."""
        if self.used(account) + size > self.quota_bytes:
            return False
        self.in_flight[account] = self.in_flight.get(account, 0) + size
        return True

    def settle(self, account: str, streamed: int, saved: Iterable[str]) -> None:
        """An upload of `streamed` bytes ended; `saved` are the files it left on disk."""
        left = self.in_flight.get(account, 0) - streamed
        if left > 0:
            self.in_flight[account] = left
        else:
            self.in_flight.pop(account, None)
        for path in saved:
            try:
                stat = Path(path).stat()
            except OSError:
                continue
            self.files[path] = HeldFile(account, max(stat.st_size, FILE_FLOOR), stat.st_ino, self.clock() + self.ttl_s)

    def forget(self, paths: Iterable[str]) -> None:
        """Files deleted by whoever found them unfit: they no longer count."""
        for path in paths:
            self.files.pop(path, None)

    def use(self, paths: Iterable[str], event: str, page: bool) -> None:
        """A job (`event`) uses these uploaded files: they stay while it is queued or running."""
        for path in paths:
            held = self.files.get(path)
            if held is not None:
                held.event, held.page, held.expires = event, page, self.clock() + self.ttl_s

    def sweep(self) -> list[tuple[str, HeldFile]]:
        """Forget and return the files to delete now: their job ended (and no page will send them
        again), or they waited unused past their time."""
        now, done = self.clock(), []
        for path, held in self.files.items():
            if held.event is not None and not self.live(held.event):
                held.event = None
                if not held.page:
                    done.append(path)
                    continue
                held.expires = now + self.ttl_s
            if held.event is None and now >= held.expires:
                done.append(path)
        return [(path, self.files.pop(path)) for path in done]


class UploadRefused(MultiPartException):
    """An upload stopped while it streamed: too big, too many files, or over the account's quota."""


class StreamedUpload:
    """The `receive` of one upload request, counting its bytes and files as they arrive (see the
    module docstring). `refusal` is the reason it was stopped, or None."""

    def __init__(self, receive: Receive, headers: Headers, account: str, quota: UploadQuota, max_bytes: int,
                 max_files: int) -> None:
        self._receive = receive
        self.account, self.quota = account, quota
        self.max_bytes, self.max_files = max_bytes, max_files
        self.delimiter = b"--" + _boundary(headers.get("content-type", ""))
        self.streamed = self.delimiters = 0
        self._tail = b""
        self.refusal: str | None = None

    async def receive(self) -> dict:
        message = await self._receive()
        if message["type"] == "http.disconnect":
            self._stop("the client went away before the upload ended")
        chunk = message.get("body", b"")
        if len(chunk) + self.streamed > self.max_bytes:
            self._stop(f"upload over {self.max_bytes:,} bytes in one request (--max-upload-mib)")
        if not self.quota.admit(self.account, len(chunk)):
            self._stop(f"the uploads of {self.account!r} would hold over {self.quota.quota_bytes:,} bytes of "
                       "temporary files (--account-upload-quota-mib); they are freed when the jobs that use "
                       "them end")
        self.streamed += len(chunk)
        window = self._tail + chunk
        self.delimiters += window.count(self.delimiter)
        self._tail = window[-(len(self.delimiter) - 1):]
        if self.delimiters > self.max_files + 1:  # parts are delimited on both sides: n parts, n + 1 lines
            self._stop(f"more than {self.max_files} files in one upload (--max-upload-files)")
        return message

    def _stop(self, reason: str) -> None:
        self.refusal = reason
        raise UploadRefused(reason)


def _boundary(content_type: str) -> bytes:
    """The multipart boundary of a `Content-Type` header (Gradio refuses a body without one)."""
    for part in content_type.split(";")[1:]:
        key, _, value = part.strip().partition("=")
        if key.lower() == "boundary":
            return value.strip('"').encode("latin-1", "replace")
    return b"\0"  # no boundary: no delimiter to count, and Gradio answers 400 before reading the body


def referenced(value, held: dict[str, HeldFile]) -> list[str]:
    """The held uploads a request's `data` names (`{"path": ...}`, as Gradio's page and clients send them)."""
    return [item["path"] for item in dicts_in(value) if isinstance(item.get("path"), str) and item["path"] in held]


def dicts_in(value) -> Iterator[dict]:
    """Every dict nested in a request's JSON `value`. A walk, not recursion: a 2 KB body nests deeper
    than Python's stack allows."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, dict):
            yield item
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)


async def remove_ended(quota: UploadQuota, known: set[str]) -> None:
    """Delete the files `quota.sweep` lets go, every `SWEEP_S`, while any is held; `known` is Gradio's
    set of uploaded paths (its page may name only those), which forgets them too."""
    while quota.files:
        await anyio.sleep(SWEEP_S)
        for path, held in quota.sweep():
            file = Path(path)
            with contextlib.suppress(OSError):
                if file.stat().st_ino == held.inode:  # not a new upload of the same picture since
                    file.unlink()
                    known.discard(path)
            with contextlib.suppress(OSError):  # Gradio's folder per content hash, if now empty
                file.parent.rmdir()
