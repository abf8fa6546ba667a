"""Prism's configuration schema: one pydantic model per section, one module per section.

Every field has a docstring; unknown fields are refused (``extra="forbid"``), so a typo in a YAML file is an error at
load time, not a silently ignored setting. Nothing here reads the environment at import; callers load a config
explicitly (``PrismConfig.model_validate(yaml_dict)``) — the media section reads
``PRISM_MEDIA_ALLOWED_PRIVATE_NETWORKS`` at that moment.

Sections (``PrismConfig`` fields → modules): ``model`` / ``models`` (:mod:`.model`, :mod:`.prism`), ``engine``,
``media``, ``admission``, ``server``, ``deployments``, ``observability``, ``batch``, ``routing``.
"""

from common.config.admission import AdmissionConfig, Rate, TenantQuota
from common.config.base import Strict
from common.config.batch import BatchConfig
from common.config.deployments import (
    DecodeStageConfig,
    DeploymentsConfig,
    EncodeStageConfig,
    IngressStageConfig,
    MediaStageConfig,
    ModelStages,
    PrefillStageConfig,
    StageConfig,
    deployment_suffix,
)
from common.config.engine import EngineConfig
from common.config.media import MediaConfig, VideoPolicy
from common.config.model import ModelConfig
from common.config.observability import ObservabilityConfig
from common.config.prism import PrismConfig, ServedModel
from common.config.routing import RoutingConfig
from common.config.server import ServerConfig, read_keys_file

__all__ = [
    "AdmissionConfig",
    "BatchConfig",
    "DecodeStageConfig",
    "DeploymentsConfig",
    "EncodeStageConfig",
    "EngineConfig",
    "IngressStageConfig",
    "MediaConfig",
    "MediaStageConfig",
    "ModelConfig",
    "ModelStages",
    "ObservabilityConfig",
    "PrefillStageConfig",
    "PrismConfig",
    "Rate",
    "RoutingConfig",
    "ServedModel",
    "ServerConfig",
    "StageConfig",
    "Strict",
    "TenantQuota",
    "VideoPolicy",
    "deployment_suffix",
    "read_keys_file",
]
