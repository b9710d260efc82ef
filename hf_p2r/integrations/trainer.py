"""`P2RTrainer`: transformers' `Trainer` that can swap its model in the middle of `train()`, for `P2RCallback`'s
delinks; `p2r_trainer(cls)` gives the same to any Trainer subclass (TRL's `SFTTrainer`).

Why a subclass: `Trainer.train` prepares the model and the optimizer once (`accelerator.prepare`: DDP, FSDP2 or
DeepSpeed wrap them) and its loop keeps that prepared model in a local variable; a callback sees neither the trainer
nor that variable. What the subclass changes, and nothing else:

- `delink` (called by `P2RCallback` at a scheduled step): the model is delinked through hf-p2r's own
  `hf_p2r.training.delink.delink_in_training` (one process and DDP: in place, then wrapped again; FSDP2: shard by
  shard; DeepSpeed: a new engine, ZeRO-3 straight into the new partitions), the new optimizer is the one `Trainer`
  builds (`create_optimizer`: `args.optim`, its weight-decay groups) with its state carried by the callback's `carry`
  (`hf_p2r.training.carry`), and the trainer's model, optimizer and scheduler (the same schedule, at the same step,
  now driving the new optimizer) are replaced where `Trainer` keeps them.
- `training_step`, `_clip_grad_norm`, `_get_grad_norm`: use the trainer's current model, not the one the loop
  prepared at the start (after a delink the loop still holds that one: its `no_sync` and `zero_grad` are taken on the
  current model here, for DDP's gradient accumulation and FSDP2's new model).
- `train(resume_from_checkpoint=...)`: the model you pass is delinked to the checkpoint's stage before `Trainer` loads
  the checkpoint into it (the stage: `trainer_state.json`'s P2RCallback state, else the checkpoint's config.json), so
  a checkpoint from either side of a delink resumes.
- `create_scheduler`: with `lr_after_delink="rewarm"`, the schedule's factor is multiplied by the rewarm
  (`hf_p2r.training.optim.rewarm_factor`, hf-p2r's own trainer's rule).
- `log`: every record carries `p2r/num_blocks` (the stage), so `report_to` integrations see it beside the loss.
- `create_model_card`: `push_to_hub` publishes hf-p2r's model card (`hf_p2r.checkpoint.card`) for the model it saved.

What it refuses, in one line when `train()` starts: FSDP1 and Megatron-LM (`check_delink_supported`), carries other
than `reset` under DeepSpeed (its ZeRO partitions hold no per-parameter state), a DeepSpeed configuration that owns
the optimizer or scheduler, an optimizer instance passed as `optimizers=` (it cannot be rebuilt for the new
parameters: pass `optimizer_cls_and_kwargs`), `model_init`, `load_best_model_at_end` (the best checkpoint may be of
an earlier stage), nn.DataParallel (several GPUs in one process: use `accelerate launch`), models sharded by
transformers at load time, `torch_compile`, and a model whose forward was patched on the instance (TRL's fused head)
under FSDP2 or DeepSpeed, which build a new model object at each delink.
"""

import contextlib
import functools
import json
import os
from pathlib import Path

import torch
from accelerate.utils import DistributedType
from torch.optim.lr_scheduler import LambdaLR
from transformers import Trainer
from transformers.trainer_utils import get_last_checkpoint

from ..checkpoint.card import render_model_card
from ..models.p2r.sharing_p2r import DelinkPlan
from ..training.delink import check_delink_supported, delink_in_training
from ..training.optim import rewarm_factor
from .callback import NUM_BLOCKS, NUM_HIDDEN_LAYERS, P2RCallback, event_plan

CARD_NAME = "README.md"


