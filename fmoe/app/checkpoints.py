"""`fmoe train`'s checkpoints on disk, written whole and verified on load.

One process writes `checkpoint.pt`: the state plus a `fmoe` record (format, fmoe version, a
SHA-256 over every tensor's bytes and every other value), so flipped bytes anywhere in the data
are caught. The file it replaces stays as `checkpoint.prev.pt` (with keep >= 2).

Several processes write a folder: `checkpoint/step-00000010/` holds the torch.distributed
shards, `trainer.pt`, each rank's `rng-rank<r>.pt` and, written last, `manifest.json` (the
SHA-256 of every file, the fmoe version and the configs). `checkpoint/latest` names the newest
complete folder and is switched only after the manifest is on disk, so a kill at any instant
leaves the previous step whole; the newest `keep` folders are kept.
"""
import hashlib
import json
import os
import shutil
import zipfile
from pathlib import Path
from typing import Optional

import torch

import fmoe
from fmoe.app.files import save_torch, sha256_file, write_json, write_text

FORMAT = "fmoe-train-checkpoint/1"
MANIFEST = "manifest.json"
TRAINER_FILE = "trainer.pt"
LATEST = "latest"


class CheckpointError(ValueError):
    """A checkpoint that is missing, truncated, corrupt or not fmoe's: the message names the file."""


def tree_digest(obj) -> str:
    """SHA-256 over a nested state: tensor dtypes, shapes and bytes, and every other leaf's repr."""
    digest = hashlib.sha256()

    def visit(node):
        if isinstance(node, torch.Tensor):
            flat = node.detach().cpu().contiguous().reshape(-1)
            digest.update(f"T{flat.dtype}{tuple(node.shape)}".encode())
            digest.update(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"")
        elif isinstance(node, dict):
            digest.update(b"{")
            for key in sorted(node, key=repr):
                digest.update(repr(key).encode())
                visit(node[key])
            digest.update(b"}")
        elif isinstance(node, (list, tuple)):
            digest.update(b"[")
            for item in node:
                visit(item)
            digest.update(b"]")
        else:
            digest.update(repr(node).encode())

    visit(obj)
    return digest.hexdigest()


def describe_fallback(previous: Optional[Path]) -> str:
    if previous is None:
        return "no earlier good checkpoint is kept; train without --resume to start over"
    return f"the previous good checkpoint is {previous}; resume from it with --resume-from {previous}"


def unreadable(what: str, path, reader: str, err: BaseException) -> CheckpointError:
    """The error for a file that `reader` cannot parse: the file, and the first line of the reader's error."""
    first_line = (str(err).splitlines() or [type(err).__name__])[0]
    return CheckpointError(f"{what} {path} is truncated or corrupt: {reader} cannot read it "
                           f"({type(err).__name__}: {first_line[:200]})")


def read_torch(path: Path, what: str = "checkpoint") -> dict:
    """torch.load with one clear error for a missing, empty, truncated or unreadable file."""
    if not path.exists():
        raise CheckpointError(f"no {what} at {path}")
    if path.stat().st_size == 0:
        raise CheckpointError(f"{what} {path} is empty (0 bytes)")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:        # zip, pickle and EOF errors all mean the same thing here
        raise unreadable(what, path, "torch", err) from err
    if not isinstance(state, dict):
        raise CheckpointError(f"{what} {path} is not an fmoe checkpoint (it holds a {type(state).__name__})")
    return state


def check_zip_records(path: Path, what: str):
    """Each record of a torch zip file against its CRC-32, which torch.load does not check; a file
    of torch's older non-zip format (or a truncated one, which read_torch names) has none to check."""
    if not zipfile.is_zipfile(path):
        return
    try:
        with zipfile.ZipFile(path) as archive:
            damaged = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as err:
        raise unreadable(what, path, "zipfile", err) from err
    if damaged is not None:
        raise CheckpointError(f"{what} {path} is corrupt: its record {damaged} fails its CRC-32 check")


# --- one process: checkpoint.pt ----------------------------------------------------------------

def previous_file(path: Path) -> Path:
    return path.with_name(path.stem + ".prev" + path.suffix)


def save_file(path: Path, state: dict, keep: int = 2):
    """Write `state` to `path` with its checksum; with keep >= 2 the replaced file becomes `*.prev.pt`."""
    record = {"format": FORMAT, "fmoe_version": fmoe.__version__, "sha256": tree_digest(state)}
    if keep >= 2 and path.exists():
        # A hard link, renamed into place: at every instant one of the two names holds a whole checkpoint.
        tmp_link = path.with_name(f".{path.name}.prev-link")
        tmp_link.unlink(missing_ok=True)
        os.link(path, tmp_link)
        os.replace(tmp_link, previous_file(path))
    save_torch(path, {**state, "fmoe": record})


