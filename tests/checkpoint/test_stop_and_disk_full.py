"""A conversion stopped part-way (Ctrl-C, SIGTERM) or out of disk ends within a piece, in one line, leaving nothing.

Each test runs `hf-p2r convert` in a fresh process, since the point is what the user sees: no traceback, no hang, no
SIGBUS, no temporary folder left.
"""

import os
import resource
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest

from .test_convert import NOTE_SIGNALS, _hashes, _leftovers, _pseudo, _run_cli

# `hf-p2r ARGS` whose every piece written (cast path) or range chunk copied (copy path) is 64 bytes and takes 0.05 s:
# a whole conversion would take a minute. It prints WROTE after the first piece and holds there until the test's
# signal has reached a handler (so how many pieces follow does not depend on how soon a busy machine delivers it), and
# PIECES n (how many it wrote in all) when the command ends.
_SLOW_CLI = textwrap.dedent("""
    import os, signal, sys, threading, time
    from hf_p2r.checkpoint import ranges, writer
    ranges._CHUNK = writer._PIECE = 64
    real_write, real_copy, pieces, signalled = writer.write_all, os.copy_file_range, [], threading.Event()
    def counted():
        if not pieces:
            print("WROTE", flush=True)
            deadline = time.monotonic() + 120
            while not signalled.is_set() and time.monotonic() < deadline:
                time.sleep(0.02)
        pieces.append(1)
        time.sleep(0.05)
    def write_all(fd, data, offset, path=None):
        real_write(fd, data, offset, path)
        if not isinstance(data, bytes):  # a piece of a tensor, not a header
            counted()
    def copy_file_range(*args):
        done = real_copy(*args)
        counted()
        return done
    writer.write_all, ranges.os.copy_file_range = write_all, copy_file_range
    {NOTE_SIGNALS}
    from hf_p2r.cli import main
    code = main(sys.argv[1:])
    print("PIECES", len(pieces), flush=True)
    sys.exit(code)
""").replace("{NOTE_SIGNALS}\n", NOTE_SIGNALS.lstrip("\n"))


@pytest.mark.parametrize("path", ["cast", "copy"])
@pytest.mark.parametrize(("sig", "message"), [(signal.SIGINT, "interrupted"), (signal.SIGTERM, "stopped by SIGTERM")])
def test_a_signal_stops_a_long_cast_or_copy_within_a_piece(tmp_path, path, sig, message):
    """SIGINT / SIGTERM in the middle of one tensor's write (a cast to float64, or a kernel copy) takes effect at the
    next piece, not at the end of the shard: the 100 KB model needs ~1600 pieces (its embeddings alone 200),
    the process stops after a few."""
    src, _ = _pseudo(tmp_path)
    before = _hashes(src)
    args = ["convert", src, tmp_path / "out", *(["--dtype", "float64"] if path == "cast" else [])]
    process = _run_cli(tmp_path, args, script=_SLOW_CLI)
    assert process.stdout.readline().startswith("WROTE"), process.stderr.read()
    process.send_signal(sig)
    out, err = process.communicate(timeout=120)
    pieces = int(out.split("PIECES")[1])
    assert pieces < 20, f"{pieces} pieces written: the signal was not seen between pieces"
    assert (process.returncode, err) == (128 + sig, f"hf-p2r convert: {message}\n")
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path, "out") == []
    assert _hashes(src) == before


def _small_file_limit():  # a real write failure: files over 40 kB cannot be written (EFBIG, as ENOSPC would)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (40_000, 40_000))


def test_a_cast_that_cannot_write_its_file_is_one_line(tmp_path):
    """The cast path allocates its file before writing (no sparse scratch mapping for the disk to fail under)."""
    src, _ = _pseudo(tmp_path)
    process = _run_cli(tmp_path, ["convert", src, tmp_path / "out", "--dtype", "float64"], preexec_fn=_small_file_limit)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 1, err
    assert err.startswith("hf-p2r convert: error: [Errno 27] File too large: ") and err.count("\n") == 1, err
    assert "model.safetensors" in err
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path, "out") == []


def _can_mount_tmpfs(where) -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {where}"],
        capture_output=True,
        timeout=30,
    )
    return probe.returncode == 0


@pytest.mark.parametrize("dtype", [None, "float64"], ids=["copy", "cast"])
def test_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, dtype):
    """On a real full filesystem (a 120 kB tmpfs in a private mount namespace; skipped where one cannot be made): the
    100 KB model cast to float64 (200 KB) once ended in SIGBUS (exit 135, no message, the temporary folder left) from
    its memory-mapped scratch file; now both paths end in one line, exit 1, and the filesystem is as it was."""
    mount = tmp_path / "small"
    mount.mkdir()
    if not _can_mount_tmpfs(mount):
        pytest.skip("cannot mount a tmpfs here (no user namespaces)")
    src, _ = _pseudo(tmp_path)
    cli = [sys.executable, "-m", "hf_p2r.cli", "convert", str(src), str(mount / "out")]
    cli += ["--dtype", dtype] if dtype else []
    script = f"mount -t tmpfs -o size=120k tmpfs {mount} && "
    if dtype is None:
        script += f"head -c 60000 /dev/zero > {mount}/filler && "  # leave 60 kB: less than the 100 kB copy
    script += " ".join(map(_quote, cli)) + f"; code=$?; ls -A {mount}; exit $code"
    result = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, HF_HUB_OFFLINE="1"),
    )
    assert result.returncode == 1, (result.returncode, result.stderr)
    assert result.stderr.startswith("hf-p2r convert: error: [Errno 28] No space left on device: ")
    assert result.stderr.count("\n") == 1, result.stderr
    left = result.stdout.split()
    assert left == ([] if dtype else ["filler"]), f"left on the full disk: {left}"


def _quote(arg: str) -> str:
    return "'" + arg.replace("'", "'\\''") + "'"
