"""The P2R training run, top to bottom: build -> prepare -> (resume) -> loop [pseudo steps, delink, real steps] -> save.

```python
from hf_p2r.training import parse_config, train

exit_code = train(parse_config(["--config", "configs/demo.yaml"]))
```

Launch with `accelerate launch scripts/train.py --config ...` for one CPU, one GPU or many (whatever `accelerate
config` says). Exit codes: 0 when the schedule is done; 128 + signal number (143 for SIGTERM, 130 for SIGINT) when
a signal stopped it after saving a checkpoint; a non-finite loss, weights or optimizer state raises
`NonFiniteLossError`.

Nothing under output_dir changes until the run has built its data and model and, when resuming, loaded its checkpoint:
a bad configuration, bad data or a damaged checkpoint leaves every earlier output as it was.
"""

import math
import os
import shlex
import shutil
import signal
import sys
import time
from pathlib import Path

import torch
import yaml
from accelerate import Accelerator
from accelerate.utils import DistributedType, set_seed
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from ..distributed import gather_shared_once
from ..models.p2r import P2RForCausalLM, P2RMoeConfig, P2RMoeForCausalLM
from .checkpointing import (
    CHECKPOINTS,
    TrainState,
    all_finite,
    discard_after,
    list_checkpoints,
    loading_checkpoint,
    read_state,
    resolve_checkpoint,
    save_checkpoint,
    save_model,
)
from .config import TrainConfig
from .data import BlockOrder, build_blocks, load_tokenizer
from .delink import check_delink_supported, delink_in_training
from .metrics import (
    METRICS_FILE,
    PLOT_FILE,
    append_metrics,
    peak_memory_gb,
    plot_losses,
    read_metrics,
    stage_summary,
    truncate_metrics,
)
from .moe import RouterLoad
from .optim import apply_offload, build_optimizer, learning_rate_at, measure_offload_activations, set_learning_rate

# What a run writes into output_dir (and what overwrite_output_dir removes; nothing else there is touched).
OUTPUTS = (CHECKPOINTS, "pseudo", "real", METRICS_FILE, PLOT_FILE, "logs", "train_config.yaml")


class NonFiniteLossError(RuntimeError):
    """The training loss, the weights or the optimizer state became NaN or infinite; the run stopped without saving
    (every checkpoint it kept has finite weights and optimizer state)."""


