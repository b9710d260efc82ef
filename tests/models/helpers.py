"""What the model tests share: checks that a folder hf-p2r wrote loads, and computes the same, without hf-p2r."""

import os
import subprocess
import sys
import textwrap

import torch

# The files of a P2R model folder saved with its code (`remote_code=True`), before the tokenizer's.
MODEL_FILES_WITH_CODE = [
    "config.json",
    "configuration_p2r.py",
    "generation_config.json",
    "model.safetensors",
    "modeling_p2r.py",
    "sharing_p2r.py",
]


def logits(model, input_ids) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids).logits


def assert_export_matches(vanilla_class, p2r_class, exported, saved, real, input_ids) -> list:
    """`exported` (a folder in a transformers family) loaded by `vanilla_class` gives the logits of `saved` (the P2R
    save of `real`) bitwise, and those of the in-memory `real` to rounding, with eager and SDPA attention; it generates
    what `real` generates. Returns the (vanilla, P2R) models loaded, one pair per attention."""
    loaded = []
    for impl in ("eager", "sdpa"):
        vanilla = vanilla_class.from_pretrained(exported, attn_implementation=impl)
        p2r = p2r_class.from_pretrained(saved, attn_implementation=impl)
        # Bitwise against P2R over the same bytes. Against the in-memory model only to rounding: mmapped weights sit
        # at another memory alignment, which can change the CPU GEMM kernel's last bit.
        assert torch.equal(logits(vanilla, input_ids), logits(p2r, input_ids))
        real.set_attn_implementation(impl)
        torch.testing.assert_close(logits(vanilla, input_ids), logits(real, input_ids), rtol=1e-5, atol=1e-6)
        loaded.append((vanilla, p2r))
    assert torch.equal(
        vanilla.generate(input_ids[:, :4], max_new_tokens=8, do_sample=False),
        real.generate(input_ids[:, :4], max_new_tokens=8, do_sample=False),
    )
    return loaded


def load_as_remote_code(model, folder, input_ids, tmp_path) -> tuple[str, int, int]:
    """`folder` (saved from `model` with `remote_code=True`) loaded through `AutoModelForCausalLM` with
    `trust_remote_code` in a fresh Python that cannot import hf_p2r, as a pseudo and as a real model: both give
    `model`'s logits bitwise. Returns (the loaded class's module, the pseudo's layers, the real's layers)."""
    torch.save({"input_ids": input_ids, "logits": logits(model, input_ids)}, tmp_path / "reference.pt")
    script = textwrap.dedent(f"""
        import sys, torch
        from transformers import AutoModelForCausalLM
        ref = torch.load({str(tmp_path / "reference.pt")!r}, weights_only=True)
        pseudo = AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True)
        real = AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True, share_layers=False)
        assert "hf_p2r" not in sys.modules, "the folder must not need hf_p2r"
        with torch.no_grad():
            assert torch.equal(pseudo(ref["input_ids"]).logits, ref["logits"])
            assert torch.equal(real(ref["input_ids"]).logits, ref["logits"])
        print(type(pseudo).__module__, len(pseudo.model.layers), len(real.model.layers))
    """)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"), PYTHONPATH="")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    module, pseudo_layers, real_layers = result.stdout.split()
    return module, int(pseudo_layers), int(real_layers)
