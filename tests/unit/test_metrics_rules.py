"""The alert rules and the Grafana dashboard under deploy/ name only metrics the services export,
and the metric registries export what the issue asks for (vLLM-compatible names)."""

from __future__ import annotations

import copy
import json
import re
from collections import Counter
from pathlib import Path

import yaml

from services.common.metrics import GatewayMetrics, Registry, SchedulerMetrics, WorkerMetrics

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "specserve-dashboard.json"
NAME = re.compile(r"specserve:[A-Za-z0-9_:]+")


def exported() -> set[str]:
    """Every series name any role exports (a worker as on CUDA, with its GPU gauges)."""
    return (GatewayMetrics(Registry("gateway")).registry.names()
            | SchedulerMetrics(Registry("scheduler")).registry.names()
            | WorkerMetrics(Registry("verifier"), gpu_memory=lambda: (1, 2)).registry.names())


def alert_exprs(rules: dict) -> dict[str, str]:
    return {r["alert"]: r["expr"] for g in rules["groups"] for r in g["rules"]}


def dashboard_exprs(dash: dict) -> dict[str, str]:
    return {f"{p['title']}/{t['refId']}": t["expr"] for p in dash["panels"] for t in p.get("targets", [])}


def unknown_names(exprs: dict[str, str], known: set[str]) -> list[str]:
    return [f"{where}: {name}" for where, expr in exprs.items() for name in NAME.findall(expr) if name not in known]


def alert_problems(rules: dict) -> list[str]:
    out = []
    for g in rules.get("groups", []):
        for r in g.get("rules", []):
            where = r.get("alert", "?")
            if not r.get("expr") or not r.get("for"):
                out.append(f"{where}: needs expr and for")
            if r.get("labels", {}).get("severity") not in ("info", "warning", "critical"):
                out.append(f"{where}: severity must be info, warning or critical")
            if not r.get("annotations", {}).get("summary"):
                out.append(f"{where}: no summary annotation")
    names = Counter(r.get("alert") for g in rules.get("groups", []) for r in g.get("rules", []))
    out += [f"{n}: defined {c} times" for n, c in names.items() if c > 1]
    return out


def test_every_metric_the_alerts_name_is_exported():
    exprs = alert_exprs(yaml.safe_load(ALERTS.read_text()))
    assert unknown_names(exprs, exported()) == []
    assert sum(len(NAME.findall(e)) for e in exprs.values()) > 10


def test_every_metric_the_dashboard_names_is_exported():
    exprs = dashboard_exprs(json.loads(DASHBOARD.read_text()))
    assert unknown_names(exprs, exported()) == []
    assert len(exprs) >= 15


def test_a_misspelled_metric_is_caught():
    rules = yaml.safe_load(ALERTS.read_text())
    broken = copy.deepcopy(rules)
    broken["groups"][0]["rules"][0]["expr"] = "rate(specserve:e2e_latency_seconds_bucket[5m]) > 1"
    assert unknown_names(alert_exprs(broken), exported()) == [
        f"{broken['groups'][0]['rules'][0]['alert']}: specserve:e2e_latency_seconds_bucket"]
    dash = json.loads(DASHBOARD.read_text())
    dash["panels"][0]["targets"][0]["expr"] = "sum(specserve:num_requests_queued)"
    assert any("specserve:num_requests_queued" in p for p in unknown_names(dashboard_exprs(dash), exported()))


def test_alerts_are_well_formed_and_cover_the_issue():
    rules = yaml.safe_load(ALERTS.read_text())
    assert alert_problems(rules) == []
    exprs = " ".join(alert_exprs(rules).values())
    for needed in ("specserve:e2e_request_latency_seconds_bucket",  # p99 latency
                   "specserve:gpu_memory_used_bytes", "specserve:kv_cache_usage_bytes",  # GPU / KV pressure
                   "specserve:spec_decode_num_accepted_tokens_total"):  # low acceptance
        assert needed in exprs, needed
    broken = copy.deepcopy(rules)
    del broken["groups"][0]["rules"][0]["labels"]
    assert any("severity" in p for p in alert_problems(broken))


def test_prometheus_loads_the_rules_compose_mounts():
    prom = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    mounts = dict(v.rsplit(":", 1)[0].split(":", 1) for v in compose["services"]["prometheus"]["volumes"])
    assert mounts["./deploy/prometheus/alerts.yml"] in prom["rule_files"]
    jobs = {j["job_name"] for j in prom["scrape_configs"]}
    assert jobs == {f"specserve-{r}" for r in ("gateway", "scheduler", "draft", "verifier")}


def test_registries_export_the_vllm_compatible_names():
    names = exported()
    for needed in ("spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
                   "spec_decode_num_accepted_tokens_total", "spec_decode_num_accepted_tokens_per_pos_total",
                   "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                   "e2e_request_latency_seconds_bucket", "num_requests_waiting", "num_requests_running",
                   "kv_cache_usage_bytes", "rate_limit_rejections_total", "auth_failures_total"):
        assert f"specserve:{needed}" in names, needed


def test_scheduler_counters_per_position():
    m = SchedulerMetrics(Registry("scheduler"))
    m.record_step(drafted=5, accepted=3)  # a tree of 5 nodes, path of 3 accepted
    m.record_step(drafted=2, accepted=0)
    m.record_step(drafted=0, accepted=0)  # no draft: not a draft step
    text = m.registry.exposition().decode()
    assert "specserve:spec_decode_num_drafts_total 2.0" in text
    assert "specserve:spec_decode_num_draft_tokens_total 7.0" in text
    assert "specserve:spec_decode_num_accepted_tokens_total 3.0" in text
    for pos in range(3):
        assert f'specserve:spec_decode_num_accepted_tokens_per_pos_total{{position="{pos}"}} 1.0' in text
    assert 'position="3"' not in text


def test_a_failing_counter_source_does_not_break_the_scrape():
    def broken():
        raise RuntimeError("gone")

    m = GatewayMetrics(Registry("gateway"), auth_failures=broken, rate_limit_rejections=lambda: {"tokens": 2})
    text = m.registry.exposition().decode()
    assert 'specserve:rate_limit_rejections_total{limit="tokens"} 2.0' in text
    samples = [ln for ln in text.splitlines() if not ln.startswith("#")]
    assert not any(ln.startswith("specserve:auth_failures_total") for ln in samples)  # skipped, not fatal
