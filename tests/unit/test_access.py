"""API keys, the admin key, the bind rule and key files; no sockets."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from dpserve.config import RouterSettings, load_settings
from dpserve.router.flow.access import Access, Keys, authorize, check_bind, load_keys, required_access
from dpserve.router.flow.tenants import Caller, key_tenant
from dpserve.router.http.errors import OpenAIError

KEYS = Keys(users=(b"user-key-1", b"user-key-2"), admins=(b"admin-key-1",))


@pytest.mark.parametrize(
    ("path", "access"),
    [
        ("/health", Access.PUBLIC),
        ("/ready", Access.PUBLIC),
        ("/metrics", Access.METRICS),
        ("/v1/chat/completions", Access.USER),
        ("/v1/models", Access.USER),
        ("/nowhere", Access.USER),
        ("/admin/replicas", Access.ADMIN),
        ("/admin/replicas/r0/drain", Access.ADMIN),
        ("/admin", Access.ADMIN),
        ("/status", Access.ADMIN),
        ("/dashboard", Access.ADMIN),
    ],
)
def test_paths_need_the_right_access(path: str, access: Access) -> None:
    assert required_access(path) is access


def status_of(authorization: bytes | None, access: Access, keys: Keys = KEYS) -> int | None:
    error = authorize(keys, access, authorization)
    return error.status if isinstance(error, OpenAIError) else None


def test_a_key_names_its_caller_and_a_named_key_its_tenant() -> None:
    settings = load_settings(RouterSettings, {"api_keys": ("acme:acme-key-1", "bare-key-22")})
    keys = load_keys(settings)
    assert keys.users == (b"acme-key-1", b"bare-key-22")
    assert authorize(keys, Access.USER, b"Bearer acme-key-1") == Caller("acme", False)
    # A bare key is its own tenant, named by a hash: never the key itself.
    bare = authorize(keys, Access.USER, b"Bearer bare-key-22")
    assert bare == Caller(key_tenant("bare-key-22"), False) and "bare-key-22" not in bare.tenant
    assert authorize(keys, Access.PUBLIC, b"Bearer acme-key-1") is None
    admin = authorize(KEYS, Access.USER, b"Bearer admin-key-1")
    assert isinstance(admin, Caller) and admin.trusted


def test_user_paths() -> None:
    assert status_of(None, Access.USER) == 401
    assert status_of(b"Bearer wrong-key-000", Access.USER) == 401
    assert status_of(b"Basic user-key-1", Access.USER) == 401
    assert status_of(b"Bearer ", Access.USER) == 401
    assert status_of(b"Bearer user-key-1", Access.USER) is None
    assert status_of(b"bearer   user-key-2 ", Access.USER) is None
    assert status_of(b"Bearer admin-key-1", Access.USER) is None  # an admin key works everywhere


def test_admin_paths() -> None:
    assert status_of(None, Access.ADMIN) == 401
    assert status_of(b"Bearer wrong-key-000", Access.ADMIN) == 401
    assert status_of(b"Bearer user-key-1", Access.ADMIN) == 403
    assert status_of(b"Bearer admin-key-1", Access.ADMIN) is None
    # User keys but no admin key: the admin API is closed to all.
    assert status_of(b"Bearer user-key-1", Access.ADMIN, Keys(users=(b"user-key-1",))) == 403


def test_public_paths_and_keyless_routers_need_nothing() -> None:
    assert status_of(None, Access.PUBLIC) is None
    assert status_of(None, Access.ADMIN, Keys()) is None


def test_metrics_are_open_until_metrics_keys_are_given_then_need_one_or_an_admin_key(tmp_path: Path) -> None:
    assert status_of(None, Access.METRICS) is None  # user and admin keys alone leave /metrics to Prometheus
    assert status_of(None, Access.METRICS, Keys()) is None
    metrics_file = tmp_path / "metrics-keys"
    metrics_file.write_text("# Prometheus\nscrape-key-0001\n")
    settings = RouterSettings(api_keys=("user-key-1",), admin_keys=("admin-key-1",), metrics_key_file=metrics_file)
    keys = load_keys(settings)
    assert status_of(None, Access.METRICS, keys) == 401
    assert status_of(b"Bearer user-key-1", Access.METRICS, keys) == 401
    assert status_of(b"Bearer scrape-key-0001", Access.METRICS, keys) is None
    assert status_of(b"Bearer admin-key-1", Access.METRICS, keys) is None
    # A metrics key reads /metrics and nothing else.
    assert status_of(b"Bearer scrape-key-0001", Access.USER, keys) == 401
    assert status_of(b"Bearer scrape-key-0001", Access.ADMIN, keys) == 401
    # Without user keys the API stays open (loopback), /metrics still needs its key.
    only_metrics = load_keys(RouterSettings(metrics_key_file=metrics_file))
    assert not only_metrics.enabled
    assert status_of(None, Access.USER, only_metrics) is None
    assert status_of(None, Access.METRICS, only_metrics) == 401


def test_a_401_is_openai_shaped_and_asks_for_a_bearer_token() -> None:
    error = authorize(KEYS, Access.USER, b"Bearer nope-nope-nope")
    assert error is not None and error.code == "invalid_api_key"
    assert error.headers["www-authenticate"].startswith("Bearer")
    assert b'"invalid_request_error"' in error.body() and b"nope" not in error.body()


def test_keys_come_from_flags_and_files(tmp_path: Path) -> None:
    users = tmp_path / "keys"
    users.write_text("# team A\nfile-key-0001\n\n  file-key-0002  \n")
    keys = load_keys(RouterSettings(api_keys=("flag-key-0001",), api_key_file=users, admin_keys=("admin-key-01",)))
    assert keys.users == (b"flag-key-0001", b"file-key-0001", b"file-key-0002")
    assert keys.admins == (b"admin-key-01",) and keys.enabled
    assert not load_keys(RouterSettings()).enabled


def test_bad_keys_and_key_files_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="8 characters"):
        load_keys(RouterSettings(api_keys=("short",)))
    with pytest.raises(ValueError, match="cannot read"):
        load_keys(RouterSettings(api_key_file=tmp_path / "missing"))
    (tmp_path / "empty").write_text("# nothing\n")
    with pytest.raises(ValueError, match="no key"):
        load_keys(RouterSettings(admin_key_file=tmp_path / "empty"))


def test_keys_from_the_environment() -> None:
    env = {"DPSERVE_API_KEYS": "env-key-0001,env-key-0002", "DPSERVE_INSECURE": "1"}
    settings = load_settings(RouterSettings, env=env)
    assert settings.api_keys == ("env-key-0001", "env-key-0002") and settings.insecure
    assert "env-key" not in repr(settings)  # keys never reach logs through the settings' repr


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "localhost", "127.0.0.2"])
def test_loopback_binds_need_no_keys(host: str) -> None:
    check_bind(host, Keys(), insecure=False)


@pytest.mark.parametrize("host", ["0.0.0.0", "10.0.0.5", "::", "router.example"])
def test_other_binds_need_keys_or_insecure(host: str) -> None:
    with pytest.raises(ValueError, match="--insecure"):
        check_bind(host, Keys(), insecure=False)
    check_bind(host, Keys(), insecure=True)
    check_bind(host, KEYS, insecure=False)


def test_keys_are_found_by_a_keyed_hash_and_never_byte_by_byte() -> None:
    """The table a token is looked up in holds MACs under a secret drawn at start, never a key (or a plain
    hash of one): a guess's lookup cannot tell how close it is to a key, or a key's length."""
    keys = Keys(users=(b"user-key-1", b"user-key-2"), admins=(b"admin-key-1",))
    table = keys._by_mac
    assert len(table) == 3 and all(len(mac) == 32 for mac in table)
    assert not any(key in mac or mac in key for mac in table for key in (*keys.users, *keys.admins))
    assert not set(table) & {hashlib.blake2b(key, digest_size=32).digest() for key in keys.users}
    # Another router (or a restart) draws another secret: nothing learned of one table carries over.
    assert not set(table) & set(Keys(users=keys.users, admins=keys.admins)._by_mac)
    assert "user-key" not in repr(keys) and "admin-key" not in repr(keys)


@pytest.mark.parametrize(
    "token",
    [
        b"user-key-",
        b"user-key-10",
        b"user-key-1\x00",
        b"USER-KEY-1",
        b"ser-key-1",
        b"admin-key-1user-key-1",
        b"\x00" * 10,
    ],
)
def test_only_a_whole_key_matches(token: bytes) -> None:
    assert status_of(b"Bearer " + token, Access.USER) == 401


def test_a_key_given_as_both_user_and_admin_key_is_an_admin_key() -> None:
    keys = Keys(users=(b"shared-key-1", b"user-key-2"), admins=(b"shared-key-1",), user_names=("acme", "bob"))
    assert authorize(keys, Access.ADMIN, b"Bearer shared-key-1") == Caller("admin", True)
    assert authorize(keys, Access.USER, b"Bearer user-key-2") == Caller("bob", False)


def test_a_thousand_keys_each_find_their_tenant() -> None:
    users = tuple(f"key-{index:06d}-{index * 7919:08d}".encode() for index in range(1000))
    keys = Keys(users=users, user_names=tuple(f"tenant-{index}" for index in range(1000)))
    for index in (0, 1, 499, 999):
        assert authorize(keys, Access.USER, b"Bearer " + users[index]) == Caller(f"tenant-{index}", False)
