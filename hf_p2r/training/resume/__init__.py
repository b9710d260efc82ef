"""The resume state in one package: what a checkpoint holds, how it is written and read back, and how it leaves.

- `checkpoints`: the atomic save protocol (`save_checkpoint`, in the background with `checkpoint_async`), the
  checkpoints of a run (`list_checkpoints`, pruning, `discard_after`), `trainer_state.json` (`TrainState`,
  `read_state`, `read_trainer_state`: checked field by field), the checks of every file before a load
  (`check_checkpoint_files`), and the models a run publishes (`save_model`).
- `dcp`: torch.distributed.checkpoint shards under the model's names (`checkpoint_format: dcp`), which any layout
  resumes: one process, DDP, FSDP2, DeepSpeed ZeRO-3, pipeline stages.
- `export`: a training checkpoint as a Hugging Face folder (`hf-p2r export`).

The torch-free reading of a checkpoint's saved configuration, which the trainer's configuration takes at a resume,
stays in `hf_p2r.config.resume` (`hf-p2r train --help` and a configuration error answer without torch). The old module
paths (`hf_p2r.training.checkpointing`, `.dcp`, `.export`) are these modules.
"""
