"""The Accelerate engine: one process, DDP, FSDP2 or DeepSpeed (whatever `accelerate config` / `accelerate launch`
says), mixed precision, gradient accumulation, and hf-p2r's granular CPU offload in one process.

Launch with `accelerate launch -m hf_p2r.train --config ...` (or `scripts/train.py`) for one CPU, one GPU or many.
"""

import math
import os
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from transformers import PreTrainedTokenizerBase

from ...checkpoint.sharded_write import save_model_from_shards
from ...compat import import_deepspeed_only_when_used
from ...config import ComputeArguments, OffloadArguments
from ...distributed import gather_shared_once
from ...distributed.deepspeed import materialize_zero3, zero3_owned_state, zero3_training_state
from ...distributed.materialize import materialize
from ...ops import HeadLoss
from ..compile import check_backend, compile_blocks
from ..delink import check_delink_supported, delink_in_training
from ..moe import RouterLoad
from ..offload import GranularOffload, apply_offload, measure_offload_activations
from ..optim import check_optimizer_supported
from ..resume.checkpoints import TrainState, loading_checkpoint, save_model
from ..resume.dcp import is_dcp_checkpoint, load_model_state, load_zero3_state, model_state
from ..resume.dcp import save as save_dcp
from ..run import say
from .base import Engine


