"""Certificates for the TLS tests, made on the spot: a CA, and a server and a client certificate it
signed, valid for 127.0.0.1 and localhost for a day."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

__all__ = ["make_certificates"]


def make_certificates(folder: Path) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, both signed by the CA."""
    now = datetime.datetime.now(datetime.UTC)

    def certificate(name: str, key, issuer_name, issuer_key, ca: bool, san=None) -> x509.Certificate:
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(issuer_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if san is not None:
            builder = builder.add_extension(san, critical=False)
        return builder.sign(issuer_key, hashes.SHA256())

    files: dict[str, Path] = {}
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvmesh test CA")])
    ca_cert = certificate("kvmesh test CA", ca_key, ca_name, ca_key, ca=True)
    files["ca"] = folder / "ca.pem"
    files["ca"].write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    san = x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")])
    for who in ("server", "client"):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = certificate(f"kvmesh {who}", key, ca_name, ca_key, ca=False, san=san)
        files[f"{who}_cert"] = folder / f"{who}.pem"
        files[f"{who}_cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        files[f"{who}_key"] = folder / f"{who}-key.pem"
        files[f"{who}_key"].write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
    return files