def build_model(config: TrainConfig, tokenizer: PreTrainedTokenizerBase, num_blocks: int) -> P2RForCausalLM:
    """A freshly initialised P2R model with `num_blocks` blocks (k: pseudo, L: real), in training mode."""
    vocab_size = config.model.vocab_size or -(-len(tokenizer) // 64) * 64  # round up: friendlier matrix shapes
    if vocab_size < len(tokenizer):
        raise ValueError(f"vocab_size: {vocab_size} is smaller than the tokenizer ({len(tokenizer)} tokens)")
    special_tokens = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    p2r_config = config.p2r_config(vocab_size, num_blocks, special_tokens)
    model = (P2RMoeForCausalLM if isinstance(p2r_config, P2RMoeConfig) else P2RForCausalLM)(p2r_config)
    if config.model.activation_checkpointing:
        model.activation_checkpointing_enable()
    return model.train()


def train(config: TrainConfig) -> int:
    """Run the schedule of `config`; returns the exit code (see the module docstring)."""
    args = config.train
    if args.pipeline_parallel_size > 1:  # the same schedule on a model split into stages (hf_p2r.distributed)
        from ..distributed.pipeline_train import train_pipelined

        return train_pipelined(config)
    started_run = time.perf_counter()
    output_dir = Path(args.output_dir)
    depth = config.model.num_hidden_layers
    delink_steps = [step for step, _ in config.delink_schedule()]

    # Build.
    cpu = args.cpu if args.cpu is not None else not torch.accelerator.is_available()
    _check_gpu_per_process(cpu)
    accelerator = Accelerator(
        mixed_precision=args.mixed_precision,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        cpu=cpu,
        log_with=None if args.report_to == "none" else args.report_to,
        project_dir=output_dir,
    )
    if delink_steps:
        check_delink_supported(accelerator, args)
    if args.offload is not None and (
        accelerator.num_processes > 1 or accelerator.distributed_type != DistributedType.NO
    ):
        raise ValueError(
            f"offload: granular offload runs in one process, this run has {accelerator.num_processes} "
            f"({accelerator.distributed_type.value}); for several GPUs use configs/accelerate/fsdp2_offload.yaml or "
            "deepspeed_zero3_offload.yaml"
        )
    checkpoint = resolve_checkpoint(output_dir, args.resume_from_checkpoint) if args.resume_from_checkpoint else None
    state = read_state(checkpoint, config) if checkpoint else TrainState(num_blocks=config.initial_blocks())
    existing = check_output_dir(output_dir, config, resumed=checkpoint is not None)

    set_seed(args.seed)
    tokenizer = load_tokenizer(config.data.tokenizer_name)
    with accelerator.main_process_first():
        train_blocks, validation_blocks = build_blocks(config.data, tokenizer, args.seed)
    model = build_model(config, tokenizer, state.num_blocks)
    # Granular offload places the model itself (resident blocks on the device, the others in CPU memory).
    activation_bytes = measure_offload_activations(model, args, config.data.block_size, accelerator)
    offload = apply_offload(model, args, accelerator, activation_bytes)
    optimizer = build_optimizer(model, args, offload)

    # Prepare (device placement, DDP / FSDP2 / DeepSpeed, mixed precision) and resume.
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        _fill_deepspeed_batch_size(accelerator, args)
    placement = [False, False] if offload is not None else None
    model, optimizer = accelerator.prepare(model, optimizer, device_placement=placement)
    if accelerator.is_fsdp2:
        gather_shared_once(model)  # a shared block is gathered once per step, not at every depth
    if offload is not None:
        _say(accelerator, f"offload: blocks {offload.layers} of {state.num_blocks} in CPU memory")
    if checkpoint:
        with loading_checkpoint(accelerator, checkpoint):
            accelerator.load_state(checkpoint)
        _say(accelerator, f"resumed from {checkpoint} (step {state.step}, {state.num_blocks} blocks)")
    prepare_output_dir(accelerator, output_dir, config, state if checkpoint else None, existing)
    if args.report_to != "none":
        accelerator.init_trackers("logs", config={k: str(v) for k, v in config.to_dict().items()})

    order = BlockOrder(len(train_blocks), args.seed)
    tokens_per_step = (
        args.per_device_batch_size
        * accelerator.num_processes
        * args.gradient_accumulation_steps
        * config.data.block_size
    )
    metrics_path = output_dir / METRICS_FILE
    log = StepLog(state, args, tokens_per_step, accelerator.device, accelerator.is_local_main_process, depth)
    progress = log.progress
    if checkpoint is None and args.eval_steps:
        _record(
            accelerator, metrics_path, state, depth, val_loss=_evaluate(accelerator, model, validation_blocks, args)
        )

    # MoE: the training loss includes the load-balancing loss (router_aux_loss_coef); the router statistics are logged.
    router_load = RouterLoad(accelerator.unwrap_model(model).config) if config.model.num_experts else None
    moe_kwargs = {"output_router_logits": True} if router_load is not None else {}
    # The loop: each pass delinks if a delink is due at this step, then makes one optimizer step.
    with _StopOnSignal() as stop, progress:  # the bar ends its line before any error is told
        while True:
            target = config.blocks_at(state.step)
            if state.num_blocks < target:
                if target == depth:
                    check_finite(accelerator, output_dir, state, depth, "pseudo/", model.parameters())
                    save_model(
                        accelerator, accelerator.unwrap_model(model), tokenizer, output_dir / "pseudo", args.remote_code
                    )
                model, optimizer, offload = delink_in_training(
                    accelerator, model, optimizer, target if target < depth else None, args, offload, activation_bytes
                )
                before, state.num_blocks = state.num_blocks, target
                offloaded = {"offloaded_blocks": offload.layers} if offload is not None else {}
                _record(accelerator, metrics_path, state, depth, event="delink", num_blocks_before=before, **offloaded)
                _say(
                    accelerator,
                    f"step {state.step}: delinked {before} -> {target} blocks "
                    f"(optimizer_carry={args.optimizer_carry}, lr_after_delink={args.lr_after_delink})"
                    + (f"; offload: blocks {offload.layers} in CPU memory" if offload is not None else ""),
                )
                progress.set_description(state.stage(depth))
            if state.step >= args.total_steps:  # (read_state refuses a checkpoint past the end)
                break

            started = time.perf_counter()
            lr = learning_rate_at(state.step, args, delink_steps)
            shared_lr = set_learning_rate(optimizer, lr)
            losses = []
            for _ in range(args.gradient_accumulation_steps):
                batch = _next_batch(accelerator, train_blocks, order, state, args.per_device_batch_size)
                with accelerator.accumulate(model):
                    outputs = model(input_ids=batch, labels=batch, **moe_kwargs)
                    loss = outputs.loss
                    accelerator.backward(loss)
                losses.append(loss.detach().float())
                if router_load is not None:
                    router_load.add(outputs)
            # One collective gives every process the same mean loss and the same stop decision.
            gathered = accelerator.gather(torch.stack([torch.stack(losses).mean(), stop.tensor(accelerator.device)]))
            loss_value = gathered[0::2].mean().item()
            signum = int(gathered[1::2].max().item())
            if not math.isfinite(loss_value):
                raise non_finite_loss(loss_value, output_dir, state, depth)
            # The last accumulate() synchronised the gradients: clip, then step.
            grad_norm = (
                accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm) if args.max_grad_norm else None
            )
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            log.step(loss_value, lr, time.perf_counter() - started)

            final = state.step == args.total_steps
            measure = log.measures(final, lr, shared_lr, grad_norm)
            if measure and router_load is not None:
                measure.update(router_load.pop(accelerator))
            if (args.eval_steps and state.step % args.eval_steps == 0) or state.step in delink_steps or final:
                measure["val_loss"] = _evaluate(accelerator, model, validation_blocks, args)
            if measure:
                _record(accelerator, metrics_path, state, depth, **measure)
            if (args.save_steps and state.step % args.save_steps == 0) or final or signum:
                check_finite(accelerator, output_dir, state, depth, "checkpoint", model.parameters(), optimizer.state)
                save_checkpoint(accelerator, output_dir, state, config)
            if signum and not final:
                progress.close()
                _say(
                    accelerator,
                    f"stopped by signal {signum} after step {state.step}; checkpoint saved: resume with "
                    "--resume_from_checkpoint latest",
                )
                return 128 + signum
    progress.close()

    # Save: the real model (already delinked by the loop, its weights checked with the last checkpoint), its
    # tokenizer, the loss curve; then the summary.
    save_model(accelerator, accelerator.unwrap_model(model), tokenizer, output_dir / "real", args.remote_code)
    if accelerator.is_main_process:
        title = f"{output_dir.name}: L={depth}, k={config.initial_blocks()}, optimizer_carry={args.optimizer_carry}"
        finish_run(output_dir, title, time.perf_counter() - started_run, args.remote_code)
    accelerator.end_training()
    return 0


