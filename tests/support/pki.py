"""A throw-away PKI made on the spot: a CA, a server certificate for 127.0.0.1/localhost, client certificates.

Keys are EC P-256; a client key can be encrypted with a password, as operators keep them.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALIDITY = timedelta(days=1)


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    client_key_password: str | None


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path, password: str | None = None) -> Path:
    encryption: serialization.KeySerializationEncryption = (
        serialization.BestAvailableEncryption(password.encode()) if password else serialization.NoEncryption()
    )
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption))
    return path


def _write_cert(cert: x509.Certificate, path: Path) -> Path:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


class Authority:
    """A CA that signs server and client certificates."""

    def __init__(self, cn: str = "batchline test CA") -> None:
        self.key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.now(UTC)
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(_name(cn))
            .issuer_name(_name(cn))
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - timedelta(minutes=5))
            .not_valid_after(now + VALIDITY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=False,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(self.key.public_key()), critical=False)
            .sign(self.key, hashes.SHA256())
        )

    def issue(self, cn: str, server: bool) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.now(UTC)
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(cn))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - timedelta(minutes=5))
            .not_valid_after(now + VALIDITY)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()), critical=False)
        )
        if server:
            names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        return builder.sign(self.key, hashes.SHA256()), key


def make_pki(out: Path, client_key_password: str | None = None, client_cn: str = "batchline-client") -> Pki:
    """Write a CA, a server pair and a client pair (its key encrypted when a password is given) under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    ca = Authority()
    server_cert, server_key = ca.issue("localhost", server=True)
    client_cert, client_key = ca.issue(client_cn, server=False)
    return Pki(
        ca=_write_cert(ca.cert, out / "ca.pem"),
        server_cert=_write_cert(server_cert, out / "server.pem"),
        server_key=_write_key(server_key, out / "server.key"),
        client_cert=_write_cert(client_cert, out / "client.pem"),
        client_key=_write_key(client_key, out / "client.key", client_key_password),
        client_key_password=client_key_password,
    )


def make_foreign_client(out: Path) -> tuple[Path, Path]:
    """A client certificate and key signed by another CA: a server that trusts only ours must refuse it."""
    out.mkdir(parents=True, exist_ok=True)
    cert, key = Authority("some other CA").issue("intruder", server=False)
    return _write_cert(cert, out / "foreign.pem"), _write_key(key, out / "foreign.key")
