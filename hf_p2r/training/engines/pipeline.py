"""The pipeline engine (`pipeline_parallel_size > 1` or `data_parallel_size > 1`): the model split into stages
(`hf_p2r.distributed.pipeline`), optionally `data_parallel_size` pipelines side by side, replicated or FSDP2-sharded
stages. With `pipeline_parallel_size: 1` the whole model is one stage and the same code is data parallelism over
`data_parallel_size` processes: `data_parallel_shard: true` is FSDP2 applied by the engine itself (each block and the
root `fully_shard`ed over the processes, as `accelerate launch` with configs/accelerate/fsdp2.yaml does on GPUs), so
one code path runs sharded on CPU (gloo), where Accelerate turns FSDP off, and on GPUs; the micro-batches
(`num_microbatches`) are gradient accumulation.

Every process builds the model on the meta device and materialises only its stages (the weights a one-process run
of the same seed has: `hf_p2r.distributed.materialize`); every process of a pipeline reads the same batch
(the schedule splits it into `num_microbatches`), and with `data_parallel_size` > 1 each pipeline reads its own
`per_device_batch_size` blocks of the step's batch (`pipeline_mesh`: pipelines x data-parallel replicas); the last
stages' mean loss is shared by one collective with the stop signal. The delink is `delink_pipeline` (each stage its
own blocks, the optimizer state carried by the one carry); a checkpoint is one file per process beside
`trainer_state.json` (a sharded stage's file holds its shards), or with `checkpoint_format: dcp` DCP shards under the
model's names, which another split, number of stages or schedule resumes; `pseudo/` and `real/` are ordinary checkpoints
written from the stages, each process its weights (`hf_p2r.checkpoint.sharded_write`). The validation loss is
computed through the stages themselves (forward only, `Pipeline.evaluate`): no process holds the whole model for it.

Launch with `torchrun --nproc-per-node 2 -m hf_p2r.train --config ... --pipeline_parallel_size 2` (or
`--data_parallel_size 2 --data_parallel_shard true`) or `accelerate launch --num_processes 2 -m hf_p2r.train ...`
(Accelerate only starts the processes and the group here).
"""

from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch import nn
from transformers import PreTrainedTokenizerBase

from ...checkpoint.sharded_write import save_model_from_shards
from ...config import ComputeArguments, ParallelArguments
from ...distributed.pipeline import (
    Pipeline,
    build_pipeline,
    load_pipeline_state,
    pipeline_mesh,
    pipeline_model_config,
    pipeline_state,
)
from ..delink import delink_pipeline
from ..resume.checkpoints import TrainState, loading_checkpoint
from ..resume.dcp import is_dcp_checkpoint, saved_schedule
from ..resume.dcp import load_pipeline_state as load_dcp_state
from ..resume.dcp import pipeline_state as dcp_state
from ..resume.dcp import save as save_dcp
from ..run import say
from .base import Engine


