"""The router's TLS flags (vLLM's names and meanings): loaded, checked together, and their files read once
at start, so a wrong one is one line and exit 2, not a traceback."""

from __future__ import annotations

import logging
import ssl
from pathlib import Path

import pytest

from dpserve.config import RouterSettings, load_settings
from dpserve.router.serve import check_tls_files
from tests.tls_certs import make_tls_files


def test_tls_settings_from_flags_and_the_environment() -> None:
    env = {"DPSERVE_SSL_CERTFILE": "/certs/router.pem", "DPSERVE_SSL_CA_CERTS": "/certs/ca.pem"}
    settings = load_settings(RouterSettings, {"ssl_cert_reqs": 2, "ssl_keyfile": Path("/k.pem")}, env=env)
    assert settings.ssl_certfile == Path("/certs/router.pem") and settings.ssl_ca_certs == Path("/certs/ca.pem")
    assert settings.ssl_keyfile == Path("/k.pem") and settings.ssl_cert_reqs == ssl.CERT_REQUIRED
    plain = RouterSettings()
    assert plain.ssl_certfile is None and plain.ssl_cert_reqs == ssl.CERT_NONE  # vLLM's default


@pytest.mark.parametrize(
    ("overrides", "error"),
    [
        ({"ssl_keyfile": Path("k.pem")}, "need --ssl-certfile"),
        ({"ssl_ca_certs": Path("ca.pem")}, "need --ssl-certfile"),
        ({"ssl_cert_reqs": 2, "ssl_ca_certs": Path("ca.pem")}, "need --ssl-certfile"),
        ({"ssl_certfile": Path("c.pem"), "ssl_cert_reqs": 2}, "--ssl-cert-reqs needs --ssl-ca-certs"),
        ({"ssl_certfile": Path("c.pem"), "ssl_cert_reqs": 1}, "--ssl-cert-reqs needs --ssl-ca-certs"),
        ({"ssl_certfile": Path("c.pem"), "ssl_ca_certs": Path("ca.pem"), "ssl_cert_reqs": 3}, "must be 0"),
    ],
)
def test_tls_flags_that_do_not_fit_together_are_refused(overrides: dict[str, object], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        load_settings(RouterSettings, overrides, env={})


def test_the_tls_files_are_read_once_at_start(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    tls = make_tls_files(tmp_path)
    good = RouterSettings(ssl_certfile=tls.server_cert, ssl_keyfile=tls.server_key)
    check_tls_files(good)
    check_tls_files(RouterSettings())  # no TLS: nothing to read
    with pytest.raises(ValueError, match=r"--ssl-certfile .*missing\.pem: cannot load"):
        check_tls_files(RouterSettings(ssl_certfile=tmp_path / "missing.pem"))
    with pytest.raises(ValueError, match="--ssl-certfile"):  # the client's key, not the certificate's
        check_tls_files(RouterSettings(ssl_certfile=tls.server_cert, ssl_keyfile=tls.client_key))
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    with pytest.raises(ValueError, match=r"--ssl-ca-certs .*garbage\.pem: cannot load"):
        check_tls_files(
            RouterSettings(
                ssl_certfile=tls.server_cert, ssl_keyfile=tls.server_key, ssl_ca_certs=garbage, ssl_cert_reqs=2
            )
        )
    # A CA given but no client certificate asked for: served, with a warning that nothing is checked.
    with caplog.at_level(logging.WARNING, logger="dpserve.router"):
        check_tls_files(
            RouterSettings(ssl_certfile=tls.server_cert, ssl_keyfile=tls.server_key, ssl_ca_certs=tls.ca_cert)
        )
    assert "clients are not asked for certificates" in caplog.text


def test_a_wrong_tls_flag_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from dpserve.cli import main

    replica = ["--replica", "http://127.0.0.1:9", "--gpu-interval", "0"]
    assert main(["router", *replica, "--ssl-certfile", str(tmp_path / "missing.pem")]) == 2
    err = capsys.readouterr().err
    assert "dpserve router: --ssl-certfile" in err and "Traceback" not in err
    with pytest.raises(SystemExit) as exit_:
        main(["router", *replica, "--ssl-certfile", "c.pem", "--ssl-cert-reqs", "2"])
    assert exit_.value.code == 2 and "--ssl-cert-reqs needs --ssl-ca-certs" in capsys.readouterr().err
    # `dpserve up` does not take them: it would have to reach its own routers over HTTPS.
    with pytest.raises(SystemExit) as exit_:
        main(["up", "--ssl-certfile", "c.pem"])
    assert exit_.value.code == 2 and "unrecognized arguments: --ssl-certfile" in capsys.readouterr().err
