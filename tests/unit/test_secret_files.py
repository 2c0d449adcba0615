"""Secrets from files, applied again when a file changes: a Kubernetes Secret's atomic swap of its `..data`
link and a plain rewrite both count; a wrong file keeps the secret in force; nothing changed, nothing applied."""

from __future__ import annotations

import os
import ssl
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from dpserve.replicas.access import reload_tls
from dpserve.router.control.secret_files import Secret, SecretFiles
from tests.tls_certs import make_tls_files


def test_a_rewritten_file_is_applied_once_and_a_wrong_one_keeps_the_secret_in_force(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("first-key-0001\n")
    in_force: list[str] = []

    def apply() -> None:
        text = path.read_text().strip()
        if not text:
            raise ValueError("no key in it")
        in_force.append(text)

    files = SecretFiles([Secret("--api-key-file", [path], apply)], interval_s=1.0)
    assert files.check() == [] and in_force == []  # read at start by its owner: nothing new
    path.write_text("second-key-0002\n")
    os.utime(path, ns=(1, 1))  # a rewrite within the same clock tick still differs: size or time
    assert files.check() == ["--api-key-file"] and in_force == ["second-key-0002"]
    assert files.check() == []
    path.write_text("")  # half-written, or emptied by mistake
    assert files.check() == [] and in_force == ["second-key-0002"]
    path.unlink()
    assert files.check() == []
    path.write_text("third-key-00003\n")
    assert files.check() == ["--api-key-file"] and in_force[-1] == "third-key-00003"
    registry = CollectorRegistry()
    registry.register(files)
    text = generate_latest(registry).decode()
    assert 'dpserve_secret_reloads_total{result="applied",secret="--api-key-file"} 2.0' in text
    assert 'dpserve_secret_reloads_total{result="failed",secret="--api-key-file"} 2.0' in text


def test_a_kubernetes_secret_swap_of_its_data_link_is_seen(tmp_path: Path) -> None:
    """Kubernetes mounts a Secret as `key -> ..data/key`, `..data -> ..<timestamp>`; an update writes a new
    timestamped folder and swaps `..data` in one rename. The file's own path never changes."""
    mount = tmp_path / "secret"
    mount.mkdir()
    old, new = mount / "..2026_11_29_1", mount / "..2026_11_29_2"
    old.mkdir()
    (old / "key").write_text("old-key-000001")
    (mount / "..data").symlink_to(old.name)
    (mount / "key").symlink_to("..data/key")
    seen: list[str] = []
    files = SecretFiles([Secret("--replica-api-key-file", [mount / "key"], lambda: seen.append("read"))], 1.0)
    new.mkdir()
    (new / "key").write_text("new-key-000002")  # the same size: the inode tells
    (mount / "..data_tmp").symlink_to(new.name)
    os.rename(mount / "..data_tmp", mount / "..data")
    assert files.check() == ["--replica-api-key-file"] and seen == ["read"]


def test_a_secret_without_files_is_not_watched() -> None:
    files = SecretFiles([Secret("--tenant-file", [], lambda: None)], 1.0)
    assert files.secrets == []


def test_a_changed_certificate_is_loaded_into_the_context_in_use_and_a_bad_pair_changes_nothing(
    tmp_path: Path,
) -> None:
    first, second = make_tls_files(tmp_path / "a"), make_tls_files(tmp_path / "b", "other")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(first.server_cert, first.server_key)
    reload_tls(context, second.ca_cert, second.server_cert, second.server_key)
    assert any(ca["subject"] for ca in context.get_ca_certs())  # the new CA is trusted from now on
    with pytest.raises(ValueError, match=r"key values mismatch|PEM|SSL"):
        reload_tls(context, None, first.server_cert, second.server_key)  # a certificate and another's key
