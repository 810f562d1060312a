"""TLS and mutual TLS (services/common/tls.py) on real processes: a verifier, a scheduler (n-gram
drafting in its process) and a gateway, each with its own certificate from a CA made here. The
gateway serves HTTPS and TLS gRPC to clients without client certificates; the internal listeners
refuse connections without one; rewritten certificate files are served without a restart."""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.tls import Tls
from specserve.v1 import common_pb2, verifier_pb2_grpc
from tests.integration.stack import REPO, Stack, free_port, stack_env

PEM_SIZE = 4096  # every PEM file is padded to this size, so a rewrite can keep its (mtime, size)


class Authority:
    """A CA issuing leaf certificates for localhost and 127.0.0.1, for servers and clients."""

    def __init__(self, name: str):
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        self.cert = self._builder(self.name, self.key.public_key()).add_extension(
            x509.BasicConstraints(ca=True, path_length=None), critical=True).sign(self.key, hashes.SHA256())

    def _builder(self, subject: x509.Name, public_key) -> x509.CertificateBuilder:
        now = datetime.datetime.now(datetime.timezone.utc)
        return (x509.CertificateBuilder().subject_name(subject).issuer_name(self.name).public_key(public_key)
                .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
                .not_valid_after(now + datetime.timedelta(days=1)))

    def issue(self, common_name: str) -> tuple[bytes, bytes, int]:
        """(certificate PEM, key PEM, serial) of a new leaf."""
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (self._builder(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]), key.public_key())
                .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                            x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                               critical=False)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .sign(self.key, hashes.SHA256()))
        key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption())
        return cert.public_bytes(serialization.Encoding.PEM), key_pem, cert.serial_number

    def write_leaf(self, directory: Path, name: str, keep_stat: bool = False) -> int:
        cert, key, serial = self.issue(name)
        write_pem(directory / f"{name}.pem", cert, keep_stat)
        write_pem(directory / f"{name}.key", key, keep_stat)
        return serial


def write_pem(path: Path, data: bytes, keep_stat: bool = False) -> None:
    """Write `data` padded to PEM_SIZE; `keep_stat` restores the old mtime, so that only SIGHUP
    can tell that the file changed."""
    old = path.stat() if keep_stat else None
    path.write_bytes(data + b"\n" * (PEM_SIZE - len(data)))
    if old is not None:
        os.utime(path, ns=(old.st_atime_ns, old.st_mtime_ns))


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    ca, stranger = Authority("specserve test CA"), Authority("unknown CA")
    write_pem(d / "ca.pem", ca.cert.public_bytes(serialization.Encoding.PEM))
    write_pem(d / "stranger-ca.pem", stranger.cert.public_bytes(serialization.Encoding.PEM))
    for name in ("verifier", "scheduler", "gateway", "client"):
        ca.write_leaf(d, name)
    stranger.write_leaf(d, "stranger")
    return d, ca


def tls_flags(d: Path, name: str) -> tuple[str, ...]:
    return "--tls-cert", str(d / f"{name}.pem"), "--tls-key", str(d / f"{name}.key"), "--tls-ca", str(d / "ca.pem")


def credentials(d: Path, client: str | None = "client", ca: str = "ca.pem") -> grpc.ChannelCredentials:
    read = lambda p: (d / p).read_bytes()  # noqa: E731
    if client is None:
        return grpc.ssl_channel_credentials(read(ca))
    return grpc.ssl_channel_credentials(read(ca), read(f"{client}.key"), read(f"{client}.pem"))


def health(addr: str, creds: grpc.ChannelCredentials) -> int | None:
    try:
        with grpc.secure_channel(addr, creds) as ch:
            return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2).status
    except grpc.RpcError:
        return None


