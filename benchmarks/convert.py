"""Benchmark: streaming pseudo -> real conversion (`hf-p2r convert`) against mergekit passthrough and `cp -r`.

The job (issue 3): a one-block Llama-shaped pseudo checkpoint (hidden 2048, FFN 5504, vocab 32000, 16 heads, bf16,
untied embeddings) expanded to 32 and to 64 layers. For each depth, in one run:

- hf-p2r:   `hf-p2r convert SRC DST` in a fresh process, as a user runs it; the process also reports how long its
            imports took and how long the conversion itself took;
- mergekit: `mergekit-yaml` passthrough stacking the same tensors saved as a one-layer Llama (with `--mergekit`;
            installed into its own virtualenv, runs/bench_convert/mergekit-venv, the first time);
- hf-p2r --dtype float16: the same with a cast, so that every tensor goes through the file-backed staging path;
- cp:       `cp -r` of the folder hf-p2r produced;
- dd:       the same copy through read()/write() (the system calls any user-space writer, safetensors too, uses);
- imports:  a process that only imports hf-p2r's CLI: the fixed cost in every hf-p2r run;
- hf-p2r --help: the console script, as a user types it.

For the hf-p2r runs the start-up is also measured from outside: the time from process start until the first byte of
weights is in the output (the first non-empty shard in the temporary folder beside DST, polled every 5 ms).

Every tool runs as its own process. Wall time is measured around the process, and reported twice: as it is (the
output may still be in the page cache, dirty) and *durable*, with the `sync` of the output's files that follows it
(the time until the output is on disk). On a machine whose writeback comes and goes, page-cache times swing several
fold from run to run; the durable times do much less. Memory is read from /proc/PID/status
every 5 ms and summed over the process tree: peak RSS is the largest VmHWM (the kernel's high-water mark of resident
memory, page cache of mmapped files included); peak anonymous memory is the largest RssAnon (private memory not backed
by any file: what cannot be reclaimed without swap; mmapped files and page cache are RssFile, not counted). Each run
starts after `sync` with its inputs in the page cache (the container cannot drop caches) and writes without fsync,
like `cp`; then `sync FILE...` of its output is timed. Each measurement is repeated (`--repeat`, tools interleaved)
and the median is reported. For every target that is not met, the markdown gives the cause in the measured numbers.

    .venv/bin/python scripts/bench_convert.py --mergekit        # ~15 GB free disk needed; ~15 minutes
    .venv/bin/python scripts/bench_convert.py --layers 32 --hidden-size 256   # quick smoke run

Writes benchmarks/convert.json and benchmarks/convert.md (unless --out says otherwise).
"""

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch

from benchmarks.harness import REPO, cpu_name, utc_now, write_json, write_text

