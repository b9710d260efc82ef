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
