"""A throwaway CA, server and client certificate for TLS tests (cryptography package)."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write_key(key, path: Path) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))


def make_pki(folder: Path, ips: tuple[str, ...] = ()) -> dict[str, Path]:
    """ca.pem, server.pem/server.key (for 127.0.0.1, localhost and ``ips``),
    client.pem/client.key."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(_name("gradstar test CA"))
          .issuer_name(_name("gradstar test CA")).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    paths = {"ca": folder / "ca.pem"}
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    for role in ("server", "client"):
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (x509.CertificateBuilder().subject_name(_name(f"gradstar {role}"))
                   .issuer_name(ca.subject).public_key(key.public_key())
                   .serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1)))
        if role == "server":
            builder = builder.add_extension(x509.SubjectAlternativeName([
                x509.DNSName("localhost"),
                *(x509.IPAddress(ipaddress.ip_address(ip)) for ip in ("127.0.0.1", *ips))]),
                critical=False)
        cert = builder.sign(ca_key, hashes.SHA256())
        paths[role] = folder / f"{role}.pem"
        paths[role].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        paths[f"{role}_key"] = folder / f"{role}.key"
        _write_key(key, paths[f"{role}_key"])
    return paths