def _check_gpu_per_process(cpu: bool) -> None:
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


def _fill_deepspeed_batch_size(accelerator: Accelerator, args) -> None:
    """DeepSpeed needs its micro-batch size before `prepare`; Accelerate reads it from a DataLoader, which this loop
    does not use, so an "auto" value in the DeepSpeed config is set from `per_device_batch_size`."""
    config = accelerator.state.deepspeed_plugin.deepspeed_config
    if config.get("train_micro_batch_size_per_gpu", "auto") == "auto":
        config["train_micro_batch_size_per_gpu"] = args.per_device_batch_size


def _next_batch(accelerator, blocks, order: BlockOrder, state: TrainState, batch_size: int) -> torch.Tensor:
    """This process's slice of the next global micro-batch; advances the data position by the global batch."""
    start = state.blocks_consumed + accelerator.process_index * batch_size
    state.blocks_consumed += batch_size * accelerator.num_processes
    return blocks[order.indices(start, batch_size)]["input_ids"].to(accelerator.device)


@torch.no_grad()
def _evaluate(accelerator: Accelerator, model, blocks, args) -> float:
    """Mean loss over `eval_blocks` validation blocks spread evenly over the split, each process taking every n-th.

    Every process runs the same number of forward passes: under FSDP2 and ZeRO-3 each forward gathers the parameters
    with all processes, so one that stopped early would leave the others waiting. A process with fewer blocks repeats
    its last batch and drops that loss.
    """
    # The unwrapped model (mixed-precision wrapper kept): DDP's forward would add collectives of its own.
    model = accelerator.unwrap_model(model).eval()
    count = min(len(blocks), args.eval_blocks)
    # Evenly spaced rather than the first ones: consecutive blocks come from the same few documents.
    chosen = [index * len(blocks) // count for index in range(count)]
    mine = chosen[accelerator.process_index :: accelerator.num_processes]
    size = args.per_device_batch_size
    batches = [mine[start : start + size] for start in range(0, len(mine), size)]
    most = math.ceil(len(chosen[:: accelerator.num_processes]) / size)  # the first process has the most blocks
    padding = [batches[-1] if batches else chosen[:1]] * (most - len(batches))
    total = torch.zeros((), device=accelerator.device)
    for index, indices in enumerate(batches + padding):
        ids = blocks[indices]["input_ids"].to(accelerator.device)
        loss = model(input_ids=ids, labels=ids).loss.float()
        if index < len(batches):
            total += loss * len(ids)
    model.train()
    return accelerator.reduce(total, reduction="sum").item() / count


class StepLog:
    """The per-step accounting of a training loop (the one-process one and the pipelined one): the step's loss and
    time into the state and the progress bar, and every `logging_steps` (and at the end) the logged measures."""

    def __init__(self, state: TrainState, args, tokens_per_step: int, device, show: bool, depth: int):
        self.state, self.args, self.tokens_per_step, self.device = state, args, tokens_per_step, device
        self.interval_steps, self.interval_time = 0, 0.0  # in this process since the last record, for tokens_per_s
        self.progress = tqdm(
            total=args.total_steps,
            initial=state.step,
            desc=state.stage(depth),
            dynamic_ncols=True,
            disable=not show,
        )

    def step(self, loss: float, lr: float, elapsed: float) -> None:
        """One optimizer step done: its mean loss, learning rate and training time (seconds)."""
        state = self.state
        state.step += 1
        state.train_time_s += elapsed
        self.interval_steps, self.interval_time = self.interval_steps + 1, self.interval_time + elapsed
        state.log_loss_sum += loss
        state.log_steps += 1
        self.progress.update(1)
        self.progress.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}")

    def measures(self, final: bool, lr: float, shared_lr: float, grad_norm) -> dict:
        """The record's measures when one is due (every `logging_steps`, and the last step), else {}."""
        state = self.state
        if not (state.step % self.args.logging_steps == 0 or final):
            return {}
        measure = dict(
            loss=state.log_loss_sum / state.log_steps,
            lr=lr,
            **({"lr_shared": shared_lr} if shared_lr < lr else {}),  # shared_lr_scale: depth
            grad_norm=None if grad_norm is None else float(grad_norm),
            tokens_per_s=self.tokens_per_step * self.interval_steps / self.interval_time,
            train_time_s=state.train_time_s,
            memory_gb=peak_memory_gb(self.device),
        )
        state.log_loss_sum, state.log_steps = 0.0, 0
        self.interval_steps, self.interval_time = 0, 0.0
        return measure


