"""A TLS front for the plain-HTTP test S3 server: an https endpoint on 127.0.0.1.

Each accepted connection is wrapped in TLS with a self-signed certificate for ``127.0.0.1`` (its
PEM in ``ca_file``, for ``S3Config.ca_bundle``) and relayed byte for byte to the upstream server.
"""

from __future__ import annotations

import datetime
import ipaddress
import select
import socket
import socketserver
import ssl
import threading
from pathlib import Path


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
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self.ca_file, key_file)
        self._stop = threading.Event()
        relay = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                try:
                    client = context.wrap_socket(self.request, server_side=True)
                except (OSError, ssl.SSLError):
                    return  # a client that gave up on the handshake
                relay._relay(client, upstream)

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = False  # server_close() joins the handlers: none outlives close()
            allow_reuse_address = True
            block_on_close = True

        self._server = Server(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="tls-relay", daemon=True)
        self._thread.start()

    @property
    def endpoint_url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"https://{host}:{port}"

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    def close(self) -> None:
        self._stop.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def _relay(self, client: ssl.SSLSocket, upstream_address: tuple[str, int]) -> None:
        upstream = socket.create_connection(upstream_address, timeout=60)
        try:
            while not self._stop.is_set():
                # TLS may hold decrypted bytes that select() cannot see: drain those first.
                readable = [client] if client.pending() else select.select([client, upstream], [], [], 0.2)[0]
                for end in readable:
                    data = end.recv(65536)
                    if not data:
                        return
                    (upstream if end is client else client).sendall(data)
        except OSError:
            return
        finally:
            upstream.close()
            client.close()
