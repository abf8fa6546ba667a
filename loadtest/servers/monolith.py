"""The monolith baseline: Prism's own ingress and stage classes in one process, no Ray, same HTTP API.

The four stage objects share one event loop and call each other through :mod:`services.ingress.local_handles`; each
engine still steps in its own thread, as in a replica, at the priority it has there (the stages are built as a
grouped replica builds them: a stage's niceness reaches its own threads, not the process). What is left out is
exactly what Prism adds: separate processes per stage (so a flood of image work cannot share a core budget with
decode), per-stage queues and scaling, and the object store between stages.
``python -m loadtest.servers.monolith --port 8101 [--config yaml]``.
"""

from __future__ import annotations

import argparse
from typing import Any

import uvicorn
import yaml
from fastapi import FastAPI, Request
from starlette.responses import Response

from common.config import PrismConfig
from services.ingress.local_handles import local_pipeline


def build(config: dict[str, Any], transport: Any = None) -> FastAPI:
    """The app; ``transport`` (a :class:`common.kv.transport.KVTransport`) overrides the config's KV transport for
    the prefill → decode hand-off (tests pass the fake backend). The stage objects follow the config's
    ``deployments.topology`` (a group as one object, as in its replica); the baseline is the default, ``E/P/D``."""
    from services.ingress.server import IngressDeployment

    cfg = PrismConfig.model_validate(config)
    # per model: its media stage, then its topology's groups, as Serve would deploy them (all in this process)
    pipelines = [local_pipeline(sub, transport) for sub in cfg.served()]
    ingress = IngressDeployment(cfg.model_dump(mode="json"), pipelines)
    app = FastAPI(title="Prism monolith", docs_url=None, redoc_url=None)
    app.state.stages = [stage._obj for stages in pipelines for stage in stages if stage is not None]  # (for tests)
    app.state.ingress = ingress

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await ingress.chat(request)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await ingress.models(request)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    return app


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtest.servers.monolith")
    parser.add_argument("--port", type=int, default=8101)
    parser.add_argument("--config", help="PrismConfig YAML")
    args = parser.parse_args()
    config = yaml.safe_load(open(args.config, encoding="utf-8")) if args.config else {}
    uvicorn.run(build(config), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
