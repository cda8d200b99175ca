"""Tables on disk in pieces: one safetensors file per piece, and a folder of them installed whole.

A checkpoint's tables (``services.snapshot.checkpoint_tables``) and an export of the tables
(``services.snapshot.table_export``) are written piece by piece, never a whole table in memory: each piece is
a safetensors file (numpy arrays; its string metadata names what it holds) of at most
``rows_per_piece`` entries, and a ``manifest.json`` lists the pieces. The files are written into a
temporary folder beside the destination, which is then renamed into place (:func:`install_folder`),
so a reader never sees half of it. A piece's header (shapes, metadata) is read without its data
(:func:`piece_header`), so a folder is checked before anything is read in full.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from typing import Any

import numpy as np
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

__all__ = ["MANIFEST", "write_piece", "piece_header", "read_piece", "new_folder", "write_manifest", "read_manifest",
           "install_folder", "remove_folder"]

MANIFEST = "manifest.json"
"""The file of a folder of pieces that lists them."""


def write_piece(path: str, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, Any]) -> None:
    """Write one piece (metadata values become strings)."""
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, path,
              metadata={k: str(v) for k, v in metadata.items()})


def piece_header(path: str) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """The shapes of a piece's tensors and its metadata, without reading the data.

    Raises:
        OSError: the file cannot be read; ValueError (safetensors' errors): it is no safetensors file.
    """
    with safe_open(path, framework="numpy") as f:
        names = list(f.keys())  # safe_open has keys(), not the mapping protocol
        return {k: tuple(f.get_slice(k).get_shape()) for k in names}, dict(f.metadata() or {})


def read_piece(path: str) -> dict[str, np.ndarray]:
    """A piece's tensors."""
    return load_file(path)


def new_folder(dest: str) -> str:
    """A new empty temporary folder beside ``dest`` (for :func:`install_folder`)."""
    parent = os.path.dirname(os.path.abspath(dest))
    os.makedirs(parent, exist_ok=True)
    return tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(dest)}.", suffix=".tmp")


def write_manifest(folder: str, manifest: Mapping[str, Any]) -> None:
    """``folder/manifest.json``."""
    with open(os.path.join(folder, MANIFEST), "w") as fh:
        json.dump(manifest, fh, indent=1, sort_keys=True)
        fh.write("\n")


def read_manifest(folder: str) -> dict[str, Any]:
    """``folder/manifest.json``.

    Raises:
        OSError: it cannot be read; ValueError: it is not JSON.
    """
    with open(os.path.join(folder, MANIFEST)) as fh:
        return json.load(fh)


def install_folder(tmp: str, dest: str) -> str | None:
    """Rename the finished folder ``tmp`` to ``dest``; a folder already at ``dest`` is first renamed
    aside. Returns where it went (to delete with :func:`remove_folder` once nothing points at it), or
    None when there was none. The folder is made readable to others (``mkdtemp`` makes it private)."""
    os.chmod(tmp, 0o755)
    old = None
    if os.path.lexists(dest):
        old = tempfile.mkdtemp(dir=os.path.dirname(os.path.abspath(dest)), prefix=f".{os.path.basename(dest)}.",
                               suffix=".old")
        os.rmdir(old)
        os.rename(dest, old)
    os.rename(tmp, dest)
    return old


def remove_folder(path: str | None) -> None:
    """Delete a folder of pieces (nothing when ``path`` is None or gone)."""
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)