class P2RTrainerMixin:
    """What `P2RTrainer` adds to a Trainer class (see the module docstring); `p2r_trainer(cls)` puts it in front of
    `cls`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.p2r_user_optimizer = self.optimizer is not None  # an instance given as optimizers= (refused)
        self.p2r_cleared_step = None  # the step whose gradients `training_step` cleared (FSDP2, after a delink)

    # --- the callback --------------------------------------------------------------------------------------------
    def p2r_callback(self) -> P2RCallback | None:
        """This trainer's P2RCallback (None without one), bound to it. Looked up each time: a resume with
        `restore_callback_states_from_checkpoint` replaces the callback by one rebuilt from the checkpoint."""
        found = [callback for callback in self.callback_handler.callbacks if isinstance(callback, P2RCallback)]
        if len(found) > 1:
            raise ValueError(f"callbacks: one P2RCallback per trainer, got {len(found)}")
        if found:
            found[0].trainer = self
        return found[0] if found else None

    # --- train, resume ---------------------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        callback = self.p2r_callback()
        if callback is not None:
            callback.events_done = None  # found again when training begins (or by the resume, below)
            self.check_p2r(callback)
            if resume_from_checkpoint:
                if resume_from_checkpoint is True:
                    resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)  # None: Trainer says so
                if resume_from_checkpoint is not None:
                    self.rebuild_for_checkpoint(str(resume_from_checkpoint), callback)
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def check_p2r(self, callback: P2RCallback) -> None:
        """Refuse up front, in one line, what the delinks cannot run under (see the module docstring)."""
        args, accelerator = self.args, self.accelerator
        refused = [
            (self.model_init is not None, "model_init: P2RTrainer delinks the model you pass as model="),
            (
                self.p2r_user_optimizer,
                "optimizers: an optimizer instance cannot be rebuilt for the delinked model's parameters; leave it "
                "to Trainer (args.optim) or pass optimizer_cls_and_kwargs",
            ),
            (
                args.load_best_model_at_end,
                "load_best_model_at_end: the best checkpoint may hold a model of an earlier stage (pseudo); not "
                "supported with P2RCallback",
            ),
            (args.n_gpu > 1, "several GPUs in one process (nn.DataParallel): launch one process per GPU"),
            (
                getattr(self, "is_distributed_loading_by_transformers", False),
                "a model sharded by transformers at load time (distributed_config/tp_plan): delinks run on models "
                "prepared by Accelerate",
            ),
            (args.torch_compile, "torch_compile: not supported with P2RCallback (the model is prepared again)"),
            (
                args.restore_callback_states_from_checkpoint,
                "restore_callback_states_from_checkpoint: P2RTrainer restores P2RCallback's stage from the checkpoint "
                "itself, and a callback rebuilt by Trainer would not be bound to it; leave it False",
            ),
        ]
        for bad, message in refused:
            if bad:
                raise ValueError(message)
        if accelerator.distributed_type == DistributedType.DEEPSPEED:
            if callback.carry != "reset":
                raise ValueError(
                    f"carry: under DeepSpeed the optimizer state lives in flat ZeRO partitions with no per-parameter "
                    f"carry; use P2RCallback(carry='reset') (got {callback.carry!r}), or FSDP2, which carries it"
                )
            config = accelerator.state.deepspeed_plugin.deepspeed_config
            owned = [name for name in ("optimizer", "scheduler") if name in config]
            if owned:
                raise ValueError(
                    f"deepspeed: the DeepSpeed configuration's {' and '.join(owned)} section(s) leave the optimizer "
                    "to DeepSpeed, which P2RTrainer must rebuild at each delink; remove them (Trainer builds both)"
                )
        check_delink_supported(accelerator, callback.carry)
        new_object = accelerator.is_fsdp2 or accelerator.distributed_type == DistributedType.DEEPSPEED
        if new_object and "forward" in vars(self.model):
            raise ValueError(
                "model: its forward is patched on the instance (TRL's fused LM head, for one), and under "
                f"{accelerator.distributed_type.value} each delink builds a new model object without it; run this "
                "trainer on one process or DDP"
            )
        callback.check(self.model, 0)  # the one-line "not a P2R model" refusal, and the schedule against the model

    def rebuild_for_checkpoint(self, checkpoint: str, callback: P2RCallback) -> None:
        """Delink or grow the model (not yet prepared) to the stage `checkpoint` was saved at, so that Trainer loads
        the checkpoint into a model of its shape: the schedule's events up to that stage, replayed (the same
        mappings), and the callback told how many are done; a stage the schedule does not pass through (a
        checkpoint of another run) by one delink to its depth and blocks."""
        depth, blocks = checkpoint_stage(checkpoint)
        model, config = self.model, self.model.config
        now = (config.num_hidden_layers, config.num_blocks)
        if depth < now[0] or blocks < now[1]:
            raise ValueError(
                f"resume_from_checkpoint: {checkpoint} holds a model with {depth} layers and {blocks} blocks, this "
                f"trainer's model has {now[0]} layers and {now[1]} blocks: give the trainer the model the run started "
                "from"
            )
        stages = callback.stages(model)
        done = max((n for n, stage in enumerate([now, *stages]) if stage == (depth, blocks)), default=None)
        if (depth, blocks) == now and done is not None:
            callback.events_done = done
            return
        if any(hasattr(param, "ds_id") for param in model.parameters()):
            raise ValueError(
                "resume_from_checkpoint: the model is partitioned by deepspeed.zero.Init and cannot be delinked "
                "before DeepSpeed prepares it; build it outside zero.Init (P2RForCausalLM(config))"
            )
        if done is None:
            try:
                model.delink(blocks, num_hidden_layers=depth)
            except ValueError as error:
                raise ValueError(f"resume_from_checkpoint: {checkpoint}: {error}") from None
            return
        for event, plan in zip(callback.events[:done], callback.plans(model)):
            if plan is not None:
                model.delink(event_plan(event, model.config))
        callback.events_done = done

    # --- the delink ------------------------------------------------------------------------------------------------
    def delink(self, num_unique_layers: int | DelinkPlan | None, carry: str) -> None:
        """Delink the prepared model to `num_unique_layers` blocks (None: the real model; a `DelinkPlan`: that delink,
        depth growth included) between two optimizer steps, and rebuild the optimizer (`create_optimizer`, its state
        carried by `carry`); the scheduler goes on at its step with the new optimizer."""
        accelerator, old_optimizer = self.accelerator, self.optimizer
        rates = [(group["lr"], group.get("initial_lr")) for group in old_optimizer.param_groups]

        def trainers_optimizer(model: torch.nn.Module, offload: None) -> torch.optim.Optimizer:
            self.optimizer = None  # create_optimizer builds one only when there is none
            return self.create_optimizer(model)

        # (no granular offload here: the delinked model is placed as Trainer placed the first)
        model, optimizer, _ = delink_in_training(
            accelerator, self.model_wrapped, old_optimizer, num_unique_layers, carry, trainers_optimizer
        )
        if len(optimizer.param_groups) != len(rates):
            raise RuntimeError(
                f"the delinked model's optimizer has {len(optimizer.param_groups)} parameter groups, the old one "
                f"{len(rates)}: the learning-rate scheduler cannot follow it"
            )
        for group, (lr, initial_lr) in zip(optimizer.param_groups, rates):
            group["lr"] = lr  # the rate the scheduler set for this step
            if initial_lr is not None:
                group["initial_lr"] = initial_lr
        for scheduler in (self.lr_scheduler, *getattr(self.lr_scheduler, "_schedulers", ())):
            scheduler.optimizer = optimizer
        self.model_wrapped, self.optimizer = model, optimizer
        self.model = model if self.is_fsdp_enabled else accelerator.unwrap_model(model)
        if self.is_deepspeed_enabled:
            self.deepspeed = model
        for name in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, name, getattr(self, name))

    # --- the step, after a delink -------------------------------------------------------------------------------
    def training_step(self, model, inputs, num_items_in_batch=None):
        current = self.model_wrapped
        if model is current:
            return super().training_step(model, inputs, num_items_in_batch)
        # The loop still holds the model it prepared at the start: what it does with that one is done here with the
        # current one. FSDP2 built a new model, whose gradients the loop's zero_grad misses: cleared at each step's
        # first micro-batch. Gradient accumulation skips the all-reduce of all but the last micro-batch.
        if self.is_fsdp_enabled and self.p2r_cleared_step != self.state.global_step:
            current.zero_grad(set_to_none=True)
            self.p2r_cleared_step = self.state.global_step
        accelerator = self.accelerator
        defer = not (
            accelerator.sync_gradients
            or accelerator.distributed_type == DistributedType.DEEPSPEED
            or accelerator.gradient_state.plugin_kwargs.get("sync_each_batch", False)
        )
        with accelerator.no_sync(model=current) if defer else contextlib.nullcontext():
            return super().training_step(current, inputs, num_items_in_batch)

    def _clip_grad_norm(self, model):
        return super()._clip_grad_norm(self.model_wrapped)

    def _get_grad_norm(self, model, grad_norm=None):
        return super()._get_grad_norm(self.model_wrapped, grad_norm=grad_norm)

    # --- schedule, logs, card ----------------------------------------------------------------------------------------
    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None):
        created = self.lr_scheduler is None
        scheduler = super().create_scheduler(num_training_steps, optimizer)
        callback = self.p2r_callback()  # (bound again after a resume that rebuilt the callback)
        if callback is not None and callback.lr_after_delink == "rewarm" and created:
            if not isinstance(scheduler, LambdaLR):
                raise ValueError(
                    f"lr_after_delink: rewarm multiplies a LambdaLR schedule's factor, this run's scheduler is "
                    f"{type(scheduler).__name__} (lr_scheduler_type {self.args.lr_scheduler_type}); use continue"
                )
            steps, length = callback.delink_steps, callback.rewarm_steps
            scheduler.lr_lambdas = [rewarmed(factor, steps, length) for factor in scheduler.lr_lambdas]
        return scheduler

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        callback = self.p2r_callback()
        if callback is not None and callback.num_blocks is not None:
            logs = {**logs, NUM_HIDDEN_LAYERS: callback.num_hidden_layers, NUM_BLOCKS: callback.num_blocks}
        return super().log(logs, *args, **kwargs)

    def create_model_card(self, *args, **kwargs) -> None:
        """hf-p2r's model card (`render_model_card`) for the model saved in `output_dir` (what `push_to_hub`
        uploads), with the `tags`, `license` and `dataset` given; Trainer's own card while no model is saved there."""
        folder = Path(self.args.output_dir)
        saved = (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))
        if self.p2r_callback() is None or not saved:
            return super().create_model_card(*args, **kwargs)
        if not self.is_world_process_zero():
            return None
        model_id = self.hub_model_id or self.args.hub_model_id or folder.name
        card = render_model_card(folder, model_id=model_id)
        tags = kwargs.get("tags")
        card.data.tags = [*card.data.tags, *([tags] if isinstance(tags, str) else tags or [])]
        if kwargs.get("license"):
            card.data.license = kwargs["license"]
        if kwargs.get("dataset"):
            card.data.datasets = [kwargs["dataset"]] if isinstance(kwargs["dataset"], str) else kwargs["dataset"]
        card.save(folder / CARD_NAME)
        return None


