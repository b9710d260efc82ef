"""P2R in an ordinary transformers `Trainer` script: a pseudo model (8 layers sharing 1 block) trains, is delinked to
2 blocks, then to the real model (8 blocks, the same function), which trains on; checkpoints along the way resume on
either side of a delink; the real model is saved and its Hub push is shown as a dry run. No download: the corpus is
the Python standard library's sources, the tokenizer hf-p2r's byte-level one. A few minutes on two CPU cores.

    python examples/trainer_callback.py --output_dir runs/trainer-demo
    python examples/trainer_callback.py --output_dir runs/trainer-demo --resume_from_checkpoint latest
    python examples/trainer_callback.py --output_dir runs/trainer-demo --push_to me/p2r-demo  # a dry run

Everything P2R adds to the script is marked `# P2R`; docs/trainer.md explains it.
"""

import argparse
from pathlib import Path

from transformers import DataCollatorForLanguageModeling, TrainingArguments

from hf_p2r import P2RConfig, P2RForCausalLM, push_to_hub
from hf_p2r.integrations import P2RCallback, P2RTrainer  # P2R
from hf_p2r.training.data import DataArguments, build_blocks, load_tokenizer


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output_dir", default="runs/trainer-demo")
    parser.add_argument("--max_steps", type=int, default=60)
    parser.add_argument("--resume_from_checkpoint", help="a checkpoint folder, or 'latest' (the newest in output_dir)")
    parser.add_argument("--push_to", metavar="REPO_ID", help="show what pushing the real model there would upload")
    options = parser.parse_args(argv)

    # Data: packed blocks of 128 tokens (any dataset of input_ids works; the collator makes the labels).
    tokenizer = load_tokenizer(None)
    block_size = 128
    train_blocks, validation_blocks = build_blocks(
        DataArguments(corpus_max_bytes=400_000, block_size=block_size, validation_fraction=0.05), tokenizer, seed=0
    )

    # The model: a pseudo model, 8 layers sharing 1 block (or P2RForCausalLM.from_pretrained(a pseudo checkpoint)).
    config = P2RConfig(
        # What the data gives: the tokenizer's 258 tokens (rounded up to 64), its special tokens, the block's length.
        vocab_size=320,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        max_position_embeddings=block_size,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=8,
        num_attention_heads=4,
        share_layers=True,  # P2R: the pseudo model
        num_unique_layers=1,
        use_cache=False,
    )
    model = P2RForCausalLM(config)

    steps = options.max_steps
    args = TrainingArguments(
        output_dir=options.output_dir,
        max_steps=steps,
        per_device_train_batch_size=8,
        learning_rate=2e-3,
        lr_scheduler_type="cosine",
        warmup_steps=steps // 10,
        weight_decay=0.1,
        adam_beta2=0.95,
        logging_steps=5,
        eval_strategy="steps",
        eval_steps=steps // 3,
        save_steps=steps // 6,
        per_device_eval_batch_size=16,
        seed=0,
        report_to="none",
    )
    trainer = P2RTrainer(  # P2R: Trainer -> P2RTrainer (p2r_trainer(SFTTrainer) for TRL's)
        model=model,
        args=args,
        train_dataset=train_blocks,
        eval_dataset=validation_blocks.select(range(min(64, len(validation_blocks)))),
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
        processing_class=tokenizer,
        # P2R: 1 block -> 2 at a sixth of the run -> the real model (8 blocks) at a third
        callbacks=[P2RCallback(delink_at={steps // 6: 2, steps // 3: None}, carry="scale")],
    )
    resume = options.resume_from_checkpoint
    trainer.train(resume_from_checkpoint=True if resume == "latest" else resume)

    real = Path(options.output_dir) / "real"
    trainer.save_model(str(real))  # the real model (config.json: share_layers false) and its tokenizer
    stage = "pseudo" if trainer.model.config.share_layers else "real"
    print(f"{stage} model with {trainer.model.config.num_blocks} blocks saved in {real}")
    if options.push_to:  # trainer.push_to_hub() publishes output_dir with hf-p2r's model card; here, offline:
        print(push_to_hub(real, options.push_to, dry_run=True))


if __name__ == "__main__":
    main()