def wait_serving(svc, creds: grpc.ChannelCredentials, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while health(svc.addr, creds) != health_pb2.HealthCheckResponse.SERVING:
        assert svc.alive, f"{svc.role} exited:\n{svc.log_tail()}"
        assert time.monotonic() < deadline, f"{svc.role} not serving over TLS:\n{svc.log_tail()}"
        time.sleep(0.3)


def verifier_info(addr: str, creds: grpc.ChannelCredentials):
    with grpc.secure_channel(addr, creds) as ch:
        return verifier_pb2_grpc.VerifierServiceStub(ch).Info(common_pb2.InfoRequest(), timeout=5)


def trusting(d: Path, ca: str = "ca.pem") -> ssl.SSLContext:
    return ssl.create_default_context(cafile=d / ca)


def served_serial(port: int, d: Path, client: str | None = None, alpn: str = "http/1.1") -> int:
    """The serial of the certificate a NEW connection to the port is served (verified with the CA)."""
    context = trusting(d)
    context.set_alpn_protocols([alpn])
    if client:
        context.load_cert_chain(d / f"{client}.pem", d / f"{client}.key")
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, \
            context.wrap_socket(raw, server_hostname="localhost") as conn:
        return x509.load_der_x509_certificate(conn.getpeercert(binary_form=True)).serial_number


@pytest.fixture(scope="module")
def tls_stack(tmp_path_factory, pki, tiny_target, home):
    d, _ = pki
    st = Stack(tmp_path_factory.mktemp("tls-stack"), stack_env(home))
    try:
        verifier = st.start("verifier", "--target", str(tiny_target), "--metrics-port", "0",
                            *tls_flags(d, "verifier"))
        wait_serving(verifier, credentials(d))
        sched = st.start("scheduler", "--target", str(tiny_target), "--draft-addrs", "local", "--metrics-port", "0",
                         "--verifier-addrs", verifier.addr, "--draft-length", "2", *tls_flags(d, "scheduler"))
        wait_serving(sched, credentials(d))
        http_port = free_port()
        gateway = st.start("gateway", "--target", str(tiny_target), "--scheduler-addrs", sched.addr,
                           "--http-port", str(http_port), *tls_flags(d, "gateway"))
        wait_serving(gateway, credentials(d, client=None))
        yield st, f"https://127.0.0.1:{http_port}", http_port
    finally:
        st.stop_all()


def test_tls_options_are_checked_at_startup(pki, tmp_path):
    d, ca = pki
    args = lambda **kw: argparse.Namespace(**{"tls_cert": None, "tls_key": None, "tls_ca": None, **kw})  # noqa: E731
    cert, key = str(d / "client.pem"), str(d / "client.key")
    assert Tls.from_args(args(), "draft").server_credentials() is None  # default: plain text
    with pytest.raises(ValueError, match="--tls-cert needs --tls-key"):
        Tls.from_args(args(tls_cert=cert), "draft")
    with pytest.raises(ValueError, match="--tls-key needs --tls-cert"):
        Tls.from_args(args(tls_key=key), "gateway")
    with pytest.raises(ValueError, match="--tls-ca needs --tls-cert"):
        Tls.from_args(args(tls_ca=str(d / "ca.pem")), "scheduler")
    with pytest.raises(ValueError, match="--tls-key .*missing.key: no such file"):
        Tls.from_args(args(tls_cert=cert, tls_key=str(tmp_path / "missing.key")), "draft")
    with pytest.raises(ValueError, match="--tls-key"):  # another certificate's key
        Tls.from_args(args(tls_cert=cert, tls_key=str(d / "gateway.key")), "draft")
    (tmp_path / "junk.pem").write_text("not a certificate\n")
    with pytest.raises(ValueError, match="--tls-ca .*junk.pem"):
        Tls.from_args(args(tls_cert=cert, tls_key=key, tls_ca=str(tmp_path / "junk.pem")), "draft")


def test_https_is_served_to_clients_that_trust_the_ca_only(tls_stack, pki):
    d, _ = pki
    _, url, _ = tls_stack
    assert httpx.get(f"{url}/v1/models", verify=trusting(d), timeout=10).status_code == 200
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(f"{url}/v1/models", verify=trusting(d, "stranger-ca.pem"), timeout=10)
    with pytest.raises(httpx.HTTPError):  # no plain-text HTTP next to HTTPS
        httpx.get(url.replace("https://", "http://") + "/v1/models", timeout=10)


def test_a_completion_crosses_mutual_tls_end_to_end(tls_stack, pki):
    """HTTPS to the gateway, then mutual TLS gateway -> scheduler -> verifier."""
    d, _ = pki
    _, url, _ = tls_stack
    with httpx.Client(base_url=url, verify=trusting(d), timeout=60) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        r = client.post("/v1/completions", json={"model": model, "prompt": "w5 w6 w7", "max_tokens": 4})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


def test_internal_listeners_refuse_connections_without_a_client_certificate(tls_stack, pki):
    d, _ = pki
    st, _, _ = tls_stack
    verifier, sched, gateway = (st.services[role][0] for role in ("verifier", "scheduler", "gateway"))
    assert verifier_info(verifier.addr, credentials(d)).role == "verifier"
    for client in (None, "stranger"):  # no client certificate, or one the CA did not sign
        with pytest.raises(grpc.RpcError) as refused:
            verifier_info(verifier.addr, credentials(d, client))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert health(sched.addr, credentials(d, client)) is None
    # The gateway's public gRPC listener asks clients for no certificate.
    assert health(gateway.addr, credentials(d, None)) == health_pb2.HealthCheckResponse.SERVING
    # A client that does not trust the CA refuses it.
    assert health(gateway.addr, credentials(d, None, ca="stranger-ca.pem")) is None


def test_container_healthcheck_speaks_tls(tls_stack, pki):
    d, _ = pki
    st, _, http_port = tls_stack
    check = [sys.executable, str(REPO / "deploy" / "healthcheck.py"), "--timeout", "5"]
    for role, extra in (("verifier", []), ("gateway", ["--http", f"http://127.0.0.1:{http_port}/health"])):
        env = {**os.environ, "SPECSERVE_TLS_CERT": str(d / f"{role}.pem"), "SPECSERVE_TLS_KEY": str(d / f"{role}.key"),
               "SPECSERVE_TLS_CA": str(d / "ca.pem")}
        done = subprocess.run(check + [st.services[role][0].addr, *extra], env=env, capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr


def test_rotated_certificates_are_served_without_a_restart(tls_stack, pki):
    d, ca = pki
    st, url, http_port = tls_stack
    verifier, gateway = st.services["verifier"][0], st.services["gateway"][0]
    pids = (verifier.proc.pid, gateway.proc.pid)

    # Rewritten files: the next connection gets the new certificate, on HTTPS and on mutual-TLS gRPC.
    serial = ca.write_leaf(d, "gateway")
    assert served_serial(http_port, d) == serial
    assert httpx.get(f"{url}/v1/models", verify=trusting(d), timeout=10).status_code == 200
    serial = ca.write_leaf(d, "verifier")
    assert served_serial(verifier.port, d, client="client", alpn="h2") == serial

    # A half-written file is not loaded: the last good certificate is still served.
    write_pem(d / "verifier.key", b"-----BEGIN PRIVATE KEY-----\n")
    assert served_serial(verifier.port, d, client="client", alpn="h2") == serial

    # Files rewritten with their old mtime and size: SIGHUP reloads them.
    serial = ca.write_leaf(d, "verifier", keep_stat=True)
    verifier.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while served_serial(verifier.port, d, client="client", alpn="h2") != serial:
        assert verifier.alive and time.monotonic() < deadline, verifier.log_tail()
        time.sleep(0.1)
    assert verifier_info(verifier.addr, credentials(d)).role == "verifier"
    assert (verifier.proc.pid, gateway.proc.pid) == pids and verifier.alive and gateway.alive
