"""Start-up: the model replica is ready before its kernel plan and matrix prior exist (they follow
between steps), and until a model's first replica answers, the ingress's ``/v1/models`` and
``/health`` agree that it is not there, and its requests wait up to ``startup_wait_s``, then get
503 ``model_loading`` with ``Retry-After``. No Ray: the ingress runs over stand-in handles."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tr_serve.serve.ingress import OpenAIIngress, build_fastapi_app
from serve_testutil import AcceptedThenOk
from tr_serve.serve.server import ACCEPTED

MODEL = "m"
BODY = {"model": MODEL, "prompt": "hi", "max_tokens": 2}


class _Call:
    def __init__(self, handle: "_Handle"):
        self.handle = handle

    def remote(self, body, request_id, context=None):
        self.handle.requests += 1
        return AcceptedThenOk()


class _Broadcast:
    def __init__(self, handle: "_Handle"):
        self.handle = handle

    async def results_async(self, timeout_s, return_exceptions):
        from ray.serve._private.common import DeploymentID
        from ray.serve.exceptions import DeploymentUnavailableError

        if not self.handle.up:  # what Serve raises while the deployment has no running replica
            raise DeploymentUnavailableError(DeploymentID(name="LLMServer:m", app_name="app"))
        return [{"model": MODEL, "alive": True}]


class _Handle:
    """A model server deployment's handle whose one replica is up or not."""

    def __init__(self):
        self.up = False
        self.requests = 0

    def options(self, **kwargs):
        return self

    def broadcast(self, method: str):
        return _Broadcast(self)

    @property
    def completions(self):
        return _Call(self)


def _ingress(startup_wait_s: float):
    handle = _Handle()
    plain = next(c for c in OpenAIIngress.__mro__ if "__serve_build_asgi_app__" in vars(c))  # without Serve's wrapper
    ingress = plain(llm_deployments={MODEL: handle}, model_cards={MODEL: {"id": MODEL, "object": "model"}},
                    limits={"startup_wait_s": startup_wait_s})
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=build_fastapi_app(ingress)), base_url="http://t")
    return ingress, handle, client


async def _probe_until_health(ingress, client: httpx.AsyncClient, status: int) -> None:
    """Probe the replicas now and wait (up to 5 s) for ``/health`` to answer ``status``."""
    ingress._probe_now.set()
    for _ in range(50):
        if (await client.get("/health")).status_code == status:
            return
        await asyncio.sleep(0.1)


def _assert_loading(r: httpx.Response) -> None:
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "model_loading" and int(r.headers["retry-after"]) > 0


def test_until_the_first_replica_answers_models_and_health_agree_and_requests_get_503_at_once():
    async def run():
        ingress, handle, client = _ingress(startup_wait_s=0)
        async with client:
            _assert_loading(await client.get("/health"))
            assert (await client.get("/v1/models")).json()["data"] == []
            _assert_loading(await client.get(f"/v1/models/{MODEL}"))
            t0 = time.monotonic()
            _assert_loading(await client.post("/v1/completions", json=BODY))
            assert time.monotonic() - t0 < 1.0 and handle.requests == 0  # never sent to a replica
            handle.up = True
            await _probe_until_health(ingress, client, 200)
            assert (await client.get("/health")).json() == {"status": "ok"}
            assert [c["id"] for c in (await client.get("/v1/models")).json()["data"]] == [MODEL]
            assert (await client.get(f"/v1/models/{MODEL}")).json()["id"] == MODEL
            assert (await client.post("/v1/completions", json=BODY)).json()["choices"][0]["text"] == "ok"
            # a started model that loses its replica stays listed; its requests get the usual fast 503
            handle.up = False
            await _probe_until_health(ingress, client, 503)
            r = await client.post("/v1/completions", json=BODY)
            assert r.status_code == 503 and r.json()["error"]["code"] == "unavailable"
            assert (await client.get("/health")).json()["error"]["code"] == "unavailable"
            assert [c["id"] for c in (await client.get("/v1/models")).json()["data"]] == [MODEL]

    asyncio.run(run())


