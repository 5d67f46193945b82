"""``tr-serve run`` fails closed: an HTTP host other than loopback with no API key configured is
refused at start, unless the app's args say ``allow_unauthenticated: true``. No Ray is started."""

from __future__ import annotations

import pytest
import yaml

from tr_serve.serve.config import API_KEYS_ENV, TRServeConfig
from tr_serve.serve.run import auth_refusal, is_loopback, main

APP = {"model": "smollm2-135m-instruct"}
NO_ENV: dict[str, str] = {}


@pytest.mark.parametrize("host", ["127.0.0.1", "127.1.2.3", "localhost", "LocalHost", "::1", "[::1]"])
def test_loopback_hosts_need_no_key(host):
    assert is_loopback(host)
    assert auth_refusal(host, {"tr_serve": APP}, NO_ENV) is None


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.0.0.5", "192.168.1.2", "example.com", "", "localhost.example"])
def test_other_hosts_without_a_key_are_refused_in_one_line(host):
    assert not is_loopback(host)
    why = auth_refusal(host, {"tr_serve": APP}, NO_ENV)
    assert why and "\n" not in why
    assert "not loopback" in why and "tr_serve" in why and API_KEYS_ENV in why and "allow_unauthenticated" in why


def test_a_key_in_the_args_or_the_env_lets_it_start():
    assert auth_refusal("0.0.0.0", {"tr_serve": {**APP, "api_keys": ["sk-1"]}}, NO_ENV) is None
    assert auth_refusal("0.0.0.0", {"tr_serve": APP}, {API_KEYS_ENV: "sk-1,sk-2"}) is None
    assert auth_refusal("0.0.0.0", {"tr_serve": {**APP, "tenants": {"acme": ["sk-a"]}}}, NO_ENV) is None


def test_blank_keys_are_no_keys():
    assert auth_refusal("0.0.0.0", {"tr_serve": {**APP, "api_keys": ["", "  "]}}, NO_ENV)
    assert auth_refusal("0.0.0.0", {"tr_serve": APP}, {API_KEYS_ENV: " , "})


def test_allow_unauthenticated_lets_it_start_open():
    assert auth_refusal("0.0.0.0", {"tr_serve": {**APP, "allow_unauthenticated": True}}, NO_ENV) is None
    assert auth_refusal("0.0.0.0", {"tr_serve": {**APP, "allow_unauthenticated": False}}, NO_ENV)
    assert TRServeConfig.from_args({**APP, "allow_unauthenticated": True}).allow_unauthenticated is True
    assert TRServeConfig().allow_unauthenticated is False


def test_every_application_needs_a_key_or_the_opt_out():
    apps = {"keyed": {**APP, "api_keys": ["sk-1"]}, "open": dict(APP)}
    why = auth_refusal("0.0.0.0", apps, NO_ENV)
    assert why and "open" in why and "keyed" not in why
    apps["open"]["allow_unauthenticated"] = True
    assert auth_refusal("0.0.0.0", apps, NO_ENV) is None


def test_tr_serve_run_exits_before_ray_starts(tmp_path, monkeypatch, capsys):
    """The check runs on the parsed config: a host left out is Serve's config default, 0.0.0.0."""
    monkeypatch.delenv(API_KEYS_ENV, raising=False)
    app = {"name": "tr_serve", "route_prefix": "/", "import_path": "tr_serve.serve.builder:build_app", "args": APP}
    path = tmp_path / "open.yaml"
    path.write_text(yaml.safe_dump({"http_options": {"port": 8000}, "applications": [app]}))
    with pytest.raises(SystemExit) as exc:  # --address: no local Ray, no second process; refused before ray.init
        main([str(path), "--address", "127.0.0.1:1"])
    message = str(exc.value)
    assert message.startswith("tr-serve run: refusing to start: HTTP host 0.0.0.0") and "\n" not in message
