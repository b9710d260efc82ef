"""A DCP training checkpoint (`checkpoint_format: dcp`) as a Hugging Face folder: `hf-p2r export`.

The checkpoint's `trainer_state.json` records the run's configuration and the model's blocks at that step; the model
is rebuilt from them on the meta device (`build_model`, as the trainer builds it: its config, its tokenizer) and saved
by `hf_p2r.checkpoint.save_model`, the trainer's own save path for `pseudo/` and `real/`, with its weights read from
the DCP shards one tensor at a time (`hf_p2r.checkpoint.dcp_weights`): never the whole state dict in memory. The
folder is what the trainer saves at that point (`pseudo/` or `real/`); a delink, another target (Llama, Mixtral) or a
dtype cast is then `convert_pseudo_to_real` of it, streamed, so the output is what `hf-p2r convert` makes of the
trainer's folder.
"""

import os
import shutil
import tempfile
from pathlib import Path

from ...checkpoint import convert_pseudo_to_real, save_model
from ...checkpoint.convert import conversion_blocks, parse_dtype
from ...checkpoint.dcp_weights import dcp_weights, write_dcp_weights
from ...checkpoint.headers import parse_size
from ...checkpoint.io import file_within, why_skipped
from ...checkpoint.output_folder import check_output_folder
from ...checkpoint.targets import get_target
from ...config import TrainConfig
from ...errors import InputError
from ..data import load_tokenizer
from ..train import build_model
from .checkpoints import CHECKPOINTS, STATE_FILE, read_trainer_state, resolve_checkpoint
from .dcp import check_files


def export_checkpoint(
    checkpoint: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    target: str = "p2r",
    num_unique_layers: int | None = None,
    dtype=None,
    max_shard_size: int | str = "5GB",
    overwrite: bool = False,
    progress: bool = True,
) -> Path:
    """Write the model of DCP checkpoint folder `checkpoint` (`output_dir/checkpoints/checkpoint-N` of a run with
    `checkpoint_format: dcp`, or a run's `output_dir`: its newest checkpoint) into `dst` as a Hugging Face folder;
    returns `dst`.

    The arguments are `convert_pseudo_to_real`'s, with its meaning: by default the real model (a pseudo checkpoint is
    delinked), `num_unique_layers=k` (the checkpoint's own block count keeps a pseudo model as it is), `target="llama"`
    or `"mixtral"` for the vanilla transformers models, `dtype` to cast. The weights are read one tensor at a time from
    the shards, whatever layout wrote them; with nothing to convert the output is the folder the trainer writes
    (`pseudo/`, `real/`: config, generation config, tokenizer, model code with `remote_code`), else what `hf-p2r
    convert` writes from that folder (streamed through a temporary copy beside `dst`). `dst` appears complete or not
    at all; it must not be the checkpoint or its run, lie inside either or contain either, and a non-empty `dst` is
    refused unless `overwrite`, which replaces only an earlier output (a model folder), never a run
    (`check_output_folder`). Bad input (not a DCP checkpoint, a damaged or missing shard, a file `.metadata` names
    outside the folder, a tensor its pieces do not cover, a `trainer_state.json` that does not describe a run) is one
    `InputError` naming the file, before anything is written.

    ```python
    >>> export_checkpoint("run/checkpoints/checkpoint-200", "model-200", target="llama")
    ```
    """
    parse_size(max_shard_size), parse_dtype(dtype), get_target(target)  # before reading anything
    checkpoint = Path(checkpoint)
    if not (checkpoint / STATE_FILE).exists() and (checkpoint / CHECKPOINTS).is_dir():  # a run's output folder
        checkpoint = resolve_checkpoint(checkpoint, "latest")
    inputs = [checkpoint.resolve()]
    if inputs[0].parent.name == CHECKPOINTS:  # a checkpoint of a run: the run is an input too
        inputs.append(inputs[0].parent.parent)
    destination = check_output_folder(dst, inputs, overwrite=overwrite)
    dcp_weights(checkpoint)  # a DCP checkpoint, its files within it, its tensors whole
    if not (checkpoint / STATE_FILE).exists():
        raise InputError(f"{checkpoint}: no {STATE_FILE} (a DCP checkpoint of hf-p2r's trainer has one)")
    if file_within(checkpoint, checkpoint / STATE_FILE) is None:
        raise InputError(f"{checkpoint / STATE_FILE}: refused: {why_skipped(checkpoint, checkpoint / STATE_FILE)}")
    state, _, saved = read_trainer_state(checkpoint / STATE_FILE)
    check_files(checkpoint)
    config = run_config(saved, checkpoint / STATE_FILE)
    tokenizer = load_tokenizer(config.data.tokenizer_name)
    model = build_model(config, tokenizer, state.num_blocks, meta=True)
    remote_code = config.checkpointing.remote_code

    def write_weights(folder: Path, tensors: dict) -> None:
        write_dcp_weights(checkpoint, folder, tensors, max_shard_size=max_shard_size, progress=progress)

    blocks = config.model.num_hidden_layers if num_unique_layers is None else num_unique_layers
    if not get_target(target).vanilla and blocks == state.num_blocks and dtype is None:  # the trainer's folder
        return save_model(
            model,
            dst,
            tokenizer=tokenizer,
            remote_code=remote_code,
            overwrite=overwrite,
            write_weights=write_weights,
            progress=progress,
        )
    # What the converter refuses, refused now (before anything is written), naming the checkpoint.
    conversion_blocks(
        model.config.to_dict(),
        checkpoint,
        checkpoint / STATE_FILE,
        num_unique_layers=num_unique_layers,
        target=target,
        dtype=parse_dtype(dtype),
    )
    near = next(folder for folder in destination.absolute().parents if folder.is_dir())  # (no folder made for it)
    scratch = Path(tempfile.mkdtemp(prefix=f".{destination.name}.export-", dir=near))
    try:
        source = scratch / checkpoint.resolve().name  # (the model card names the source: checkpoint-N)
        save_model(
            model, source, tokenizer=tokenizer, remote_code=remote_code, write_weights=write_weights, progress=progress
        )
        return convert_pseudo_to_real(
            source,
            dst,
            num_unique_layers=num_unique_layers,
            max_shard_size=max_shard_size,
            dtype=dtype,
            target=target,
            overwrite=overwrite,
            progress=progress,
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def run_config(saved: dict, path: Path) -> TrainConfig:
    """The `TrainConfig` of a run from the flat configuration its `trainer_state.json` (`path`) records; a field that
    does not fit is an `InputError` naming the file."""
    try:
        return TrainConfig.from_dict(saved, check=False)
    except (ValueError, TypeError) as error:
        raise InputError(f'{path}: "config": {error}'.splitlines()[0]) from None
