"""The byte-level corpus for `fmoe train`: files read as raw bytes, split, and sampled in random windows."""
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

import torch

DEFAULT_MAX_BYTES = 4 * 1024 * 1024
VAL_FRACTION = 0.1
# Third-party code under the stdlib folder depends on what is installed; leaving it out keeps the default
# corpus the same on every machine with the same Python.
SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


@dataclass
class Corpus:
    train_N: torch.Tensor      # uint8 bytes
    val_N: torch.Tensor
    source: str
    num_files: int
    truncated: bool

    @property
    def num_bytes(self) -> int:
        return self.train_N.numel() + self.val_N.numel()


def stdlib_files() -> List[Path]:
    """The running interpreter's standard-library *.py files, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS]
        files.extend(Path(folder) / n for n in names if n.endswith(".py"))
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def is_text(path: Path) -> bool:
    """A file with no NUL byte in its first 8 KiB: the usual test for text."""
    with open(path, "rb") as f:
        return b"\0" not in f.read(8192)


def data_files(data: Path) -> List[Path]:
    if not data.exists():
        raise ValueError(f"--data {str(data)!r}: no such file or folder")
    if data.is_file():
        if not is_text(data):
            raise ValueError(f"--data {str(data)!r} is not a text file (a NUL byte in its first 8 KiB): fmoe train "
                             "reads text only, as it skips the binary files in a folder")
        return [data]
    visible = (p for p in sorted(data.rglob("*")) if not any(s.startswith(".") for s in p.relative_to(data).parts))
    return [p for p in visible if p.is_file() and is_text(p)]


def read_capped(files: List[Path], max_bytes: int) -> Tuple[bytes, int, bool]:
    """The files' bytes joined, at most `max_bytes`; also how many files were read and whether it was cut."""
    chunks, total = [], 0
    for i, path in enumerate(files):
        with open(path, "rb") as f:        # only what is kept: a big file is never read whole
            chunk = f.read(max_bytes - total)
        chunks.append(chunk)
        total += len(chunk)
        if total >= max_bytes:
            return b"".join(chunks), i + 1, True
    return b"".join(chunks), len(files), False


def load_corpus(data: Optional[str] = None, seq_len: int = 128, max_bytes: int = DEFAULT_MAX_BYTES) -> Corpus:
    """Bytes of `data` (a text file, or every text file under a folder: binary files are never read) or, by
    default, of the Python stdlib.

    The last VAL_FRACTION of the bytes is the validation split; both splits must hold a window
    of `seq_len + 1` bytes.
    """
    if data is None:
        files, source = stdlib_files(), f"Python stdlib ({sysconfig.get_paths()['stdlib']})"
    else:
        files, source = data_files(Path(data)), str(data)
    raw, num_files, truncated = read_capped(files, max_bytes)
    if not raw:
        raise ValueError(f"--data {source!r} holds no text to train on")
    bytes_N = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    n_val = max(int(len(raw) * VAL_FRACTION), seq_len + 1)
    if len(raw) - n_val < seq_len + 1:
        raise ValueError(
            f"--data {source!r} has {len(raw)} bytes, too few for --seq-len {seq_len}: need at least "
            f"{2 * (seq_len + 1)} for a training and a validation window"
        )
    return Corpus(bytes_N[:-n_val], bytes_N[-n_val:], source, num_files, truncated)


class BatchSampler:
    """Random windows of a byte split: (x_BT, y_BT) with y the next byte, drawn from a seeded generator."""

    def __init__(self, bytes_N: torch.Tensor, batch_size: int, seq_len: int, seed: int):
        if bytes_N.numel() < seq_len + 1:
            raise ValueError(f"a split of {bytes_N.numel()} bytes is shorter than seq_len + 1 = {seq_len + 1}")
        self.bytes_N = bytes_N
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.generator = torch.Generator().manual_seed(seed)

    def next(self) -> Tuple[torch.Tensor, torch.Tensor]:
        starts_B = torch.randint(self.bytes_N.numel() - self.seq_len, (self.batch_size,), generator=self.generator)
        window_BT = torch.arange(self.seq_len + 1) + starts_B[:, None]
        chunk_BT = self.bytes_N[window_BT].long()
        return chunk_BT[:, :-1], chunk_BT[:, 1:]
