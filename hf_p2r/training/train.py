"""The P2R training run, top to bottom: build -> prepare -> (resume) -> loop [pseudo steps, delink, real steps] -> save.

```python
from hf_p2r.training import parse_config, train

exit_code = train(parse_config(["--config", "configs/demo.yaml"]))
```

One loop for every way of running the model: an engine (`engines/`) owns how a step, a clip and an optimizer step, a
delink, an evaluation and a save happen (`AccelerateEngine`: one process, DDP, FSDP2, DeepSpeed, granular offload;
`PipelineEngine`: pipeline stages), and the loop reads the same for all of them.

Launch with `accelerate launch -m hf_p2r.train --config ...` (or `hf-p2r train`, or `scripts/train.py`) for one CPU,
one GPU or many (whatever `accelerate config` says). Exit codes: 0 when the schedule is done; 128 + signal number
(143 for SIGTERM, 130 for SIGINT) when a signal stopped it after saving a checkpoint; a non-finite loss, weights or
optimizer state raises `NonFiniteLossError`.

Nothing under output_dir changes until the run has built its data and model and, when resuming, loaded its checkpoint:
a bad configuration, bad data or a damaged checkpoint leaves every earlier output as it was.
"""

import dataclasses
import functools
import math
import time
from pathlib import Path

import torch
from accelerate.utils import gather_object, set_seed
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from ..config import TrainConfig
from ..distributed.materialize import materialize
from .data import BlockOrder, BlockStream, build_blocks, check_output_dir_outside_data, load_tokenizer, stream_blocks
from .engines import Engine, engine_for
from .metrics import METRICS_FILE, training_flops_per_token
from .optim import learning_rate_at, set_learning_rate
from .resume.checkpoints import (
    TrainState,
    abandon_checkpoint,
    finish_checkpoint,
    read_state,
    resolve_checkpoint,
    save_checkpoint,
)
from .run import (
    NonFiniteLossError,
    StepLog,
    StopOnSignal,
    check_finite,
    check_output_dir,
    finish_run,
    holding_output_dir,
    non_finite_loss,
    prepare_output_dir,
    say,
)


def build_model(
    config: TrainConfig,
    tokenizer: PreTrainedTokenizerBase,
    num_blocks: int,
    *,
    meta: bool = False,
    depth: int | None = None,
) -> PreTrainedModel:
    """A freshly initialised P2R model with `num_blocks` blocks (k: pseudo, L: real) at `depth` layers (default L; a
    shallow pseudo stage's fewer), in training mode: the class the Auto registry maps its config to
    (`P2RForCausalLM`, or `P2RMoeForCausalLM` when `num_experts`).

    The model is built on the meta device, then materialised in this process by the layout-independent initialisation
    (`hf_p2r.distributed.materialize`: each module by the model's `_init_weights` under a seed derived from `seed` and
    its name). With `meta` it is left on the meta device: the run's engine materialises only what its process holds
    (its stages, its FSDP2 shards), to the same values."""
    vocab_size = config.model_vocab_size(len(tokenizer))
    special_tokens = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config.p2r_config(vocab_size, num_blocks, special_tokens, depth))
    if not meta:
        materialize(model, config.compute.seed)
    if config.model.activation_checkpointing:
        model.activation_checkpointing_enable()
    return model.train()


def train(config: TrainConfig) -> int:
    """Run the schedule of `config`; returns the exit code (see the module docstring)."""
    # The model's config as transformers builds it (its activation, RoPE scaling...): refused now, in one line, before
    # the engine joins processes or the data is tokenized.
    config.p2r_config(config.model.vocab_size or 256, config.initial_blocks(), special_tokens={})
    # The engine: its Accelerator (what it cannot run is refused now), later the model it places and parallelises.
    engine = engine_for(config)
    try:
        with holding_output_dir(engine.accelerator, Path(config.checkpointing.output_dir)):  # one run per output_dir
            return run(config, engine)
    finally:
        abandon_checkpoint()  # an error's way out: a checkpoint still written in the background (checkpoint_async) ends
        engine.close()  # every way out (done, stopped by a signal, an error) releases what it built and ends the run


