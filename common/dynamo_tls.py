"""Mutual TLS between the gateway and NVIDIA Dynamo's frontend, with a CA of the stack's own.

:func:`ensure` makes, once per stack, in ``Settings.dynamo_tls_dir`` (0700, keys 0600):
``ca.pem`` (the CA; its key is not kept), ``server.pem`` / ``server.key`` (the frontend's) and
``client.pem`` / ``client.key`` (the gateway's, and a replica agent's for its own probes).
:class:`DynamoTls` gives the frontend's flags (``frontend_args``) and a client's ``ssl_context``;
``load`` returns None when the directory holds no certificates. Invariants: a client verifies
the chain against ``ca.pem``, not a host name (the server certificate names ``SERVER_NAME``,
``localhost`` and the stack's host); a process without the client certificate is refused at the
handshake. Why, and why not the request plane's TLS: docs/design.md "Security".
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

SERVER_NAME = "rollouts-dynamo"
FILES = ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")
VALID_DAYS = 3650


@dataclass(frozen=True)
class DynamoTls:
    directory: Path

    def path(self, name: str) -> str:
        return str(self.directory / name)

    def frontend_args(self) -> list[str]:
        """Dynamo frontend flags: HTTPS, and a client certificate signed by the stack's CA required."""
        return [
            "--tls-cert-path",
            self.path("server.pem"),
            "--tls-key-path",
            self.path("server.key"),
            "--tls-client-ca-cert-path",
            self.path("ca.pem"),
        ]

    def ssl_context(self) -> ssl.SSLContext:
        """A client context for the frontend's HTTPS: trusts the stack's CA only, presents the
        client certificate; the chain is what is verified (module docstring), not the host name."""
        ctx = ssl.create_default_context(cafile=self.path("ca.pem"))
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_cert_chain(self.path("client.pem"), self.path("client.key"))
        return ctx


def load(directory: Path) -> DynamoTls | None:
    """The certificates in ``directory``; None when it holds none. Raises ValueError naming what
    is missing when it holds some but not all."""
    present = [name for name in FILES if (directory / name).is_file()]
    if not present:
        return None
    missing = [name for name in FILES if name not in present]
    if missing:
        raise ValueError(
            f"Dynamo's TLS directory {directory} lacks {', '.join(missing)}: "
            "copy all of ca.pem, server.pem, server.key, client.pem, client.key from the stack's"
        )
    return DynamoTls(directory)


def ensure(directory: Path, hosts: tuple[str, ...] = ("127.0.0.1",)) -> DynamoTls:
    """The certificates in ``directory``, made first if it holds none (``hosts``: IP addresses
    the server certificate names too, for clients that check names)."""
    existing = load(directory)
    if existing is not None:
        return existing
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "rollouts stack CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    names: list[x509.GeneralName] = [x509.DNSName(SERVER_NAME), x509.DNSName("localhost")]
    names += [x509.IPAddress(ipaddress.ip_address(h)) for h in dict.fromkeys(hosts)]
    _write(directory, "ca.pem", ca.public_bytes(serialization.Encoding.PEM))
    for role, usage, sans in (
        ("server", ExtendedKeyUsageOID.SERVER_AUTH, names),
        ("client", ExtendedKeyUsageOID.CLIENT_AUTH, [x509.DNSName("rollouts-gateway")]),
    ):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"rollouts dynamo {role}")]))
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        _write(
            directory,
            f"{role}.key",
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            ),
        )
        _write(directory, f"{role}.pem", cert.public_bytes(serialization.Encoding.PEM))
    return DynamoTls(directory)


def _write(directory: Path, name: str, data: bytes) -> None:
    tmp = directory / f".{name}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, directory / name)
