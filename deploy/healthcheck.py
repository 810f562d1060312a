#!/usr/bin/env python3
"""Container health check: exit 0 when the gRPC server at ADDR reports SERVING on grpc.health.v1
(service ""), and, with --http URL, that URL answers 200. Used by docker-compose healthchecks:

    python /app/deploy/healthcheck.py 127.0.0.1:50052
    python /app/deploy/healthcheck.py 127.0.0.1:50050 --http http://127.0.0.1:8000/health

(Kubernetes probes the same health service natively with `grpc:` probes.)

With SPECSERVE_TLS_CERT set (the role serves TLS, services/common/tls.py) the check speaks TLS too,
presenting SPECSERVE_TLS_CERT/KEY as its client certificate when SPECSERVE_TLS_CA is set (mutual
TLS), and an http:// URL becomes https://.
"""

import argparse
import os
import ssl
import sys
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _dns_name(cert_path: str) -> str | None:
    """The first DNS name of the role's own certificate (cryptography comes with pyjwt[crypto])."""
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(_read(cert_path))
    try:
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return None
    dns = names.get_values_for_type(x509.DNSName)
    return dns[0].replace("*.", "healthcheck.", 1) if dns else None  # a wildcard needs a concrete name


def grpc_channel(addr: str) -> grpc.Channel:
    cert, key, ca = (os.environ.get(f"SPECSERVE_TLS_{name}") for name in ("CERT", "KEY", "CA"))
    if not cert:
        return grpc.insecure_channel(addr)
    # Internal roles (SPECSERVE_TLS_CA set) want a client certificate: the role's own serves.
    creds = grpc.ssl_channel_credentials(root_certificates=_read(ca) if ca else None,
                                         private_key=_read(key) if ca else None,
                                         certificate_chain=_read(cert) if ca else None)
    # The check dials 127.0.0.1, while the certificate names the service (draft, api.example.com):
    # verify the server's certificate for the name its own certificate carries.
    name = _dns_name(cert)
    return grpc.secure_channel(addr, creds, [("grpc.ssl_target_name_override", name)] if name else [])


def http_get(url: str, timeout: float):
    if not os.environ.get("SPECSERVE_TLS_CERT"):
        return urllib.request.urlopen(url, timeout=timeout)
    # The gateway's HTTP port serves only HTTPS then. The probe asks whether this container's own
    # process answers on loopback; it does not check identity (a public certificate names no
    # loopback address, and the gRPC check above verified the certificate).
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    return urllib.request.urlopen(url.replace("http://", "https://", 1), timeout=timeout, context=context)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("addr", help="host:port of the gRPC server")
    ap.add_argument("--http", help="also require 200 from this URL")
    ap.add_argument("--timeout", type=float, default=3.0)
    args = ap.parse_args()
    try:
        with grpc_channel(args.addr) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""),
                                                              timeout=args.timeout)
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            print(f"{args.addr}: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}")
            return 1
        if args.http:
            with http_get(args.http, args.timeout) as r:
                if r.status != 200:
                    print(f"{args.http}: HTTP {r.status}")
                    return 1
    except (grpc.RpcError, OSError) as e:
        print(f"unhealthy: {e}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
