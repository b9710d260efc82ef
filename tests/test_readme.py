"""The README and docs/ as a user meets them: the Python blocks run (or are run by a named test, or excused with the
reason), every training command passes the trainer's checks, every relative link and anchor resolves, each table of
contents lists its page's sections, every page is reachable from the index, every benchmark page is quoted with its
newest date, and the README stays short. (Their shell commands run in test_readme_commands.py.)"""

import re
from pathlib import Path

import pytest

from .docs_pages import (
    INDEX,
    PENDING,
    README,
    REPO,
    anchors,
    code_blocks,
    headings,
    links,
    local_target,
    outside_code,
    pages,
    relative,
    text,
)

# Every ```python block of the pages, by a string only it holds: how the suite runs it. "here": executed in a fresh
# folder by test_python_blocks_run; "after the commands": test_readme_commands runs it in its workspace once the
# commands have written runs/; a test's name: that test runs it as written; anything else: why it is not run.
PYTHON_BLOCKS = {
    "num_hidden_layers=12, share_layers=True, num_unique_layers=1)": "tests/test_readme.py::"
    "test_the_quickstart_saves_both_models",
    "num_experts=8, num_experts_per_tok=2, share_layers=True)": "here",
    'growth="interleave", function_preserving=True)': "here",
    'AutoTokenizer.from_pretrained("runs/demo/real")': "after the commands",
    "convert_pseudo_to_real(": "tests/checkpoint/test_convert.py::test_readme_examples_run_on_what_make_demo_writes",
    "CheckpointReader(": "tests/checkpoint/test_convert.py::test_readme_examples_run_on_what_make_demo_writes",
    'from_pretrained("pseudo_dir")': "a fragment: loads a folder of the reader's (tests/models/test_save_load.py "
    "covers each call)",
    "GranularOffload(model, 0.5": "needs a CUDA device (tests/training/test_offload.py runs the same calls on CPU)",
    "DistributedConfig(tp_size=8)": "needs 8 processes under torchrun (tests/distributed/test_tensor_parallel.py)",
    "callbacks=[P2RCallback(delink_at={1000: 4, 3000: None}": "tests/integrations/test_example.py::"
    "test_the_example_trains_resumes_on_either_side_of_the_delink_and_dry_runs_the_push",
    "growth=[Grow(": "tests/integrations/test_growth.py::test_the_growth_snippet_of_the_docs_runs_as_written",
    "p2r_trainer(SFTTrainer)": "tests/integrations/test_trl.py::"
    "test_sft_trainer_delinks_keeps_trls_fused_head_and_resumes_bitwise",
}


def python_blocks() -> list[tuple[Path, str]]:
    return [(page, block) for page in pages() for block in code_blocks(page, "python")]


def how_run(block: str) -> str:
    matches = [how for key, how in PYTHON_BLOCKS.items() if key in block]
    assert len(matches) == 1, f"a Python block matches {len(matches)} entries of PYTHON_BLOCKS:\n{block}"
    return matches[0]


def test_every_python_block_is_run_or_excused():
    blocks = python_blocks()
    for _, block in blocks:
        how_run(block)
    unused = [key for key in PYTHON_BLOCKS if not any(key in block for _, block in blocks)]
    assert not unused, f"PYTHON_BLOCKS entries that match no block: {unused}"
    for how in set(PYTHON_BLOCKS.values()):
        if how.startswith("tests/"):
            path, _, name = how.partition("::")
            assert f"def {name}(" in (REPO / path).read_text(encoding="utf-8"), how


@pytest.mark.parametrize(
    "key", [key for key, how in PYTHON_BLOCKS.items() if how == "here"], ids=lambda key: key.split("(")[0][:30]
)
def test_python_blocks_run(key, tmp_path, monkeypatch):
    page, block = next((page, block) for page, block in python_blocks() if key in block)
    monkeypatch.chdir(tmp_path)
    exec(compile(block, str(page), "exec"), {})
    assert any(tmp_path.iterdir()), "each of these blocks saves a model"


def test_the_quickstart_saves_both_models(tmp_path, monkeypatch):
    section = text(README).split("## Quickstart: load and generate", 1)[1].split("\n## ")[0]
    code = next(block for block in re.findall(r"```python\n(.*?)```", section, re.S) if "P2RConfig(" in block)
    assert "delink()" in code and "from_pretrained" in code
    monkeypatch.chdir(tmp_path)
    exec(compile(code, str(README), "exec"), {})
    assert (tmp_path / "p2r-pseudo" / "model.safetensors").exists()
    assert (tmp_path / "p2r-real" / "model.safetensors").exists()


def train_commands() -> list[list[str]]:
    """The trainer's arguments in every `scripts/train.py` command of the pages' shell blocks (continuation lines
    joined, the launcher's own arguments dropped)."""
    commands = []
    for page in pages():
        for block in code_blocks(page, "bash"):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.split("#", 1)[0]
                if "scripts/train.py" in line:
                    commands.append(line.split("scripts/train.py", 1)[1].split())
    return commands


