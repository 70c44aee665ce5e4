"""The config tree: frozen dataclasses composed into one EngineConfig.

Plain Python (no jax import), so host code and the CLI's --help stay fast. Build an
EngineConfig with `jaxengine.engine_args.EngineArgs(...).create_engine_config()`;
change one only through `dataclasses.replace`.
"""

from jaxengine.config.attention import AttentionConfig
from jaxengine.config.cache import CacheConfig
from jaxengine.config.compilation import CompilationConfig
from jaxengine.config.engine import EngineConfig
from jaxengine.config.load import LoadConfig
from jaxengine.config.lora import LoRAConfig
from jaxengine.config.model import ModelConfig
from jaxengine.config.multimodal import MultiModalConfig
from jaxengine.config.observability import ObservabilityConfig
from jaxengine.config.parallel import ParallelConfig
from jaxengine.config.scheduler import SchedulerConfig
from jaxengine.config.speculative import SpeculativeConfig
from jaxengine.config.structured_outputs import StructuredOutputsConfig
from jaxengine.config.unsupported import check_supported

__all__ = [
    "AttentionConfig",
    "CacheConfig",
    "CompilationConfig",
    "EngineConfig",
    "LoadConfig",
    "LoRAConfig",
    "SpeculativeConfig",
    "ModelConfig",
    "MultiModalConfig",
    "ObservabilityConfig",
    "ParallelConfig",
    "SchedulerConfig",
    "StructuredOutputsConfig",
    "check_supported",
]
