"""The top-level configuration (the Serve application's ``args.config``) and one model of a several-model one."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from common.config.admission import AdmissionConfig
from common.config.base import Strict
from common.config.batch import BatchConfig
from common.config.deployments import DeploymentsConfig, ModelStages, deployment_suffix
from common.config.engine import EngineConfig
from common.config.media import MediaConfig
from common.config.model import ModelConfig
from common.config.observability import ObservabilityConfig
from common.config.routing import RoutingConfig
from common.config.server import ServerConfig


class ServedModel(ModelConfig):
    """One model of a several-model application (an entry of ``models:``): its source, dtype, name and its own
    stage deployments — media included, so each model's processor and processor cache live in replicas of its own."""

    deployments: ModelStages = ModelStages()
    """This model's media, encode, prefill and decode deployments."""

    def model_only(self) -> ModelConfig:
        return ModelConfig(**self.model_dump(exclude={"deployments"}))


class PrismConfig(Strict):
    """Top-level configuration (the ``args.config`` of the Serve application).

    One model: ``model`` and ``deployments``. Several: ``models`` (a list of :class:`ServedModel`, each with its own
    stage deployments) and ``deployments.ingress``; the ingress routes each request by its ``model`` field."""

    model: ModelConfig = ModelConfig()
    models: list[ServedModel] = Field(default_factory=list)
    """Several models in one application; leave ``model`` out then (and give each model its stages here)."""
    engine: EngineConfig = EngineConfig()
    media: MediaConfig = Field(default_factory=MediaConfig)
    admission: AdmissionConfig = AdmissionConfig()
    server: ServerConfig = ServerConfig()
    deployments: DeploymentsConfig = DeploymentsConfig()
    observability: ObservabilityConfig = ObservabilityConfig()
    batch: BatchConfig = BatchConfig()
    routing: RoutingConfig = RoutingConfig()

    @model_validator(mode="after")
    def _one_or_several(self) -> PrismConfig:
        if not self.models:
            return self
        if self.model != ModelConfig():  # (a dumped config carries the default `model` beside its `models`)
            raise ValueError("give either `model` (one model) or `models` (several), not both")
        default = DeploymentsConfig()
        stray = [n for n in ModelStages.model_fields if getattr(self.deployments, n) != getattr(default, n)]
        if stray:
            raise ValueError(
                f"with `models`, each model's stages go under models[i].deployments, not deployments.{sorted(stray)[0]}"
            )
        for names in ([m.name for m in self.models], [deployment_suffix(m.name) for m in self.models]):
            twice = sorted({n for n in names if names.count(n) > 1})
            if twice:
                raise ValueError(
                    f"models must have distinct names (also as deployment names); {twice[0]!r} appears twice"
                )
        return self

    @property
    def transport(self) -> Literal["object_store", "nixl"]:
        """The transport of this config's (first) model: its own, or ``server.transport``."""
        return self.model.transport or self.server.transport

    def served(self) -> list[PrismConfig]:
        """One single-model config per served model (what its stage deployments and its ingress client take): the
        config itself when it has one model."""
        if not self.models:
            return [self]
        ingress = self.deployments.ingress
        return [
            self.model_copy(
                update={
                    "model": m.model_only(),
                    "models": [],
                    "deployments": DeploymentsConfig(ingress=ingress, **dict(m.deployments)),
                }
            )
            for m in self.models
        ]

    @property
    def body_bytes_in_flight(self) -> int:
        """``server.max_body_bytes_in_flight``, or four bodies at :attr:`body_limit`."""
        return self.server.max_body_bytes_in_flight or 4 * self.body_limit

    @property
    def body_limit(self) -> int:
        """``server.max_body_bytes``, or what the media and text limits allow (see that field)."""
        if self.server.max_body_bytes is not None:
            return self.server.max_body_bytes
        media = min(self.media.max_request_bytes, self.media.max_items_per_request * self.media.max_item_bytes)
        return 4 * -(-media // 3) + 8 * self.server.max_text_chars + (1 << 20)