def test_every_training_command_passes_the_trainers_checks():
    """What the pages tell a user to run (pipelines, FSDP2, DeepSpeed, the GPU preset) is a configuration the trainer
    accepts: a field the trainer refuses with a pipeline, say, would fail here and not on the user's cluster."""
    from hf_p2r.training import parse_config

    commands = train_commands()
    assert len(commands) >= 6 and any("--pipeline_parallel_size" in argv for argv in commands)
    for argv in commands:
        argv = [str(REPO / arg) if arg.startswith("configs/") else arg for arg in argv]
        parse_config(argv)


def test_every_relative_link_and_anchor_resolves():
    broken = []
    for page in pages():
        for target in links(page):
            local = local_target(page, target)
            if local is None:
                continue
            path, anchor = local
            if not path.exists():
                if relative(path) not in PENDING:
                    broken.append(f"{relative(page)}: {target} (no such file)")
            elif anchor and path.suffix == ".md" and anchor not in anchors(path):
                broken.append(f"{relative(page)}: {target} (no such section in {relative(path)})")
    assert not broken, "\n".join(broken)


def test_pending_pages_are_still_pending():
    """A page of PENDING that now exists is tested like any other: take it off the list."""
    arrived = [name for name in PENDING if (REPO / name).exists()]
    assert not arrived, f"{arrived} exist now: remove them from PENDING in tests/docs_pages.py"


def test_every_table_of_contents_lists_its_pages_sections():
    checked = 0
    for page in pages():
        match = re.search(r"<!-- toc -->\n(.*?)<!-- /toc -->", text(page), re.S)
        if not match:
            continue
        listed = re.findall(r"^- \[(.+)\]\(#([^)]+)\)$", match.group(1), re.M)
        sections = [title for level, title in headings(page) if level == 2]
        assert [title for title, _ in listed] == sections, relative(page)
        for title, anchor in listed:
            assert anchor in anchors(page), f"{relative(page)}: {title} -> #{anchor}"
        checked += 1
    assert checked >= 5


def test_every_page_is_linked_from_the_index_and_the_index_from_the_readme():
    linked = {local_target(INDEX, target)[0] for target in links(INDEX) if local_target(INDEX, target)}
    unlinked = [relative(page) for page in sorted(INDEX.parent.glob("*.md")) if page != INDEX and page not in linked]
    assert not unlinked, f"docs pages the index (docs/README.md) does not link: {unlinked}"
    assert INDEX in {local_target(README, target)[0] for target in links(README) if local_target(README, target)}
    assert set(pages()) == {README, INDEX, *INDEX.parent.glob("*.md")}


def test_every_path_a_page_names_exists():
    """A file or folder of the repository named in code spans (`hf_p2r/...`, `tests/...`, `configs/...`) exists: a
    module that moves takes its mentions along."""
    roots = ("hf_p2r", "tests", "scripts", "configs", "benchmarks", "requirements", "model_cards", "docs")
    missing = []
    for page in pages():
        for span in re.findall(r"`([^`\n]+)`", outside_code(page)):
            for path in re.findall(rf"(?<![\w./-])((?:{'|'.join(roots)})/[\w./-]*)", span):
                path = path.rstrip(".")
                if any(mark in span for mark in "<*{") or path.endswith("_"):
                    continue  # a pattern, not a path
                if not (REPO / path).exists() and path not in PENDING:
                    missing.append(f"{relative(page)}: {path}")
    assert not missing, "\n".join(missing)


def test_every_benchmark_page_is_quoted_with_its_newest_date():
    """docs/benchmarks.md links every page under benchmarks/, and the section that links a page quotes that page's
    newest date: a benchmark re-run (its page rewritten with a later date) is not summarised with stale figures."""
    page = REPO / "docs" / "benchmarks.md"
    sections = re.split(r"\n## ", text(page))
    linked = {}
    for section in sections:
        for target in links_in(section):
            local = local_target(page, target)
            if local and local[0].suffix == ".md" and REPO / "benchmarks" in local[0].parents:
                linked[local[0]] = section
    unlinked = [relative(p) for p in sorted((REPO / "benchmarks").rglob("*.md")) if p not in linked]
    assert not unlinked, f"benchmark pages docs/benchmarks.md does not link: {unlinked}"
    stale = []
    for bench, section in linked.items():
        dates = re.findall(r"(?<!\d)20\d\d-\d\d-\d\d(?!\d)", text(bench))
        if dates and max(dates) not in section:
            stale.append(f"{relative(bench)}: its newest date {max(dates)} is not in its section of docs/benchmarks.md")
    assert not stale, "\n".join(stale)


def links_in(markdown: str) -> list[str]:
    return re.findall(r"\]\(([^)\s]+)\)", re.sub(r"```.*?```", "", markdown, flags=re.S))


def test_the_readme_is_short():
    lines = text(README).count("\n")
    assert lines <= 200, f"README.md has {lines} lines: move the details to a page of docs/"