PYTHON = Path(sys.executable)
MERGEKIT = "mergekit==0.1.5"
TORCH_CPU = "torch==2.13.0"  # installed first into mergekit's venv: a bare `torch` requirement pulls a CUDA build
CAST = "hf-p2r --dtype float16"
DD = "dd (read/write copy)"
IMPORTS = "imports only"
HELP = "hf-p2r --help"
TOOLS = ("hf-p2r", CAST, "cp", DD, "mergekit", IMPORTS, HELP)
# `hf-p2r ARGS` (the console script calls the same main) that also reports its import and conversion times.
_HF_P2R = """import json, sys, time
start = time.perf_counter()
from hf_p2r.cli import main
imported = time.perf_counter()
code = main(sys.argv[1:])
print("BENCH", json.dumps({"import_s": imported - start, "convert_s": time.perf_counter() - imported}))
sys.exit(code)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--hidden-size", type=int, default=2048)
    parser.add_argument("--intermediate-size", type=int, default=5504)
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--repeat", type=int, default=3, help="runs per tool and depth (median reported)")
    parser.add_argument("--mergekit", action="store_true", help=f"also run {MERGEKIT} (installed on first use)")
    parser.add_argument("--workdir", type=Path, default=REPO / "runs" / "bench_convert", help="checkpoints, outputs")
    parser.add_argument("--mergekit-venv", type=Path, default=REPO / "runs" / "bench_convert" / "mergekit-venv")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "convert", help="writes OUT.json + OUT.md")
    parser.add_argument("--report-only", action="store_true", help="rewrite OUT.md from OUT.json; measure nothing")
    args = parser.parse_args()
    if args.report_only:
        report = json.loads(args.out.with_suffix(".json").read_text())
        report["summary"] = _summary(report["results"], [int(key[1:]) for key in report["summary"] if key[0] == "L"])
        write_json(args.out.with_suffix(".json"), report)
        write_text(args.out.with_suffix(".md"), _markdown(report))
        return

    work = args.workdir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    mergekit_bin, mergekit_note = _mergekit(args.mergekit_venv.resolve()) if args.mergekit else (None, "not requested")
    sources = _build_sources(work, args)
    shape = {key: getattr(args, key) for key in ("hidden_size", "intermediate_size", "vocab_size")}
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_DISABLE_PROGRESS_BARS="1")
    results = []
    for layers in args.layers:
        _check_disk(work, 3.2 * _output_bytes(sources["weights"], layers))  # at most three outputs at a time
        src, dst, copy, merged = work / f"pseudo-{layers}", work / f"real-{layers}", work / "cp-copy", work / "merged"
        for _ in range(args.repeat):
            for path in (dst, copy, merged):
                shutil.rmtree(path, ignore_errors=True)
            command = [PYTHON, "-c", _HF_P2R, "convert", src, dst]
            results.append(_run("hf-p2r", layers, command, warm=[src], env=env, out=dst))
            cast = work / "cast"  # the cast path: every tensor staged through the file-backed scratch mapping
            results.append(
                _run(CAST, layers, [*command[:-1], cast, "--dtype", "float16"], warm=[src], env=env, out=cast)
            )
            shutil.rmtree(cast)
            results.append(_run("cp", layers, ["cp", "-r", dst, copy], warm=[dst], out=copy))
            shutil.rmtree(copy)
            # the same copy through read()/write(): the system calls any user-space writer (safetensors too) uses
            dd = 'mkdir "$2" && for f in "$1"/*; do dd if="$f" of="$2/${f##*/}" bs=64M status=none; done'
            results.append(_run(DD, layers, ["sh", "-c", dd, "dd", dst, copy], warm=[dst], out=copy))
            results.append(_run(IMPORTS, layers, [PYTHON, "-c", "import hf_p2r.cli"], warm=[], env=env))
            results.append(_run(HELP, layers, [PYTHON.parent / "hf-p2r", "--help"], warm=[], env=env))
            if mergekit_bin is not None:
                config = _mergekit_config(work, sources["llama"], layers)
                command = [mergekit_bin, config, merged, "--no-copy-tokenizer", "--quiet"]
                shutil.rmtree(copy)  # disk: at most two outputs at a time
                results.append(_run("mergekit", layers, command, warm=[sources["llama"]], env=env, out=merged))
        for path in (dst, copy, merged):
            shutil.rmtree(path, ignore_errors=True)

    report = {
        "benchmark": "pseudo -> real conversion (scripts/bench_convert.py)",
        "date": utc_now(),
        "machine": _machine(work),
        "conditions": (
            f"Each tool is a separate process, run {args.repeat} times (interleaved), each run after `sync` with its "
            "inputs in the page cache (a warm-cache measurement); outputs are written without fsync, and the `sync` "
            "of the output's files that follows is timed (durable = wall + sync: until the output is on disk). "
            f"Medians are reported. Load average (1 min) during the runs: {_load_range(results)} on "
            f"{os.cpu_count()} cores (load_average per run in the JSON)."
        ),
        "checkpoint": {
            **shape,
            "num_attention_heads": 16,
            "dtype": "bfloat16",
            "tie_word_embeddings": False,
            "pseudo_blocks": 1,
            "source_bytes": sources["weights"].stat().st_size,
        },
        "command": " ".join(["scripts/bench_convert.py", *sys.argv[1:]]),
        "mergekit": mergekit_note,
        "reflinks": _reflinks(work),
        "results": results,
        "summary": _summary(results, args.layers),
    }
    write_json(args.out.with_suffix(".json"), report)
    write_text(args.out.with_suffix(".md"), _markdown(report))
    print(args.out.with_suffix(".md").read_text())


# --- the checkpoints -------------------------------------------------------------------------------------------------


def _build_sources(work: Path, args) -> dict[str, Path]:
    """One bf16 weight file, written with hf-p2r's writer from tensors generated directly in bf16 (no model is built),
    hard-linked into the pseudo checkpoints (one config.json per depth) and the one-layer Llama checkpoint for
    mergekit: every tool reads the same bytes."""
    from transformers import LlamaConfig

    from hf_p2r import P2RConfig, P2RForCausalLM
    from hf_p2r.checkpoint import write_checkpoint

    fields = dict(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_attention_heads=16,
        num_key_value_heads=16,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )
    weights_dir = work / "weights"
    weights = weights_dir / "model.safetensors"
    config = P2RConfig(**fields, num_hidden_layers=max(args.layers), share_layers=True, num_unique_layers=1)
    if not weights.exists() or json.loads((weights_dir / "shape.json").read_text()) != fields:
        shutil.rmtree(weights_dir, ignore_errors=True)
        weights_dir.mkdir()
        generator = torch.Generator().manual_seed(0)
        with torch.device("meta"):
            names = {name: p.shape for name, p in P2RForCausalLM(config).state_dict().items()}
        tensors = {}
        for name, shape in names.items():
            tensor = torch.empty(shape, dtype=torch.bfloat16)
            tensors[name] = (
                tensor.fill_(1.0) if name.endswith("norm.weight") else tensor.normal_(0, 0.02, generator=generator)
            )
        write_checkpoint(weights_dir, tensors, progress=False)
        (weights_dir / "shape.json").write_text(json.dumps(fields))
    for layers in args.layers:
        folder = work / f"pseudo-{layers}"
        _link_weights(weights, folder)
        P2RConfig(**fields, num_hidden_layers=layers, share_layers=True, num_unique_layers=1).save_pretrained(folder)
    llama = work / "llama-1"
    _link_weights(weights, llama)
    LlamaConfig(**fields, num_hidden_layers=1, architectures=["LlamaForCausalLM"]).save_pretrained(llama)
    return {"weights": weights, "llama": llama}


def _link_weights(weights: Path, folder: Path) -> None:
    folder.mkdir(exist_ok=True)
    target = folder / weights.name
    if target.exists() and target.stat().st_ino == weights.stat().st_ino:
        return
    target.unlink(missing_ok=True)
    os.link(weights, target)


def _output_bytes(weights: Path, layers: int) -> int:
    """Bytes of the real checkpoint: the one-block source's tensors, the block's L times."""
    from hf_p2r.checkpoint.headers import read_weights

    sizes = [(".layers." in name, info.nbytes) for name, info in read_weights(weights.parent).items()]
    return sum(nbytes * (layers if in_block else 1) for in_block, nbytes in sizes)


def _check_disk(work: Path, needed: float) -> None:
    free = shutil.disk_usage(work).free
    if free < needed:
        sys.exit(f"bench_convert: {work} has {free / 1e9:.1f} GB free, needs about {needed / 1e9:.1f} GB")


def _reflinks(work: Path) -> str:
    """Whether `work`'s filesystem shares blocks between files (FICLONE); if not, whether a loop-mounted XFS or btrfs
    image could give a row that does (root, loop devices, mkfs)."""
    import errno
    import fcntl

    a, b = work / ".reflink-a", work / ".reflink-b"
    a.write_bytes(b"\0" * 4096)
    try:
        with open(a, "rb") as source, open(b, "wb") as target:
            fcntl.ioctl(target.fileno(), 0x40049409, source.fileno())  # FICLONE
        return f"{work}: the filesystem has reflinks (FICLONE works); hf-p2r clones aligned ranges there"
    except OSError as error:
        why = errno.errorcode.get(error.errno, str(error.errno))
    finally:
        a.unlink(missing_ok=True), b.unlink(missing_ok=True)
    tools = {tool: shutil.which(tool) for tool in ("mkfs.xfs", "mkfs.btrfs", "losetup", "mount")}
    missing = [tool for tool, found in tools.items() if not found]
    kernel = [fs for fs in ("xfs", "btrfs") if fs in Path("/proc/filesystems").read_text()]
    return (
        f"{work}: no reflinks (FICLONE: {why}), so no row for them. A loop-mounted XFS or btrfs image "
        + (f"cannot be made here: {', '.join(missing)} not installed" if missing else "could be made here")
        + f" (root: {os.geteuid() == 0}; kernel filesystems: {', '.join(kernel) or 'neither'})."
    )


# --- mergekit --------------------------------------------------------------------------------------------------------


def _mergekit(venv: Path) -> tuple[Path | None, str]:
    """mergekit-yaml from its own virtualenv (created on first use), or None and the reason it is unavailable."""
    binary = venv / "bin" / "mergekit-yaml"
    if not binary.exists():
        try:
            subprocess.run([sys.executable, "-m", "venv", "--clear", venv], check=True)
            pip = [venv / "bin" / "python", "-m", "pip", "install", "--quiet"]
            subprocess.run([*pip, TORCH_CPU], check=True)
            subprocess.run([*pip, MERGEKIT], check=True)
        except (OSError, subprocess.CalledProcessError) as error:
            return None, f"could not install {MERGEKIT}: {error}"
    version = subprocess.run(
        [venv / "bin" / "python", "-c", "import importlib.metadata as m; print(m.version('mergekit'))"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    return binary, f"mergekit {version} (passthrough, CPU, defaults, --no-copy-tokenizer) in {venv}"


def _mergekit_config(work: Path, llama: Path, layers: int) -> Path:
    slices = "".join(f"  - sources:\n      - model: {llama}\n        layer_range: [0, 1]\n" for _ in range(layers))
    path = work / f"mergekit-{layers}.yml"
    path.write_text(f"merge_method: passthrough\ndtype: bfloat16\nslices:\n{slices}")
    return path


# --- measuring -------------------------------------------------------------------------------------------------------


def _run(tool: str, layers: int, command: list, *, warm: list[Path], env: dict | None = None, out=None) -> dict:
    subprocess.run(["sync"], check=True)
    for folder in warm:  # inputs in the page cache, as after the step that produced them
        for path in Path(folder).rglob("*"):
            if path.is_file():
                with open(path, "rb") as file:
                    while file.read(1 << 24):
                        pass
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryFile() as log:  # a file, not a pipe: a chatty tool must never block on a full pipe
        start = time.perf_counter()
        process = subprocess.Popen([str(c) for c in command], env=env, stdout=log, stderr=subprocess.STDOUT)
        peaks = {"rss": 0, "anon": 0, "start": start, "first_byte": None}
        watch = Path(out) if out is not None and tool.startswith("hf-p2r") else None
        sampler = threading.Thread(target=_sample, args=(process, peaks, watch), daemon=True)
        sampler.start()
        _, status, usage = os.wait4(process.pid, 0)
        wall = time.perf_counter() - start
        process.returncode = os.waitstatus_to_exitcode(status)  # reaped here: tell Popen
        sampler.join()
        sync_s = _sync(Path(out)) if out is not None and Path(out).exists() else None
        log.seek(0)
        output = log.read().decode(errors="replace")
    result = {
        "tool": tool,
        "layers": layers,
        "wall_s": round(wall, 2),
        "sync_s": None if sync_s is None else round(sync_s, 2),
        "durable_s": round(wall + (sync_s or 0.0), 2),
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 2),  # user + system, the process and its waited-for children
        "peak_rss_mb": round(peaks["rss"] / 2**20),
        "peak_anon_mb": round(peaks["anon"] / 2**20),
        "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "first_byte_s": None if peaks["first_byte"] is None else round(peaks["first_byte"], 3),
        "exit_code": process.returncode,
    }
    if out is not None and Path(out).exists():
        result["output_bytes"] = sum(p.stat().st_size for p in Path(out).rglob("*") if p.is_file())
    for line in output.splitlines():
        if line.startswith("BENCH "):
            result.update({key: round(value, 2) for key, value in json.loads(line[6:]).items()})
    if result["exit_code"] != 0:
        result["error"] = output[-2000:]
    print(f"{tool:9s} L={layers}: {result}", flush=True)
    return result


def _sync(folder: Path) -> float:
    """Seconds `sync` takes to put `folder`'s files (and the folder) on disk: fsync of each, not of the whole system,
    so that other jobs' dirty pages are not counted."""
    paths = [str(p) for p in sorted(folder.rglob("*")) if p.is_file()] + [str(folder)]
    start = time.perf_counter()
    subprocess.run(["sync", "--", *paths], check=True)
    return time.perf_counter() - start


