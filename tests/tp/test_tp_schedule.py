"""``configs/smollm2-cpu-tp.yaml`` on a Ray that has only 2 logical CPUs, as on the 2-core machine
(the other TP tests start Ray with 4): the replica and its 3 workers are scheduled and answer; and a
replica whose placement group can never be scheduled gets the request a fast 503, not a hang."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
import yaml

from tp_testutil import free_port

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 240
UNAVAILABLE_BOUND_S = 10.0  # the ingress probes every second; a refused request takes milliseconds


def shipped_args() -> dict:
    config = yaml.safe_load((ROOT / "configs" / "smollm2-cpu-tp.yaml").read_text())
    return dict(config["applications"][0]["args"])


@pytest.fixture(scope="module")
def two_cpu_serve():
    from local_ray import local_ray
    from ray import serve

    with local_ray(num_cpus=2) as ray:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield ray, f"http://127.0.0.1:{port}"


def wait_for(url: str, status: int, timeout: float) -> httpx.Response:
    deadline = time.monotonic() + timeout
    seen = set()
    while True:
        try:
            r = httpx.get(url, timeout=5)
            seen.add(r.status_code)
            if r.status_code == status:
                return r
        except httpx.HTTPError as e:
            seen.add(type(e).__name__)
        assert time.monotonic() < deadline, f"{url} did not answer {status} within {timeout} s (seen: {seen})"
        time.sleep(0.5)


def chat(url: str, timeout: float = 120) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", timeout=timeout, json={
        "model": "smollm2-135m-instruct", "temperature": 0, "max_tokens": 8,
        "messages": [{"role": "user", "content": "Say hello."}]})


def test_unschedulable_replica_gets_a_fast_503(two_cpu_serve):
    from ray import serve

    from tr_serve.serve.builder import build_app

    _, base = two_cpu_serve
    # startup_wait_s 0: a model whose first replica never started is refused at once (else after that wait)
    args = shipped_args() | {"placement_group_bundles": [{"CPU": 1}] * 4, "ray_actor_options": {"num_cpus": 1},
                             "startup_wait_s": 0}
    # serve.run would wait for the app to be RUNNING, which it never is: deploy without waiting
    serve._run(build_app(args), _blocking=False, name="unschedulable", route_prefix="/")
    url = base
    try:
        # the ingress is up and its probe found no replica (the model replica never will be scheduled)
        wait_for(url + "/health", 503, START_TIMEOUT_S)
        for _ in range(2):
            t0 = time.monotonic()
            r = chat(url, timeout=UNAVAILABLE_BOUND_S * 6)
            elapsed = time.monotonic() - t0
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "model_loading"  # its first replica has not started
            assert r.headers.get("retry-after")
            assert elapsed < UNAVAILABLE_BOUND_S, elapsed
        print(f"\nunschedulable replica: 503 in {elapsed:.3f} s")
    finally:
        serve.delete("unschedulable", _blocking=False)


def test_shipped_tp_config_is_scheduled_on_two_cpus_and_answers(two_cpu_serve):
    from ray import serve

    from tr_serve.serve.builder import build_app

    _, base = two_cpu_serve
    t0 = time.monotonic()
    serve.run(build_app(shipped_args()), blocking=False, name="tp", route_prefix="/tp")  # returns once RUNNING
    url = base + "/tp"
    wait_for(url + "/health", 200, START_TIMEOUT_S)
    print(f"\nthe TP replica (2 logical CPUs in all) became healthy {time.monotonic() - t0:.1f} s after the deploy")
    r = chat(url)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"]
    serve.delete("tp", _blocking=False)
