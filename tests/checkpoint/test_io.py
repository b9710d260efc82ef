import os
import stat
import subprocess
import sys

import pytest
import torch

from hf_p2r.checkpoint import atomic_directory, write_checkpoint
from hf_p2r.checkpoint import io as io_module


def _dead_pid() -> int:
    """The PID of a process that has exited (and been reaped)."""
    process = subprocess.Popen([sys.executable, "-c", ""])
    process.wait()
    return process.pid


def _names(folder):
    return sorted(p.name for p in folder.iterdir())


@pytest.fixture
def umask():
    """Set the umask for one test (and restore it)."""
    previous = os.umask(0o022)
    yield os.umask
    os.umask(previous)


def test_temporary_folder_is_named_for_destination_process_and_host(tmp_path):
    with atomic_directory(tmp_path / "out") as tmp:
        assert tmp.parent == tmp_path
        assert tmp.name.startswith(f".out.tmp-{os.getpid()}-{io_module._host()}-")
        (tmp / "file").write_text("x")
    assert _names(tmp_path) == ["out"] and _names(tmp_path / "out") == ["file"]


def test_stale_temporaries_of_dead_processes_are_removed(tmp_path):
    dead, host = _dead_pid(), io_module._host()
    stale = {
        f".out.tmp-{dead}-{host}-0123abcd": "a killed conversion: removed",
        f".out.tmp-{os.getpid()}-{host}-89abcdef": "a live process (this one): kept",
        f".out.tmp-{dead}-other-host.example-0123abcd": "another host (shared filesystem): kept",
        f".other.tmp-{dead}-{host}-0123abcd": "another destination: kept",
        f".out.tmp-{dead}-{host}": "not our name pattern: kept",
        ".out.tmp-abc": "the old, PID-less names: kept",
        f".out.old-{dead}-{host}-0123abcd": "a moved-aside old copy, but DST is absent: kept",
    }
    for name in stale:
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(b"partial")
    with atomic_directory(tmp_path / "out"):
        pass
    kept = sorted(name for name, why in stale.items() if why.endswith("kept"))
    assert _names(tmp_path) == sorted([*kept, "out"])
    # once DST exists again, the old copy of a dead process is removed too
    with atomic_directory(tmp_path / "out", overwrite=True):
        pass
    assert _names(tmp_path) == sorted([*(name for name in kept if ".old-" not in name), "out"])


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two renames"])
def test_overwrite_replaces_destination(tmp_path, monkeypatch, exchange):
    if exchange and io_module._renameat2() is None:
        pytest.skip("no renameat2 in this C library")
    if not exchange:
        monkeypatch.setattr(io_module, "_renameat2", lambda: None)
    renames = []
    real_replace = os.replace
    monkeypatch.setattr(io_module.os, "replace", lambda a, b: renames.append((a, b)) or real_replace(a, b))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "old.txt").write_text("old")
    with atomic_directory(tmp_path / "out", overwrite=True) as tmp:
        (tmp / "new.txt").write_text("new")
    assert _names(tmp_path) == ["out"] and _names(tmp_path / "out") == ["new.txt"]
    # RENAME_EXCHANGE swaps the two folders in one system call: DST is never absent. The fallback moves DST aside first.
    assert len(renames) == (0 if exchange else 2)


def test_exchange_is_atomic_swap(tmp_path):
    if io_module._renameat2() is None:
        pytest.skip("no renameat2 in this C library")
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "in_a").touch()
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "in_b").touch()
    assert io_module._exchange(tmp_path / "a", tmp_path / "b")
    assert _names(tmp_path / "a") == ["in_b"] and _names(tmp_path / "b") == ["in_a"]
    with pytest.raises(FileNotFoundError):
        io_module._exchange(tmp_path / "a", tmp_path / "missing")


def test_failure_leaves_old_destination(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "old.txt").write_text("old")
    with pytest.raises(RuntimeError), atomic_directory(tmp_path / "out", overwrite=True) as tmp:
        (tmp / "new.txt").write_text("new")
        raise RuntimeError("mid-way")
    assert _names(tmp_path) == ["out"] and (tmp_path / "out" / "old.txt").read_text() == "old"


@pytest.mark.parametrize("mask", [0o022, 0o027, 0o077])
def test_output_modes_follow_the_umask(tmp_path, umask, mask):
    """Like mkdir and open: a folder others can read (mkdtemp would make it 0700), files too (safetensors writes
    0600)."""
    umask(mask)
    with atomic_directory(tmp_path / "out") as tmp:
        write_checkpoint(tmp, {"w": torch.zeros(3)}, progress=False)
        write_checkpoint(tmp, {f"w{i}": torch.zeros(100) for i in range(3)}, max_shard_size=500, progress=False)
    assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == 0o777 & ~mask
    for path in (tmp_path / "out").iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~mask, path.name


def test_files_within_keeps_what_lies_in_the_folder_and_skips_links_out(tmp_path):
    from hf_p2r.checkpoint import file_within, files_within

    folder = tmp_path / "model"
    (folder / "sub").mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "sub" / "notes.txt").write_text("x")
    (folder / "alias.json").symlink_to("config.json")  # a link within the folder: kept
    outside = tmp_path / "secret.txt"
    outside.write_text("token")
    (folder / "tokenizer.json").symlink_to(outside)  # a link out of the folder: skipped
    (folder / "proc").symlink_to("/proc/self")  # a link to a folder outside: skipped, never walked
    (folder / "dangling.json").symlink_to(tmp_path / "missing")
    os.mkfifo(folder / "pipe.json")
    (folder / ".hidden").write_text("x")
    kept, skipped = files_within(folder)
    assert kept == ["alias.json", "config.json", "sub/notes.txt"]
    assert skipped == ["dangling.json", "pipe.json", "proc", "tokenizer.json"]
    assert file_within(folder, folder / "tokenizer.json") is None
    assert file_within(folder, folder / "alias.json") == (folder / "config.json").resolve()


