"""``configs/smollm2-cpu-tp.yaml``'s application on a local Ray instance, fleet sync on: the
tensor-parallel replica (3 workers) answers greedy chat requests with the single-process engine's tokens; killing one
worker fails the request in flight with a clear 503, the replica reports unhealthy, and Serve
brings up a working replacement."""

from __future__ import annotations

import tempfile
import time
import uuid
from pathlib import Path

import httpx
import pytest
import yaml

from tp_testutil import dev_questions, free_port
from tr_serve.engine.config import EngineConfig
from tr_serve.engine.engine import Engine
from tr_serve.engine.prompt import encode_prompt
from tr_serve.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
MAX_TOKENS = 24
START_TIMEOUT_S = 240
RECOVER_TIMEOUT_S = 240


def app_args() -> dict:
    config = yaml.safe_load((ROOT / "configs" / "smollm2-cpu-tp.yaml").read_text())
    args = dict(config["applications"][0]["args"])
    assert args["tensor_parallel_size"] == 3
    args["health_check_period_s"] = 1  # notice the dead worker within seconds
    args["engine_kwargs"] = {**args["engine_kwargs"], "max_model_len": 1024}
    # fleet sync on, as it works under TP: the replacement replica adopts the first one's rows
    args["fleet"] = {"enabled": True, "namespace": f"tp-serve-{uuid.uuid4().hex[:8]}",
                     "snapshot_dir": tempfile.mkdtemp(prefix="tp_serve_fleet_"), "sync_interval_s": 1}
    return args


def worker_actors(ray) -> dict[str, tuple[str, str]]:
    """tag -> [(name, namespace)] of the live tensor-parallel workers."""
    out: dict = {}
    for a in ray.util.list_named_actors(all_namespaces=True):
        if a["name"].startswith("tr_tp_worker:"):
            tag = a["name"].split(":")[1]
            out.setdefault(tag, []).append((a["name"], a["namespace"]))
    return out


def chat(base: str, text: str, timeout: float = 120) -> httpx.Response:
    return httpx.post(base + "/v1/chat/completions", timeout=timeout, json={
        "model": "smollm2-135m-instruct", "temperature": 0, "max_tokens": MAX_TOKENS,
        "messages": [{"role": "user", "content": text}]})


@pytest.fixture(scope="module")
def app(ray_tp):
    from ray import serve

    from tr_serve.serve.builder import build_app

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(app_args()), blocking=False, name="tr_serve_tp", route_prefix="/")
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            if httpx.get(base + "/v1/models", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the tensor-parallel app did not come up"
        time.sleep(0.5)
    return base


@pytest.fixture(scope="module")
def references(loaded) -> list[tuple[str, str, int]]:
    """(question, greedy text, completion tokens) from the single-process engine."""
    engine = Engine(loaded, EngineConfig(tree="top4", max_num_seqs=4, max_model_len=1024))
    questions = [q["turns"][0] for q in dev_questions(2)]
    for i, q in enumerate(questions):
        engine.add_request(encode_prompt(loaded.tokenizer, [{"role": "user", "content": q}]),
                           SamplingParams(max_tokens=MAX_TOKENS), request_id=str(i))
    done = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    return [(q, done[str(i)].text, len(done[str(i)].token_ids)) for i, q in enumerate(questions)]


def check_answer(r: httpx.Response, text: str, n_tokens: int) -> None:
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["message"]["content"] == text
    assert body["usage"]["completion_tokens"] == n_tokens


def test_tp_app_matches_single_process_and_recovers_from_a_dead_worker(ray_tp, app, references):
    for question, text, n in references:
        check_answer(chat(app, question), text, n)
    stats = httpx.get(app + "/v1/tr/stats", timeout=30).json()["data"][0]
    assert stats["engine_alive"] and stats["num_running"] == 0
    assert stats["fleet"] is not None  # fleet sync runs in the TP replica

    workers = worker_actors(ray_tp)
    assert len(workers) == 1, workers
    (old_tag, names), = workers.items()
    assert sorted(n for n, _ in names) == [f"tr_tp_worker:{old_tag}:{r}" for r in range(3)]
    name, namespace = next((n, ns) for n, ns in names if n.endswith(":1"))
    ray_tp.kill(ray_tp.get_actor(name, namespace=namespace))

    # the next request reaches the broken replica: a clear 503, not a hang
    question, text, n = references[0]
    r = chat(app, question, timeout=60)
    assert r.status_code == 503, r.text
    assert "tensor-parallel worker" in r.text and "restarting" in r.text, r.text

    # Serve sees the failing health check and brings up a working replica with new workers
    t0 = time.monotonic()
    while True:
        try:
            r = chat(app, question, timeout=60)
            if r.status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() - t0 < RECOVER_TIMEOUT_S, f"no working replica after the kill: {r.text}"
        time.sleep(1)
    print(f"\nreplacement replica answered {time.monotonic() - t0:.1f} s after the failed request")
    check_answer(r, text, n)
    workers = worker_actors(ray_tp)
    assert old_tag not in workers and len(workers) == 1, workers
    check_answer(chat(app, references[1][0]), references[1][1], references[1][2])