def _sample(process: subprocess.Popen, peaks: dict, watch: Path | None = None) -> None:
    """Largest RSS (VmHWM, the kernel's high-water mark) and RssAnon summed over the process and its descendants,
    every 5 ms until it exits. (Not wait4's ru_maxrss: with vfork/exec it reports the parent's peak.) With `watch`
    (an output folder), also the seconds from `peaks["start"]` until a shard of it holds data."""
    try:
        root = psutil.Process(process.pid)
    except psutil.NoSuchProcess:
        return
    while True:
        try:
            tree = [root, *root.children(recursive=True)]
            if root.status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        rss = anon = 0
        for proc in tree:
            fields = _status_fields(proc.pid)
            rss += fields.get("VmHWM", 0)
            anon += fields.get("RssAnon", 0)
        peaks["rss"], peaks["anon"] = max(peaks["rss"], rss), max(peaks["anon"], anon)
        if watch is not None and peaks["first_byte"] is None and _has_data(watch):
            peaks["first_byte"] = time.perf_counter() - peaks["start"]
        time.sleep(0.005)


def _has_data(out: Path) -> bool:
    """Whether a weights file in the temporary folder beside `out` (or in `out`) is longer than its header."""
    for path in [*out.parent.glob(f".{out.name}.tmp-*/model*.safetensors"), *out.glob("model*.safetensors")]:
        try:
            with open(path, "rb") as file:
                header = int.from_bytes(file.read(8), "little")
            if path.stat().st_size > 8 + header > 8:
                return True
        except OSError:
            continue
    return False


