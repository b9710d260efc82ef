"""What an engine is: the object behind the one training loop (`hf_p2r.training.train`) that owns how a step, a clip
and an optimizer step, a delink, an evaluation and a save happen for one way of running the model.

The loop reads top to bottom the same for every engine; an engine is built from the sections of the configuration it
reads and a few of the other sections' values (`engine_for` hands them out; `__init__` makes its `Accelerator` and
refuses what it cannot run), given the model (`build`), maybe a checkpoint (`load`), then driven step by step. A new
way of running the model (a parallelism, a backend) is one new subclass in this package and one line in `engine_for`
(`__init__.py`).
"""

import gc
from pathlib import Path

import torch
from accelerate import Accelerator
from transformers import PreTrainedTokenizerBase

from ...config import ComputeArguments
from ..optim import OptimizerFactory
from ..resume.checkpoints import TrainState
from ..resume.dcp import release_background_group


class Engine:
    """The interface the loop drives; the methods below each engine implements."""

    accelerator: Accelerator
    optimizer: torch.optim.Optimizer  # what the learning rate is set on before each step
    # The data layout: this process reads slice `data_rank` of every global micro-batch, cut into `data_size` slices
    # (the processes, or pipelines, reading different data).
    data_rank: int
    data_size: int

    def __init__(
        self,
        compute: ComputeArguments,
        *,
        block_size: int,
        optimizer_factory: OptimizerFactory,
        max_grad_norm: float,
        optimizer_carry: str,
        checkpoint_format: str,
        remote_code: bool,
    ):
        """`compute`: the run's compute section (the batch, the seed, the device, precision); the rest, values of the
        other sections: the blocks' tokens, the optimizer (`optimizer_factory(model, offload)`: the run's, from its
        optimizer section), clipping, the optimizer state's carry at a delink, the checkpoints' format as asked
        (`checkpoint_format` resolves "auto"), and whether saved models hold the model code."""
        self.compute = compute
        self.block_size = block_size
        self.optimizer_factory = optimizer_factory
        self.max_grad_norm = max_grad_norm
        self.optimizer_carry = optimizer_carry
        self.format_asked = checkpoint_format
        self.remote_code = remote_code

    @property
    def checkpoint_format(self) -> str:
        """How this run writes its resume checkpoints: `checkpoint_format`, "auto" resolved for the engine's layout."""
        return self.format_asked

    @property
    def tokens_per_step(self) -> int:
        compute = self.compute
        per_process = compute.per_device_batch_size * compute.gradient_accumulation_steps * self.block_size
        return per_process * self.data_size

    # --- build and resume ---------------------------------------------------------------------------------------------
    def build(self, model: torch.nn.Module, num_blocks: int) -> None:
        """Take the freshly built `model` (with `num_blocks` blocks: `model_blocks`) and make it ready to train: its
        placement, parallelism and optimizer."""
        raise NotImplementedError

    def model_blocks(self, state: TrainState) -> int:
        """Blocks of the model `build` takes for a run at `state` (a resumed run's, or the first model's)."""
        return state.num_blocks

    def load(self, checkpoint: Path, state: TrainState) -> None:
        """Load `checkpoint` (its files checked by `read_state`) into the built model and optimizer, on every
        process."""
        raise NotImplementedError

    # --- a step -------------------------------------------------------------------------------------------------------
    def forward_backward(self, input_ids: torch.Tensor) -> torch.Tensor | None:
        """One micro-batch's forward and backward (of `gradient_accumulation_steps`); its loss where this process
        computes one."""
        raise NotImplementedError

    def mean_loss(self, losses: list, signum: int) -> tuple[float, int]:
        """The step's mean loss over every process and the largest stop signal any process caught: one collective,
        the same answer everywhere."""
        raise NotImplementedError

    def optimizer_step(self) -> torch.Tensor | None:
        """Clip the gradients to `max_grad_norm` (0: no clipping), step the optimizer, zero the gradients; the
        gradient norm when it was computed."""
        raise NotImplementedError

    def step_measures(self) -> dict:
        """What the engine adds to a metrics record (a collective: every process calls it)."""
        return {}

    # --- delink, evaluation, saves ----------------------------------------------------------------------------------
    def delink(self, num_unique_layers: int | None) -> dict:
        """Delink the model to `num_unique_layers` blocks (None: the real model), the optimizer state carried
        (`hf_p2r.training.carry`); returns what the delink's metrics record adds."""
        raise NotImplementedError

    def delink_note(self, rules: str) -> str:
        """What the delink's message says after "delinked k -> k' blocks", around `rules` (the optimizer state's carry
        and the learning rate's rule after a delink)."""
        return f" ({rules})"

    @torch.no_grad()
    def evaluate(self, blocks, count: int) -> float:
        """The validation loss over `count` (the run's `eval_blocks`) of `blocks`, the same on every process."""
        raise NotImplementedError

    def weights(self):
        """The model's weights as `all_finite` reads them (checked before `pseudo/` is written)."""
        raise NotImplementedError

    def training_state(self):
        """What a checkpoint holds, as `all_finite` reads it (checked before the checkpoint is written)."""
        raise NotImplementedError

    def save_model(self, directory: Path, tokenizer: PreTrainedTokenizerBase) -> None:
        """`pseudo/` or `real/`: the whole model and its tokenizer as one ordinary checkpoint."""
        raise NotImplementedError

    def write_checkpoint(self, folder: Path, training_state) -> None:
        """This process's part of a resume checkpoint into `folder` (`training_state`, already checked): the `write`
        of `hf_p2r.training.resume.checkpoints.save_checkpoint`, which makes `checkpoint-{step}/` of it atomically
        with `trainer_state.json`."""
        raise NotImplementedError

    def title(self) -> str:
        """What the loss curve's title says of the run's layout."""
        return f"optimizer_carry={self.optimizer_carry}"

    def release(self) -> None:
        """Drop what the engine built (model, optimizer, pipeline), then collect the reference cycles among them now.

        Left to the interpreter's exit, a cycle that holds gloo's work objects or process groups (a pipeline's
        schedule refers back to its pipeline, for one) can be destroyed during finalization, where gloo aborts the
        process ("terminate called without an active exception", SIGABRT) and replaces the run's exit code: seen in
        3-4 of 14 two-process runs that built pipelines and gathered objects without collecting first, none in 14
        with this collection (tests/distributed/spawn.py and the pipeline benchmarks' workers do the same). The
        asynchronous checkpoints' gloo group goes the same way (`release_background_group`)."""
        release_background_group()
        gc.collect()

    def close(self) -> None:
        """The end of the run, on every path out of it (done, stopped by a signal, an error): release what was
        built, end the trackers and the process group."""
        self.release()
        self.accelerator.end_training()