class AccelerateEngine(Engine):
    """The model and optimizer prepared by Accelerate; granular offload places the model itself."""

    def __init__(
        self,
        compute: ComputeArguments,
        offload: OffloadArguments,
        *,
        optimizer: str,
        delinks: bool,
        checkpoint_async: bool,
        log_with: str | None,
        project_dir: Path,
        **common,
    ):
        """`compute`, `offload`: the run's sections; `optimizer` its optimizer's name (Muon needs whole matrices),
        `delinks` whether its schedule delinks, `checkpoint_async` whether it saves in the background; `log_with`,
        `project_dir`: its trackers and their folder; `common`: what every engine takes (`Engine`)."""
        super().__init__(compute, **common)
        self.offload_args = offload
        self.checkpoint_async = checkpoint_async
        cpu = compute.cpu if compute.cpu is not None else not torch.accelerator.is_available()
        check_gpu_per_process(cpu)
        import_deepspeed_only_when_used()  # (DeepSpeed's import prints into the progress bar of a run not using it)
        if compute.compile:
            check_backend(compute.compile_backend)
        self.accelerator = accelerator = Accelerator(
            mixed_precision=compute.mixed_precision,
            gradient_accumulation_steps=compute.gradient_accumulation_steps,
            cpu=cpu,
            log_with=log_with,
            project_dir=project_dir,
        )
        if delinks:
            check_delink_supported(accelerator, self.optimizer_carry)
        check_optimizer_supported(accelerator, optimizer)  # optimizer: muon needs whole matrices
        if offload.offload is not None and (
            accelerator.num_processes > 1 or accelerator.distributed_type != DistributedType.NO
        ):
            raise ValueError(
                f"offload: granular offload runs in one process, this run has {accelerator.num_processes} "
                f"({accelerator.distributed_type.value}); for several GPUs use configs/accelerate/fsdp2_offload.yaml "
                "or deepspeed_zero3_offload.yaml"
            )
        if self.format_asked == "dcp" or checkpoint_async:
            self.check_dcp()
        if zero3_config(accelerator) is not None:
            build_without_zero_init()
        self.data_rank, self.data_size = accelerator.process_index, accelerator.num_processes
        self.model = self.optimizer = self.offload = self.router_load = None
        self.activation_bytes = 0

    def build(self, model: torch.nn.Module, num_blocks: int) -> None:
        accelerator, seed, offload = self.accelerator, self.compute.seed, self.offload_args.offload
        self.shape_model(model)
        # The model comes on the meta device: FSDP2 shards it there and each process materialises its shards only;
        # granular offload materialises each part straight into its home (`apply_offload`: resident modules on the
        # device, each offloaded block on the CPU then into its pinned slab before the next), so the host never holds
        # more than the offloaded blocks and one block; DeepSpeed ZeRO-3 materialises one module at a time into its
        # partitions (`materialize_zero3`, what `deepspeed.zero.Init` does); otherwise (one process, DDP, ZeRO-1/2,
        # and `offload: auto`, which measures activations with a forward on the CPU first) the whole model is
        # materialised on the CPU.
        if accelerator.is_fsdp2:
            model = self.shard_on_meta(model)
        if zero3_config(accelerator) is not None:
            materialize_zero3(model, seed, zero3_config(accelerator))
        elif offload is None or offload == "auto":
            materialize(model, seed)
        # Granular offload places the model itself (resident blocks on the device, the others in CPU memory).
        batch_size = self.compute.per_device_batch_size
        self.activation_bytes = measure_offload_activations(
            model, self.offload_args, self.block_size, accelerator, batch_size
        )
        self.offload = apply_offload(model, self.offload_args, accelerator, self.activation_bytes, seed)
        optimizer = self.optimizer_factory(model, self.offload)
        # Device placement, DDP / FSDP2 / DeepSpeed, mixed precision.
        if accelerator.distributed_type == DistributedType.DEEPSPEED:
            fill_deepspeed_batch_size(accelerator, batch_size)
        placement = [False, False] if self.offload is not None else None
        self.model, self.optimizer = accelerator.prepare(model, optimizer, device_placement=placement)
        if accelerator.is_fsdp2:
            gather_shared_once(self.model)  # a shared block is gathered once per step, not at every depth
        if self.offload is not None:
            say(accelerator, f"offload: blocks {self.offload.layers} of {num_blocks} in CPU memory")
        # MoE: the training loss includes the load-balancing loss (router_aux_loss_coef); the router statistics are
        # logged.
        model_config = accelerator.unwrap_model(self.model).config
        if getattr(model_config, "num_experts", 0):
            self.router_load = RouterLoad(model_config)

    def place(self, model: torch.nn.Module) -> GranularOffload | None:
        """Granular offload applied to the delinked `model` (`apply_offload`, re-selecting its blocks), or None."""
        return apply_offload(model, self.offload_args, self.accelerator, self.activation_bytes)

    def shard_on_meta(self, model: torch.nn.Module) -> torch.nn.Module:
        """FSDP2 on the meta-device `model` as `accelerator.prepare` applies it (Accelerate's `fsdp2_prepare_model`
        with the plugin's wrapping, then `gather_shared_once`), its local shards allocated on the device (`prepare`
        takes the sharded model as it is). `fsdp_cpu_ram_efficient_loading` (the first process loads the weights, the
        others receive them) is off meanwhile: there are no weights to load, each process initialises its shards."""
        from accelerate.utils.fsdp_utils import fsdp2_prepare_model

        plugin = self.accelerator.state.fsdp_plugin
        efficient, plugin.cpu_ram_efficient_loading = plugin.cpu_ram_efficient_loading, False
        try:
            model = gather_shared_once(fsdp2_prepare_model(self.accelerator, model))
        finally:
            plugin.cpu_ram_efficient_loading = efficient
        return model.to_empty(device=self.accelerator.device)

    def shape_model(self, model: torch.nn.Module) -> None:
        """What the run changes in how the model computes, from outside it: compiled blocks (`compile`, before
        sharding, as torchtitan orders it; the compiled forward is found at each call) and the loss from the hidden
        states (`loss_kernel`: the model's `loss_from_hidden_states` hook, inside its forward, so DDP's and FSDP2's
        root hooks run around it). Applied to the first model and to the model of every delink."""
        compute = self.compute
        if compute.compile:
            compile_blocks(model, compute.compile_backend)
        if compute.loss_kernel != "plain":
            device = self.accelerator.device.type
            if compute.loss_kernel == "liger" and device != "cuda":
                raise ValueError(f"loss_kernel: liger runs on CUDA, this run computes on {device}; use chunked or auto")
            model.loss_from_hidden_states = HeadLoss(compute.loss_kernel)

    @property
    def checkpoint_format(self) -> str:
        """auto: DCP for several processes or asynchronous saves, where it runs (not under granular offload or
        DeepSpeed ZeRO-1/2), so that another layout can resume them; Accelerate's format otherwise."""
        if self.format_asked != "auto":
            return self.format_asked
        deepspeed = self.accelerator.distributed_type == DistributedType.DEEPSPEED
        runs = self.offload_args.offload is None and not (deepspeed and zero3_config(self.accelerator) is None)
        wanted = self.accelerator.num_processes > 1 or self.checkpoint_async
        return "dcp" if runs and wanted else "accelerate"

    def check_dcp(self) -> None:
        """DCP checkpoints (`resume.dcp`) hold a torch optimizer's state by parameter name: one process, DDP,
        FSDP2 and DeepSpeed ZeRO-3 (whose partitions are saved and loaded one whole parameter at a time); granular
        offload's and ZeRO-1/2's optimizers keep Accelerate's format."""
        deepspeed = self.accelerator.distributed_type == DistributedType.DEEPSPEED
        if self.offload_args.offload is not None or (deepspeed and zero3_config(self.accelerator) is None):
            raise ValueError(
                "checkpoint_format: dcp checkpoints are for one process, DDP, FSDP2, DeepSpeed ZeRO-3 and pipelines; "
                "granular offload and DeepSpeed ZeRO-1/2 save and resume with checkpoint_format accelerate"
            )

    def load(self, checkpoint: Path, state: TrainState) -> None:
        if is_dcp_checkpoint(checkpoint):
            self.check_dcp()
        with loading_checkpoint(self.accelerator, checkpoint):
            if is_dcp_checkpoint(checkpoint) and zero3_config(self.accelerator) is not None:
                load_zero3_state(checkpoint, self.model)  # the DeepSpeed engine's partitions, from any layout
            elif is_dcp_checkpoint(checkpoint):  # saved by any layout: resharded to this one
                load_model_state(checkpoint, self.model, self.optimizer.optimizer)
            else:
                self.accelerator.load_state(checkpoint)

    def forward_backward(self, input_ids: torch.Tensor) -> torch.Tensor:
        extra = {"output_router_logits": True} if self.router_load is not None else {}
        with self.accelerator.accumulate(self.model):
            # No KV cache in training: its update would build one (and, compiled, specialise each block on its depth).
            outputs = self.model(input_ids=input_ids, labels=input_ids, use_cache=False, **extra)
            loss = outputs.loss
            self.accelerator.backward(loss)
        if self.router_load is not None:
            self.router_load.add(outputs)
        return loss.detach().float()

    def mean_loss(self, losses: list[torch.Tensor], signum: int) -> tuple[float, int]:
        device = self.accelerator.device
        signal = torch.tensor(float(signum), device=device)
        gathered = self.accelerator.gather(torch.stack([torch.stack(losses).mean(), signal]))
        return gathered[0::2].mean().item(), int(gathered[1::2].max().item())

    def optimizer_step(self) -> torch.Tensor | None:
        # The last accumulate() synchronised the gradients: clip, then step.
        max_norm = self.max_grad_norm
        if max_norm and self.offload is not None:  # offloaded gradients' norms were taken as they left the device
            self.accelerator.unscale_gradients()  # fp16's loss scale (changed gradients are measured again)
            norm = self.offload.clip_grad_norm_(self.model.parameters(), max_norm)
        else:
            norm = self.accelerator.clip_grad_norm_(self.model.parameters(), max_norm) if max_norm else None
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def step_measures(self) -> dict:
        return self.router_load.pop(self.accelerator) if self.router_load is not None else {}

    def delink(self, num_unique_layers: int | None) -> dict:
        self.model, self.optimizer, self.offload = delink_in_training(
            self.accelerator,
            self.model,
            self.optimizer,
            num_unique_layers,
            self.optimizer_carry,
            self.optimizer_factory,
            self.offload,
            self.place,
        )
        self.shape_model(self.accelerator.unwrap_model(self.model))  # FSDP2 and DeepSpeed build a new model
        return {"offloaded_blocks": self.offload.layers} if self.offload is not None else {}

    def delink_note(self, rules: str) -> str:
        offloaded = f"; offload: blocks {self.offload.layers} in CPU memory" if self.offload is not None else ""
        return super().delink_note(rules) + offloaded

    @torch.no_grad()
    def evaluate(self, blocks, count: int) -> float:
        return evaluate(self.accelerator, self.model, blocks, count, self.compute.per_device_batch_size)

    def weights(self):
        if self.offload is not None:
            self.offload.synchronize()  # the offloaded blocks' optimizer steps may still run (overlap_step)
        return self.model.parameters()

    def training_state(self):
        if self.offload is not None:
            self.offload.synchronize()
        return [self.model.parameters(), self.optimizer.state]

    def save_model(self, directory: Path, tokenizer: PreTrainedTokenizerBase) -> None:
        """`pseudo/` or `real/`. Under FSDP2 each process writes its shards (`save_model_from_shards`), no process
        gathers the model (a MoE model's experts, sharded by expert, are written one expert per tensor under Mixtral's
        names by the process that holds it); under DeepSpeed ZeRO-3 the processes gather one parameter at a time and
        each keeps and writes its share of the whole tensors (`zero3_owned_state`; a MoE model's experts tensor goes
        whole to one process, which writes it one expert per tensor), so none holds the model whole either; under
        ZeRO-1/2, DDP and one process the main process writes the state dict it holds whole anyway (`save_model`)."""
        model = self.accelerator.unwrap_model(self.model)
        if self.accelerator.is_fsdp2 or zero3_config(self.accelerator) is not None:
            save_model_from_shards(
                model,
                directory,
                # FSDP2: DTensors, this process's shards; ZeRO-3: this process's share of the whole tensors
                model.state_dict() if self.accelerator.is_fsdp2 else zero3_owned_state(model),
                tokenizer=tokenizer,
                remote_code=self.remote_code,
                overwrite=True,
                progress=False,
            )
            return
        save_model(self.accelerator, model, tokenizer, directory, self.remote_code)

    def write_checkpoint(self, folder: Path, training_state) -> None:
        """DCP: every process its shards, under the model's names; else Accelerate's `save_state`."""
        if self.checkpoint_format != "dcp":
            self.accelerator.save_state(folder)
        elif zero3_config(self.accelerator) is not None:  # each process its share of the whole tensors
            save_dcp(folder, zero3_training_state(self.model))
        else:
            save_dcp(folder, model_state(self.model, self.optimizer.optimizer))


