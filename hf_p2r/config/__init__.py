"""The trainer's configuration: its fields (`arguments`), how a value is checked (`fields`), the rules between fields
(`rules`, shared by the trainer and the planner), the whole run (`run.TrainConfig`), and the command line and YAML file
that give it (`parse.parse_config`).

Plain Python: importing it, `hf-p2r train --help` and every configuration error load neither torch nor transformers.

```python
>>> from hf_p2r.config import parse_config
>>> config = parse_config(["--config", "configs/demo.yaml", "--pseudo_steps", "50"])
>>> config.delink_schedule()
[(17, 2), (33, 4), (50, 8)]
```
"""

from .arguments import MOE_FIELDS, DataArguments, ModelArguments, TrainArguments, offload_text, parse_offload
from .fields import ConfigError
from .parse import MAX_CONFIG_BYTES, build_config, parse_config
from .rules import check_run
from .run import TrainConfig, even_delink_steps

__all__ = [
    "MAX_CONFIG_BYTES",
    "MOE_FIELDS",
    "ConfigError",
    "DataArguments",
    "ModelArguments",
    "TrainArguments",
    "TrainConfig",
    "build_config",
    "check_run",
    "even_delink_steps",
    "offload_text",
    "parse_config",
    "parse_offload",
]
