"""Checkpoints and model saves, all written atomically (a temporary folder beside the target, renamed at the end).

A checkpoint is `output_dir/checkpoints/checkpoint-{step}/`: Accelerate's `save_state` (model, optimizer, RNG
states, gradient scaler) plus `trainer_state.json` (stage, step, blocks, data position, the run's configuration). The
model stored there has the blocks it had at that step, so resuming after a delink builds a model with that many blocks
before `load_state`. Those resume checkpoints are Accelerate's format and written by Accelerate (`save_state`, which
handles every engine's sharded states); hf-p2r only makes them atomic.

The models a run publishes (`pseudo/`, `real/`) are written by `save_model`, through `hf_p2r.checkpoint.save_model`,
the same writer as the converter and the exporter.
"""

import dataclasses
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from accelerate import Accelerator
from accelerate.utils import broadcast_object_list
from torch import nn
from transformers import PreTrainedTokenizerBase

from ..checkpoint import atomic_directory
from ..checkpoint import save_model as write_model_folder
from ..models.p2r import P2RForCausalLM
from .config import DataArguments, ModelArguments, TrainConfig

STATE_FILE = "trainer_state.json"
CHECKPOINTS = "checkpoints"
# Fields that decide what a checkpoint's weights mean, or its optimizer's parameter groups: a resumed run must agree.
_COMPATIBLE_FIELDS = (
    [f.name for f in dataclasses.fields(ModelArguments)]
    + [f.name for f in dataclasses.fields(DataArguments) if f.name not in ("cache_dir", "preprocessing_num_workers")]
    + ["seed", "shared_lr_scale"]
)


@dataclass
class TrainState:
    """Where the run is; everything else (the learning rate, the data order) is a function of these and the config."""

    step: int = 0  # optimizer steps done
    num_blocks: int = 1  # blocks of the model now
    blocks_consumed: int = 0  # data position: training blocks used so far, over all processes
    train_time_s: float = 0.0  # wall time spent in training steps (no evaluation, no saving)
    log_loss_sum: float = 0.0  # training loss summed over the steps since the last metrics record
    log_steps: int = 0
    metrics_records: int = 0  # records in metrics.jsonl (a resumed run drops those written after the checkpoint)

    def stage(self, depth: int) -> str:
        """ "pseudo" while the model has fewer blocks than its `depth` layers, then "real"."""
        return "pseudo" if self.num_blocks < depth else "real"


def checkpoint_path(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / CHECKPOINTS / f"checkpoint-{step}"


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints in `output_dir`, oldest first (temporary folders of interrupted saves are ignored)."""
    folder = Path(output_dir) / CHECKPOINTS
    found = [p for p in folder.glob("checkpoint-*") if (p / STATE_FILE).is_file() and _step_of(p) is not None]
    return sorted(found, key=_step_of)


def _step_of(path: Path) -> int | None:
    suffix = path.name.removeprefix("checkpoint-")
    return int(suffix) if suffix.isdigit() else None


def save_checkpoint(
    accelerator: Accelerator,
    output_dir: str | Path,
    state: TrainState,
    config: TrainConfig,
    write: Callable[[Path], None] | None = None,
) -> Path:
    """Write `checkpoint-{step}` atomically and keep the newest `save_total_limit`; call on every process.

    The main process makes the temporary folder and tells the others its name; every process writes its part there
    with `write(folder)` (default: `accelerator.save_state`: model, optimizer, scheduler, RNG states; the pipelined
    trainer writes its stages), and the folder is renamed into place once every process has finished writing.
    """
    write = write or accelerator.save_state
    destination = checkpoint_path(output_dir, state.step)
    payload = {
        "stage": state.stage(config.model.num_hidden_layers),
        "state": dataclasses.asdict(state),
        "config": config.to_dict(),
    }
    if accelerator.is_main_process:
        with atomic_directory(destination, overwrite=True) as tmp:
            broadcast_object_list([str(tmp)])
            write(tmp)
            (tmp / STATE_FILE).write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
            accelerator.wait_for_everyone()
        limit = config.train.save_total_limit
        if limit is not None:
            for old in list_checkpoints(output_dir)[:-limit]:
                shutil.rmtree(old, ignore_errors=True)
    else:
        [tmp] = broadcast_object_list([None])
        write(Path(tmp))
        accelerator.wait_for_everyone()
    accelerator.wait_for_everyone()
    return destination


def resolve_checkpoint(output_dir: str | Path, name: str) -> Path:
    """`name` is a checkpoint folder or "latest" (the newest complete one in `output_dir`)."""
    if name == "latest":
        found = list_checkpoints(output_dir)
        if not found:
            raise FileNotFoundError(f"resume_from_checkpoint: no checkpoint in {Path(output_dir) / CHECKPOINTS}")
        return found[-1]
    path = Path(name)
    if not (path / STATE_FILE).is_file():
        raise FileNotFoundError(f"resume_from_checkpoint: {path} is not a checkpoint (no {STATE_FILE})")
    return path


def read_state(path: Path, config: TrainConfig) -> TrainState:
    """The state saved in checkpoint `path`, after checking that it belongs to a run like `config`."""
    payload = json.loads((path / STATE_FILE).read_text(encoding="utf-8"))
    saved, current = payload["config"], config.to_dict()
    differing = [name for name in _COMPATIBLE_FIELDS if saved.get(name) != current[name]]
    if differing:
        details = ", ".join(f"{name}={saved.get(name)!r} there, {current[name]!r} now" for name in differing)
        raise ValueError(f"resume_from_checkpoint: {path} comes from a different run ({details})")
    state = TrainState(**payload["state"])
    if state.num_blocks > config.blocks_at(state.step):
        raise ValueError(
            f"resume_from_checkpoint: {path} holds a model with {state.num_blocks} blocks at step {state.step}, but "
            f"this configuration delinks to that later (pseudo_steps, partial_delink_steps)"
        )
    return state


def save_model(
    accelerator: Accelerator,
    model: P2RForCausalLM,
    tokenizer: PreTrainedTokenizerBase,
    directory: str | Path,
    remote_code: bool,
) -> None:
    """Save the unwrapped `model` and its tokenizer into `directory` (replaced atomically) as a checkpoint that
    `from_pretrained` loads (`hf_p2r.checkpoint.save_model`); with `remote_code`, with the model's code. Call on every
    process: the full state dict is gathered by `accelerator.get_state_dict` on all of them (a collective when the
    model is sharded: FSDP2, ZeRO-3), then the main process writes it."""
    state_dict = accelerator.get_state_dict(_prepared(accelerator, model))
    if accelerator.is_main_process:
        write_model_folder(
            model,
            directory,
            state_dict=state_dict,
            remote_code=remote_code,
            tokenizer=tokenizer,
            overwrite=True,
            progress=False,
        )
    accelerator.wait_for_everyone()


def _prepared(accelerator: Accelerator, model: nn.Module) -> nn.Module:
    """What `accelerator.prepare` returned for the unwrapped `model` (a DeepSpeed engine, DDP...), which
    `get_state_dict` needs under ZeRO-3; the model itself when it was prepared in place (one device, FSDP2)."""
    for prepared in accelerator._models:
        if prepared is model or accelerator.unwrap_model(prepared) is model:
            return prepared
    return model


def discard_after(output_dir: str | Path, step: int) -> None:
    """Remove checkpoints newer than `step`: resuming from `step` abandons what the run wrote after it."""
    for path in list_checkpoints(output_dir):
        if _step_of(path) > step:
            shutil.rmtree(path)
