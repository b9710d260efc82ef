"""Constant memory: converting to 32 layers takes no more memory than converting to 8 (the real model is never held).

Measured in a child process (a clean heap, nothing else of pytest's), on /proc/self/status: the peak resident set
(VmHWM, reset before each conversion through /proc/self/clear_refs; it also counts mapped file pages, so a converter
that touched every output tensor, e.g. to count parameters, would show here) and the peak anonymous memory (RssAnon,
sampled every millisecond by a thread while safetensors writes without the GIL). The control converts the same way after
materialising the output tensors, which is what a converter that builds the real model does: the measurement must
see that.
"""

import json
import subprocess
import sys
import textwrap

import pytest

from ..conftest import tiny_model
from ..models.test_modeling_p2r_moe import moe_model

# One block of 1 M parameters (4.2 MB in float32): 8 layers write 34 MB, 32 layers 134 MB. The MoE block (4 experts of
# width 256, a router) is as large, in 13 tensors where the MLP has 3.
SHAPE = dict(hidden_size=256, intermediate_size=1024, num_attention_heads=4, num_key_value_heads=4, vocab_size=1000)
MODELS = {"dense": (tiny_model, {}), "moe": (moe_model, dict(num_experts=4, moe_intermediate_size=256))}
TOLERANCE_MB = 16  # allocator and thread noise; 24 layers more are 100 MB

_CHILD = textwrap.dedent("""
    import json, sys, threading, time
    import torch
    from hf_p2r import convert_pseudo_to_real
    from hf_p2r.checkpoint import convert

    def status():
        with open("/proc/self/status") as file:
            return {k: int(v.split()[0]) * 1024 for k, _, v in (l.partition(":") for l in file) if v.endswith("kB\\n")}

    # Peaks during a conversion, over the process's memory after the warm-up: a fixed base, so that memory the
    # allocator kept from an earlier conversion and reuses is neither counted twice nor taken for the base.
    def measure(src, dst):
        with open("/proc/self/clear_refs", "w") as file:
            file.write("5")  # VmHWM := VmRSS
        peak_anon, done = [0], threading.Event()
        def sample():
            while not done.is_set():
                peak_anon[0] = max(peak_anon[0], status()["RssAnon"])
                time.sleep(0.001)
        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            convert_pseudo_to_real(src, dst, max_shard_size="20MB", progress=False)
        finally:
            done.set()
            sampler.join()
        after = status()
        return {"hwm": after["VmHWM"] - base["VmRSS"], "anon": max(peak_anon[0], after["RssAnon"]) - base["RssAnon"]}

    def write_materialised(folder, tensors, **kwargs):
        held = []  # every output tensor's bytes in memory, as when the real model is built
        for info in tensors.values():
            with open(info.file, "rb") as file:
                file.seek(info.offset)
                held.append(file.read(info.nbytes))
        return write(folder, tensors, **kwargs)

    torch.set_num_threads(1)
    work, peaks = sys.argv[1], {}
    base = status()
    measure(f"{work}/pseudo-8", f"{work}/warm-up")  # first use: lazy imports, caches
    base = status()
    for mode in ("stream", "materialise"):
        if mode == "materialise":  # the control: every output tensor in memory, as when the model is built
            write, convert.copying = convert.copying, write_materialised
        peaks[mode] = {layers: measure(f"{work}/pseudo-{layers}", f"{work}/{mode}-{layers}") for layers in (8, 32)}
    print(json.dumps(peaks))
""")


@pytest.mark.parametrize("kind", MODELS)
def test_peak_memory_does_not_grow_with_depth(tmp_path, kind):
    build, fields = MODELS[kind]
    for layers in (8, 32):
        model = build(share_layers=True, num_unique_layers=1, num_hidden_layers=layers, **SHAPE, **fields)
        model.save_pretrained(tmp_path / f"pseudo-{layers}")
    result = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    peaks = json.loads(result.stdout.splitlines()[-1])
    # growth of each peak from 8 to 32 layers, MB
    streamed, materialised = (
        {metric: (peaks[mode]["32"][metric] - peaks[mode]["8"][metric]) / 2**20 for metric in ("hwm", "anon")}
        for mode in ("stream", "materialise")
    )
    # The control: holding the output shows up as ~100 MB more for 24 more layers, in both measures.
    assert materialised["hwm"] > 64 and materialised["anon"] > 64, materialised
    assert streamed["hwm"] < TOLERANCE_MB and streamed["anon"] < TOLERANCE_MB, streamed