def _record(accelerator: Accelerator, path: Path, state: TrainState, depth: int, **values) -> None:
    record = {"step": state.step, "stage": state.stage(depth), "num_blocks": state.num_blocks, **values}
    state.metrics_records += 1
    if accelerator.is_main_process:
        append_metrics(path, record)
    numbers = {k: v for k, v in values.items() if isinstance(v, int | float) and not isinstance(v, bool)}
    if numbers and accelerator.trackers:
        accelerator.log(numbers, step=state.step)


def _say(accelerator: Accelerator, message: str) -> None:
    if accelerator.is_local_main_process:
        tqdm.write(message)


def check_output_dir(output_dir: Path, config: TrainConfig, resumed: bool) -> list[Path]:
    """The earlier outputs in `output_dir` (`OUTPUTS`), after checking what the run may do with them, changing
    nothing: a fresh run refuses them unless overwrite_output_dir; a resumed run needs a readable metrics.jsonl.
    Called on every process (so all of them stop on an error)."""
    existing = [output_dir / name for name in OUTPUTS if (output_dir / name).exists()]
    if not resumed and existing and not config.train.overwrite_output_dir:
        raise FileExistsError(
            f"output_dir: {output_dir} already holds a run ({', '.join(p.name for p in existing)}); pass "
            "--resume_from_checkpoint latest to continue it or --overwrite_output_dir true to start over"
        )
    if resumed:
        read_metrics(output_dir / METRICS_FILE)  # a damaged record is refused now, not after the load
    return existing


