"""The trainer's pipelined run (`pipeline_parallel_size > 1`), called by `hf_p2r.training.train.train`.

The same story as the one-process loop (build -> pseudo steps -> delink -> real steps -> save), on a model split into
stages (`build_pipeline`): every process builds the same seeded model and keeps its stages; every process of a
pipeline reads the same batch (the pipeline splits it into `num_microbatches`), and with `data_parallel_size` > 1
each pipeline reads its own `per_device_batch_size` blocks of the step's batch (`pipeline_mesh`: pipelines x
data-parallel replicas, replicated or FSDP2-sharded stages); the last stages' mean loss is shared by one collective
with the stop signal. The delink is `delink_pipeline` (each stage its own blocks, optimizer state carried per
`optimizer_carry`); a checkpoint is one file per process beside `trainer_state.json` (a sharded stage's file holds
its shards); `pseudo/` and `real/` are ordinary checkpoints written by the first process from the gathered weights.
The validation loss is computed by each pipeline's first process on the gathered model (cheap at the sizes a CPU
pipeline runs; a pipelined evaluation is future work).

Launch with `torchrun --nproc-per-node 2 scripts/train.py --config ... --pipeline_parallel_size 2` or
`accelerate launch --num_processes 2 scripts/train.py ...` (Accelerate only starts the processes and the group here).
"""

import math
import time
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch import nn

from ..checkpoint import save_model as write_model_folder
from ..models.p2r import P2RForCausalLM
from ..training.checkpointing import (
    TrainState,
    loading_checkpoint,
    read_state,
    resolve_checkpoint,
    save_checkpoint,
)
from ..training.config import TrainConfig
from ..training.data import BlockOrder, build_blocks, load_tokenizer
from ..training.metrics import METRICS_FILE
from ..training.optim import build_optimizer, learning_rate_at, set_learning_rate, shared_lr_scales
from .pipeline import (
    Pipeline,
    build_pipeline,
    delink_pipeline,
    gather_state_dict,
    load_pipeline_state,
    pipeline_mesh,
    pipeline_model_config,
    pipeline_state,
)