def _status_fields(pid: int) -> dict[str, int]:
    try:
        with open(f"/proc/{pid}/status") as file:
            lines = file.read().splitlines()
    except OSError:
        return {}
    fields = {}
    for line in lines:
        key, _, value = line.partition(":")
        if value.strip().endswith("kB"):
            fields[key] = int(value.split()[0]) * 1024
    return fields


# --- report ----------------------------------------------------------------------------------------------------------


def _machine(work: Path) -> dict:
    mount = subprocess.run(["df", "-T", str(work)], capture_output=True, text=True).stdout.splitlines()[-1].split()
    import safetensors
    import transformers

    return {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "memory_gb": round(psutil.virtual_memory().total / 1e9, 1),
        "filesystem": f"{mount[1]} ({mount[0]})",
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "safetensors": safetensors.__version__,
        "transformers": transformers.__version__,
        "cp": subprocess.run(["cp", "--version"], capture_output=True, text=True).stdout.splitlines()[0],
    }


def _summary(results: list[dict], depths: list[int]) -> dict:
    """Medians per (tool, depth), the ratios the issue sets targets on, and whether each target is met."""
    runs = {}
    for r in results:
        if r.get("exit_code") == 0:
            runs.setdefault((r["tool"], r["layers"]), []).append(r)
    summary = {}
    for layers in depths:
        row = {}
        for tool in TOOLS:
            if (tool, layers) in runs:
                done = runs[(tool, layers)]
                row[tool] = {
                    "runs": len(done),
                    "wall_s": round(statistics.median(r["wall_s"] for r in done), 2),
                    "wall_s_range": [min(r["wall_s"] for r in done), max(r["wall_s"] for r in done)],
                    "durable_s": round(statistics.median(r["durable_s"] for r in done), 2),
                    "durable_s_range": [min(r["durable_s"] for r in done), max(r["durable_s"] for r in done)],
                    "peak_rss_mb": max(r["peak_rss_mb"] for r in done),
                    "peak_anon_mb": max(r["peak_anon_mb"] for r in done),
                    "cpu_s": round(statistics.median(r["cpu_s"] for r in done), 2),
                }
                if tool in ("hf-p2r", CAST):
                    row[tool]["import_s"] = round(statistics.median(r["import_s"] for r in done), 2)
                    row[tool]["convert_s"] = round(statistics.median(r["convert_s"] for r in done), 2)
                    starts = [r["first_byte_s"] for r in done if r.get("first_byte_s") is not None]
                    row[tool]["first_byte_s"] = round(statistics.median(starts), 3) if starts else None
        ours, cp, mk = row.get("hf-p2r"), row.get("cp"), row.get("mergekit")
        if ours and cp:
            row["time_vs_cp"] = _ratio(ours["wall_s"], cp["wall_s"])
            row["durable_time_vs_cp"] = _ratio(ours["durable_s"], cp["durable_s"])
            row["conversion_only_vs_cp"] = _ratio(ours["convert_s"], cp["wall_s"])
            row["cpu_vs_cp"] = _ratio(ours["cpu_s"], cp["cpu_s"])
        if ours and DD in row:
            row["conversion_only_vs_dd"] = _ratio(ours["convert_s"], row[DD]["wall_s"])
        if ours and mk:
            row["time_vs_mergekit"] = _ratio(ours["wall_s"], mk["wall_s"], 3)
            row["durable_time_vs_mergekit"] = _ratio(ours["durable_s"], mk["durable_s"], 3)
            row["peak_rss_vs_mergekit"] = _ratio(ours["peak_rss_mb"], mk["peak_rss_mb"], 3)
        summary[f"L{layers}"] = row
    for tool in ("hf-p2r", CAST):
        anon = [summary[f"L{n}"][tool]["peak_anon_mb"] for n in depths if tool in summary[f"L{n}"]]
        if len(anon) > 1:
            summary.setdefault("peak_anon_growth_mb", {})[tool] = anon[-1] - anon[0]
    summary["targets"] = {
        "time <= 1/3 mergekit": _all(summary, depths, lambda row: row.get("time_vs_mergekit"), 1 / 3),
        "time <= 1/3 mergekit, durable (with sync)": _all(
            summary, depths, lambda row: row.get("durable_time_vs_mergekit"), 1 / 3
        ),
        "time <= 1.1 x cp": _all(summary, depths, lambda row: row.get("time_vs_cp"), 1.1),
        "time <= 1.1 x cp, durable (with sync)": _all(summary, depths, lambda row: row.get("durable_time_vs_cp"), 1.1),
        "hf-p2r --help < 0.3 s": _all(summary, depths, lambda row: row.get(HELP, {}).get("wall_s"), 0.3 - 1e-9),
        "hf-p2r convert start-up (process start to first byte written) < 0.5 s": _all(
            summary, depths, lambda row: row.get("hf-p2r", {}).get("first_byte_s"), 0.5 - 1e-9
        ),
        "conversion without interpreter start and imports <= 1.1 x cp": _all(
            summary, depths, lambda row: row.get("conversion_only_vs_cp"), 1.1
        ),
        "peak anon <= 300 MB (with and without --dtype)": _all(
            summary,
            depths,
            lambda row: max(row.get(tool, {}).get("peak_anon_mb", 1e9) for tool in ("hf-p2r", CAST)),
            300,
        ),
        "peak anon flat from first to last depth (growth <= 16 MB)": (
            max(summary["peak_anon_growth_mb"].values()) <= 16 if "peak_anon_growth_mb" in summary else None
        ),
    }
    return summary


