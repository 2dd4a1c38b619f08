"""Safe to share, round three (issue 43), finding 7: uploads bounded per request and per account.

One app served as on a LAN (`--listen`, four logins), its Gradio temp folder private to this module
(`GRADIO_TEMP_DIR`), so that counting the files in it counts this app's uploads only. A 20 × 15 MiB
chunked multipart (no `Content-Length`) was accepted: up to 1,000 files a request, kept on disk
until the server stopped.
"""

from __future__ import annotations

import io
import os
import socket
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
from PIL import Image
from served_app import free_port, make_ui_data, running_app

from app.settings import Settings
from app.ui.upload_quota import FILE_FLOOR, UploadQuota

gradio_client = pytest.importorskip("gradio_client")
LOGINS = {name: f"{name}-password-43" for name in ("alice", "bob", "carol", "dave")}
BOUNDARY = "steady-upload-boundary"
MIB = 1 << 20
ZEROS = bytes(MIB)  # the content of every chunk the tests stream


@pytest.fixture(scope="module")
def app(tmp_path_factory, demo_dir):
    data = make_ui_data(tmp_path_factory.mktemp("upload-quota"), demo_dir)
    uploads = tmp_path_factory.mktemp("gradio-uploads")
    settings = Settings(data_dir=data, device="cpu", port=free_port(), listen=True, auth=tuple(LOGINS.items()),
                        account_upload_quota_mib=20)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("GRADIO_TEMP_DIR", str(uploads))  # Gradio reads it when its server app is made
        with running_app(settings) as (server, _engine):
            yield server, uploads


def _login(app, user: str) -> httpx.Client:
    client = httpx.Client(base_url=app[0].local_url, timeout=60)
    assert client.post("/login", data={"username": user, "password": LOGINS[user]}).status_code == 200
    return client


def _files(folder: Path) -> list[Path]:
    return [path for path in folder.rglob("*") if path.is_file()]


def _bytes_in(folder: Path) -> int:
    total = 0
    for path in _files(folder):
        try:
            total += path.stat().st_size
        except OSError:  # removed meanwhile
            pass
    return total


def _png(pixels: int, name_seed: int = 0) -> bytes:
    """A PNG of `pixels`² random RGB pixels, stored uncompressed: about 3 × pixels² bytes."""
    image = Image.frombytes("RGB", (pixels, pixels), os.urandom(pixels * pixels * 3))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", compress_level=0)
    return buffer.getvalue()


def _chunked_upload(app, client: httpx.Client, parts: list[tuple[str, int]]) -> tuple[int, str]:
    """POST a multipart of `parts` (name, size in MiB or bytes under 1 MiB, zeros) to Gradio's upload
    route as a chunked body without a `Content-Length`, over a plain socket that stops sending once
    the answer has come; (status, text). Every chunk is a view of one shared buffer, so the test
    itself allocates nothing per chunk."""
    port = int(app[0].local_url.rstrip("/").rsplit(":", 1)[1])
    cookie = "; ".join(f"{k}={v}" for k, v in client.cookies.items())
    zeros, answered = memoryview(ZEROS), threading.Event()

    def chunk(sock: socket.socket, data) -> None:
        sock.sendall(f"{len(data):x}\r\n".encode())
        sock.sendall(data)
        sock.sendall(b"\r\n")

    def send(sock: socket.socket) -> None:
        try:
            for name, size in parts:
                chunk(sock, f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"files\"; filename=\"{name}\"\r\n"
                      "Content-Type: image/png\r\n\r\n".encode())
                for start in range(0, size, MIB):
                    if answered.is_set():
                        return
                    chunk(sock, zeros[:min(MIB, size - start)])
                chunk(sock, b"\r\n")
            chunk(sock, f"--{BOUNDARY}--\r\n".encode())
            sock.sendall(b"0\r\n\r\n")
        except OSError:  # the server may close once it has answered
            pass

    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(f"POST /gradio_api/upload HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nCookie: {cookie}\r\n"
                     f"Content-Type: multipart/form-data; boundary={BOUNDARY}\r\n"
                     "Transfer-Encoding: chunked\r\n\r\n".encode())
        sender = threading.Thread(target=send, args=(sock,), daemon=True)
        sender.start()
        reply = sock.makefile("rb")
        status = int(reply.readline().split()[1])
        length = 0
        while (line := reply.readline().strip()):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        text = reply.read(length).decode()
        answered.set()
        sender.join(60)
    return status, text


