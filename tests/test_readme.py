"""The README's Python quickstart runs as written."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_quickstart_runs(tmp_path, monkeypatch):
    section = README.read_text().split("## Quickstart in Python", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert "delink()" in code and "from_pretrained" in code
    monkeypatch.chdir(tmp_path)
    exec(compile(code, str(README), "exec"), {})
    assert (tmp_path / "p2r-pseudo" / "model.safetensors").exists()
    assert (tmp_path / "p2r-real" / "model.safetensors").exists()


def train_commands() -> list[list[str]]:
    """The trainer's arguments in every `scripts/train.py` command of the README's shell blocks (continuation lines
    joined, the launcher's own arguments dropped)."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", README.read_text(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("#", 1)[0]
            if "scripts/train.py" in line:
                commands.append(line.split("scripts/train.py", 1)[1].split())
    return commands


def test_every_training_command_passes_the_trainers_checks():
    """What the README tells a user to run (pipelines, FSDP2, DeepSpeed, the GPU preset) is a configuration the trainer
    accepts: a field the trainer refuses with a pipeline, say, would fail here and not on the user's cluster."""
    from hf_p2r.training import parse_config

    commands = train_commands()
    assert len(commands) >= 6 and any("--pipeline_parallel_size" in argv for argv in commands)
    root = README.parent
    for argv in commands:
        argv = [str(root / arg) if arg.startswith("configs/") else arg for arg in argv]
        parse_config(argv)
