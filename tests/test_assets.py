"""llmtune.assets fetches a pinned archive from the package index's simple API (PEP 691 JSON or PEP 503 HTML), checks
the index's sha256 and keeps it in the cache: served here by a local index, so nothing leaves the machine."""

from __future__ import annotations

import hashlib
import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmtune import assets

SDIST = b"an sdist's bytes"
WHEEL = b"a wheel's bytes"


def sha(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


PAGES: dict[str, tuple[str, bytes]] = {
    # PEP 691: the JSON form, relative file URLs, two versions.
    "/simple/some-sdist/": (
        "application/vnd.pypi.simple.v1+json",
        json.dumps(
            {
                "files": [
                    {"filename": "some_sdist-1.0.tar.gz", "url": "../../files/old.tar.gz", "hashes": {}},
                    {
                        "filename": "some_sdist-2.0.tar.gz",
                        "url": "../../files/s.tar.gz",
                        "hashes": {"sha256": sha(SDIST)},
                    },
                ]
            }
        ).encode(),
    ),
    # PEP 503: the HTML form, the sha256 in the link's fragment, a platform wheel beside the pure one.
    "/simple/some-wheel/": (
        "text/html",
        (
            f'<a href="/files/x.whl#sha256={sha(b"x")}">some_wheel-2.0-cp311-cp311-linux_x86_64.whl</a>\n'
            f'<a href="/files/w.whl#sha256={sha(WHEEL)}">some_wheel-2.0-py3-none-any.whl</a>\n'
        ).encode(),
    ),
    "/simple/bad-hash/": (
        "application/vnd.pypi.simple.v1+json",
        json.dumps(
            {"files": [{"filename": "bad_hash-2.0.tar.gz", "url": "/files/s.tar.gz", "hashes": {"sha256": "0" * 64}}]}
        ).encode(),
    ),
    "/files/s.tar.gz": ("application/octet-stream", SDIST),
    "/files/w.whl": ("application/octet-stream", WHEEL),
}


@pytest.fixture
def index(tmp_path, monkeypatch) -> Iterator[list[str]]:
    """A local index at PIP_INDEX_URL and an empty cache; yields the paths requested."""
    requested: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            requested.append(self.path)
            kind, body = PAGES.get(self.path, ("text/plain", b""))
            self.send_response(200 if self.path in PAGES else 404)
            self.send_header("Content-Type", kind)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{server.server_port}/simple/")
    monkeypatch.setenv("LLMTUNE_ASSETS", str(tmp_path / "cache"))
    for name, kind in (("some-sdist", "sdist"), ("some_wheel", "wheel"), ("bad-hash", "sdist")):
        monkeypatch.setitem(assets.PACKAGES, name, ("2.0", kind, ""))
    yield requested
    server.shutdown()


def test_an_sdist_is_fetched_from_the_json_index_once(index):
    path = assets.archive("some-sdist")
    assert path.name == "some_sdist-2.0.tar.gz" and path.read_bytes() == SDIST
    assert assets.archive("some-sdist") == path
    assert index == ["/simple/some-sdist/", "/files/s.tar.gz"]  # the second call found it in the cache


def test_a_pure_wheel_is_fetched_from_an_html_index(index):
    path = assets.archive("some_wheel")  # the project's name normalised: some-wheel
    assert path.name == "some_wheel-2.0-py3-none-any.whl" and path.read_bytes() == WHEEL


def test_a_file_unlike_the_index_sha256_is_refused_and_not_kept(index):
    with pytest.raises(assets.AssetError, match=r"bad-hash==2\.0 .*does not match the index's sha256"):
        assets.archive("bad-hash")
    assert not any(Path(assets.cache_dir(), "archives").iterdir())


def test_a_version_the_index_lacks_is_named(index, monkeypatch):
    monkeypatch.setitem(assets.PACKAGES, "some-sdist", ("3.0", "sdist", ""))
    with pytest.raises(assets.AssetError, match=r"lists no sdist of version 3\.0"):
        assets.archive("some-sdist")
