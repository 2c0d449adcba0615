"""Test certificates, made with `cryptography` into a folder: a CA, a server certificate for 127.0.0.1 and
localhost that it signed, and a client certificate it signed; and the client's SSL context that trusts
the CA. For tests of TLS anywhere (the router's port, the router's links to replicas)."""

from __future__ import annotations

import datetime
import ipaddress
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALID_FOR = datetime.timedelta(days=2)


@dataclass(frozen=True)
class TlsFiles:
    """PEM files: the CA's certificate, and each party's certificate and key."""

    ca_cert: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path

    def client_context(self, with_client_cert: bool = False) -> ssl.SSLContext:
        """A client's context trusting this CA alone (hostname checked), presenting the client certificate
        when asked to."""
        context = ssl.create_default_context(cafile=str(self.ca_cert))
        if with_client_cert:
            context.load_cert_chain(self.client_cert, self.client_key)
        return context

    def server_flags(self) -> tuple[str, ...]:
        """`dpserve router`'s (and vLLM's) flags serving HTTPS with the server certificate."""
        return ("--ssl-certfile", str(self.server_cert), "--ssl-keyfile", str(self.server_key))


def make_tls_files(folder: Path, name: str = "test") -> TlsFiles:
    """A new CA (named `name`, so two calls make two CAs that do not trust each other's certificates), and
    the server and client certificates it signed, written into `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"dpserve {name} CA")])
    ca_cert = (
        _builder(ca_name, ca_name, ca_key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(signs_certificates=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    server_names = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
    server_key, server_cert = _signed(
        ca_cert, ca_key, f"dpserve {name} server", ExtendedKeyUsageOID.SERVER_AUTH, server_names
    )
    client_key, client_cert = _signed(ca_cert, ca_key, f"dpserve {name} client", ExtendedKeyUsageOID.CLIENT_AUTH)
    files = TlsFiles(
        folder / f"{name}-ca.pem",
        folder / f"{name}-server.pem",
        folder / f"{name}-server-key.pem",
        folder / f"{name}-client.pem",
        folder / f"{name}-client-key.pem",
    )
    _write_cert(files.ca_cert, ca_cert)
    _write_cert(files.server_cert, server_cert)
    _write_key(files.server_key, server_key)
    _write_cert(files.client_cert, client_cert)
    _write_key(files.client_key, client_key)
    return files


def _builder(subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))  # a clock a little behind still accepts it
        .not_valid_after(now + VALID_FOR)
    )


def _key_usage(signs_certificates: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=not signs_certificates,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=signs_certificates,
        crl_sign=signs_certificates,
        encipher_only=False,
        decipher_only=False,
    )


def _signed(
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    common_name: str,
    usage: x509.ObjectIdentifier,
    names: list[x509.GeneralName] | None = None,
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A new key, and its certificate signed by the CA for `usage` (and `names`, the server's addresses)."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    ca_key_id = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    builder = (
        _builder(subject, ca_cert.subject, key.public_key())
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(signs_certificates=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_key_id), critical=False)
    )
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return key, builder.sign(ca_key, hashes.SHA256())


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    path.write_bytes(pem)
    path.chmod(0o600)
