"""A checkpoint the system refuses to write (a full disk, the file-size limit): one line saying which error and where,
exit 1, the checkpoint's temporary folder removed, the checkpoints before it kept."""

import errno
import resource
import shutil
import subprocess

import pytest
import torch

from hf_p2r.errors import exit_code
from hf_p2r.training import checkpointing as checkpointing_module
from hf_p2r.training import parse_config, train
from hf_p2r.training.checkpointing import list_checkpoints

from .helpers import PYTHON, REPO, subprocess_env, tiny_argv

TRAIN_SCRIPT = str(REPO / "scripts/train.py")
SCHEDULE = dict(pseudo_steps=3, real_steps=0, warmup_steps=1, save_steps=1, eval_steps=0)


def _refuse_the_third_save(monkeypatch, failure: str) -> None:
    """torch.save (Accelerate's writer of optimizer.bin) fails from the third checkpoint on: with the OSError a file
    object would give, or as torch reports a short write to a path (then the file system looks full)."""
    save, calls = torch.save, {"n": 0}

    def refusing(obj, path, *args, **kwargs):
        if str(path).endswith("optimizer.bin"):
            calls["n"] += 1
            if calls["n"] >= 3:
                with open(path, "wb") as file:
                    file.write(b"PK\x03\x04 partial")
                if failure == "OSError":
                    raise OSError(errno.ENOSPC, "No space left on device", str(path))
                raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
        return save(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", refusing)
    monkeypatch.setattr(checkpointing_module, "_free_bytes", lambda folder: 4096)


@pytest.mark.parametrize("failure", ["OSError", "torch's short write"])
def test_a_refused_write_is_one_line_and_keeps_the_earlier_checkpoints(tmp_path, monkeypatch, failure):
    _refuse_the_third_save(monkeypatch, failure)
    output_dir = tmp_path / "run"
    message = (
        r"^checkpoint-3 not saved: no space left on device \(ENOSPC\) writing optimizer\.bin into .*/checkpoints "
        r"\(0 MiB free there\); its temporary folder is removed and the checkpoints already there are kept: free some "
        r"space \(or lower save_total_limit\), then resume with --resume_from_checkpoint latest$"
    )
    with pytest.raises(OSError, match=message) as raised:
        train(parse_config(tiny_argv(output_dir, **SCHEDULE)))
    assert exit_code(raised.value) == 1  # a failure at run time, not bad input
    assert sorted(p.name for p in (output_dir / "checkpoints").iterdir()) == ["checkpoint-1", "checkpoint-2"]
    assert [p.name for p in list_checkpoints(output_dir)] == ["checkpoint-1", "checkpoint-2"]


def _script(command: list[str], preexec_fn=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        command,
        capture_output=True,
        text=True,
        env=subprocess_env(),
        cwd=REPO,
        timeout=300,
        preexec_fn=preexec_fn,
    )


def _check_refused(result: subprocess.CompletedProcess, checkpoint: str, reason: str, where) -> None:
    assert result.returncode == 1, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, result.stderr[-3000:]
    assert errors[0].startswith(f"train.py: error: {checkpoint} not saved: {reason} writing "), errors[0]
    assert f"into {where} (" in errors[0]
    assert "Traceback" not in result.stderr + result.stdout


def test_the_file_size_limit_is_said_as_efbig(tmp_path):
    """RLIMIT_FSIZE below optimizer.bin's size (about 250 kB for this model), above everything written before it."""

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))

    output_dir = tmp_path / "run"
    result = _script([PYTHON, TRAIN_SCRIPT, *tiny_argv(output_dir, **SCHEDULE)], preexec_fn=limit)
    _check_refused(result, "checkpoint-1", "file too large (EFBIG)", output_dir / "checkpoints")
    assert list(output_dir.glob("checkpoints/*")) == []  # its temporary folder removed


def test_a_full_disk_is_said_as_enospc(tmp_path):
    """A real full file system: a 1000 kB tmpfs (in a user and mount namespace of its own) holds two checkpoints of
    this model (about 400 kB each), not a third. Skipped where such a namespace is not permitted."""
    unshare = shutil.which("unshare")
    mount = tmp_path / "small"
    mount.mkdir()
    output_dir = mount / "run"
    namespace = [unshare or "unshare", "--mount", "--map-root-user", "sh", "-c"]
    probe = _script([*namespace, f"mount -t tmpfs -o size=1000k tmpfs {mount}"]) if unshare else None
    if probe is None or probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {probe.stderr.strip() if probe else 'no unshare'}")
    # The tmpfs goes with the namespace: the shell lists what the run left in it.
    script = (
        f'mount -t tmpfs -o size=1000k tmpfs {mount} && "$@"; status=$?; ls -A {output_dir}/checkpoints; exit $status'
    )
    result = _script([*namespace, script, "sh", PYTHON, TRAIN_SCRIPT, *tiny_argv(output_dir, **SCHEDULE)])
    _check_refused(result, "checkpoint-3", "no space left on device (ENOSPC)", output_dir / "checkpoints")
    assert result.stdout.split()[-2:] == ["checkpoint-1", "checkpoint-2"], result.stdout[-500:]