@torch.no_grad()
def evaluate(accelerator: Accelerator, model, blocks, eval_blocks: int, batch_size: int) -> float:
    """Mean loss over `eval_blocks` validation blocks spread evenly over the split, each process taking every n-th, in
    batches of `batch_size`.

    Every process runs the same number of forward passes: under FSDP2 and ZeRO-3 each forward gathers the parameters
    with all processes, so one that stopped early would leave the others waiting. A process with fewer blocks repeats
    its last batch and drops that loss.
    """
    # The unwrapped model (mixed-precision wrapper kept): DDP's forward would add collectives of its own.
    model = accelerator.unwrap_model(model).eval()
    count = min(len(blocks), eval_blocks)
    # Evenly spaced rather than the first ones: consecutive blocks come from the same few documents.
    chosen = [index * len(blocks) // count for index in range(count)]
    mine = chosen[accelerator.process_index :: accelerator.num_processes]
    size = batch_size
    batches = [mine[start : start + size] for start in range(0, len(mine), size)]
    most = math.ceil(len(chosen[:: accelerator.num_processes]) / size)  # the first process has the most blocks
    padding = [batches[-1] if batches else chosen[:1]] * (most - len(batches))
    total = torch.zeros((), device=accelerator.device)
    for index, indices in enumerate(batches + padding):
        ids = blocks[indices]["input_ids"].to(accelerator.device)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss.float()
        if index < len(batches):
            total += loss * len(ids)
    model.train()
    return accelerator.reduce(total, reduction="sum").item() / count


def check_gpu_per_process(cpu: bool) -> None:
    """Raise `ValueError` for a CPU run whose process of local rank r sees fewer than r + 1 GPUs.

    Accelerate's barriers call torch's `barrier(device_ids=[r])`, which allocates on the machine's accelerator, so a
    CPU process on a machine with CUDA still needs `cuda:r`: with fewer GPUs than processes the run would fail with
    "CUDA error: invalid device ordinal", then gloo's "connection closed by peer". (A GPU run is left to Accelerate,
    which maps rank r to `cuda:r % count`: with one visible GPU per process, as SLURM sets it, that is right.)
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "-1"))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if cpu and 0 < gpus <= local_rank:
        processes = os.environ.get("LOCAL_WORLD_SIZE", f"more than {local_rank}")
        raise ValueError(
            f"cpu: this CPU run has {processes} processes on a machine whose {gpus} GPU(s) they can see, and a "
            f"CPU process still needs cuda:{local_rank} for its barriers: hide the GPUs "
            "(CUDA_VISIBLE_DEVICES= accelerate launch ..., or accelerate launch --cpu)"
        )


def zero3_config(accelerator: Accelerator) -> dict | None:
    """The DeepSpeed configuration of a ZeRO-3 run, None for any other: the one Accelerate's DeepSpeed plugin hands
    transformers for `deepspeed.zero.Init` (`dschf`: the batch sizes' "auto" resolved as Accelerate does before
    `prepare`)."""
    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        return None
    plugin = accelerator.state.deepspeed_plugin
    return plugin.dschf.config if plugin.zero_stage == 3 else None


def build_without_zero_init() -> None:
    """Let transformers build models on the meta device under ZeRO-3: the engine partitions them itself
    (`materialize_zero3`, and `delink_deepspeed` at a delink).

    Accelerate's DeepSpeed plugin registers its configuration with transformers whatever `zero3_init_flag` says, and
    with a ZeRO-3 configuration there `from_config` builds the model inside `deepspeed.zero.Init` and initialises
    it gathered, which fails on the meta device (`build_model(meta=True)`: "Cannot copy out of meta tensor; no data!").
    The registration is dropped (`unset_hf_deepspeed_config`); Accelerate itself reads its plugin, not it."""
    from transformers.integrations import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()


def fill_deepspeed_batch_size(accelerator: Accelerator, per_device_batch_size: int) -> None:
    """DeepSpeed needs its micro-batch size before `prepare`; Accelerate reads it from a DataLoader, which this loop
    does not use, so an "auto" value in the DeepSpeed config is set from `per_device_batch_size`."""
    config = accelerator.state.deepspeed_plugin.deepspeed_config
    if config.get("train_micro_batch_size_per_gpu", "auto") == "auto":
        config["train_micro_batch_size_per_gpu"] = per_device_batch_size