def test_a_request_sent_while_the_model_starts_waits_for_it_up_to_startup_wait_s():
    async def run():
        ingress, handle, client = _ingress(startup_wait_s=1.5)
        async with client:
            t0 = time.monotonic()
            _assert_loading(await client.post("/v1/completions", json=BODY))  # never up: refused after the wait
            assert 1.4 < time.monotonic() - t0 < 5

        # a wait far longer than the probe's period, so a loaded machine cannot turn it into a refusal
        ingress, handle, client = _ingress(startup_wait_s=20)
        async with client:
            async def come_up():
                await asyncio.sleep(0.5)
                handle.up = True

            t0 = time.monotonic()
            up = asyncio.create_task(come_up())
            r = await client.post("/v1/completions", json=BODY)
            await up
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ok"
            assert 0.4 < time.monotonic() - t0 < 20  # waited for the replica (the probe runs every second)

    asyncio.run(run())


def test_a_drain_releases_requests_waiting_for_a_starting_model():
    async def run():
        ingress, handle, client = _ingress(startup_wait_s=30)
        async with client:
            async def drain_soon():
                await asyncio.sleep(0.3)
                await ingress.drain(0)

            t0 = time.monotonic()
            task = asyncio.create_task(drain_soon())
            r = await client.post("/v1/completions", json=BODY)
            await task
            assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
            assert time.monotonic() - t0 < 5

    asyncio.run(run())


