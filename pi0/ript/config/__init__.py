"""The typed training config of stages 7-11 (:mod:`pi0.ript.config.schema`) and its YAML presets (package data)."""

from pi0.ript.config.schema import (PRESET_DIR, DistributedConfig, EnvConfig, FeatureFlags, LoggingConfig,
                                    StageRules, TaskConfig, TrainConfig, load_config, preset_path, presets,
                                    save_config)

__all__ = ["PRESET_DIR", "DistributedConfig", "EnvConfig", "FeatureFlags", "LoggingConfig", "StageRules",
           "TaskConfig", "TrainConfig", "load_config", "preset_path", "presets", "save_config"]