def load_file(path: Path) -> dict:
    """The verified state of a `checkpoint.pt`, or a CheckpointError naming the file and the fallback."""
    try:
        return verify_file(path)
    except CheckpointError as err:
        prev = previous_file(path)
        fallback = prev if prev != path and prev.exists() and is_good_file(prev) else None
        if not path.exists():
            raise
        raise CheckpointError(f"{err}; {describe_fallback(fallback)}") from None


def verify_file(path: Path) -> dict:
    state = read_torch(path)
    record = state.pop("fmoe", None)
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path} is not an fmoe train checkpoint (no '{FORMAT}' record)")
    if tree_digest(state) != record.get("sha256"):
        raise CheckpointError(f"checkpoint {path} is corrupt: its contents do not match the checksum written "
                              "with it (bytes changed after saving)")
    state["fmoe_version"] = record.get("fmoe_version")
    return state


def is_good_file(path: Path) -> bool:
    try:
        verify_file(path)
        return True
    except CheckpointError:
        return False


# --- several processes: checkpoint/step-*/ ------------------------------------------------------

def step_key(folder: Path):
    """Order of step folders: step-00000010 < step-00000010.1 < step-00000012."""
    name = folder.name[len("step-"):]
    step, _, again = name.partition(".")
    return int(step), int(again or 0)


def step_folders(root: Path):
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-")]
    return sorted((p for p in found if _parses(p)), key=step_key)


def _parses(folder: Path) -> bool:
    try:
        step_key(folder)
        return True
    except ValueError:
        return False


def new_step_folder(root: Path, step: int) -> Path:
    """A folder no earlier save used (a second save at one step gets a `.1` suffix)."""
    base = root / f"step-{step:08d}"
    folder, again = base, 0
    while folder.exists():
        again += 1
        folder = base.with_name(f"{base.name}.{again}")
    folder.mkdir(parents=True)
    return folder


def write_manifest(folder: Path, step: int, configs: dict):
    files = {p.name: sha256_file(p) for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST}
    write_json(folder / MANIFEST, {"format": FORMAT, "fmoe_version": fmoe.__version__, "step": step,
                                   **configs, "files": files}, indent=1)


def publish(root: Path, folder: Path, keep: int):
    """Point `latest` at `folder` (atomically), then remove all but the newest `keep` complete folders."""
    write_text(root / LATEST, folder.name + "\n")
    kept = {folder}
    for older in reversed([f for f in step_folders(root) if step_key(f) < step_key(folder)]):
        if len(kept) >= keep:
            break
        if (older / MANIFEST).exists():
            kept.add(older)
    for stale in step_folders(root):
        if stale not in kept:
            shutil.rmtree(stale, ignore_errors=True)


def verify_folder(folder: Path) -> dict:
    """The manifest of a step folder whose every file matches its checksum."""
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint folder {folder} does not exist")
    manifest_path = folder / MANIFEST
    if not manifest_path.exists():
        raise CheckpointError(f"checkpoint folder {folder} is incomplete: it has no {MANIFEST} "
                              "(the save that wrote it was interrupted)")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{manifest_path} is corrupt: not JSON ({err})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint folder {folder} is not an fmoe train checkpoint")
    for name, expected in manifest.get("files", {}).items():
        path = folder / name
        if not path.exists():
            raise CheckpointError(f"checkpoint file {path} is missing")
        if sha256_file(path) != expected:
            size = path.stat().st_size
            raise CheckpointError(f"checkpoint file {path} is corrupt or truncated ({size} bytes): "
                                  "its checksum does not match the manifest")
    return manifest


def latest_folder(root: Path) -> Optional[Path]:
    pointer = root / LATEST
    if not pointer.exists():
        return None
    return root / pointer.read_text().strip()


def load_folder(root: Path, folder: Optional[Path] = None) -> Path:
    """The verified step folder to resume from (the `latest` one unless `folder` is given)."""
    chosen = folder or latest_folder(root)
    if chosen is None:
        raise CheckpointError(f"no checkpoint at {root}: {root / LATEST} does not exist")
    try:
        verify_folder(chosen)
    except CheckpointError as err:
        before = (lambda f: step_key(f) < step_key(chosen)) if _parses(chosen) else (lambda f: True)
        earlier = [f for f in reversed(step_folders(root)) if f != chosen and before(f)]
        fallback = next((f for f in earlier if _good_folder(f)), None)
        raise CheckpointError(f"{err}; {describe_fallback(fallback)}") from None
    return chosen


def _good_folder(folder: Path) -> bool:
    try:
        verify_folder(folder)
        return True
    except CheckpointError:
        return False
