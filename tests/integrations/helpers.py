"""One tiny run described once for both trainers: hf-p2r's own (`hf_p2r.training.train`) and `P2RTrainer`, on the
same model (`build_model`: the same initial weights), the same blocks in the same order (`build_blocks`, `BlockOrder`),
the same optimizer settings and the same schedule (`P2RCallback.from_config`).

Run as a module (`accelerate launch -m tests.integrations.helpers SPECS.json`) it trains the `P2RTrainer` runs that
SPECS.json lists, one after the other in the same processes (each {"output_dir", "fields": tiny_argv overrides, "args":
TrainingArguments overrides, "resume", and for a growth run "callback": P2RCallback's arguments and "real_depth"}),
and writes each run's log history to its output_dir/history.json (the main process).
"""

import json
import sys
from pathlib import Path

import torch
from accelerate import PartialState
from transformers import Trainer, TrainerCallback, TrainingArguments, default_data_collator

from hf_p2r.integrations import P2RCallback, P2RTrainer
from hf_p2r.training import TrainConfig, build_model, parse_config
from hf_p2r.training.data import BlockOrder, build_blocks, load_tokenizer

from ..training.helpers import tiny_argv

# What a resumed or distributed run must reproduce in Trainer's log history (the rest is timing).
DETERMINISTIC = (
    "step",
    "loss",
    "grad_norm",
    "learning_rate",
    "eval_loss",
    "p2r/num_hidden_layers",
    "p2r/num_blocks",
    "p2r/delink",
    "p2r/grow",
)
# The trainer's fields that TrainingArguments names alike.
SAME_NAMES = (
    "output_dir",
    "gradient_accumulation_steps",
    "learning_rate",
    "warmup_steps",
    "weight_decay",
    "adam_beta1",
    "adam_beta2",
    "adam_epsilon",
    "max_grad_norm",
    "seed",
)


def p2r_config(output_dir, **fields) -> TrainConfig:
    """hf-p2r's configuration of a tiny run (tests/training/helpers.py's `TINY`), constant learning rate by default:
    transformers' warm-up and decay formulas differ from hf-p2r's (docs/trainer.md)."""
    defaults = dict(lr_scheduler="constant", warmup_steps=0, shared_lr_scale="none", eval_steps=0, save_steps=0)
    return parse_config(tiny_argv(output_dir, **{**defaults, **fields}))


def trainer_for(
    config: TrainConfig,
    *,
    trainer_class: type[Trainer] = P2RTrainer,
    world_size: int = 1,
    callback: bool | P2RCallback = True,
    real_depth: int | None = None,
    **args,
) -> Trainer:
    """A trainer for the run `config` describes on `world_size` processes: its model, its training blocks in hf-p2r's
    order (each process takes its `per_device_batch_size` slice of every global batch, as Accelerate shards a
    sequential sampler and as hf-p2r's loop does), its optimizer settings and its schedule (or `callback`'s, if it is
    one); `args` override the TrainingArguments. `real_depth`: the model is a shallow one (its `num_hidden_layers`
    from `config`) that may grow to that depth."""
    t = config.train
    tokenizer = load_tokenizer(config.data.tokenizer_name)
    with PartialState().main_process_first():  # the main process tokenizes, the others read its cache file
        blocks, validation = build_blocks(config.data, tokenizer, t.seed)
    count = t.total_steps * t.per_device_batch_size * t.gradient_accumulation_steps * world_size
    labelled = blocks.select(BlockOrder(len(blocks), t.seed).indices(0, count)).map(with_labels, batched=True)
    validation = validation.select(range(min(len(validation), t.eval_blocks))).map(with_labels, batched=True)
    model = build_model(config, tokenizer, config.initial_blocks())
    model.config.use_cache = False
    if real_depth is not None:
        model.config.real_num_hidden_layers = real_depth
    fields = {name: getattr(t, name) for name in SAME_NAMES}
    fields.update(
        max_steps=t.total_steps,
        per_device_train_batch_size=t.per_device_batch_size,
        per_device_eval_batch_size=t.per_device_batch_size,
        lr_scheduler_type=t.lr_scheduler,
        optim="adamw_torch_fused",
        train_sampling_strategy="sequential",
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    fields.update(args)
    if isinstance(callback, P2RCallback):
        callbacks = [callback]
    else:
        callbacks = [P2RCallback.from_config(config)] if callback else []
    return trainer_class(
        model=model,
        args=TrainingArguments(**fields),
        train_dataset=labelled,
        eval_dataset=validation,
        data_collator=default_data_collator,
        processing_class=tokenizer,
        callbacks=callbacks,
    )


def with_labels(batch: dict) -> dict:
    return {"labels": batch["input_ids"]}  # the causal-LM loss shifts them itself


def last_layer_dtypes(trainer: Trainer, after_step: int) -> list:
    """The dtypes the model's last layer computes in (its MLP's output), recorded from the step after `after_step` on
    (on the model the trainer has then: the one a delink or a growth made); filled as `trainer` trains."""
    dtypes = []

    class Probe(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step == after_step:
                down_proj = model.model.layers[-1].mlp.down_proj
                down_proj.register_forward_hook(lambda module, inputs, output: dtypes.append(output.dtype))

    trainer.add_callback(Probe())
    return dtypes


def assert_state_carried(after: dict, name: str, source: dict, carry: str, ratio: float) -> None:
    """The Adam state of a new layer's parameter `name` after a delink or a growth: none (`carry` reset), its source
    block's `source` (copy), or that times `ratio` (scale; ratio**2 for exp_avg_sq), the step count kept."""
    if carry == "reset":
        assert name not in after
        return
    ratio = ratio if carry == "scale" else 1.0
    assert torch.equal(after[name]["step"], source["step"])
    assert torch.equal(after[name]["exp_avg"], source["exp_avg"] * ratio if ratio != 1 else source["exp_avg"])
    expected_sq = source["exp_avg_sq"] * ratio**2 if ratio != 1 else source["exp_avg_sq"]
    assert torch.equal(after[name]["exp_avg_sq"], expected_sq)


def deterministic(history: list[dict]) -> list[dict]:
    """The records of a log history, each with only what a repeated run must reproduce."""
    kept = [{key: record[key] for key in DETERMINISTIC if key in record} for record in history]
    return [record for record in kept if set(record) - {"step", "p2r/num_hidden_layers", "p2r/num_blocks"}]


def history(output_dir) -> list[dict]:
    return json.loads((Path(output_dir) / "history.json").read_text())


def main(spec_file: str) -> None:
    for spec in json.loads(Path(spec_file).read_text()):
        world_size = spec.get("world_size", 1)
        callback = P2RCallback(**spec["callback"]) if "callback" in spec else True
        config = p2r_config(spec["output_dir"], **spec["fields"])
        trainer = trainer_for(
            config, world_size=world_size, callback=callback, real_depth=spec.get("real_depth"), **spec["args"]
        )
        trainer.train(resume_from_checkpoint=spec.get("resume"))
        if trainer.is_world_process_zero():
            (Path(spec["output_dir"]) / "history.json").write_text(json.dumps(trainer.state.log_history))
    trainer.accelerator.end_training()  # once, after the last run: it ends the process group the runs share


if __name__ == "__main__":
    main(sys.argv[1])
