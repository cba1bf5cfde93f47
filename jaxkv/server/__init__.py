"""`jaxkv serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over one engine.

``protocol`` holds the request models, ``async_engine`` the engine loop on its thread,
``metrics`` the Prometheus metrics, ``auth`` the API keys and tenants, ``app`` the routes.
"""

from jaxkv.server.app import build_app, serve

__all__ = ["build_app", "serve"]
