"""The ingress key store: SHA-256 digests compared with ``hmac.compare_digest``, rotation by re-reading the mounted
file (no restart), fail-closed when a key source is configured."""

from __future__ import annotations

import hashlib
import json
import os

import pytest

import common.auth as auth
from common.auth import KeyStore
from common.config import ServerConfig
from common.errors import AuthenticationError


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _write(path, keys: dict[str, str]) -> None:
    """Replace the file the way Kubernetes updates a mounted Secret: a new file swapped in by rename."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(keys))
    os.replace(tmp, path)


def test_keys_are_held_as_digests_and_compared_with_compare_digest(monkeypatch):
    calls: list[tuple[bytes, bytes]] = []
    real = auth.hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    keys = {"sk-alpha-1": "alpha", "sk-beta-1": "beta", "sk-gamma-1": "gamma"}
    store = KeyStore(ServerConfig(api_keys=keys))
    assert store.tenant("sk-alpha-1") == "alpha"
    # every stored digest compared (no early exit at the match), each side a SHA-256 digest, never the key itself
    assert len(calls) == len(keys)
    assert all(isinstance(a, bytes) and len(a) == 32 and len(b) == 32 for a, b in calls)
    assert {a for a, _ in calls} == {hashlib.sha256(b"sk-alpha-1").digest()}
    assert {b for _, b in calls} == {hashlib.sha256(k.encode()).digest() for k in keys}
    calls.clear()
    with pytest.raises(AuthenticationError):
        store.tenant("sk-alpha-2")
    assert len(calls) == len(keys)
    dump = repr(vars(store)) + repr(store)
    assert not any(k in dump for k in keys), "no plaintext key kept in the store"


@pytest.mark.parametrize("presented", [None, "", "sk-wrong", "sk-alpha-1 ", "SK-ALPHA-1"])
def test_missing_or_wrong_keys_are_401(presented):
    store = KeyStore(ServerConfig(api_keys={"sk-alpha-1": "alpha"}))
    with pytest.raises(AuthenticationError) as info:
        store.tenant(presented)
    assert info.value.http_status == 401


def test_no_key_source_serves_everyone_as_default():
    assert KeyStore(ServerConfig()).tenant(None) == "default"


def test_a_rotated_key_file_takes_effect_without_restart_and_the_old_key_stops_working(tmp_path):
    path = tmp_path / "api-keys.json"
    _write(path, {"sk-old": "alpha"})
    clock = Clock()
    store = KeyStore(ServerConfig(api_keys_file=str(path), api_keys_reload_s=5), clock=clock)
    assert store.tenant("sk-old") == "alpha"
    _write(path, {"sk-new": "alpha", "sk-beta": "beta"})
    clock.now += 1  # within the reload interval: no stat yet, the old key still works
    assert store.tenant("sk-old") == "alpha"
    clock.now += 5
    assert store.tenant("sk-new") == "alpha" and store.tenant("sk-beta") == "beta"
    with pytest.raises(AuthenticationError):
        store.tenant("sk-old")


def test_inline_keys_survive_a_file_rotation(tmp_path):
    path = tmp_path / "api-keys.json"
    _write(path, {"sk-file": "beta"})
    store = KeyStore(ServerConfig(api_keys={"sk-inline": "alpha"}, api_keys_file=str(path), api_keys_reload_s=0))
    _write(path, {"sk-file-2": "beta"})
    assert store.tenant("sk-inline") == "alpha" and store.tenant("sk-file-2") == "beta"
    with pytest.raises(AuthenticationError):
        store.tenant("sk-file")


@pytest.mark.parametrize("broken", ["missing", "not yaml", "wrong shape"])
def test_a_broken_rotation_keeps_the_last_good_keys(tmp_path, broken, caplog):
    path = tmp_path / "api-keys.json"
    _write(path, {"sk-good": "alpha"})
    store = KeyStore(ServerConfig(api_keys_file=str(path), api_keys_reload_s=0))
    if broken == "missing":
        path.unlink()
    elif broken == "not yaml":
        path.write_text('{"sk-leaked-in-a-log": [unclosed')
    else:
        path.write_text('["sk-good"]')
    assert store.tenant("sk-good") == "alpha"
    assert "not reloaded" in caplog.text and "sk-leaked" not in caplog.text  # the error never quotes the file
    _write(path, {"sk-fixed": "alpha"})  # the next good update is taken
    assert store.tenant("sk-fixed") == "alpha"


def test_a_configured_but_empty_key_file_refuses_everyone(tmp_path):
    path = tmp_path / "api-keys.json"
    path.write_text("{}")
    store = KeyStore(ServerConfig(api_keys_file=str(path), api_keys_reload_s=0))
    for presented in (None, "", "anything"):
        with pytest.raises(AuthenticationError):
            store.tenant(presented)
    _write(path, {"sk-first": "alpha"})
    assert store.tenant("sk-first") == "alpha"


def test_a_missing_key_file_at_start_stops_the_replica(tmp_path):
    with pytest.raises(OSError):
        KeyStore(ServerConfig(api_keys_file=str(tmp_path / "nope.json")))


def test_a_map_written_the_wrong_way_round_never_puts_a_key_in_an_error(tmp_path, caplog):
    path = tmp_path / "api-keys.json"
    secret = "sk-live/9f8e+7d6c5b4a3=="  # not a valid tenant name: the check refuses it without quoting it
    path.write_text(json.dumps({"team-a": secret}))
    with pytest.raises(ValueError) as info:
        KeyStore(ServerConfig(api_keys_file=str(path)))
    assert secret not in str(info.value) and "entry 1" in str(info.value)
    _write(path, {"sk-good": "alpha"})
    store = KeyStore(ServerConfig(api_keys_file=str(path), api_keys_reload_s=0))
    path.write_text(json.dumps({"team-a": secret}))  # the same mistake in a rotation
    assert store.tenant("sk-good") == "alpha" and secret not in caplog.text and "not reloaded" in caplog.text


def test_an_empty_key_file_path_is_refused_not_taken_for_anonymous():
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        ServerConfig(api_keys_file="")


@pytest.mark.parametrize(
    ("header", "key"),
    [
        ("Bearer k-1", "k-1"),
        ("bearer  k-1 ", "k-1"),
        ("BEARER k-1", "k-1"),
        ("Basic dXNlcjpwYXNz", None),
        ("Bearer", None),
        ("Bearerk-1", None),
        ("", None),
        (None, None),
    ],
)
def test_the_one_bearer_parse_takes_the_key_of_a_bearer_header_only(header, key) -> None:
    assert auth.bearer_key(header) == key
