"""Faults on the multi-replica topology (tests/integration/topology.py): replicas killed
mid-stream with SIGKILL, restarted in place, rejoining. At temperature 0 a stream that survives
a fault must carry exactly the text of an uninterrupted run: no token lost, none repeated."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.integration.topology import (LONG, PROMPT, Topology, complete, no_state_left, record, reference,
                                        stream_completion, wait_until)


def kill_mid_stream(topo: Topology, role: str):
    """Stream LONG through gateway 0 and SIGKILL the `role` replica holding it after the first
    chunk; returns (stream result, the killed service)."""
    killed = []

    def kill_holder(_res) -> bool:
        holders = topo.holding(role)
        if not holders:
            return False  # not on any replica yet (e.g. a step without speculation)
        topo.stack.kill(holders[0])
        killed.append(holders[0])
        return True

    res = stream_completion(topo.http_url(0), LONG, topo.headers, on_event=kill_holder)
    assert killed, f"no {role} replica ever held the request"
    return res, killed[0]


def rejoins(topo: Topology, svc, timeout: float = 30.0) -> float:
    """Restart a killed replica in place; returns seconds until it takes part in a request."""
    topo.stack.restart(svc)
    start = time.monotonic()
    topo.wait_ready(svc)
    before = topo.steps(svc)

    def served() -> bool:
        for gw in (0, 1):  # new requests spread over replicas: the restarted one gets some
            r = complete(topo.http_url(gw), {"prompt": PROMPT, "max_tokens": 8, "temperature": 0}, topo.headers)
            assert r.status_code == 200, r.text
        return topo.steps(svc) > before

    wait_until(served, timeout, f"{svc.role} on {svc.port} rejoining", interval=0)
    return time.monotonic() - start


def test_every_replica_takes_part(topology):
    topology.heal()
    for i in range(8):
        r = complete(topology.http_url(i % 2), {"prompt": PROMPT, "max_tokens": 16, "temperature": 0},
                     topology.headers)
        assert r.status_code == 200, r.text
    for role in ("scheduler", "draft", "verifier"):
        for svc in topology.services(role):
            assert topology.steps(svc) > 0, f"{role} on {svc.port} served nothing"


@pytest.mark.parametrize("role", ["draft", "verifier"])
def test_a_worker_replica_killed_mid_stream_loses_no_token(topology, role):
    """A dead draft replica costs speculation only (its requests move to the other one); a dead
    verifier's requests are re-prefilled on the other from their committed tokens."""
    topology.heal()
    want = reference(topology)
    res, dead = kill_mid_stream(topology, role)
    assert res.error is None, res.error
    assert res.done and res.finish_reason == "length"
    assert res.events_after_mark > 0, "the stream ended before the fault: nothing was tested"
    assert res.text == want
    no_state_left(topology)  # the moved request was freed on the survivor too
    rejoin_s = rejoins(topology, dead)
    record(f"{role} replica SIGKILL mid-stream", client_saw="stream continued, same text",
           tokens_lost=0, chunks_after_kill=res.events_after_mark,
           longest_stall_s=round(res.max_gap_after_mark, 3), restart_to_serving_s=round(rejoin_s, 2))


def test_no_draft_left_decodes_plainly(topology):
    topology.heal()
    want = reference(topology)
    for svc in topology.services("draft"):
        topology.stack.kill(svc)
    r = complete(topology.http_url(0), LONG, topology.headers)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
    assert r.json()["usage"]["completion_tokens"] == LONG["max_tokens"]
    record("every draft replica SIGKILL", client_saw="served by plain decoding, same text", tokens_lost=0)


def test_no_verifier_left_is_a_clear_error_then_recovers(topology):
    topology.heal()
    want = reference(topology)
    for svc in topology.services("verifier"):
        topology.stack.kill(svc)
    start = time.monotonic()
    r = complete(topology.http_url(0), LONG, topology.headers, timeout=30)
    waited = time.monotonic() - start
    assert r.status_code == 503, r.text
    assert "verifier" in r.json()["error"]["message"]
    assert r.headers.get("retry-after")
    s = stream_completion(topology.http_url(1), LONG, topology.headers, timeout=30)
    assert s.status == 503 and "verifier" in s.error["message"]
    for svc in topology.services("verifier"):
        topology.stack.restart(svc)
    restarted = time.monotonic()
    topology.heal()

    def serves() -> bool:
        got = complete(topology.http_url(0), LONG, topology.headers)
        return got.status_code == 200 and got.json()["choices"][0]["text"] == want

    wait_until(serves, 30, "serving after the verifiers came back", interval=0.2)
    record("every verifier replica SIGKILL", client_saw=f"HTTP {r.status_code}: {r.json()['error']['message']}",
           error_after_s=round(waited, 2), tokens_lost=0,
           restart_to_serving_s=round(time.monotonic() - restarted, 2))
    no_state_left(topology)


def test_a_scheduler_killed_mid_stream_fails_its_clients_at_once(topology):
    topology.heal()
    want = reference(topology)
    res, dead = kill_mid_stream(topology, "scheduler")
    assert res.error is not None and res.done, "the client must see an error, then [DONE]"
    assert "scheduler" in res.error["message"]
    error_after = res.ended_at - res.marked_at
    assert error_after < 5, f"the error took {error_after:.1f} s"
    assert want.startswith(res.text)  # what did arrive was right
    # The other scheduler keeps serving both gateways meanwhile.
    for i in range(4):
        r = complete(topology.http_url(i % 2), LONG, topology.headers)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want
    rejoin_s = rejoins(topology, dead, timeout=60)
    record("scheduler SIGKILL mid-stream", client_saw=f"SSE error: {res.error['message']}",
           error_after_s=round(error_after, 3), tokens_lost=0, other_requests="4/4 served by the survivor",
           restart_to_serving_s=round(rejoin_s, 2))


def test_a_gateway_killed_leaves_the_other_serving(topology):
    topology.heal()
    want = reference(topology)
    gw = topology.services("gateway")[0]
    topology.stack.kill(gw)
    with pytest.raises(httpx.TransportError):
        complete(topology.http_url(0), LONG, topology.headers)
    r = complete(topology.http_url(1), LONG, topology.headers)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
    topology.stack.restart(gw)
    start = time.monotonic()
    topology.wait_ready(gw)
    r = complete(topology.http_url(0), LONG, topology.headers)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
    record("gateway SIGKILL", client_saw="connection refused on that gateway; the other served",
           tokens_lost=0, restart_to_serving_s=round(time.monotonic() - start, 2))
    no_state_left(topology)
