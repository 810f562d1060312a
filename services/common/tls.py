"""TLS material of one role: its certificate and key, and the internal CA for mutual TLS.

--tls-cert/--tls-key are served on the role's listeners (gRPC; on the gateway HTTPS too) and
presented as its client certificate on the internal calls it makes. --tls-ca turns the internal
hops into mutual TLS: the scheduler, draft and verifier listeners require a client certificate the
CA signed, and the gateway and scheduler verify the servers they call with it. The gateway's
public listeners never ask for a client certificate (clients authenticate with API keys or JWTs).
Nothing set: plain text, as before.

Rotation without a restart: servers look at the files (mtime, size) at each new handshake and
reload them when they changed, or at once on SIGHUP. A reload that fails (a half-written file, a
key that does not match) keeps the previous material and logs one warning per change. Outgoing
calls read the client certificate when their channel is created (a restart picks up a new one).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import ssl
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc

log = logging.getLogger(__name__)

# Roles whose listeners face clients (no client certificates); the others are internal.
PUBLIC_ROLES = ("gateway",)


@dataclass(frozen=True)
class Material:
    """One loaded version of the files; replaced whole, so readers on other threads see one version."""
    version: int
    cert: bytes
    key: bytes
    ca: bytes | None
    context: ssl.SSLContext  # HTTPS server context holding cert and key


class CertFiles:
    """The certificate, key and CA files, reloaded when they change."""

    def __init__(self, cert: str, key: str, ca: str | None = None):
        self.paths = {"--tls-cert": cert, "--tls-key": key, **({"--tls-ca": ca} if ca else {})}
        for flag, path in self.paths.items():
            if not os.path.isfile(path):
                raise ValueError(f"{flag} {path}: no such file")
        # gRPC asks for certificates on a C-core thread, HTTPS on the event loop.
        self._lock = threading.Lock()
        self._failed: tuple | None = None  # the stamp of files that did not load (warned once)
        self._stamp, self.current = self._load(0)

    def _stat(self) -> tuple:
        return tuple((s.st_mtime_ns, s.st_size) for s in map(os.stat, self.paths.values()))

    def _load(self, version: int) -> tuple[tuple, Material]:
        """Read and check the files; ValueError naming the flag when they do not make a usable pair."""
        stamp = self._stat()
        cert, key, ca = self.paths["--tls-cert"], self.paths["--tls-key"], self.paths.get("--tls-ca")
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            context.load_cert_chain(cert, key)
        except ssl.SSLError as e:
            raise ValueError(f"--tls-cert {cert} and --tls-key {key} are not a PEM certificate and its "
                             f"private key ({e.reason or e})") from None
        if ca:
            try:
                ssl.create_default_context(cafile=ca)
            except ssl.SSLError as e:
                raise ValueError(f"--tls-ca {ca} is not a PEM CA certificate ({e.reason or e})") from None
        material = Material(version, Path(cert).read_bytes(), Path(key).read_bytes(),
                            Path(ca).read_bytes() if ca else None, context)
        if self._stat() != stamp:  # rewritten while we read: what we checked may not be what we read
            raise ValueError("the files changed while being read")
        return stamp, material

    def refresh(self, force: bool = False) -> None:
        """Reload if the files changed since the last attempt (or `force`, from SIGHUP)."""
        with self._lock:
            try:
                stamp = self._stat()
            except OSError:  # missing, perhaps mid-rename: tried (and warned about) once
                stamp = ("missing",)
            if not force and stamp in (self._stamp, self._failed):
                return
            try:
                self._stamp, self.current = self._load(self.current.version + 1)
            except (OSError, ValueError) as e:
                self._failed = stamp
                log.warning("TLS files not reloaded, still serving the previous certificate: %s", e)
                return
            self._failed = None
            log.info("TLS certificate reloaded from %s (version %d)", self.paths["--tls-cert"], self.current.version)


class Tls:
    """A role's TLS settings; `files` is None when TLS is off."""

    def __init__(self, role: str, files: CertFiles | None = None):
        self.role, self.files = role, files

    @classmethod
    def from_args(cls, args, role: str) -> Tls:
        """From the parsed --tls-* options (missing attributes count as unset); ValueError names the flag."""
        cert, key, ca = (getattr(args, f"tls_{name}", None) or None for name in ("cert", "key", "ca"))
        if bool(cert) != bool(key):
            raise ValueError("--tls-cert needs --tls-key" if cert else "--tls-key needs --tls-cert")
        if ca and not cert:
            raise ValueError("--tls-ca needs --tls-cert and --tls-key: mutual TLS serves and presents them")
        return cls(role, CertFiles(cert, key, ca) if cert else None)

    @property
    def mutual(self) -> bool:
        return self.files is not None and self.files.current.ca is not None

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """Credentials of the role's gRPC listener; internal ones require client certificates
        with --tls-ca. gRPC calls the fetcher before each new handshake: it hands over the new
        files once after they changed (None = keep the current ones)."""
        if self.files is None:
            return None
        files, require = self.files, self.mutual and self.role not in PUBLIC_ROLES
        served = files.current

        def configuration(m: Material):
            return grpc.ssl_server_certificate_configuration([(m.key, m.cert)], m.ca if require else None)

        def fetch():
            nonlocal served
            files.refresh()
            if files.current is served:
                return None
            served = files.current
            return configuration(served)

        return grpc.dynamic_ssl_server_credentials(configuration(served), fetch,
                                                   require_client_authentication=require)

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """Credentials of internal calls: TLS only with --tls-ca (mutual: the server is verified
        with the CA, this role's certificate is presented), else plain text."""
        if not self.mutual:
            return None
        m = self.files.current
        return grpc.ssl_channel_credentials(root_certificates=m.ca, private_key=m.key, certificate_chain=m.cert)

    def uvicorn_options(self) -> dict:
        """uvicorn.Config arguments for HTTPS (none when TLS is off). uvicorn builds its context
        once; its SNI callback, which runs on every handshake (with or without SNI), checks the
        files and switches the connection to the current certificate."""
        if self.files is None:
            return {}
        files = self.files

        def use_current(connection, server_name, context) -> None:
            files.refresh()
            connection.context = files.current.context

        def factory(config, default) -> ssl.SSLContext:
            context = default()
            context.sni_callback = use_current
            return context

        return {"ssl_certfile": files.paths["--tls-cert"], "ssl_keyfile": files.paths["--tls-key"],
                "ssl_context_factory": factory}

    def watch_sighup(self) -> None:
        """SIGHUP reloads the files at once (call from the role's event loop). Without TLS,
        SIGHUP keeps its default action."""
        if self.files is not None:
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self.files.refresh, True)