def run(config: TrainConfig, engine: Engine) -> int:
    """The run itself, top to bottom, on `engine`; returns the exit code."""
    stages, logging, saving, compute = config.stages, config.logging, config.checkpointing, config.compute
    started_run = time.perf_counter()
    output_dir = Path(saving.output_dir)
    depth = config.model.num_hidden_layers
    delink_steps = [step for step, _ in config.delink_schedule()]
    lr_schedule = config.lr_schedule()

    # Build: where the run starts, the data, the model (placed and parallelised by the engine); then resume.
    accelerator = engine.accelerator
    resume = saving.resume_from_checkpoint
    checkpoint = resolve_checkpoint(output_dir, resume) if resume else None
    first = TrainState(num_blocks=config.initial_blocks(), num_hidden_layers=config.initial_depth())
    state = read_state(checkpoint, config) if checkpoint else first
    state.num_hidden_layers = state.num_hidden_layers or depth  # (a checkpoint written before depth growth: L)
    resumed = dataclasses.replace(state) if checkpoint else None  # where this invocation starts (for the summary)
    existing = check_output_dir(saving, resumed=checkpoint is not None)
    check_output_dir_outside_data(config.data, output_dir)
    for note in config.notes:
        say(accelerator, note)

    set_seed(compute.seed)
    tokenizer = load_tokenizer(config.data.tokenizer_name)
    if not config.data.streaming:
        with accelerator.main_process_first():  # the main process tokenizes, the others read its cache file
            data = build_blocks(config.data, tokenizer, compute.seed)
    num_blocks = engine.model_blocks(state)
    model = build_model(config, tokenizer, num_blocks, meta=True, depth=state.num_hidden_layers)
    engine.build(model, num_blocks)  # it materialises what it holds
    if config.data.streaming:  # split by the engine's data layout (a pipelined engine's is known once built)
        data = stream_blocks(config.data, tokenizer, engine.data_rank, engine.data_size, logging.eval_blocks)
    train_blocks, validation_blocks = data
    say(accelerator, data.report)  # each split's documents and tokens
    position = data.position(compute.seed)  # the data position: the stream, or the order of the map-style blocks
    if checkpoint:  # on the data it was saved on (or, with allow_data_change, a warning)
        stream_states, index, count = state.stream_states, accelerator.process_index, accelerator.num_processes
        if warning := position.resume(stream_states, index, count, checkpoint):
            say(accelerator, warning)
        engine.load(checkpoint, state)
        say(accelerator, f"resumed from {checkpoint} (step {state.step}, {state.num_blocks} blocks)")
    prepare_output_dir(accelerator, output_dir, config.to_dict(), state if checkpoint else None, existing)
    if logging.report_to != "none":
        accelerator.init_trackers("logs", config={k: str(v) for k, v in config.to_dict().items()})

    log = StepLog(
        accelerator, state, logging, stages.total_steps, engine.tokens_per_step, depth, output_dir / METRICS_FILE
    )

    def flops_per_step() -> float:
        """Training FLOPs of one step of the model as it is now (changes at each growth)."""
        model_config = config.p2r_config(vocab_size, state.num_blocks, {}, state.num_hidden_layers)
        return engine.tokens_per_step * training_flops_per_token(model_config, config.data.block_size)

    vocab_size = config.model_vocab_size(len(tokenizer))
    step_flops = flops_per_step()
    if checkpoint is None and logging.eval_steps:
        log.record(val_loss=engine.evaluate(validation_blocks, logging.eval_blocks))

    # The loop: each pass delinks if a delink is due at this step, then makes one optimizer step.
    with StopOnSignal() as stop, log.progress:  # the bar ends its line before any error is told
        while True:
            target_depth, target = config.stage_at(state.step)
            if (state.num_hidden_layers, state.num_blocks) != (target_depth, target):
                finish_checkpoint(accelerator)  # a checkpoint written in the background (checkpoint_async) first
                if target == depth:  # the pseudo stage ends: its model is kept as pseudo/
                    check_finite(accelerator, output_dir, state, depth, "pseudo/", engine.weights())
                    engine.save_model(output_dir / "pseudo", tokenizer)
                extra = engine.delink(config.delink_to(state.num_hidden_layers, state.num_blocks, target_depth, target))
                before, state.num_blocks = state.num_blocks, target
                before_depth, state.num_hidden_layers = state.num_hidden_layers, target_depth
                step_flops = flops_per_step()
                log.record(event="delink", num_blocks_before=before, num_hidden_layers_before=before_depth, **extra)
                grew = f"grew {before_depth} -> {target_depth} layers ({stages.growth}), " * (
                    target_depth > before_depth
                )
                rules = f"optimizer_carry={stages.optimizer_carry}, lr_after_delink={config.schedule.lr_after_delink}"
                log.say(f"step {state.step}: {grew}delinked {before} -> {target} blocks{engine.delink_note(rules)}")
                log.stage_changed()
            if state.step >= stages.total_steps:  # (read_state refuses a checkpoint past the end)
                break

            started = time.perf_counter()
            lr = learning_rate_at(state.step, lr_schedule, delink_steps)
            shared_lr = set_learning_rate(engine.optimizer, lr)  # (2BW steps inside its schedule, at this rate)
            losses = [
                engine.forward_backward(next_batch(train_blocks, position, state, engine))
                for _ in range(compute.gradient_accumulation_steps)
            ]
            # One collective gives every process the same mean loss and the same stop decision.
            loss_value, signum = engine.mean_loss(losses, stop.signum)
            if not math.isfinite(loss_value):
                raise non_finite_loss(loss_value, output_dir, state, depth)
            grad_norm = engine.optimizer_step()
            state.tokens, state.flops = state.tokens + engine.tokens_per_step, state.flops + step_flops
            log.step(loss_value, lr, time.perf_counter() - started)

            final = state.step == stages.total_steps
            measure = log.measures(final, lr, shared_lr, grad_norm)
            if measure:
                measure.update(engine.step_measures())
            if (logging.eval_steps and state.step % logging.eval_steps == 0) or state.step in delink_steps or final:
                measure["val_loss"] = engine.evaluate(validation_blocks, logging.eval_blocks)
            if measure:
                log.record(**measure)
            if (saving.save_steps and state.step % saving.save_steps == 0) or final or signum:
                # every process's data position (a stream's, or what the blocks are made of), by process index
                state.stream_states = gather_object([position.state_dict()])
                saved = engine.training_state()
                check_finite(accelerator, output_dir, state, depth, "checkpoint", saved)
                write = functools.partial(engine.write_checkpoint, training_state=saved)
                save_checkpoint(accelerator, output_dir, state, config, write=write)
                if final or signum:  # the run stops: a checkpoint written in the background completes first
                    finish_checkpoint(accelerator)
            if signum and not final:
                log.progress.close()
                log.say(
                    f"stopped by signal {signum} after step {state.step}; checkpoint saved: resume with "
                    "--resume_from_checkpoint latest"
                )
                return 128 + signum
    log.progress.close()

    # Save: the real model (already delinked by the loop, its weights checked with the last checkpoint), its
    # tokenizer, the loss curve; then the summary.
    engine.save_model(output_dir / "real", tokenizer)
    if accelerator.is_main_process:
        title = f"{output_dir.name}: L={depth}, k={config.initial_blocks()}, {engine.title()}"
        finish_run(output_dir, title, time.perf_counter() - started_run, saving.remote_code, resumed)
    return 0


def next_batch(blocks, order: BlockOrder | None, state: TrainState, engine: Engine) -> torch.Tensor:
    """This process's slice of the next global micro-batch (`engine.data_rank` of `engine.data_size`; a stream is
    already this process's share); advances the data position by the global batch."""
    size = engine.compute.per_device_batch_size
    if isinstance(blocks, BlockStream):
        batch = blocks.take(size)
    else:
        start = state.blocks_consumed + engine.data_rank * size
        batch = blocks[order.indices(start, size)]["input_ids"]
    state.blocks_consumed += size * engine.data_size
    return batch.to(engine.accelerator.device)


__all__ = ["NonFiniteLossError", "build_model", "next_batch", "train"]
