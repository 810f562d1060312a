#!/usr/bin/env python3
"""Container health check: exit 0 when the gRPC server at ADDR reports SERVING on grpc.health.v1
(service ""), and, with --http URL, that URL answers 200. Used by docker-compose healthchecks:

    python /app/deploy/healthcheck.py 127.0.0.1:50052
    python /app/deploy/healthcheck.py 127.0.0.1:50050 --http http://127.0.0.1:8000/health

(Kubernetes probes the same health service natively with `grpc:` probes.)
"""

import argparse
import sys
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("addr", help="host:port of the gRPC server")
    ap.add_argument("--http", help="also require 200 from this URL")
    ap.add_argument("--timeout", type=float, default=3.0)
    args = ap.parse_args()
    try:
        with grpc.insecure_channel(args.addr) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""),
                                                              timeout=args.timeout)
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            print(f"{args.addr}: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}")
            return 1
        if args.http:
            with urllib.request.urlopen(args.http, timeout=args.timeout) as r:
                if r.status != 200:
                    print(f"{args.http}: HTTP {r.status}")
                    return 1
    except (grpc.RpcError, OSError) as e:
        print(f"unhealthy: {e}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
