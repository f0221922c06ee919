"""Run configuration: the GRPO `Config` of its components' config types (`schema`), and its loader (`load`)."""
from posttrain.config.load import (MLA_LATENTS_OVER_FSDP, ConfigError, DataError, as_config, config_changes,  # noqa: F401
                                   default_config, dryrun_config, env_spec, from_config_dict, to_dict)
from posttrain.config.schema import (CheckpointConfig, Config, CurriculumConfig, EnvConfig, EnvSpec,  # noqa: F401
                                     EvalConfig, GRPOConfig, MeshConfig, ModelRunConfig, OptimConfig, SamplingConfig,
                                     TrainConfig)