def test_the_replica_is_ready_before_its_kernel_plan_and_prior_then_builds_them_between_steps(tokenizer, tmp_path,
                                                                                              monkeypatch):
    """``LLMServer.__init__`` (what Serve waits for before routing to a replica) returns without
    measuring a kernel plan, computing the matrix prior or calibrating fully; it serves at once, and
    its start-up task then measures and seeds between steps; the greedy text stays the same."""
    from tests.tiny_model import tiny_loaded
    from tr_serve import model_loader
    from tr_serve.runner import calibration, matrix_prior
    from tr_serve.kernels import kernel_autotune, kernel_timing
    from tr_serve.serve.protocol import CompletionRequest
    from tr_serve.serve.server import LLMServer

    ready = []

    def guard(module, name: str, what: str) -> None:
        real = getattr(module, name)

        def guarded(*a, **k):
            if not ready:
                raise AssertionError(f"{what} ran before the replica was ready")
            return real(*a, **k)

        monkeypatch.setattr(module, name, guarded)

    monkeypatch.setenv("TR_SERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(kernel_autotune, "POINTS", (1, 2, 4))
    monkeypatch.setattr(model_loader, "load_model", lambda *a, **k: tiny_loaded(tokenizer, seed=3))
    guard(kernel_autotune, "measure_plan", "the kernel plan's measurement")
    guard(kernel_timing, "time_pass", "the kernel plan's measurement")
    guard(matrix_prior, "first_token_top_k", "the matrix prior")
    guard(matrix_prior.PriorComputation, "advance", "the matrix prior")
    guard(calibration, "measure", "the full calibration")
    request = CompletionRequest(model="tiny", prompt=[5, 17, 99, 3, 250], max_tokens=12, temperature=0,
                                ignore_eos=True)

    async def complete(server) -> str:
        items = [item async for item in server.completions(request, "cmpl-1")]
        assert items[0] == ACCEPTED and isinstance(items[1], dict), items
        return items[1]["choices"][0]["text"]

    async def run():
        server = LLMServer.__new__(LLMServer)
        await LLMServer.__init__(server, {"model": "tiny", "engine_kwargs": {"max_num_seqs": 2, "max_model_len": 128}})
        ready.append(True)
        try:
            assert server.startup.pending == ["kernel plan", "latency table", "matrix prior"]
            core = server.engine.engine
            assert core.runner.kernel_plan is None and core.matrix.num_filled_rows() == 0
            first = await complete(server)  # served before the start-up work is done
            await asyncio.wait_for(server._startup_task, 120)
            assert sorted(server.startup.done) == ["kernel plan", "latency table", "matrix prior"]
            assert not server.startup.failed
            assert core.runner.kernel_plan is not None and core.matrix.num_filled_rows() == 512
            assert (await server.engine_stats())["startup_work"]["pending"] == []
            assert await complete(server) == first
        finally:
            await server.__del__()

    asyncio.run(run())


def test_a_request_and_a_shutdown_do_not_wait_for_the_idle_latency_measurement(tokenizer, tmp_path, monkeypatch):
    """The full latency table is measured in one piece while the replica is idle; a request that
    comes meanwhile is served after one forward of it, not after all of it (the measurement starts
    again at the next idle moment), and so is a shutdown (an idle SIGTERM exits promptly)."""
    from tests.tiny_model import tiny_loaded
    from tr_serve import model_loader
    from tr_serve.runner import calibration
    from tr_serve.kernels import kernel_autotune
    from tr_serve.serve.protocol import CompletionRequest
    from tr_serve.serve.server import LLMServer

    monkeypatch.setenv("TR_SERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(kernel_autotune, "POINTS", (1, 2, 4))
    monkeypatch.setattr(model_loader, "load_model", lambda *a, **k: tiny_loaded(tokenizer, seed=3))
    real, started = calibration.measure, []

    def endless(runner, max_tokens, **k):  # a measurement that ends only when interrupted
        started.append(time.monotonic())
        return real(runner, max_tokens, **{**k, "repeats": 10 ** 9})

    monkeypatch.setattr(calibration, "measure", endless)
    request = CompletionRequest(model="tiny", prompt=[5, 17, 99, 3, 250], max_tokens=8, temperature=0,
                                ignore_eos=True)

    async def run():
        server = LLMServer.__new__(LLMServer)
        await LLMServer.__init__(server, {"model": "tiny", "engine_kwargs": {"max_num_seqs": 2, "max_model_len": 128}})
        stopped = False
        try:
            deadline = time.monotonic() + 120
            while not started and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert "latency table" in server.startup.pending
            await asyncio.sleep(0.5)  # well into the measurement
            t0 = time.monotonic()
            items = [item async for item in server.completions(request, "cmpl-1")]
            assert isinstance(items[1], dict) and items[1]["choices"][0]["finish_reason"] == "length"
            assert time.monotonic() - t0 < 10
            while len(started) < 2 and time.monotonic() < deadline:  # idle again: measured from the start
                await asyncio.sleep(0.05)
            job = next(j for j in server.startup.jobs if j.name == "latency table")
            assert job.interruptions >= 1
            t0 = time.monotonic()
            await asyncio.wait_for(server.__del__(), 30)
            stopped = True
            assert time.monotonic() - t0 < 5 and not server.engine.alive
        finally:
            if not stopped:
                await server.__del__()

    asyncio.run(run())


@pytest.mark.parametrize("wait", [-1, float("inf")])
def test_startup_wait_s_must_be_a_finite_non_negative_number(wait):
    from tr_serve.serve.config import ConfigError, TRServeConfig

    with pytest.raises(ConfigError, match="startup_wait_s"):
        TRServeConfig.from_args({"startup_wait_s": wait})


def test_prepare_caches_what_a_starting_replica_then_finds(tokenizer, tmp_path, monkeypatch):
    """``tr-serve prepare CONFIG`` builds the replica's engine with nothing deferred; a replica of
    the same config then finds its kernel plan, full latency table and matrix prior cached."""
    from tests.tiny_model import tiny_loaded
    from tr_serve import cli
    from tr_serve.engine.engine import Engine
    from tr_serve.model_loader import load_model
    from tr_serve.runner import calibration
    from tr_serve.kernels import kernel_timing
    from tr_serve.runner.startup_work import deferring
    from tr_serve.serve.warm_cache import app_configs

    model_dir = tmp_path / "tiny"
    tiny_loaded(tokenizer, seed=3).model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    config = tmp_path / "serve.yaml"
    config.write_text(f"""applications:
  - name: tiny
    route_prefix: /
    import_path: tr_serve.serve.builder:build_app
    args:
      model: {model_dir}
      engine_kwargs: {{max_num_seqs: 1, max_model_len: 256}}  # a full table fits in the rows
""")
    monkeypatch.setenv("TR_SERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(kernel_timing, "cpu_busy", lambda: None)  # a plan measured on a busy machine is not final
    assert cli.main(["prepare", str(config)]) == 0
    for folder, pattern in (("kernels", "*.json"), ("calibration", "*.json"), ("matrix_prior", "*.pt")):
        assert len(list((tmp_path / "cache" / folder).glob(pattern))) == 1, folder

    def fail(*a, **k):
        raise AssertionError("measured again")

    monkeypatch.setattr(calibration, "provisional", fail)
    [app] = app_configs(str(config))
    with deferring() as work:
        engine = Engine(load_model(str(model_dir)), app.engine_config())
    assert work.pending == [] and engine.runner.kernel_plan is not None and engine.matrix.num_filled_rows() == 512
    assert cli.main(["prepare", str(tmp_path / "missing.yaml")]) == 2
