"""SSRF corpus: every hostile URL is refused with its specific code *before* a connection is made.

The real HTTP server on 127.0.0.1 records every request it receives; a blocked case must leave it untouched.
"""

from __future__ import annotations

import hashlib
import os

import httpx
import pytest

from common.config.media import ENV_PRIVATE_NETWORKS, MediaConfig
from common.errors import InvalidMediaURL, MediaFetchBlocked, PrismError
from common.media.fetch import MediaFetcher
from tests.mediakit import MediaServer, Route, png_bytes

PNG = png_bytes()


@pytest.fixture
def server():
    with MediaServer() as s:
        s.routes["/img.png"] = Route(body=PNG, headers={"Content-Type": "image/png"})
        yield s


def fake_resolver(table: dict[str, list[str]]):
    def resolve(host: str, port: int) -> list[str]:
        return table[host.rstrip(".").lower()]

    return resolve


def _blocked(fetcher: MediaFetcher, url: str, code: str = "media_fetch_blocked") -> PrismError:
    with pytest.raises(PrismError) as info:
        fetcher.fetch(url)
    assert info.value.code == code, f"{url}: {info.value.code} {info.value.message}"
    return info.value


LOOPBACK_SPELLINGS = [
    "127.0.0.1",
    "localhost",
    "localhost.",
    "[::1]",
    "2130706433",  # decimal
    "0x7f000001",  # hex integer
    "0x7f.0.0.1",  # hex octet
    "127.1",  # short form
    "[::ffff:127.0.0.1]",  # IPv4-mapped
    "[::ffff:7f00:1]",
    "[::127.0.0.1]",  # IPv4-compatible
    "[2002:7f00:1::]",  # 6to4 of 127.0.0.1
    "[64:ff9b::7f00:1]",  # NAT64 of 127.0.0.1
    "[2001:0:4136:e378:8000:63bf:80ff:fffe]",  # Teredo, client 127.0.0.1
]


@pytest.mark.parametrize("host", LOOPBACK_SPELLINGS)
def test_loopback_in_any_spelling_is_blocked(server, host):
    fetcher = MediaFetcher(MediaConfig())
    err = _blocked(fetcher, f"http://{host}:{server.port}/img.png")
    assert err.http_status == 403
    assert server.seen == []


@pytest.mark.parametrize(
    "host",
    [
        "10.0.0.1",
        "172.16.5.4",
        "192.168.1.1",
        "169.254.169.254",  # cloud metadata
        "100.64.0.1",  # carrier-grade NAT: not global
        "0.0.0.0",
        "192.0.2.1",  # TEST-NET
        "224.0.0.1",  # multicast
        "[fe80::1]",
        "[fd00::1]",
        "[fd00:ec2::254]",  # AWS IPv6 metadata
        "[::]",
        "[::ffff:169.254.169.254]",
        "[64:ff9b::a9fe:a9fe]",  # NAT64 of the metadata address
    ],
)
def test_private_link_local_and_metadata_are_blocked(host):
    sent = []

    class NeverConnect(httpx.BaseTransport):
        def handle_request(self, request):
            sent.append(request.url)
            raise AssertionError("a blocked fetch must not reach the transport")

    _blocked(MediaFetcher(MediaConfig(), transport=NeverConnect()), f"http://{host}/latest/meta-data/")
    assert sent == []


def test_octal_ipv4_is_refused_as_invalid_url():
    """httpx (the library that connects) refuses octal octets; the URL never reaches the resolver."""
    _blocked(MediaFetcher(MediaConfig()), "http://0177.0.0.1/x.png", code="invalid_media_url")


def test_metadata_hostname_via_dns_is_blocked():
    fetcher = MediaFetcher(MediaConfig(), resolver=fake_resolver({"metadata.google.internal": ["169.254.169.254"]}))
    _blocked(fetcher, "http://metadata.google.internal/computeMetadata/v1/")


def test_dns_answer_mixing_public_and_private_is_blocked(server):
    cfg = MediaConfig()
    fetcher = MediaFetcher(cfg, resolver=fake_resolver({"mixed.test": ["93.184.216.34", "127.0.0.1"]}))
    _blocked(fetcher, f"http://mixed.test:{server.port}/img.png")
    fetcher = MediaFetcher(cfg, resolver=fake_resolver({"mixed6.test": ["2606:4700::1", "::1"]}))
    _blocked(fetcher, f"http://mixed6.test:{server.port}/img.png")
    assert server.seen == []