def rewarmed(factor, delink_steps: list[int], rewarm_steps: int):
    """`factor` (a LambdaLR's function of the step) times hf-p2r's rewarm after the `delink_steps`. A plain function,
    so the scheduler's state_dict keeps nothing of it (`LambdaLR.state_dict` skips functions): a resumed run builds it
    again from the callback."""

    def rewarmed_factor(step: int) -> float:
        return factor(step) * rewarm_factor(step, delink_steps, rewarm_steps)

    return rewarmed_factor


def checkpoint_stage(checkpoint: str) -> tuple[int, int]:
    """(depth, blocks) of the model in a Trainer checkpoint: the P2RCallback state of its trainer_state.json
    (`num_hidden_layers`, `num_blocks`), else its config.json (`num_hidden_layers`; `num_unique_layers` of a pseudo
    model). `ValueError` naming the checkpoint when neither says."""
    state_file, config_file = os.path.join(checkpoint, "trainer_state.json"), os.path.join(checkpoint, "config.json")
    saved, config = {}, {}
    try:
        with open(state_file, encoding="utf-8") as file:
            state = json.load(file).get("stateful_callbacks", {}).get(P2RCallback.__name__)
        saved = (state[-1] if isinstance(state, list) else state)["attributes"]
    except (OSError, ValueError, TypeError, KeyError, IndexError, AttributeError):
        pass
    try:
        with open(config_file, encoding="utf-8") as file:
            config = json.load(file)
        config = {
            "num_hidden_layers": config["num_hidden_layers"],
            "num_blocks": config["num_unique_layers"] if config.get("share_layers") else config["num_hidden_layers"],
        }
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        config = {}
    stage = []
    for name in ("num_hidden_layers", "num_blocks"):
        value = saved.get(name) if isinstance(saved, dict) else None
        value = value if _is_count(value) else config.get(name)  # (a checkpoint of before growth: blocks only)
        if not _is_count(value):
            raise ValueError(
                f"resume_from_checkpoint: {checkpoint} does not say which stage it belongs to (no P2RCallback state "
                "in trainer_state.json, no P2R config.json)"
            )
        stage.append(value)
    return stage[0], stage[1]


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@functools.cache
def p2r_trainer(trainer_class: type[Trainer]) -> type[Trainer]:
    """`trainer_class` (a Trainer subclass, e.g. TRL's `SFTTrainer`) with `P2RTrainerMixin` in front: the same class
    for the same argument.

    ```python
    >>> from trl import SFTTrainer
    >>> trainer = p2r_trainer(SFTTrainer)(model=model, args=args, train_dataset=texts, callbacks=[P2RCallback(300)])
    ```
    """
    if not (isinstance(trainer_class, type) and issubclass(trainer_class, Trainer)):
        raise TypeError(f"p2r_trainer: expects transformers.Trainer or a subclass, got {trainer_class!r}")
    if issubclass(trainer_class, P2RTrainerMixin):
        return trainer_class
    return type(f"P2R{trainer_class.__name__}", (P2RTrainerMixin, trainer_class), {"__module__": __name__})


class P2RTrainer(P2RTrainerMixin, Trainer):
    """transformers' `Trainer` that runs `P2RCallback`'s delinks (see the module docstring).

    ```python
    >>> model = P2RForCausalLM(pseudo_config)  # or P2RForCausalLM.from_pretrained(pseudo_checkpoint)
    >>> trainer = P2RTrainer(model=model, args=args, train_dataset=blocks, callbacks=[P2RCallback(delink_at=300)])
    >>> trainer.train()
    ```
    """


__all__ = ["P2RTrainer", "P2RTrainerMixin", "checkpoint_stage", "p2r_trainer", "rewarmed"]