def _ratio(ours: float, theirs: float, digits: int = 2) -> float | None:
    return round(ours / theirs, digits) if theirs else None


def _all(summary: dict, depths: list[int], value, limit: float) -> bool | None:
    values = [value(summary[f"L{n}"]) for n in depths]
    return None if None in values else all(v <= limit for v in values)


def _load_range(results: list[dict]) -> str:
    loads = [value for result in results for value in result["load_average"]]
    return f"{min(loads):.1f}-{max(loads):.1f}"


def _markdown(report: dict) -> str:
    machine, summary, checkpoint = report["machine"], report["summary"], report["checkpoint"]
    lines = [
        "# Pseudo -> real conversion benchmark",
        "",
        f"{report['date']} on {machine['cpu']}, {machine['cores']} cores, {machine['memory_gb']} GB RAM, "
        f"{machine['filesystem']}; torch {machine['torch']}, safetensors {machine['safetensors']}, {machine['cp']}. "
        f"Command: `{report['command']}`.",
        "",
        f"Job: a one-block pseudo checkpoint (hidden {checkpoint['hidden_size']}, "
        f"FFN {checkpoint['intermediate_size']}, vocab {checkpoint['vocab_size']}, bf16, untied; "
        f"{checkpoint['source_bytes'] / 1e6:.0f} MB) expanded to L layers. {report['conditions']}",
        "",
        f"Reflinks: {report['reflinks']}",
        "",
        "| L | tool | wall s (page cache), median (min-max) | wall + sync s (durable), median (min-max) "
        "| of which: imports / conversion s | first byte s | CPU s | peak RSS MB | peak anon MB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key, row in _depth_rows(summary):
        for tool in TOOLS:
            if tool not in row:
                why = report["mergekit"] if tool == "mergekit" else "failed: see convert.json"
                lines.append(f"| {key[1:]} | {tool} | not run ({why}) | | | | | | |")
                continue
            t = row[tool]
            inner = f"{t['import_s']} / {t['convert_s']}" if "import_s" in t else ""
            durable = "-" if tool in (IMPORTS, HELP) else f"{t['durable_s']} ({_span(t['durable_s_range'])})"
            lines.append(
                f"| {key[1:]} | {tool} | {t['wall_s']} ({_span(t['wall_s_range'])}) | {durable} | {inner} "
                f"| {_cell(t.get('first_byte_s'))} | {t['cpu_s']} | {t['peak_rss_mb']} | {t['peak_anon_mb']} |"
            )
    columns = [
        ("hf-p2r / mergekit time", "time_vs_mergekit"),
        ("same, durable", "durable_time_vs_mergekit"),
        ("hf-p2r / cp time", "time_vs_cp"),
        ("same, durable", "durable_time_vs_cp"),
        ("conversion only / cp", "conversion_only_vs_cp"),
        ("conversion only / dd", "conversion_only_vs_dd"),
        ("hf-p2r / cp CPU time", "cpu_vs_cp"),
        ("hf-p2r / mergekit RSS", "peak_rss_vs_mergekit"),
    ]
    lines += ["", "| L | " + " | ".join(title for title, _ in columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for key, row in _depth_rows(summary):
        lines.append(f"| {key[1:]} | " + " | ".join(_cell(row.get(name)) for _, name in columns) + " |")
    lines += ["", "Targets:", ""]
    causes = _causes(report)
    for target, ok in summary["targets"].items():
        lines.append(f"- {target}: {'met' if ok else 'not met' if ok is False else 'not measured'}")
        if ok is False:
            lines += [f"  - {cause}" for cause in causes.get(target, ["(no cause derived from the measurements)"])]
    lines += [
        "",
        f"Growth of peak anonymous memory from the first to the last depth, MB: {summary.get('peak_anon_growth_mb')}. "
        f"mergekit: {report['mergekit']}.",
        "",
        "*imports* is the time `from hf_p2r.cli import main` took inside the hf-p2r process (no torch, no "
        "transformers: only the cast path imports torch, inside the conversion); *conversion* is the rest of that "
        "process after it; *imports only* is a process that does nothing else; *first byte* is the time from process "
        "start until the first byte of weights is in the output. "
        "*durable* adds the `sync` of the output's files that follows each run: the time until the output is on disk. "
        "Peak anon is the largest RssAnon (memory backed by no file) sampled every 5 ms over the process tree; peak "
        "RSS is the largest VmHWM, which also counts pages of mmapped files (page cache the kernel can reclaim at "
        "will). Every run, with its load average, is in convert.json.",
    ]
    return "\n".join(lines) + "\n"


def _causes(report: dict) -> dict[str, list[str]]:
    """{target: [why it is missed at each depth, from the measured numbers]} for the targets the summary checks."""
    summary, cp_version = report["summary"], report["machine"]["cp"]
    causes: dict[str, list[str]] = {}
    for key, row in _depth_rows(summary):
        ours, cp, dd, mk, imports = (row.get(tool) for tool in ("hf-p2r", "cp", DD, "mergekit", IMPORTS))
        if ours is None:
            continue
        fixed = (
            f"{ours['import_s']} s of its {ours['wall_s']} s ({_percent(ours['import_s'], ours['wall_s'])}) is "
            f"importing hf-p2r's command line, a fixed cost whatever the model size"
            + (f" (a process that only imports takes {imports['wall_s']} s)" if imports else "")
        )
        if mk and row.get("time_vs_mergekit", 0) > 1 / 3:
            alone = _ratio(ours["convert_s"], mk["wall_s"], 3)
            causes.setdefault("time <= 1/3 mergekit", []).append(
                f"{key}: hf-p2r {ours['wall_s']} s vs mergekit {mk['wall_s']} s; {fixed}. The conversion phase alone "
                f"takes {ours['convert_s']} s = {alone} x mergekit"
                + (": the import time is what misses the target." if alone is not None and alone <= 1 / 3 else ".")
            )
        if mk and row.get("durable_time_vs_mergekit", 0) > 1 / 3:
            causes.setdefault("time <= 1/3 mergekit, durable (with sync)", []).append(
                f"{key}: hf-p2r {ours['durable_s']} s vs mergekit {mk['durable_s']} s until on disk, of which sync "
                f"{round(ours['durable_s'] - ours['wall_s'], 2)} s vs {round(mk['durable_s'] - mk['wall_s'], 2)} s; "
                f"{fixed}."
            )
        if cp is None:
            continue
        # hf-p2r copies with copy_file_range, as cp 9 does: what is left is CPU and start-up, or the machine's load
        writes = (
            f" Both copy inside the kernel ({cp_version}: copy_file_range); CPU time hf-p2r {ours['cpu_s']} s vs cp "
            f"{cp['cpu_s']} s (hf-p2r's extra CPU is Python's start-up and the config and model card, whose "
            "huggingface_hub imports take ~0.5 s of CPU: written while the kernel copies, they cost no wall time "
            f"when a core is free); hf-p2r's first byte is written {ours.get('first_byte_s')} s after it starts"
            + (f"; dd (read()/write() in user space) takes {dd['wall_s']} s" if dd else "")
            + f"; load average {_load_range([r for r in report['results'] if r['layers'] == int(key[1:])])} "
            "during these runs."
        )
        if row.get("time_vs_cp", 0) > 1.1:
            causes.setdefault("time <= 1.1 x cp", []).append(
                f"{key}: hf-p2r {ours['wall_s']} s vs cp {cp['wall_s']} s; {fixed}; the conversion phase takes "
                f"{ours['convert_s']} s = {row.get('conversion_only_vs_cp')} x cp.{writes}"
            )
        if row.get("durable_time_vs_cp", 0) > 1.1:
            causes.setdefault("time <= 1.1 x cp, durable (with sync)", []).append(
                f"{key}: hf-p2r {ours['durable_s']} s vs cp {cp['durable_s']} s until on disk (sync "
                f"{round(ours['durable_s'] - ours['wall_s'], 2)} s vs {round(cp['durable_s'] - cp['wall_s'], 2)} s); "
                f"{fixed}."
            )
        if row.get("conversion_only_vs_cp", 0) > 1.1:
            causes.setdefault("conversion without interpreter start and imports <= 1.1 x cp", []).append(
                f"{key}: conversion {ours['convert_s']} s vs cp {cp['wall_s']} s.{writes}"
            )
    for key, row in _depth_rows(summary):
        runs = [r for r in report["results"] if r["layers"] == int(key[1:])]
        load = f"load average {_load_range(runs)} on {report['machine']['cores']} cores"
        if HELP in row and row[HELP]["wall_s"] >= 0.3:
            help_ = row[HELP]
            causes.setdefault("hf-p2r --help < 0.3 s", []).append(
                f"{key}: {help_['wall_s']} s (fastest {help_['wall_s_range'][0]} s) for {help_['cpu_s']} s of CPU time "
                f"(interpreter start and imports, no torch): the rest is waiting for a core ({load})."
            )
        ours = row.get("hf-p2r")
        if ours and ours.get("first_byte_s") is not None and ours["first_byte_s"] >= 0.5:
            starts = sorted(r["first_byte_s"] for r in runs if r["tool"] == "hf-p2r" and r.get("first_byte_s"))
            causes.setdefault("hf-p2r convert start-up (process start to first byte written) < 0.5 s", []).append(
                f"{key}: median {ours['first_byte_s']} s (fastest {starts[0]} s), of which imports "
                f"{ours['import_s']} s; the rest starts the interpreter, reads config.json and the headers and plans "
                f"the shards ({load})."
            )
    anon_target = "peak anon <= 300 MB (with and without --dtype)"
    for key, row in _depth_rows(summary):
        imports = row.get(IMPORTS)
        for tool in ("hf-p2r", CAST):
            if tool in row and row[tool]["peak_anon_mb"] > 300:
                base = (
                    f"; the interpreter with hf-p2r's command line imported holds {imports['peak_anon_mb']} MB"
                    if (imports)
                    else ""
                )
                causes.setdefault(anon_target, []).append(f"{key}: {tool} {row[tool]['peak_anon_mb']} MB{base}.")
    growth = summary.get("peak_anon_growth_mb", {})
    if growth:
        causes["peak anon flat from first to last depth (growth <= 16 MB)"] = [
            f"{tool}: +{value} MB from the first to the last depth." for tool, value in growth.items() if value > 16
        ]
    return causes


def _depth_rows(summary: dict):
    return [(key, row) for key, row in summary.items() if key.startswith("L")]


def _span(values: list[float]) -> str:
    return f"{values[0]}-{values[1]}"


def _cell(value) -> str:
    return "-" if value is None else str(value)


def _percent(part: float, whole: float) -> str:
    return f"{100 * part / whole:.0f}%" if whole else "?"
