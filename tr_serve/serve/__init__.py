"""Ray Serve application with an OpenAI-compatible HTTP API.

``tr_serve.serve.builder:build_app`` is the Serve entry point (see ``configs/*.yaml``); its args
are a ``TRServeConfig``. Layers: ``OpenAIIngress`` (FastAPI, auth, routing by ``model``, SSE)
-> ``LLMServer`` (one per model, owns an ``AsyncEngine``) -> ``Engine``.
Ray is imported only inside this package.
"""

from tr_serve.serve.config import ConfigError, TRServeConfig

__all__ = ["ConfigError", "TRServeConfig", "build_app"]


def __getattr__(name):  # keep `import tr_serve.serve` light: Ray loads with the builder
    if name == "build_app":
        from tr_serve.serve.builder import build_app

        return build_app
    raise AttributeError(name)
