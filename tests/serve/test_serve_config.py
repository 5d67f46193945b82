"""Config validation, YAML files and request models: no Ray cluster, no model."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from tr_serve.serve.config import ConfigError, TRServeConfig
from tr_serve.serve.protocol import ChatCompletionRequest, CompletionRequest, validation_error

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("name", ["smollm2-cpu.yaml", "llama70b.yaml"])
def test_yaml_is_a_valid_serve_config_and_tr_config(name):
    from ray.serve.schema import ServeDeploySchema

    raw = yaml.safe_load((CONFIGS / name).read_text())
    schema = ServeDeploySchema.model_validate(raw)
    assert len(schema.applications) == 1
    app = schema.applications[0]
    assert app.import_path == "tr_serve.serve.builder:build_app"
    assert app.route_prefix == "/"
    TRServeConfig.from_args(app.args)  # raises on an unknown key or a bad value


def test_compile_is_refused_under_tensor_parallelism_and_the_decoder_settings_checked_alone():
    args = yaml.safe_load((CONFIGS / "llama70b.yaml").read_text())["applications"][0]["args"]
    compact = TRServeConfig.from_args({**args, "engine_kwargs": {**args["engine_kwargs"], "decoder": "compact"}})
    assert compact.engine_kwargs.decoder == "compact" and compact.tensor_parallel_size == 8
    bad = {**args, "engine_kwargs": {**args["engine_kwargs"], "compile": True}}
    with pytest.raises((ConfigError, ValidationError), match="tensor_parallel_size"):
        TRServeConfig.from_args(bad)
    for bad_kwargs in ({"decoder": "fast"}, {"decoder": "transformers", "compile": True}):
        with pytest.raises((ConfigError, ValidationError), match="decoder"):
            TRServeConfig.from_args({"engine_kwargs": bad_kwargs})


def test_cpu_yaml_binds_loopback_port_8000_and_the_embedded_model():
    raw = yaml.safe_load((CONFIGS / "smollm2-cpu.yaml").read_text())
    assert raw["http_options"] == {"host": "127.0.0.1", "port": 8000}
    cfg = TRServeConfig.from_args(raw["applications"][0]["args"])
    assert (cfg.model, cfg.engine_kwargs.device, cfg.engine_kwargs.tree) == ("smollm2-135m-instruct", "cpu", "auto")


def test_llama70b_yaml_builds_an_8_gpu_tensor_parallel_replica():
    from tr_serve.serve.builder import build_app

    args = yaml.safe_load((CONFIGS / "llama70b.yaml").read_text())["applications"][0]["args"]
    cfg = TRServeConfig.from_args(args)
    opts = cfg.server_deployment_options()
    assert opts["placement_group_bundles"] == [{"CPU": 4}] + [{"GPU": 1, "CPU": 4}] * 8  # the replica, 8 TP workers
    assert cfg.tensor_parallel_size == 8
    assert opts["placement_group_strategy"] == "STRICT_PACK"
    assert opts["autoscaling_config"]["min_replicas"] == 1 and opts["autoscaling_config"]["max_replicas"] == 4
    assert "num_replicas" not in opts
    assert opts["max_ongoing_requests"] == 64 and opts["max_queued_requests"] == 256
    e = cfg.engine_kwargs
    assert (e.dtype, e.device, e.tree) == ("bfloat16", "cuda", "auto")
    build_app(args)  # Serve's own option checks (actor must fit the first bundle) pass


@pytest.mark.parametrize("args, key", [
    ({"modle": "x"}, "modle"),
    ({"engine_kwargs": {"k": 0}}, "k must be >= 1"),
    ({"engine_kwargs": {"max_num_seqs": "four"}}, "engine_kwargs.max_num_seqs"),
    ({"engine_kwargs": {"tree": "no-such-tree"}}, "tree"),
    ({"engine_kwargs": {"device": "gpu"}}, "device"),
    ({"engine_kwargs": {"dtype": "int3"}}, "dtype"),
    ({"engine_kwargs": {"pair_table_slots": 1000}}, "pair_table_slots must be a power of two"),
    ({"engine_kwargs": {"tre": "top4"}}, "engine_kwargs.tre: unknown key"),
    ({"engine_kwargs": {"model": "x"}}, "engine_kwargs: `model` is set at the top level"),
    ({"tree": "top4"}, "tree: unknown key"),  # engine settings live in engine_kwargs
    ({"ingress": {"replicas": 2}}, "ingress.replicas"),
    ({"autoscaling_config": {"min_replica": 1}}, "autoscaling_config"),
    ({"max_queued_requests": -5}, "max_queued_requests"),
    ({"placement_group_strategy": "PACK"}, "placement_group_bundles"),
    ({"placement_group_bundles": [{"GPU": 1}], "ray_actor_options": {"num_cpus": 2}}, "placement_group_bundles"),
])
def test_build_app_rejects_bad_args_naming_the_key(args, key):
    from tr_serve.serve.builder import build_app

    with pytest.raises(ConfigError) as e:
        build_app(args)
    assert key in str(e.value)


def test_server_options_defaults_follow_max_num_seqs():
    cfg = TRServeConfig.from_args({"engine_kwargs": {"max_num_seqs": 3}})
    opts = cfg.server_deployment_options()
    assert opts["max_ongoing_requests"] == 6 and opts["max_queued_requests"] == 24
    assert opts["backpressure_config"] == {"status_code": 429, "retry_after_s": 1.0}
    assert opts["num_replicas"] == 1
    assert cfg.served_model_id == "smollm2-135m-instruct"
    gpu = TRServeConfig.from_args({"engine_kwargs": {"device": "cuda"}, "placement_group_bundles": [{"GPU": 1}] * 2})
    assert gpu.server_deployment_options()["ray_actor_options"] == {"num_gpus": 1, "num_cpus": 0}


def test_api_keys_from_config_and_env(monkeypatch):
    monkeypatch.setenv("TR_SERVE_API_KEYS", " env-a, ,env-b ")
    cfg = TRServeConfig.from_args({"api_keys": ["cfg-1"]})
    assert cfg.resolved_api_keys() == ["cfg-1", "env-a", "env-b"]
    assert "cfg-1" not in repr(cfg)  # secrets stay out of logs


def _errors(model, body):
    with pytest.raises(ValidationError) as e:
        model.model_validate(body)
    return validation_error(e.value.errors())


def test_request_validation_is_strict_and_names_the_param():
    msgs = [{"role": "user", "content": "hi"}]
    assert _errors(ChatCompletionRequest, {"model": "m", "messages": msgs, "max_tokens": "5"}).param == "max_tokens"
    assert _errors(ChatCompletionRequest, {"model": "m", "messages": msgs, "stream": "yes"}).param == "stream"
    assert _errors(ChatCompletionRequest, {"messages": msgs}).param == "model"
    err = _errors(ChatCompletionRequest, {"model": "m", "messages": [{"role": "wizard", "content": "x"}]})
    assert err.param == "messages[0].role" and err.status_code == 400
    assert _errors(CompletionRequest, {"model": "m", "prompt": 5}).param == "prompt"
    # unknown fields are ignored, like vLLM
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": msgs, "whatever": {"x": 1}})
    assert req.unsupported() is None and req.requested_max_tokens() is None


def test_unsupported_fields_are_rejected_with_their_param():
    msgs = [{"role": "user", "content": "hi"}]
    n2 = ChatCompletionRequest.model_validate({"model": "m", "messages": msgs, "n": 2}).unsupported()
    assert (n2.param, n2.message) == ("n", "n > 1 is not supported")
    logprobs = CompletionRequest.model_validate({"model": "m", "prompt": "x", "logprobs": 1}).unsupported()
    assert logprobs.param == "logprobs"
    batch = CompletionRequest.model_validate({"model": "m", "prompt": ["a", "b"]}).single_prompt()
    assert batch.param == "prompt"
    assert CompletionRequest.model_validate({"model": "m", "prompt": [[1, 2]]}).single_prompt() == [1, 2]
    chat = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": msgs, "max_tokens": 5, "max_completion_tokens": 7})
    assert (chat.requested_max_tokens(), chat.max_tokens_param) == (7, "max_completion_tokens")


def test_engine_options_pass_through():
    from tr_serve.engine.config import EngineConfig

    assert TRServeConfig.from_args({}).engine_config() == EngineConfig()  # engine defaults kept
    assert EngineConfig().tree == "auto"
    cfg = TRServeConfig.from_args({"model": "m", "engine_kwargs": {"budget": "auto", "max_num_batched_tokens": 64,
                                                                   "kv_cache_memory_gb": 0.5, "cpu_kernels": "torch",
                                                                   "online_latency": False}})
    e = cfg.engine_config()
    assert (e.budget, e.max_num_batched_tokens, e.kv_cache_memory_gb, e.cpu_kernels) == ("auto", 64, 0.5, "torch")
    assert (e.model, e.online_latency) == ("m", False)
    for bad, key in (({"budget": "smart"}, "budget"), ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
                     ({"kv_cache_memory_gb": 0}, "kv_cache_memory_gb"), ({"cpu_kernels": "fast"}, "cpu_kernels")):
        with pytest.raises(ConfigError, match=key):
            TRServeConfig.from_args({"engine_kwargs": bad})


def test_engine_load_from_async_engine_stats():
    from tr_serve.serve.metrics import engine_load

    load = engine_load({"running": 1, "prefilling": 2, "waiting": 4, "kv_rows_used": 3, "kv_rows": 6})
    assert load == {"num_running": 3, "num_decoding": 1, "num_prefilling": 2, "num_waiting": 4, "num_rows": 6,
                    "kv_cache_usage": 0.5}


def test_health_check_fails_once_the_engine_is_not_alive():
    from types import SimpleNamespace

    from tr_serve.engine.async_engine import AsyncEngine
    from tr_serve.serve.server import LLMServer

    server = LLMServer.__new__(LLMServer)  # no model: only the health check's use of the engine contract
    pings = []
    core = SimpleNamespace(config=None, tokenizer=None, matrix=None, has_unfinished=lambda: False,
                           check_health=lambda: pings.append(1), shutdown=lambda: None)  # an EngineCore stand-in
    server.engine = AsyncEngine(core)
    server.check_health()
    assert pings == [1]  # the engine itself is asked too (tensor parallel: its workers)
    server.engine.error = ValueError("boom")
    with pytest.raises(RuntimeError, match="boom"):
        server.check_health()
    server.engine.error = None
    server.engine.shutdown()
    with pytest.raises(RuntimeError, match="step thread gone"):
        server.check_health()


def test_edge_limits_default_from_max_model_len():
    cfg = TRServeConfig.from_args({"engine_kwargs": {"max_model_len": 512}})
    assert cfg.resolved_max_prompt_chars() == 64 * 512
    assert cfg.resolved_max_request_bytes() == 4 * 64 * 512 + 65536
    assert (cfg.max_json_depth, cfg.drain_timeout_s) == (32, 30.0)
    cfg = TRServeConfig.from_args({"max_prompt_chars": 1000, "max_request_bytes": 4096, "drain_timeout_s": 7})
    assert (cfg.resolved_max_prompt_chars(), cfg.resolved_max_request_bytes()) == (1000, 4096)
    # a replica Serve replaces gets the drain timeout; the ingress outlives it
    assert cfg.server_deployment_options()["graceful_shutdown_timeout_s"] == 7
    assert cfg.ingress_deployment_options()["graceful_shutdown_timeout_s"] == 12
    explicit = TRServeConfig.from_args({"graceful_shutdown_timeout_s": 3})
    assert explicit.server_deployment_options()["graceful_shutdown_timeout_s"] == 3
    for bad, key in (({"max_request_bytes": 10}, "max_request_bytes"), ({"max_json_depth": 1000}, "max_json_depth"),
                     ({"drain_timeout_s": -1}, "drain_timeout_s"), ({"max_prompt_chars": 0}, "max_prompt_chars")):
        with pytest.raises(ConfigError, match=key):
            TRServeConfig.from_args(bad)


def test_check_json_bounds_depth_and_refuses_lone_surrogates():
    from tr_serve.serve.protocol import check_json

    deep = node = {}
    for _ in range(40):
        node["x"] = [{}]
        node = node["x"][0]
    assert check_json({"a": [1, {"b": "ok é 😀"}]}, 32) is None
    err = check_json({"tool_choice": deep}, 32)
    assert (err.status_code, err.code, err.param) == (400, "invalid_body", "tool_choice.x[0].x")
    assert check_json({"tool_choice": deep}, 100) is None
    for obj, param in (({"model": "\ud800"}, "model"), ({"messages": [{"content": "a\udfffb"}]}, "messages[0].content"),
                       ({"\udc00": 1}, None), ({"stop": ["x", "\ud83d"]}, "stop[1]")):
        err = check_json(obj, 32)
        assert (err.status_code, err.code, err.param) == (400, "invalid_unicode", param), obj


def test_echo_cuts_and_escapes_user_strings():
    from tr_serve.serve.protocol import echo

    assert echo("gpt-4o") == "gpt-4o"
    assert echo("a\x00b\ud800c\x1b") == "a\\u0000b\\ud800c\\u001b"
    long = echo("m" * 5_000_000)
    assert long == "m" * 64 + "... (5000000 characters)"
    long.encode("ascii")


@pytest.mark.parametrize("extra, param", [
    ({"tool_choice": "auto"}, "tool_choice"), ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ({"tools": [{"type": "function"}]}, "tools"), ({"functions": [{"name": "f"}]}, "functions"),
    ({"function_call": "auto"}, "function_call"), ({"audio": {"voice": "x"}}, "audio"),
    ({"modalities": ["audio"]}, "modalities"), ({"prediction": {"type": "content"}}, "prediction"),
    ({"web_search_options": {}}, "web_search_options"), ({"stop": [str(i) for i in range(17)]}, "stop"),
    ({"stop": "x" * 1001}, "stop"),
])
def test_unsupported_chat_fields_are_refused_by_name(extra, param):
    msgs = [{"role": "user", "content": "hi"}]
    err = ChatCompletionRequest.model_validate({"model": "m", "messages": msgs, **extra}).unsupported()
    assert err is not None and err.param == param and err.status_code == 400


def test_harmless_chat_fields_are_accepted_and_prompt_chars_counted():
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}],
                                                        "name": "ann"}]
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": msgs, "tool_choice": "none",
                                                "modalities": ["text"], "stop": [str(i) for i in range(16)],
                                                "parallel_tool_calls": False, "store": False})
    assert req.unsupported() is None
    assert (req.prompt_chars(), req.prompt_param) == (len("be brief") + len("hi") + len("ann"), "messages")
    comp = CompletionRequest.model_validate({"model": "m", "prompt": [1, 2, 3]})
    assert (comp.prompt_chars(), comp.prompt_param) == (3, "prompt")


def test_error_middleware_rewrites_plain_text_errors_and_keeps_retry_after():
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse, Response
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from tr_serve.serve.http_edge import APIKeyMiddleware, OpenAIErrorMiddleware
    from tr_serve.serve.tenants import TenantDirectory

    async def busy(request):  # what Serve's own BackPressureError handler sends
        return Response("Request dropped due to backpressure (num_queued_requests=16, max_queued_requests=16).",
                        status_code=429, headers={"Retry-After": "2"})

    async def boom(request):
        raise RuntimeError("boom")

    async def text(request):
        return PlainTextResponse("fine")

    app = Starlette(routes=[Route("/busy", busy), Route("/boom", boom), Route("/ok", text), Route("/health", text)])
    client = TestClient(OpenAIErrorMiddleware(APIKeyMiddleware(app, TenantDirectory.from_config(["k"], {}, "tenant"))), raise_server_exceptions=False)
    auth = {"Authorization": "Bearer k"}
    r = client.get("/busy", headers=auth)
    assert r.status_code == 429 and r.headers["retry-after"] == "2"
    assert r.json()["error"]["type"] == "rate_limit_error" and r.json()["error"]["code"] == "overloaded"
    assert "backpressure" in r.json()["error"]["message"]
    r = client.get("/boom", headers=auth)
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    assert client.get("/ok", headers=auth).text == "fine"  # successes pass untouched
    assert client.get("/health").status_code == 200  # the one route without a key
    for path in ("/x/health", "/health/", "/ok"):
        r = client.get(path)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
