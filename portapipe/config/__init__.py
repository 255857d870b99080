"""Configuration: YAML in, a validated and typed :class:`Config` out, and what decides which
settings combine.

- :mod:`.schema`: the sections, one class per concern, every key documented where declared
  (:mod:`.train_section`: the ``train`` section; :mod:`.section`: what every section is);
- :mod:`.kinds`: the typing rule every key follows;
- :mod:`.load`: reading YAML, ``--set`` overrides, and the checks across sections
  (:func:`load_config`; every problem one line naming the key path);
- :mod:`.text`: the YAML reader and the override syntax (:class:`ConfigError`);
- :mod:`.rules` and :mod:`.setup`: the table of rules and the :class:`~.setup.Setup` a config
  implies, which the planner reads too (nothing here imports the planner);
- :mod:`.model_rules`, :mod:`.model_shape`: the architecture's keys and the model's sizes.
"""

from .load import config_from_dict, load_config
from .schema import (
    BalancerConfig,
    BenchConfig,
    CheckpointConfig,
    Config,
    DataConfig,
    LaunchConfig,
    LogConfig,
    MemoryConfig,
    ModelConfig,
    ParallelConfig,
    ScheduleConfig,
    SourceConfig,
    WandbConfig,
)
from .train_section import LrPhase, TrainConfig
from .text import ConfigError, apply_overrides

__all__ = [
    "BalancerConfig", "BenchConfig", "CheckpointConfig", "Config", "ConfigError", "DataConfig", "LaunchConfig",
    "LogConfig", "LrPhase", "MemoryConfig", "ModelConfig", "ParallelConfig", "ScheduleConfig", "SourceConfig",
    "TrainConfig", "WandbConfig", "apply_overrides", "config_from_dict", "load_config",
]