class PipelineEngine(Engine):
    """This process's stages of the model, their schedule and optimizer (`Pipeline`); Accelerate only joins the
    processes."""

    def __init__(
        self,
        compute: ComputeArguments,
        parallel: ParallelArguments,
        *,
        initial_blocks: int,
        num_hidden_layers: int,
        log_with: str | None,
        project_dir: Path,
        **common,
    ):
        """`compute`, `parallel`: the run's sections; `initial_blocks`, `num_hidden_layers`: the first model's blocks
        (the split is chosen on it) and the real model's depth; `log_with`, `project_dir`: its trackers and their
        folder; `common`: what every engine takes (`Engine`)."""
        super().__init__(compute, **common)
        self.parallel = parallel
        self.initial_blocks, self.num_hidden_layers = initial_blocks, num_hidden_layers
        cpu = compute.cpu if compute.cpu is not None else not torch.accelerator.is_available()
        self.joined = dist.is_initialized()  # a caller's process group (tests) is left to the caller at the end
        self.accelerator = accelerator = Accelerator(
            cpu=cpu, mixed_precision="no", log_with=log_with, project_dir=project_dir
        )
        if accelerator.num_processes != parallel.pipeline_parallel_size * parallel.data_parallel_size:
            name = "pipeline_parallel_size" if parallel.pipeline_parallel_size > 1 else "data_parallel_size"
            raise ValueError(
                f"{name}: {parallel.pipeline_parallel_size} stages x data_parallel_size {parallel.data_parallel_size} "
                f"need as many processes, the launcher started {accelerator.num_processes} (a resume takes the saved "
                "run's layout: give this one's pipeline_parallel_size and data_parallel_size)"
            )
        self.pipeline: Pipeline | None = None
        self.data_size = parallel.data_parallel_size  # each pipeline reads its slice (`data_rank`, once built)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.pipeline.optimizer

    @property
    def checkpoint_format(self) -> str:
        """auto: DCP, which another split, schedule or data-parallel size resumes."""
        return "accelerate" if self.format_asked == "accelerate" else "dcp"

    def model_blocks(self, state: TrainState) -> int:
        # The split is chosen on the first model (a checkpoint records it); `load` delinks to the checkpoint's blocks.
        return self.initial_blocks

    def build(self, model: torch.nn.Module, num_blocks: int) -> None:
        parallel, accelerator = self.parallel, self.accelerator
        data_parallel = parallel.data_parallel_size
        mesh = (
            pipeline_mesh(parallel.pipeline_parallel_size, data_parallel, accelerator.device.type)
            if data_parallel > 1
            else None
        )
        self.pipeline = build_pipeline(
            model,
            schedule=parallel.pipeline_schedule,
            num_microbatches=parallel.num_microbatches or parallel.pipeline_parallel_size,
            split=parallel.pipeline_split,
            seq_len=self.block_size,
            device=accelerator.device,
            mesh=mesh,
            shard=parallel.data_parallel_shard,
            max_grad_norm=self.max_grad_norm or None,
            delay_correction=parallel.pipeline_delay_correction,
            seed=self.compute.seed,  # the meta model's stages this process holds are materialised from it
        )
        self.pipeline.optimizer = self.new_optimizer(self.pipeline.parameters())
        self.data_rank = self.pipeline.data_rank
        say(accelerator, self.pipeline.explanation)

    def new_optimizer(self, params: list[nn.Parameter]) -> torch.optim.Optimizer:
        """The run's optimizer (`build_optimizer`: AdamW, or Muon for the blocks' matrices) over `params`, this
        process's stages' parameters (`pipeline.parameters()`, named by the pipeline: which are the blocks' matrices),
        a shared block's rate divided by the depths of the whole model running it under `shared_lr_scale: depth` (by
        the stages' own parameters, sharded or not)."""
        if {id(param) for param in params} != {id(param) for param in self.pipeline.parameters()}:
            raise ValueError("new_optimizer: params must be the pipeline's stages' parameters")
        return self.optimizer_factory(self.pipeline)

    def load(self, checkpoint: Path, state: TrainState) -> None:
        part = checkpoint / f"stage-{dist.get_rank()}.pt"
        sharded = is_dcp_checkpoint(checkpoint)  # saved by any split, stages or schedule: resharded to this one
        if not sharded and not part.is_file():
            raise ValueError(
                f"resume_from_checkpoint: {part} is missing: the checkpoint was saved by fewer processes; resume it "
                "with its pipeline_parallel_size and data_parallel_size (a checkpoint_format dcp checkpoint, the "
                "default of several processes, resumes on any layout)"
            )
        depth = self.num_hidden_layers
        if state.num_blocks > self.initial_blocks:  # the layout it saved: delinked (partly or fully)
            self.delink(state.num_blocks if state.num_blocks < depth else None)
        with loading_checkpoint(self.accelerator, checkpoint):
            if sharded:
                load_dcp_state(checkpoint, self.pipeline, self.optimizer)
                saved = saved_schedule(checkpoint)
            else:
                loaded = torch.load(part, weights_only=True)
                load_pipeline_state(self.pipeline, self.optimizer, loaded)
                saved = {key for key in ("other_version", "previous_update") if key in loaded}
        self.say_correction(saved)

    def say_correction(self, saved: set[str]) -> None:
        """A line when a 2BW checkpoint's delay correction does not carry into this 2BW run: the correction switched
        off drops its buffers (d(t-1)); switched on, it starts afresh, as a new run's does."""
        parallel = self.parallel
        if parallel.pipeline_schedule != "2bw" or "other_version" not in saved:  # (flush <-> 2BW: README)
            return
        corrected, correcting = "previous_update" in saved, parallel.pipeline_delay_correction != "none"
        if corrected and not correcting:
            say(self.accelerator, "resume: the checkpoint's delay-correction buffers are dropped (this run has "
                "pipeline_delay_correction: none)")  # fmt: skip
        elif correcting and not corrected:
            say(self.accelerator, "resume: the checkpoint was saved without pipeline_delay_correction: the correction "
                "starts afresh, as in a new run")  # fmt: skip

    def forward_backward(self, input_ids: torch.Tensor) -> torch.Tensor | None:
        return self.pipeline.step(input_ids)

    def mean_loss(self, losses: list[torch.Tensor | None], signum: int) -> tuple[float, int]:
        # Every process gets the last stages' mean loss (over the data-parallel pipelines) and the same stop.
        [loss] = losses  # the pipeline's micro-batches are its accumulation (gradient_accumulation_steps: 1)
        device = self.accelerator.device  # NCCL (a GPU launch's only backend) reduces no CPU tensor
        shared = torch.tensor([0.0 if loss is None else loss.item(), float(loss is not None)], device=device)
        dist.all_reduce(shared)
        signal = torch.tensor(float(signum), device=device)
        dist.all_reduce(signal, op=dist.ReduceOp.MAX)
        return shared[0].item() / shared[1].item(), int(signal.item())

    def optimizer_step(self) -> torch.Tensor | None:
        return self.pipeline.update()  # 2BW stepped inside its schedule: None

    def delink(self, num_unique_layers: int | None) -> dict:
        delink_pipeline(self.pipeline, self.optimizer, self.new_optimizer, self.optimizer_carry, num_unique_layers)
        return {}

    def delink_note(self, rules: str) -> str:
        return " in every stage" + super().delink_note(rules)

    @torch.no_grad()
    def evaluate(self, blocks, count: int) -> float:
        """Mean validation loss over `count` blocks (`eval_blocks`) spread over the split, through the pipeline's own
        stages (`Pipeline.evaluate`: forward only, hidden states sent from stage to stage, nothing gathered; 2BW: the
        newest weights), in batches of `per_device_batch_size`, each batch's token mean weighted by its blocks; every
        pipeline runs every batch (sharded stages gather their weights with their data-parallel peers), the first
        pipeline's last stage's mean is shared with every process."""
        pipeline = self.pipeline
        count = min(len(blocks), count)
        chosen = [index * len(blocks) // count for index in range(count)]
        size = self.compute.per_device_batch_size
        batches = [blocks[chosen[start : start + size]]["input_ids"] for start in range(0, count, size)]
        losses = pipeline.evaluate(batches)
        value = torch.zeros(1, device=self.accelerator.device)  # NCCL broadcasts no CPU tensor
        if losses is not None:
            value[0] = sum(loss.item() * len(ids) for loss, ids in zip(losses, batches, strict=True)) / count
        last = pipeline.pipelines[0][(len(pipeline.split) - 1) % pipeline.size]  # the last stage of the first pipeline
        dist.broadcast(value, src=last)
        return value.item()

    def weights(self):
        return pipeline_state(self.pipeline, None)

    def training_state(self):
        return pipeline_state(self.pipeline, self.optimizer)

    def save_model(self, directory: Path, tokenizer: PreTrainedTokenizerBase) -> None:
        """One ordinary checkpoint written from the stages (`save_model_from_shards`): each process writes its
        stages' weights (a sharded stage: its shards; a replica once) into the folder's files, the first process the
        config and tokenizer; no process gathers the model. 2BW: its newest weights (`drain`)."""
        self.pipeline.drain()
        with torch.device("meta"):
            skeleton = self.pipeline.model_class(pipeline_model_config(self.pipeline))
        save_model_from_shards(
            skeleton,
            directory,
            dict(self.pipeline.named_parameters()),
            tokenizer=tokenizer,
            remote_code=self.remote_code,
            overwrite=True,
            progress=False,
        )

    def write_checkpoint(self, folder: Path, training_state) -> None:
        """`stage-{rank}.pt` per process (`training_state`: its `pipeline_state`), or with `checkpoint_format: dcp`
        every process's shards under the model's names (`hf_p2r.training.resume.dcp`)."""
        if self.checkpoint_format == "dcp":
            save_dcp(folder, dcp_state(self.pipeline, self.optimizer))
        else:
            torch.save(training_state, folder / f"stage-{dist.get_rank()}.pt")

    def title(self) -> str:
        parallel = self.parallel
        if parallel.pipeline_parallel_size == 1:  # no pipeline: the data-parallel layout
            return f"{'FSDP2' if parallel.data_parallel_shard else 'replicated'} x{parallel.data_parallel_size}"
        return f"{parallel.pipeline_schedule} x{parallel.pipeline_parallel_size}"

    def release(self) -> None:
        self.pipeline = None
        super().release()

    def close(self) -> None:
        self.release()
        if not self.joined:  # a caller's process group (tests) is left to the caller
            self.accelerator.end_training()
