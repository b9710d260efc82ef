"""Checking a written checkpoint against its source, byte for byte, before it is renamed into place (the converter's
`verify=True`, `hf-p2r convert --verify`). Needs torch (imported when called)."""

import os
from pathlib import Path

from .source import source_tensor


def verify_checkpoint(folder: str | os.PathLike, expected: dict) -> int:
    """Check that the weights in `folder` are exactly `expected` ({name: (source tensor, torch dtype)}): same names,
    shapes and dtypes, and every byte equal to the source cast to that dtype; returns the number of files checked.
    Raises `ValueError` on the first difference. Compares in chunks, so memory stays small (and Ctrl-C acts between
    two of them)."""
    import torch

    from .reader import CheckpointReader

    with CheckpointReader(folder) as out:
        names = set(out.keys())
        if names != expected.keys():
            missing, extra = sorted(expected.keys() - names), sorted(names - expected.keys())
            raise ValueError(f"{folder}: verify failed: missing {missing[:3]}, unexpected {extra[:3]}")
        for name, (source, dtype) in expected.items():
            tensor = out.get(name)
            if tensor.shape != source.shape or tensor.dtype != dtype:
                raise ValueError(
                    f"{out.file_of(name)}: verify failed: {name} is {tensor.dtype} {list(tensor.shape)}, expected "
                    f"{dtype} {list(source.shape)}"
                )
            flat, flat_source = tensor.reshape(-1), source.reshape(-1)
            step = 1 << 22
            for start in range(0, flat.numel(), step):
                chunk = flat[start : start + step]
                source_chunk = flat_source[start : start + step].to(dtype).contiguous()  # (zeros are expanded)
                # bytes, not values: NaNs compare equal to themselves, -0.0 differs from 0.0
                if not torch.equal(chunk.view(torch.uint8), source_chunk.view(torch.uint8)):
                    raise ValueError(f"{out.file_of(name)}: verify failed: {name} differs from its source")
        return len(out.files)


def verify_against_source(
    tmp: Path, src: Path, new_to_old: dict, views: dict, dtype: str, zeroed: set = frozenset()
) -> int:
    """`verify_checkpoint` of the output written in `tmp` against the checkpoint `src` it was written from ({new name:
    source name} `new_to_old`, the 3-D experts' `views` of `split_experts`), cast to `dtype`, the `zeroed` tensors
    zeros; returns the number of files checked."""
    import torch

    from .reader import CheckpointReader

    with CheckpointReader(src) as reader:
        expected = {
            new: (source_tensor(reader, old, views, new in zeroed), getattr(torch, dtype))
            for new, old in new_to_old.items()
        }
        return verify_checkpoint(tmp, expected)