def train_pipelined(config: TrainConfig) -> int:
    """Run `config` with `pipeline_parallel_size` stages; returns the exit code (as `train`)."""
    from ..training.train import (
        StepLog,
        _record,
        _say,
        _StopOnSignal,
        build_model,
        check_finite,
        check_output_dir,
        finish_run,
        non_finite_loss,
        prepare_output_dir,
    )

    started_run = time.perf_counter()
    args = config.train
    output_dir, depth = Path(args.output_dir), config.model.num_hidden_layers
    delink_steps = [step for step, _ in config.delink_schedule()]

    # Build.
    cpu = args.cpu if args.cpu is not None else not torch.accelerator.is_available()
    joined = dist.is_initialized()  # a caller's process group (tests) is left to the caller at the end
    accelerator = Accelerator(cpu=cpu, mixed_precision="no")
    if accelerator.num_processes != args.pipeline_parallel_size * args.data_parallel_size:
        raise ValueError(
            f"pipeline_parallel_size: {args.pipeline_parallel_size} stages x data_parallel_size "
            f"{args.data_parallel_size} need as many processes, the launcher started {accelerator.num_processes}"
        )
    if config.model.num_experts:
        raise ValueError("num_experts: mixture-of-experts models are not supported with pipeline_parallel_size > 1")
    checkpoint = resolve_checkpoint(output_dir, args.resume_from_checkpoint) if args.resume_from_checkpoint else None
    state = read_state(checkpoint, config) if checkpoint else TrainState(num_blocks=config.initial_blocks())
    existing = check_output_dir(output_dir, config, resumed=checkpoint is not None)

    set_seed(args.seed)
    tokenizer = load_tokenizer(config.data.tokenizer_name)
    with accelerator.main_process_first():
        train_blocks, validation_blocks = build_blocks(config.data, tokenizer, args.seed)
    model = build_model(config, tokenizer, config.initial_blocks())
    data_parallel = args.data_parallel_size
    mesh = (
        pipeline_mesh(args.pipeline_parallel_size, data_parallel, accelerator.device.type)
        if data_parallel > 1
        else None
    )

    pipeline, model_scales = None, shared_lr_scales(model, args)

    def new_optimizer(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        # `shared_lr_scale: depth`: a shared block's rate over the depths of the whole model running it; until the
        # pipeline exists (2BW makes its optimizer while it is built) the stages hold the model's own parameters.
        depth_scaled = args.shared_lr_scale == "depth" and pipeline is not None
        scales = pipeline.shared_lr_scales() if depth_scaled else model_scales if pipeline is None else {}
        return build_optimizer(nn.ParameterList(params), args, lr_scales=scales)

    pipeline = build_pipeline(
        model,
        schedule=args.pipeline_schedule,
        num_microbatches=args.num_microbatches or args.pipeline_parallel_size,
        split=args.pipeline_split,
        seq_len=config.data.block_size,
        device=accelerator.device,
        mesh=mesh,
        shard=args.data_parallel_shard,
        optimizer_factory=new_optimizer,
        max_grad_norm=args.max_grad_norm or None,
    )
    _say(accelerator, pipeline.explanation)
    del model  # each process keeps its stages' pieces
    two_bw = args.pipeline_schedule == "2bw"
    optimizer = pipeline.schedule.optimizer if two_bw else new_optimizer(pipeline.parameters())
    if checkpoint:
        part = checkpoint / f"stage-{dist.get_rank()}.pt"
        if not part.is_file():
            raise ValueError(
                f"resume_from_checkpoint: {part} is missing: the checkpoint was saved by fewer processes (resume "
                "with its pipeline_parallel_size and data_parallel_size)"
            )
        if state.num_blocks > config.initial_blocks():  # the layout it saved: delinked (partly or fully)
            target = state.num_blocks if state.num_blocks < depth else None
            optimizer = delink_pipeline(pipeline, optimizer, new_optimizer, args.optimizer_carry, target)
        with loading_checkpoint(accelerator, checkpoint):
            load_pipeline_state(pipeline, optimizer, torch.load(part, weights_only=True))
        optimizer = pipeline.schedule.optimizer if two_bw else optimizer
        _say(accelerator, f"resumed from {checkpoint} (step {state.step}, {state.num_blocks} blocks)")
    prepare_output_dir(accelerator, output_dir, config, state if checkpoint else None, existing)

    order = BlockOrder(len(train_blocks), args.seed)
    batch_size = args.per_device_batch_size  # per pipeline; the step's batch is data_parallel_size times that
    mine = slice(pipeline.data_rank * batch_size, (pipeline.data_rank + 1) * batch_size)
    tokens_per_step = batch_size * data_parallel * config.data.block_size
    metrics_path = output_dir / METRICS_FILE
    log = StepLog(state, args, tokens_per_step, accelerator.device, accelerator.is_main_process, depth)
    progress = log.progress
    if checkpoint is None and args.eval_steps:
        _record(accelerator, metrics_path, state, depth, val_loss=_evaluate(pipeline, validation_blocks, args))

    # The loop: each pass delinks if the delink is due at this step, then makes one optimizer step.
    with _StopOnSignal() as stop, progress:  # the bar ends its line before any error is told
        while True:
            target = config.blocks_at(state.step)
            if state.num_blocks < target:
                if target == depth:
                    check_finite(accelerator, output_dir, state, depth, "pseudo/", pipeline_state(pipeline, None))
                    _save_model(accelerator, pipeline, tokenizer, output_dir / "pseudo", args.remote_code)
                optimizer = delink_pipeline(
                    pipeline, optimizer, new_optimizer, args.optimizer_carry, target if target < depth else None
                )
                before, state.num_blocks = state.num_blocks, target
                _record(accelerator, metrics_path, state, depth, event="delink", num_blocks_before=before)
                _say(
                    accelerator,
                    f"step {state.step}: delinked {before} -> {target} blocks in every stage "
                    f"(optimizer_carry={args.optimizer_carry})",
                )
                progress.set_description(state.stage(depth))
            if state.step >= args.total_steps:  # (read_state refuses a checkpoint past the end)
                break

            started = time.perf_counter()
            lr = learning_rate_at(state.step, args, delink_steps)
            # 2BW steps its optimizer inside `step` (the previous batch's update): it takes this rate.
            shared_lr = set_learning_rate(optimizer, lr)
            indices = order.indices(state.blocks_consumed, batch_size * data_parallel)[mine]
            batch = train_blocks[indices]["input_ids"].to(accelerator.device)
            state.blocks_consumed += batch_size * data_parallel
            loss = pipeline.step(batch)
            grad_norm = None
            if not two_bw:
                if args.max_grad_norm:
                    grad_norm = pipeline.clip_grad_norm_(args.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            # Every process gets the last stages' mean loss (over the data-parallel pipelines) and the same stop.
            shared = torch.tensor([0.0 if loss is None else loss.item(), float(loss is not None)])
            dist.all_reduce(shared)
            signal = torch.tensor(float(stop.signum))
            dist.all_reduce(signal, op=dist.ReduceOp.MAX)
            loss_value, signum = shared[0].item() / shared[1].item(), int(signal.item())
            if not math.isfinite(loss_value):
                raise non_finite_loss(loss_value, output_dir, state, depth)
            log.step(loss_value, lr, time.perf_counter() - started)

            final = state.step == args.total_steps
            measure = log.measures(final, lr, shared_lr, grad_norm)
            if (args.eval_steps and state.step % args.eval_steps == 0) or state.step in delink_steps or final:
                measure["val_loss"] = _evaluate(pipeline, validation_blocks, args)
            if measure:
                _record(accelerator, metrics_path, state, depth, **measure)
            if (args.save_steps and state.step % args.save_steps == 0) or final or signum:
                part = pipeline_state(pipeline, optimizer)
                check_finite(accelerator, output_dir, state, depth, "checkpoint", part)
                _save_checkpoint(accelerator, output_dir, state, config, part)
            if signum and not final:
                progress.close()
                _say(
                    accelerator,
                    f"stopped by signal {signum} after step {state.step}; checkpoint saved: resume "
                    "with --resume_from_checkpoint latest",
                )
                return 128 + signum
    progress.close()

    _save_model(accelerator, pipeline, tokenizer, output_dir / "real", args.remote_code)
    if accelerator.is_main_process:
        layout = f"{args.pipeline_schedule} x{args.pipeline_parallel_size}"
        title = f"{output_dir.name}: L={depth}, k={config.initial_blocks()}, {layout}"
        finish_run(output_dir, title, time.perf_counter() - started_run, args.remote_code)
    if not joined:
        accelerator.end_training()
    return 0


def _gathered_model(pipeline: Pipeline) -> P2RForCausalLM | None:
    """The whole model on the first process (None elsewhere): a collective."""
    pipeline.drain()
    weights = gather_state_dict(pipeline)
    if weights is None:
        return None
    config = pipeline_model_config(pipeline)
    if config.tie_word_embeddings:  # the head is gathered under the embeddings' name
        weights.setdefault("lm_head.weight", weights["model.embed_tokens.weight"])
    model = P2RForCausalLM(config)
    model.load_state_dict(weights)
    return model.eval()


@torch.no_grad()
def _evaluate(pipeline: Pipeline, blocks, args) -> float:
    """Mean validation loss over `eval_blocks` blocks spread over the split, on the gathered model (first process),
    shared with every process."""
    model = _gathered_model(pipeline)
    value = torch.zeros(1)
    if model is not None:
        count = min(len(blocks), args.eval_blocks)
        chosen = [index * len(blocks) // count for index in range(count)]
        total = 0.0
        for start in range(0, count, args.per_device_batch_size):
            ids = blocks[chosen[start : start + args.per_device_batch_size]]["input_ids"]
            total += model(input_ids=ids, labels=ids).loss.item() * len(ids)
        value[0] = total / count
    dist.broadcast(value, src=dist.get_process_group_ranks(pipeline.group)[0], group=pipeline.group)
    return value.item()


def _save_model(accelerator: Accelerator, pipeline: Pipeline, tokenizer, directory: Path, remote_code: bool) -> None:
    """`pseudo/` or `real/`: one ordinary checkpoint, written by the first process from the gathered weights."""
    pipeline.drain()
    weights = gather_state_dict(pipeline)
    if weights is not None and accelerator.is_main_process:  # the first pipeline's first process
        with torch.device("meta"):
            skeleton = P2RForCausalLM(pipeline_model_config(pipeline))
        write_model_folder(
            skeleton,
            directory,
            state_dict=weights,
            remote_code=remote_code,
            tokenizer=tokenizer,
            overwrite=True,
            progress=False,
        )
    accelerator.wait_for_everyone()


def _save_checkpoint(accelerator, output_dir: Path, state: TrainState, config: TrainConfig, part: dict):
    """`checkpoint-{step}/`: `stage-{rank}.pt` per process (`part`: its `pipeline_state`) and `trainer_state.json`,
    atomically."""
    name = f"stage-{dist.get_rank()}.pt"
    return save_checkpoint(accelerator, output_dir, state, config, write=lambda folder: torch.save(part, folder / name))