def prepare_output_dir(
    accelerator: Accelerator, output_dir: Path, config: TrainConfig, resumed: TrainState | None, existing: list[Path]
) -> None:
    """Once the run is built (and resumed): a resumed run drops what came after its checkpoint (newer checkpoints,
    later metrics records), a fresh one removes the `existing` outputs that `check_output_dir` found; both write the
    resolved configuration. The main process changes the folder."""
    accelerator.wait_for_everyone()  # every process has loaded before the main one changes anything
    if accelerator.is_main_process:
        if resumed is not None:
            discard_after(output_dir, resumed.step)
            truncate_metrics(output_dir / METRICS_FILE, resumed.metrics_records)
        else:
            for path in existing:
                shutil.rmtree(path) if path.is_dir() else path.unlink()
            output_dir.mkdir(parents=True, exist_ok=True)
        # The resolved configuration, usable as --config to repeat the run.
        config_text = yaml.safe_dump(config.to_dict(), sort_keys=False)
        (output_dir / "train_config.yaml").write_text(config_text, encoding="utf-8")
    accelerator.wait_for_everyone()


def check_finite(accelerator: Accelerator, output_dir: Path, state: TrainState, depth: int, what: str, *objects):
    """Raise `NonFiniteLossError` before `what` is saved unless every tensor of `objects` (parameters, optimizer
    state) is finite on every process (`all_finite`: one pass, one collective)."""
    if not all_finite(accelerator, *objects):
        raise NonFiniteLossError(
            f"non-finite weights or optimizer state after step {state.step} ({state.stage(depth)} stage): stopped "
            f"without saving the {what}; {_last_good(output_dir)}"
        )


def non_finite_loss(loss: float, output_dir: Path, state: TrainState, depth: int) -> NonFiniteLossError:
    """The error for a non-finite training `loss` in the step after `state.step` (nothing of that step is saved)."""
    return NonFiniteLossError(
        f"non-finite training loss ({loss}) at step {state.step + 1} ({state.stage(depth)} stage): stopped without "
        f"saving; {_last_good(output_dir)}"
    )


def _last_good(output_dir: Path) -> str:
    last = list_checkpoints(output_dir)
    return (
        f"last good checkpoint: {last[-1] if last else 'none'}; try a lower learning_rate, more warmup_steps or "
        "max_grad_norm"
    )


def finish_run(output_dir: Path, title: str, wall_time_s: float, remote_code: bool) -> None:
    """The main process's end of a run: the loss curve (`loss.png`), then the summary (`run_summary`) on stdout."""
    records = read_metrics(output_dir / METRICS_FILE)
    if not plot_losses(records, output_dir / PLOT_FILE, title):
        print(f"matplotlib is not installed: skipped {output_dir / PLOT_FILE} (pip install 'hf-p2r[plot]')")
    print(run_summary(output_dir, records, wall_time_s, remote_code), flush=True)