@pytest.mark.parametrize(
    "url",
    ["gopher://127.0.0.1:70/_x", "ftp://example.com/a.png", "file:///etc/passwd", "javascript:alert(1)", "nourl"],
)
def test_other_schemes_are_blocked(url):
    _blocked(MediaFetcher(MediaConfig()), url)


def test_userinfo_is_blocked(server):
    fetcher = MediaFetcher(MediaConfig(allowed_private_networks=("127.0.0.1/32",)))
    _blocked(fetcher, f"http://user:secret@127.0.0.1:{server.port}/img.png")
    _blocked(fetcher, f"http://evil.com@127.0.0.1:{server.port}/img.png")
    assert server.seen == []


def test_domain_allow_and_deny_lists(server):
    table = {"img.good.test": ["127.0.0.1"], "good.test": ["127.0.0.1"], "bad.good.test": ["127.0.0.1"]}
    cfg = MediaConfig(
        allowed_private_networks=("127.0.0.1/32",),
        allowed_domains=("good.test",),
        denied_domains=("bad.good.test",),
    )
    fetcher = MediaFetcher(cfg, resolver=fake_resolver({**table, "other.test": ["127.0.0.1"]}))
    assert fetcher.fetch(f"http://img.good.test:{server.port}/img.png").data == PNG
    _blocked(fetcher, f"http://bad.good.test:{server.port}/img.png")
    _blocked(fetcher, f"http://other.test:{server.port}/img.png")
    _blocked(fetcher, f"http://notgood.test:{server.port}/img.png")  # suffix match is on label boundaries
    assert len(server.seen) == 1


def test_redirect_from_allowed_host_to_private_is_blocked(server):
    server.routes["/to-private"] = Route(status=302, headers={"Location": "http://10.0.0.1/img.png"})
    server.routes["/to-metadata"] = Route(status=301, headers={"Location": "http://169.254.169.254/"})
    server.routes["/to-other-loopback"] = Route(status=307, headers={"Location": f"http://127.0.0.2:{server.port}/"})
    server.routes["/to-gopher"] = Route(status=302, headers={"Location": "gopher://127.0.0.1/"})
    fetcher = MediaFetcher(MediaConfig(allowed_private_networks=("127.0.0.1/32",)))
    for path in ("/to-private", "/to-metadata", "/to-other-loopback", "/to-gopher"):
        _blocked(fetcher, server.url(path))
    assert [s.path for s in server.seen] == ["/to-private", "/to-metadata", "/to-other-loopback", "/to-gopher"]


def test_redirects_are_followed_by_hand_and_capped(server):
    server.routes["/hop"] = Route(status=302, headers={"Location": "/img.png"})
    server.routes["/loop"] = Route(status=302, headers={"Location": "/loop"})
    fetcher = MediaFetcher(MediaConfig(allowed_private_networks=("127.0.0.1/32",), max_redirects=3))
    assert fetcher.fetch(server.url("/hop")).data == PNG
    server.seen.clear()
    _blocked(fetcher, server.url("/loop"), code="media_fetch_failed")
    assert len(server.seen) == 4  # the first request + 3 redirects, then it stops


def test_https_to_http_downgrade_is_refused():
    fetcher = MediaFetcher(MediaConfig())
    with pytest.raises(MediaFetchBlocked, match="https to http"):
        fetcher._next_hop(httpx.URL("https://a.example/x"), "http://a.example/y")
    assert fetcher._next_hop(httpx.URL("http://a.example/x"), "https://b.example/y").host == "b.example"


def test_connects_to_checked_address_keeping_host_header(server):
    resolved = []

    def once(host, port):
        resolved.append(host)
        return ["127.0.0.1"]

    fetcher = MediaFetcher(MediaConfig(allowed_private_networks=("127.0.0.1/32",)), resolver=once)
    got = fetcher.fetch(f"http://images.example.test:{server.port}/img.png")
    assert got.data == PNG and got.digest == hashlib.sha256(PNG).hexdigest() and got.source == "http"
    assert resolved == ["images.example.test"], "the name is resolved exactly once"
    assert server.seen[0].host == f"images.example.test:{server.port}"


