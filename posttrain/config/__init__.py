"""Run configuration: the schema (`schema.py`, frozen dataclasses) and its loader (`load.py`).

    from posttrain.config import default_config, env_spec, from_config_dict
"""
from posttrain.config.load import (MLA_LATENTS_OVER_FSDP, ConfigError, DataError, as_config, config_changes, default_config,  # noqa: F401
                                   env_spec, from_config_dict, dryrun_config, to_dict)
from posttrain.config.schema import (CheckpointConfig, Config, CurriculumConfig, EnvConfig, EnvSpec,  # noqa: F401
                                     EvalConfig, RLConfig, MeshConfig, ModelRunConfig, OptimConfig, SamplingConfig,
                                     TrainConfig)
