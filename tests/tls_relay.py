"""A TLS front for the plain-HTTP test S3 server: an https endpoint on 127.0.0.1.

Each accepted connection is wrapped in TLS with a self-signed certificate for ``127.0.0.1`` (its
PEM in ``ca_file``, for ``S3Config.ca_bundle``) and relayed byte for byte to the upstream server.
"""

from __future__ import annotations

import datetime
import ipaddress
import socket
import ssl
import threading
from pathlib import Path

from s3_faults import LoopbackServer, relay


def self_signed_certificate(directory: Path) -> tuple[Path, Path]:
    """(certificate, key) PEM files for the IP address 127.0.0.1."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    loopback = x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(loopback, critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = directory / "cert.pem", directory / "key.pem"
    cert_file.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return cert_file, key_file


class TlsRelay:
    def __init__(self, upstream: tuple[str, int], directory: Path) -> None:
        self.ca_file, key_file = self_signed_certificate(directory)
        self._context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._context.load_cert_chain(self.ca_file, key_file)
        self._upstream = upstream
        self._stop = threading.Event()
        self._server = LoopbackServer(self._handle, "tls-relay")

    @property
    def endpoint_url(self) -> str:
        host, port = self.address
        return f"https://{host}:{port}"

    @property
    def address(self) -> tuple[str, int]:
        return self._server.address

    def close(self) -> None:
        self._stop.set()
        self._server.close()

    def _handle(self, accepted: socket.socket) -> None:
        try:
            client = self._context.wrap_socket(accepted, server_side=True)
        except (OSError, ssl.SSLError):
            return  # a client that gave up on the handshake
        upstream = socket.create_connection(self._upstream, timeout=60)
        try:
            relay(client, upstream, self._stop)
        finally:
            upstream.close()
            client.close()
