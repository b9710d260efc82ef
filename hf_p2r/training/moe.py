"""Router statistics of a mixture-of-experts run, for metrics.jsonl.

Per logging interval: `expert_load`, the fraction of routed tokens each expert received (averaged over the sparse
depths, the micro-batches and the processes; balanced routing gives 1 / num_experts each), its coefficient of
variation `expert_load_cv` (0 when balanced), and `aux_loss`, the mean load-balancing loss. A record carries its stage,
so the pseudo and the real stage are told apart as for the loss.
"""

import torch
from accelerate import Accelerator

from ..models.p2r.configuration_p2r_moe import P2RMoeConfig


class RouterLoad:
    """Sums the router statistics of the forwards of a logging interval; `pop` gives the record's fields."""

    def __init__(self, config: P2RMoeConfig):
        self.config = config
        self.load: torch.Tensor | None = None
        self.aux_loss: torch.Tensor | None = None
        self.forwards = 0

    def add(self, outputs) -> None:
        """Count one forward's outputs (`output_router_logits=True`)."""
        from ..models.p2r.modeling_p2r_moe import expert_load  # (loaded by a MoE run only: 0.1-0.2 CPU s)

        load = expert_load(outputs.router_logits, self.config)
        aux_loss = outputs.aux_loss.detach().float()
        self.load = load if self.load is None else self.load + load
        self.aux_loss = aux_loss if self.aux_loss is None else self.aux_loss + aux_loss
        self.forwards += 1

    def pop(self, accelerator: Accelerator) -> dict[str, float | list[float]]:
        """The interval's statistics, the same on every process (a collective: every process calls it), and a reset."""
        if not self.forwards:
            return {}
        stats = torch.cat([self.load, self.aux_loss.view(1)]) / self.forwards
        stats = accelerator.reduce(stats.to(accelerator.device), reduction="mean").cpu()
        load, aux_loss = stats[:-1], stats[-1]
        self.load, self.aux_loss, self.forwards = None, None, 0
        return {
            "aux_loss": aux_loss.item(),
            "expert_load": [round(fraction, 6) for fraction in load.tolist()],
            "expert_load_cv": (load.std(correction=0) / load.mean()).item(),
        }
