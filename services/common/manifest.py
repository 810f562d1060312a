"""Weight integrity: a sha256 manifest written on the first load of a checkpoint, checked after."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

MANIFEST_NAME = "specserve-manifest.json"
COVERED_SUFFIXES = (".safetensors", ".json", ".model", ".txt")


class IntegrityError(RuntimeError):
    """A checkpoint file no longer matches the manifest written when it was first loaded."""


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def checkpoint_files(ckpt: Path) -> list[Path]:
    return sorted(p for p in ckpt.iterdir()
                  if p.is_file() and p.suffix in COVERED_SUFFIXES and p.name != MANIFEST_NAME)


def write_manifest(ckpt: Path, manifest: Path) -> dict[str, str]:
    digests = {p.name: sha256_file(p) for p in checkpoint_files(ckpt)}
    manifest.parent.mkdir(parents=True, exist_ok=True)
    tmp = manifest.with_suffix(f".tmp{os.getpid()}")  # several services may load one model at once
    tmp.write_text(json.dumps({"checkpoint": str(ckpt), "sha256": digests}, indent=1))
    tmp.replace(manifest)
    return digests


def check_manifest(ckpt: Path, manifest: Path) -> bool:
    """Write the manifest if absent (returns True), else verify every file against it.

    Raises IntegrityError naming the first file that is missing, new or changed.
    """
    if not manifest.exists():
        write_manifest(ckpt, manifest)
        return True
    expected: dict[str, str] = json.loads(manifest.read_text())["sha256"]
    present = {p.name for p in checkpoint_files(ckpt)}
    hint = (f"(manifest {manifest}); restore the original file, or delete the manifest "
            "if the change is intended")
    for name in sorted(set(expected) | present):
        if name not in present:
            raise IntegrityError(f"checkpoint file {ckpt / name} is missing {hint}")
        if name not in expected:
            raise IntegrityError(f"checkpoint file {ckpt / name} is not in the manifest {hint}")
        actual = sha256_file(ckpt / name)
        if actual != expected[name]:
            raise IntegrityError(f"checkpoint file {ckpt / name} has sha256 {actual[:16]}..., "
                                 f"the manifest recorded {expected[name][:16]}... {hint}")
    return False
