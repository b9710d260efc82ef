"""The same callback under TRL's SFTTrainer (`p2r_trainer(SFTTrainer)`): continued pretraining on raw text (the
built-in corpus, packed into blocks), through a partial delink and the delink to the real model, resumed from a
checkpoint of the real stage. Skipped without TRL (`pip install hf-p2r[trl]`)."""

import pytest
import torch

from hf_p2r import P2RConfig, P2RForCausalLM
from hf_p2r.integrations import P2RCallback, p2r_trainer
from hf_p2r.training.data import load_tokenizer, stdlib_corpus

from .helpers import deterministic

trl = pytest.importorskip("trl")


def sft_trainer(output_dir, **args):
    """TRL's SFTTrainer with P2R on a tiny pseudo model (1 block of 4 layers): raw text, packed into blocks of 32
    tokens (`packing_strategy: wrapped`: documents concatenated, as hf-p2r's own blocks), TRL's defaults otherwise
    (bf16 autocast, its fused LM head: patched on the model's instance)."""
    tokenizer = load_tokenizer(None)
    special = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    config = P2RConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2, vocab_size=320,
        max_position_embeddings=32, share_layers=True, num_unique_layers=1, use_cache=False,
        pad_token_id=tokenizer.pad_token_id, **special,
    )  # fmt: skip
    torch.manual_seed(0)
    fields = dict(
        max_steps=6, per_device_train_batch_size=4, learning_rate=3e-3, logging_steps=1, report_to="none",
        use_cpu=True, disable_tqdm=True, packing=True, packing_strategy="wrapped", max_length=32,
        save_strategy="steps", save_steps=5, seed=0,
    )  # fmt: skip
    return p2r_trainer(trl.SFTTrainer)(
        model=P2RForCausalLM(config),
        args=trl.SFTConfig(str(output_dir), **{**fields, **args}),
        train_dataset=stdlib_corpus(30_000),
        processing_class=tokenizer,
        callbacks=[P2RCallback(delink_at={2: 2, 4: None}, carry="scale")],
    )


@pytest.mark.slow
@pytest.mark.versions  # trl's floor and newest release: make compat
def test_sft_trainer_delinks_keeps_trls_fused_head_and_resumes_bitwise(tmp_path):
    trainer = sft_trainer(tmp_path / "run")
    assert type(trainer).__name__ == "P2RSFTTrainer" and trainer.args.bf16
    trainer.train()
    records = trainer.state.log_history
    assert [(r["step"], r["p2r/num_blocks"]) for r in records if "p2r/delink" in r] == [(2, 2), (4, 4)]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 6 and all(0 < loss < 10 for loss in losses)
    assert "mean_token_accuracy" in records[0]  # TRL's own metrics, from its fused head, logged as usual
    model = trainer.model
    assert model.config.share_layers is False and "forward" in vars(model)  # the delink kept TRL's patch
    ids = torch.randint(0, 256, (1, 8))
    assert model(input_ids=ids, labels=ids, fused_lm_head=True).log_probs.shape == (1, 7)

    resumed = sft_trainer(tmp_path / "resumed")
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-5"))  # the real model
    assert deterministic(resumed.state.log_history) == deterministic(records)