def test_a_chunked_upload_of_twenty_15_mib_files_is_stopped_as_it_streams(app):
    """Finding 7: a chunked multipart (no `Content-Length`) of 20 × 15 MiB files was accepted, 300 MiB
    of temp files (1,000 files a request, ~16 GB, were possible). Its bytes are now counted as they
    arrive: 413 naming `--max-upload-mib` once the request passes it, Gradio's temp files of it deleted
    (none left behind), the temp folder never more than one request's cap plus a chunk, RSS unmoved. A
    chunked request of many small files is stopped past `--max-upload-files` the same way."""
    server, uploads = app
    client = _login(app, "carol")
    before_files = set(_files(uploads))
    _chunked_upload(app, client, [("warm-up.png", 15 * MIB)] * 2)  # Gradio's parser and threads warmed up
    rss_before = psutil.Process().memory_info().rss
    peak, stop = [0], threading.Event()

    def watch_disk() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _bytes_in(uploads))
            time.sleep(0.02)

    watcher = threading.Thread(target=watch_disk, daemon=True)
    watcher.start()
    try:
        status, text = _chunked_upload(app, client, [(f"big-{i}.png", 15 * MIB) for i in range(20)])
    finally:
        stop.set()
        watcher.join()
    rss_growth = (psutil.Process().memory_info().rss - rss_before) / MIB
    assert status == 413 and "upload over 16,842,752 bytes in one request (--max-upload-mib)" in text, (status, text)
    assert set(_files(uploads)) == before_files  # nothing of it (nor of the warm-up) left behind
    assert peak[0] < 18 * MIB, peak[0] / MIB  # measured: 16 MiB
    assert rss_growth < 50, rss_growth  # measured: +0 to +3 MiB
    status, text = _chunked_upload(app, client, [(f"small-{i}.png", 100) for i in range(40)])
    assert status == 413 and "more than 16 files in one upload (--max-upload-files)" in text, (status, text)
    assert set(_files(uploads)) == before_files


def test_one_account_over_its_quota_is_refused_while_another_still_uploads(app):
    """Finding 7: each account's uploads hold at most `--account-upload-quota-mib` (20 here) of temp
    files: alice's second 11.5 MiB picture is refused 413 naming the flag (and leaves no file), while
    bob's upload is taken."""
    server, uploads = app
    picture = _png(2000)  # 11.5 MiB
    alice, bob = _login(app, "alice"), _login(app, "bob")
    first = alice.post("/gradio_api/upload", files={"files": ("alice-1.png", picture)})
    assert first.status_code == 200, first.text
    before = set(_files(uploads))
    refused = alice.post("/gradio_api/upload", files={"files": ("alice-2.png", _png(2000))})
    assert refused.status_code == 413, refused.text
    assert "'alice' would hold over 20,971,520 bytes" in refused.text and "--account-upload-quota-mib" in refused.text
    assert set(_files(uploads)) == before
    taken = bob.post("/gradio_api/upload", files={"files": ("bob-1.png", picture)})
    assert taken.status_code == 200 and Path(taken.json()[0]).is_file(), taken.text


def test_the_files_of_a_finished_job_are_removed(app):
    """Finding 7: uploaded files stayed until the server stopped. A file a script's job used is
    removed once that job ends (so the account's quota frees up); the job itself ran on it."""
    server, uploads = app
    Image.new("RGB", (64, 64), (200, 60, 30)).save(uploads.parent / "dave-init.png")
    client = gradio_client.Client(server.local_url, auth=("dave", LOGINS["dave"]), verbose=False)
    _, text, _ = client.predict(prompt="a fox", sampler="Euler", steps=2, cfg=5.0, seed=1, width=64, height=64,
                                init_image=gradio_client.handle_file(str(uploads.parent / "dave-init.png")),
                                denoising_strength=0.5, resize_mode="just resize", api_name="/img2img")
    assert "Denoising strength: 0.5" in text
    deadline = time.monotonic() + 10
    while list(uploads.rglob("dave-init.png")) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not list(uploads.rglob("dave-init.png"))


def test_held_files_live_as_long_as_their_job_or_a_bounded_wait(tmp_path):
    """Finding 7: a file no job uses is let go after `ttl_s`, never before; one a queued or running job
    uses stays, past `ttl_s` too; once that job ends a script's file goes at once, and one the app's
    page sent (the page sends it again with its next Generate) waits `ttl_s` more; a new upload of the
    same picture under the same path is a new file with its own time."""
    now, live = [0.0], {"running"}
    quota = UploadQuota(1 << 30, live=lambda event: event in live, ttl_s=100, clock=lambda: now[0])
    for name in ("unused", "script", "page"):
        (tmp_path / name).write_bytes(b"x")
    quota.settle("alice", 3, [str(tmp_path / name) for name in ("unused", "script", "page")])
    assert quota.used("alice") == 3 * FILE_FLOOR and quota.in_flight == {}
    quota.use([str(tmp_path / "script")], "running", page=False)
    quota.use([str(tmp_path / "page")], "running", page=True)
    now[0] = 99
    assert quota.sweep() == []
    now[0] = 150
    assert [Path(path).name for path, _held in quota.sweep()] == ["unused"]  # the others' job still runs
    live.clear()
    assert [Path(path).name for path, _held in quota.sweep()] == ["script"]
    now[0] = 249
    assert quota.sweep() == []
    now[0] = 250
    assert [Path(path).name for path, _held in quota.sweep()] == ["page"] and quota.used("alice") == 0