def test_files_within_follows_a_hub_cache_snapshot_into_its_blobs(tmp_path):
    from hf_p2r.checkpoint import files_within

    repo = tmp_path / "hub" / "models--org--name"
    snapshot = repo / "snapshots" / "abc123"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (repo / "blobs" / "1234").write_text("{}")
    (snapshot / "config.json").symlink_to("../../blobs/1234")
    (tmp_path / "hub" / "other").write_text("x")
    (snapshot / "escape.json").symlink_to("../../../other")  # out of the repository: skipped
    assert files_within(snapshot) == (["config.json"], ["escape.json"])


# --- two writers, one destination --------------------------------------------------------------------------------


def test_a_destination_filled_meanwhile_is_not_replaced(tmp_path):
    """Two conversions to one DST: the later one finds, at its rename, the folder the earlier one finished. Without
    overwrite it is refused at that moment (the check at start passed), the earlier output is kept, nothing of the
    later one is left."""
    with pytest.raises(FileExistsError, match="out: another process wrote this folder while this one ran"):
        with atomic_directory(tmp_path / "out") as tmp:
            (tmp / "mine.txt").write_text("later")
            with atomic_directory(tmp_path / "out") as other:  # the earlier conversion finishes first
                (other / "theirs.txt").write_text("earlier")
    assert _names(tmp_path) == ["out"] and _names(tmp_path / "out") == ["theirs.txt"]


def test_an_empty_destination_is_replaced_and_overwrite_still_replaces_a_filled_one(tmp_path):
    (tmp_path / "out").mkdir()
    with atomic_directory(tmp_path / "out") as tmp:  # an empty folder, made by the user: replaced
        (tmp / "a.txt").write_text("a")
    assert _names(tmp_path / "out") == ["a.txt"]
    with atomic_directory(tmp_path / "out", overwrite=True) as tmp:
        (tmp / "b.txt").write_text("b")
        with atomic_directory(tmp_path / "out", overwrite=True) as other:
            (other / "c.txt").write_text("c")
    assert _names(tmp_path) == ["out"] and _names(tmp_path / "out") == ["b.txt"], "with overwrite the later wins"


def test_a_destination_that_is_a_link_is_written_through(tmp_path):
    """DST a link to a folder (e.g. runs/latest -> runs/2026-01): the output replaces the link's target, the link
    stays, and nothing is left beside either (the temporary folder once stayed behind as a link, undeletable by
    rmtree)."""
    (tmp_path / "target").mkdir()
    (tmp_path / "link").symlink_to("target")
    with atomic_directory(tmp_path / "link") as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".target.tmp-")
        (tmp / "a.txt").write_text("a")
    assert _names(tmp_path) == ["link", "target"] and (tmp_path / "link").is_symlink()
    assert _names(tmp_path / "target") == ["a.txt"]
    with pytest.raises(FileExistsError, match="target: folder is not empty"), atomic_directory(tmp_path / "link"):
        pass
    with atomic_directory(tmp_path / "link", overwrite=True) as tmp:
        (tmp / "b.txt").write_text("b")
    assert _names(tmp_path) == ["link", "target"] and _names(tmp_path / "link") == ["b.txt"]
    (tmp_path / "dangling").symlink_to("made/later")  # a dangling link: its target is made
    with atomic_directory(tmp_path / "dangling") as tmp:
        (tmp / "c.txt").write_text("c")
    assert _names(tmp_path / "dangling") == ["c.txt"] and (tmp_path / "dangling").is_symlink()
    (tmp_path / "loop").symlink_to("loop")
    with pytest.raises(ValueError, match="loop: a link that loops"), atomic_directory(tmp_path / "loop"):
        pass


def test_parents_made_for_a_failed_output_are_removed(tmp_path):
    with pytest.raises(RuntimeError), atomic_directory(tmp_path / "a" / "b" / "out"):
        raise RuntimeError("mid-way")
    assert _names(tmp_path) == []


# --- config.json: whatever the file holds, one line ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: p.write_text("[" * 100_000), "config.json: not valid JSON \\(nested too deeply\\)"),
        (lambda p: p.write_text("[" * 40 + "]" * 40), "config.json: expected a JSON object, got array"),
        (lambda p: p.write_text('{"a":' * 40 + "1" + "}" * 40), "config.json: nested more than 32 levels deep"),
        (lambda p: p.write_bytes(b'{"a": "\xff"}'), "config.json: not valid JSON"),
        (lambda p: os.mkfifo(p), "config.json: a FIFO: not read"),
        (lambda p: p.symlink_to("/dev/zero"), "config.json: a link to a character device \\(/dev/zero\\): not read"),
        (lambda p: p.symlink_to("/proc/self/environ"), "config.json: a link out of .*model \\(to /proc/.*environ\\)"),
        (lambda p: p.symlink_to(p.parent.parent / "elsewhere.json"), "config.json: a link out of .*model"),
    ],
    ids=["deep", "array", "nested config", "bad utf-8", "fifo", "/dev/zero", "/proc", "out of the folder"],
)
def test_config_json_is_one_line_whatever_it_holds(tmp_path, make, message):
    from hf_p2r.checkpoint import read_config_dict

    (tmp_path / "model").mkdir()
    (tmp_path / "elsewhere.json").write_text("{}")
    make(tmp_path / "model" / "config.json")
    with pytest.raises(ValueError, match=message) as info:
        read_config_dict(tmp_path / "model")
    assert "\n" not in str(info.value)