def run_summary(output_dir: Path, records: list[dict], wall_time_s: float, remote_code: bool) -> str:
    """What a finished run reached and where it is: each stage's steps, blocks, final validation loss and tokens/s
    (`stage_summary` of its metrics records), the wall time, the output folders and files there, and the commands
    that come next (load, publish, convert)."""
    lines = [f"***** run summary: {output_dir} *****"]
    stages = stage_summary(records)
    width = max((len(stage["stage"]) for stage in stages), default=0)
    for stage in stages:
        blocks = " -> ".join(str(n) for n in stage["blocks"])
        figures = [f"steps {stage['steps'][0]}-{stage['steps'][1]}", f"blocks {blocks}"]
        if stage["val_loss"] is not None:
            figures.append(f"val_loss {stage['val_loss']:.4f}")
        if stage["tokens_per_s"] is not None:
            figures.append(f"{stage['tokens_per_s']:,.0f} tokens/s")
        lines.append(f"  {stage['stage'] + ' stage:':<{width + 7}} " + ", ".join(figures))
    training = sum(stage["train_time_s"] for stage in stages)
    lines.append(f"  wall time: {_duration(wall_time_s)}, of which training steps {_duration(training)}")
    outputs = {
        "real": "the trained model",
        "pseudo": "the pseudo model at the end of its stage",
        METRICS_FILE: "the logged metrics, one JSON record per line",
        PLOT_FILE: "the loss curve",
        CHECKPOINTS: "resume with --resume_from_checkpoint latest",
    }
    found = [(output_dir / name, text) for name, text in outputs.items() if (output_dir / name).exists()]
    names = [str(path) + os.sep * path.is_dir() for path, _ in found]
    width = max(map(len, names), default=0)
    lines += ["  outputs:", *(f"    {name:<{width}}  {text}" for name, (_, text) in zip(names, found))]
    real, pseudo, cli = output_dir / "real", output_dir / "pseudo", hf_p2r_command()
    load = (
        f"from transformers import AutoModelForCausalLM; model = AutoModelForCausalLM.from_pretrained({str(real)!r}, "
        "trust_remote_code=True)"
        if remote_code  # the modeling code is in real/
        else f"import hf_p2r; from transformers import AutoModelForCausalLM; "
        f"model = AutoModelForCausalLM.from_pretrained({str(real)!r})"
    )
    lines += [
        "  next:",
        f"    load it (Python):      {load}",
        f"    publish it on the Hub: {cli} push {shlex.quote(str(real))} USER/NAME",
    ]
    if pseudo.exists():
        delinked = shlex.quote(str(output_dir / "pseudo-delinked"))
        lines.append(
            f"    delink pseudo/:        {cli} convert {shlex.quote(str(pseudo))} {delinked}  (the model the real "
            "stage started from)"
        )
    return "\n".join(lines)


def hf_p2r_command() -> str:
    """How to run `hf-p2r` from this shell: its name when that finds this Python's, else its path (a virtual
    environment that is not activated), relative to the current folder when it is under it."""
    script = Path(sys.executable).with_name("hf-p2r")
    on_path = shutil.which("hf-p2r")
    if not script.exists() or (on_path and Path(on_path).resolve() == script.resolve()):
        return "hf-p2r"
    relative = os.path.relpath(script)
    return shlex.quote(str(script) if relative.startswith("..") else relative)


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, seconds = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{seconds:02d}"


class _StopOnSignal:
    """SIGTERM / SIGINT ask the loop to stop after the current step (it then saves a checkpoint and returns 128 + the
    first signal's number).

    A second Ctrl-C acts at once (SIGINT's previous handler is put back). SIGTERM stays a request however often it
    comes: sent to a one-process launcher's process group, it reaches the trainer twice, from the sender and as the
    launcher's death signal (scripts/train.py), and the second must not cut the checkpoint short.
    """

    def __init__(self):
        self.signum = 0
        self._previous = {}

    def tensor(self, device: torch.device) -> torch.Tensor:
        return torch.tensor(float(self.signum), device=device)

    def _handle(self, signum, frame):
        self.signum = self.signum or signum
        if signum == signal.SIGINT:
            signal.signal(signum, self._previous[signum])

    def __enter__(self):
        for signum in (signal.SIGTERM, signal.SIGINT):
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc):
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
