"""P2R where Hugging Face users already train: transformers' `Trainer` and TRL's trainers.

```python
from hf_p2r.integrations import P2RCallback, P2RTrainer

trainer = P2RTrainer(model=pseudo_model, args=args, train_dataset=blocks, callbacks=[P2RCallback(delink_at=300)])
trainer.train()
```

A shallow model grows in depth the same way (`P2RCallback(growth=[Grow(600, num_hidden_layers=8)])`).

`P2RCallback` (`callback`) holds the schedule (`Delink` and `Grow` events), the carry and the learning-rate rule;
`P2RTrainer` and `p2r_trainer(cls)` (`trainer`) are the Trainer (or a subclass, such as TRL's `SFTTrainer`) that can
swap its model mid-run. docs/trainer.md explains both.
"""

from .callback import Delink, Grow, P2RCallback
from .trainer import P2RTrainer, P2RTrainerMixin, p2r_trainer

__all__ = ["Delink", "Grow", "P2RCallback", "P2RTrainer", "P2RTrainerMixin", "p2r_trainer"]
