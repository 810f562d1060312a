"""The deployment files agree with the code's configuration (services/common/settings.py): the
real files have no problems, and each rule catches a broken copy (tests/deploy_checks.py)."""

from __future__ import annotations

import copy
import importlib.metadata
import shutil
import subprocess

import pytest
import yaml

from services.common.settings import ROLES
from tests.deploy_checks import K8S, ROOT, compose_problems, docker_problems, k8s_problems, load_all


def test_compose_agrees_with_settings():
    files = load_all()
    assert compose_problems(files["compose"], files["prometheus"]) == []


def test_k8s_agrees_with_settings():
    files = load_all()
    assert k8s_problems(files["k8s"], files["kustomization"]) == []


def test_dockerfile_runs_specserve_serve():
    files = load_all()
    assert docker_problems(files["dockerfile"], files["dockerignore"]) == []


def test_healthcheck_script_is_where_compose_runs_it():
    compose = load_all()["compose"]
    for role in ROLES:
        test = compose["services"][role]["healthcheck"]["test"]
        script = next(a for a in test if a.endswith(".py"))
        assert script.startswith("/app/") and (ROOT / script[len("/app/"):]).is_file(), script


def test_no_top_level_package_shadows_an_installed_distribution():
    """The checkout's packages import before site-packages: one named like another installed
    distribution's package hides it (ours was `kernels` until transformers 5.25 required Hugging
    Face's `kernels` and then imported ours)."""
    installed = importlib.metadata.packages_distributions()  # import name -> distributions
    ours = {path.parent.name for path in ROOT.glob("*/__init__.py")}
    clashes = {name: set(installed.get(name, ())) - {"specserve"} for name in ours}
    assert {name: dists for name, dists in clashes.items() if dists} == {}


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kustomization_builds():
    res = subprocess.run(["kubectl", "kustomize", str(K8S)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    kinds = [(d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(res.stdout) if d]
    assert {("Deployment", r) for r in ROLES} | {("Service", r) for r in ROLES} <= set(kinds)


def _env_list_set(c: dict, name: str, value: str) -> None:
    c["env"] = [e for e in c["env"] if e["name"] != name] + [{"name": name, "value": value}]


def _k8s(files, role):
    return next(d for ds in files["k8s"].values() for d in ds
                if d["kind"] == "Deployment" and d["metadata"]["name"] == role)["spec"]["template"]["spec"]


def _service(files, name):
    return next(d for ds in files["k8s"].values() for d in ds
                if d["kind"] == "Service" and d["metadata"]["name"] == name)


COMPOSE_BREAKS = {
    "no service draft": lambda f: f["compose"]["services"].pop("draft"),
    "command must be": lambda f: f["compose"]["services"]["verifier"].update(command=["serve", "verifier"]),
    "container_name prevents": lambda f: f["compose"]["services"]["draft"].update(container_name="draft"),
    "publishes container ports": lambda f: f["compose"]["services"]["verifier"].update(ports=["50053:50053"]),
    "SPECSERVE_PORT 50099": lambda f: f["compose"]["services"]["draft"]["environment"].update(SPECSERVE_PORT="50099"),
    "SPECSERVE_DRAFT_LEN is not defined": lambda f: f["compose"]["services"]["scheduler"]["environment"].update(
        SPECSERVE_DRAFT_LEN="4"),
    "SPECSERVE_DRAFT is not a setting of the verifier": lambda f: f["compose"]["services"]["verifier"][
        "environment"].update(SPECSERVE_DRAFT="ngram"),
    "SPECSERVE_DRAFT_ADDRS=draft:50053": lambda f: f["compose"]["services"]["scheduler"]["environment"].update(
        SPECSERVE_DRAFT_ADDRS="draft:50053"),
    "SPECSERVE_VERIFIER_ADDRS=draft:50052": lambda f: f["compose"]["services"]["scheduler"]["environment"].update(
        SPECSERVE_VERIFIER_ADDRS="draft:50052"),
    "SPECSERVE_SCHEDULER_ADDRS is not set": lambda f: f["compose"]["services"]["gateway"]["environment"].pop(
        "SPECSERVE_SCHEDULER_ADDRS"),
    "SPECSERVE_HOST must be": lambda f: f["compose"]["services"]["gateway"]["environment"].update(
        SPECSERVE_HOST="127.0.0.1"),
    "REDIS_URL=redis://cache:6379/0": lambda f: f["compose"]["services"]["gateway"]["environment"].update(
        REDIS_URL="redis://cache:6379/0"),
    "OTEL_SERVICE_NAME is not": lambda f: f["compose"]["services"]["draft"]["environment"].update(
        OTEL_SERVICE_NAME="draft"),
    "healthcheck does not check port 50052": lambda f: f["compose"]["services"]["draft"]["healthcheck"].update(
        test=["CMD", "python", "/app/deploy/healthcheck.py", "127.0.0.1:50053"]),
    "does not check GET /health": lambda f: f["compose"]["services"]["gateway"]["healthcheck"]["test"].pop(),
    "prometheus: target gateway:9400": lambda f: f["prometheus"]["scrape_configs"][0]["static_configs"][0].update(
        targets=["gateway:9400"]),
    "deploy/prometheus.yml is not mounted": lambda f: f["compose"]["services"]["prometheus"].update(volumes=[]),
    "COLLECTOR_OTLP_ENABLED": lambda f: f["compose"]["services"]["jaeger"].update(environment={}),
}

K8S_BREAKS = {
    "resources": lambda f: f["kustomization"]["resources"].remove("draft.yaml"),
    "no Deployment scheduler": lambda f: f["k8s"]["scheduler.yaml"].pop(0),
    "container ports": lambda f: _k8s(f, "verifier")["containers"][0]["ports"][0].update(containerPort=50099),
    "Service ports": lambda f: _service(f, "draft")["spec"]["ports"][0].update(port=50099),
    "readinessProbe must be grpc {'port': 50052}": lambda f: _k8s(f, "draft")["containers"][0].update(
        readinessProbe={"tcpSocket": {"port": 50052}}),
    "livenessProbe must be grpc {'port': 50051, 'service': 'liveness'}": lambda f: _k8s(f, "scheduler")[
        "containers"][0]["livenessProbe"]["grpc"].update(port=50050),
    "k8s verifier: livenessProbe must be": lambda f: _k8s(f, "verifier")["containers"][0]["livenessProbe"][
        "grpc"].pop("service"),  # liveness on readiness: a restart while it waits
    "k8s scheduler: readinessProbe must be": lambda f: _k8s(f, "scheduler")["containers"][0]["readinessProbe"][
        "grpc"].update(service="liveness"),
    "readinessProbe must be httpGet {'path': '/health', 'port': 8000}": lambda f: _k8s(f, "gateway")[
        "containers"][0]["readinessProbe"]["httpGet"].update(path="/health/live"),
    "args must be": lambda f: _k8s(f, "gateway")["containers"][0].update(args=["scheduler"]),
    "SPECSERVE_TREE is not defined": lambda f: _env_list_set(_k8s(f, "scheduler")["containers"][0],
                                                             "SPECSERVE_TREE", "6"),
    "REDIS_URL is not a setting of the draft": lambda f: _env_list_set(_k8s(f, "draft")["containers"][0], "REDIS_URL",
                                                                      "redis://redis:6379/0"),
    "SPECSERVE_VERIFIER_ADDRS=verifier:50052": lambda f: _env_list_set(
        _k8s(f, "scheduler")["containers"][0], "SPECSERVE_VERIFIER_ADDRS", "verifier:50052"),
    "SPECSERVE_SCHEDULER_ADDRS=sched:50051": lambda f: _env_list_set(
        _k8s(f, "gateway")["containers"][0], "SPECSERVE_SCHEDULER_ADDRS", "sched:50051"),
    "ConfigMap specserve-config: SPECSERVE_LOGLEVEL": lambda f: f["k8s"]["configmap.yaml"][0]["data"].update(
        SPECSERVE_LOGLEVEL="INFO"),
    "envFrom a missing ConfigMap": lambda f: _k8s(f, "verifier")["containers"][0]["envFrom"][0].update(
        configMapRef={"name": "other"}),
    "terminationGracePeriodSeconds": lambda f: _k8s(f, "verifier").update(terminationGracePeriodSeconds=10),
    "runAsNonRoot": lambda f: _k8s(f, "gateway").pop("securityContext"),
    "selects no Deployment": lambda f: _service(f, "redis")["spec"].update(selector={"app": "nothing"}),
    "targetPort": lambda f: _service(f, "gateway")["spec"]["ports"][0].update(targetPort="web"),
}

DOCKER_BREAKS = {
    "ENTRYPOINT": lambda f: f.update(dockerfile=f["dockerfile"].replace('ENTRYPOINT ["specserve", "serve"]',
                                                                        'ENTRYPOINT ["specserve"]')),
    "non-root USER": lambda f: f.update(dockerfile=f["dockerfile"].replace("USER specserve", "USER root")),
    "python:3.11-slim": lambda f: f.update(dockerfile=f["dockerfile"].replace("FROM python:3.11-slim",
                                                                              "FROM python:3.12")),
    "specserve prepare": lambda f: f.update(dockerfile=f["dockerfile"].replace("specserve prepare", "true")),
    "EXPOSE": lambda f: f.update(dockerfile=f["dockerfile"].replace("EXPOSE 50050", "EXPOSE 50049")),
    ".dockerignore": lambda f: f.update(dockerignore=f["dockerignore"].replace(".venv", "")),
}


@pytest.mark.parametrize("expected", COMPOSE_BREAKS)
def test_compose_checks_catch(expected):
    files = copy.deepcopy(load_all())
    COMPOSE_BREAKS[expected](files)
    problems = compose_problems(files["compose"], files["prometheus"])
    assert any(expected in p for p in problems), problems


@pytest.mark.parametrize("expected", K8S_BREAKS)
def test_k8s_checks_catch(expected):
    files = copy.deepcopy(load_all())
    K8S_BREAKS[expected](files)
    problems = k8s_problems(files["k8s"], files["kustomization"])
    assert any(expected in p for p in problems), problems


@pytest.mark.parametrize("expected", DOCKER_BREAKS)
def test_docker_checks_catch(expected):
    files = load_all()
    before = (files["dockerfile"], files["dockerignore"])
    DOCKER_BREAKS[expected](files)
    assert (files["dockerfile"], files["dockerignore"]) != before, "the mutation did not apply"
    problems = docker_problems(files["dockerfile"], files["dockerignore"])
    assert any(expected in p for p in problems), problems
