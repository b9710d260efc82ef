"""Everything distributed, applied to a P2R model from outside it: FSDP2 (`fsdp`) and pipeline parallelism
(`pipeline`, `pipedream`)."""

from .fsdp import delink_fully_sharded, fully_shard_p2r, gather_deepspeed_model, gather_shared_once

__all__ = ["delink_fully_sharded", "fully_shard_p2r", "gather_deepspeed_model", "gather_shared_once"]