def test_proxy_environment_is_ignored(server, monkeypatch):
    monkeypatch.setenv("HTTP_PROXY", "http://10.9.9.9:3128")
    monkeypatch.setenv("http_proxy", "http://10.9.9.9:3128")
    monkeypatch.setenv("ALL_PROXY", "http://10.9.9.9:3128")
    fetcher = MediaFetcher(MediaConfig(allowed_private_networks=("127.0.0.1/32",)))
    assert fetcher.fetch(server.url("/img.png")).data == PNG


def test_private_networks_from_environment(server, monkeypatch):
    monkeypatch.setenv(ENV_PRIVATE_NETWORKS, "127.0.0.0/8, 10.0.0.0/8")
    cfg = MediaConfig()
    assert cfg.allowed_private_networks == ("127.0.0.0/8", "10.0.0.0/8")
    assert MediaFetcher(cfg).fetch(server.url("/img.png")).data == PNG
    monkeypatch.delenv(ENV_PRIVATE_NETWORKS)
    assert MediaConfig().allowed_private_networks == ()
    with pytest.raises(ValueError):
        MediaConfig(allowed_private_networks=("not-a-cidr",))


def test_file_urls_only_under_the_root(tmp_path):
    root = tmp_path / "media"
    root.mkdir()
    (root / "ok.png").write_bytes(PNG)
    secret = tmp_path / "secret.png"
    secret.write_bytes(PNG)
    os.symlink(secret, root / "escape.png")
    (root / "sub").mkdir()

    no_root = MediaFetcher(MediaConfig(allowed_schemes=("file",)))
    _blocked(no_root, f"file://{root}/ok.png")

    fetcher = MediaFetcher(MediaConfig(allowed_schemes=("file",), file_root=str(root)))
    assert fetcher.fetch(f"file://{root}/ok.png").data == PNG
    _blocked(fetcher, "file:///etc/passwd")
    _blocked(fetcher, f"file://{root}/../secret.png")
    _blocked(fetcher, f"file://{root}/sub/%2e%2e/%2e%2e/secret.png")
    _blocked(fetcher, f"file://{root}/escape.png")  # symlink pointing outside
    _blocked(fetcher, f"file://otherhost{root}/ok.png")
    _blocked(fetcher, f"file://{root!s}-sibling/ok.png")  # prefix trick: /media-sibling is not under /media
    _blocked(fetcher, f"file://{root}/missing.png", code="media_fetch_failed")


def test_invalid_url_is_a_400():
    err = _blocked(MediaFetcher(MediaConfig()), "http://[::1/x", code="invalid_media_url")
    assert isinstance(err, InvalidMediaURL) and err.http_status == 400


def test_https_goes_to_the_checked_ip_with_name_in_host_and_sni():
    """The transport sees the IP that was checked; the name travels in Host and as the TLS SNI/verify name."""
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, stream=httpx.ByteStream(PNG), headers={"Content-Type": "image/png"})

    fetcher = MediaFetcher(
        MediaConfig(),
        resolver=fake_resolver({"images.example": ["93.184.216.34"]}),
        transport=httpx.MockTransport(handler),
    )
    assert fetcher.fetch("https://images.example/cat.png").data == PNG
    (req,) = seen
    assert req.url.host == "93.184.216.34" and req.url.scheme == "https"
    assert req.headers["host"] == "images.example"
    assert req.extensions["sni_hostname"] == "images.example"
    assert req.headers["accept-encoding"] == "identity"


def test_a_hanging_name_lookup_times_out_and_holds_at_most_its_pool():
    """The system resolver has no timeout: a lookup that hangs is abandoned after ``dns_timeout_s`` (504
    ``media_fetch_timeout``), and lookups queued behind hung ones time out all the same (the pool is bounded)."""
    import threading
    import time

    from common.errors import MediaFetchTimeout
    from common.media.fetch import TimedResolver

    release = threading.Event()

    def hanging(host: str, port: int) -> list[str]:
        release.wait(10)
        return ["93.184.216.34"]

    resolver = TimedResolver(0.2, workers=1, resolve=hanging)
    try:
        for _ in range(2):  # the second waits behind the first's thread
            start = time.monotonic()
            with pytest.raises(MediaFetchTimeout) as info:
                resolver("slow.example", 443)
            assert time.monotonic() - start < 1.0 and info.value.http_status == 504
        assert threading.active_count() < 50
    finally:
        release.set()
    assert TimedResolver(1.0, resolve=lambda h, p: ["203.0.113.9"])("fast.example", 443) == ["203.0.113.9"]
