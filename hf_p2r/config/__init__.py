"""The trainer's configuration, in sections: the fields, each declared once with its type, default, help and checks
(`sections`, by the mechanism of `fields`), the rules between fields (`rules`, shared by the trainer and the planner),
the whole run (`run.TrainConfig`: one attribute per section, and what is derived from them), the command line and YAML
file that give it (`parse.parse_config`; flat keys), a Llama or P2R config.json as the model's fields
(`model_file`), and what a resume reads of the run it continues (`resume`).

Plain Python: importing it, `hf-p2r train --help` and every configuration error load neither torch nor transformers.

```python
>>> from hf_p2r.config import parse_config
>>> config = parse_config(["--config", "configs/demo.yaml", "--pseudo_steps", "50"])
>>> config.delink_schedule(), config.stages.pseudo_steps, config.optim.learning_rate
([(17, 2), (33, 4), (50, 8)], 50, 0.002)
```
"""

from . import sections
from .fields import ConfigError
from .flat import TrainArguments
from .parse import MAX_CONFIG_BYTES, build_config, parse_config
from .rules import check_run
from .run import TrainConfig
from .sections import *  # noqa: F403  (the sections and their helpers: `sections.__all__`)

__all__ = [
    "MAX_CONFIG_BYTES",
    "ConfigError",
    "TrainArguments",
    "TrainConfig",
    "build_config",
    "check_run",
    "parse_config",
    *sections.__all__,
]
