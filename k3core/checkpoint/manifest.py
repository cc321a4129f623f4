"""Content manifests: the sha256 and size of every file of a checkpoint k3rl wrote, checked before
anything reads the checkpoint.

Owns: ``MANIFEST_NAME``, ``write_manifest`` (hash a finished directory, write its manifest),
``verify_manifest`` (every listed file present, of the listed size and sha256; names the first file
that is not) and ``ManifestError``. Does not own: what a checkpoint's files mean (``hf``,
``validate``, ``dcp_safe``), or where a trusted hash of the manifest itself comes from (a pin).

Who writes one: ``save_hf`` (every public-layout checkpoint: ``init``, ``quantize``, weight
transfers through disk) and ``save_trainer_state`` (every DCP trainer state, ``.metadata``
included). Who checks it: ``validate_checkpoint``, ``load_hf``, ``load_w4a8_model``,
``quantize_checkpoint``, ``read_disk`` (public checkpoints, when a manifest is present: a release
fetched from elsewhere has none, and a pin is how it is held to a hash) and ``load_trainer_state``
(always: a trainer state without its manifest is refused, since its ``.metadata`` is a pickle).

What it protects against: a file that changed after it was written (a flipped bit, a truncated or
swapped shard, a planted ``.metadata``) when the manifest itself was not rewritten to match. Someone
who can rewrite the manifest too is stopped only by a pin (``k3core.checkpoint.pin``) and, for the
DCP pickles, by ``dcp_safe``'s restricted unpickling (``docs/security.md``).

Format (``k3rl.manifest.json``, beside the files)::

    {"format": "k3rl.manifest/1", "algorithm": "sha256",
     "files": {"<relative posix path>": {"sha256": "<hex>", "size": <bytes>}, ...}}
"""

from __future__ import annotations

import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath

from k3core.checkpoint.files import atomic_write_json, sha256_file

__all__ = ["MANIFEST_NAME", "MANIFEST_FORMAT", "ManifestError", "write_manifest", "read_manifest", "verify_manifest",
           "has_manifest"]

MANIFEST_NAME = "k3rl.manifest.json"
MANIFEST_FORMAT = "k3rl.manifest/1"
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


class ManifestError(ValueError):
    """A checkpoint file that does not match its manifest (or a manifest that cannot be trusted)."""


def _listed_files(root: Path) -> list[Path]:
    """Every regular file under ``root`` except the manifest: dot files too (DCP's ``.metadata``)."""
    return sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink() and p.name != MANIFEST_NAME)


def write_manifest(root: str | os.PathLike, workers: int = 4, known: dict[str, tuple[str, int]] | None = None) -> dict:
    """Hash every file of the finished directory ``root`` and write ``root/k3rl.manifest.json``
    atomically (the caller publishes ``root`` as a whole afterwards). Returns the manifest.

    ``known``: relative name -> (sha256, size) of files whose digest the writer computed from the
    bytes it wrote (``ODirectFileSystemWriter.digests``); those are not read back. A known size that
    differs from the file's is a writer bug, and raises ``ManifestError`` rather than record a lie."""
    root = Path(root)
    files = _listed_files(root)
    names = [p.relative_to(root).as_posix() for p in files]
    sizes = [p.stat().st_size for p in files]
    known = known or {}
    for name, size in zip(names, sizes):
        if name in known and known[name][1] != size:
            raise ManifestError(f"{root / name}: {size} bytes on disk, its writer reported {known[name][1]}")
    todo = [k for k, name in enumerate(names) if name not in known]
    digests = {names[k]: known[names[k]][0] for k in range(len(names)) if names[k] in known}
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        digests.update(zip((names[k] for k in todo), pool.map(lambda k: sha256_file(files[k]), todo)))
    manifest = {"format": MANIFEST_FORMAT, "algorithm": "sha256",
                "files": {name: {"sha256": digests[name], "size": size} for name, size in zip(names, sizes)}}
    atomic_write_json(root / MANIFEST_NAME, manifest)
    return manifest


def has_manifest(root: str | os.PathLike) -> bool:
    return (Path(root) / MANIFEST_NAME).is_file()


def _safe_name(name: str) -> bool:
    p = PurePosixPath(name)
    return bool(name) and not p.is_absolute() and ".." not in p.parts and "\\" not in name and name == p.as_posix()


def read_manifest(root: str | os.PathLike) -> dict:
    """The parsed, well-formed manifest of ``root`` (``ManifestError`` naming what is wrong)."""
    p = Path(root) / MANIFEST_NAME
    try:
        m = json.loads(p.read_text())
    except FileNotFoundError:
        raise ManifestError(f"{p} is missing: k3rl writes one with every checkpoint it saves; without it the "
                            f"files cannot be checked (restore the checkpoint, or fetch it again)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ManifestError(f"{p}: not readable JSON ({e})") from None
    files = m.get("files") if isinstance(m, dict) else None
    if not isinstance(m, dict) or m.get("format") != MANIFEST_FORMAT or m.get("algorithm") != "sha256" \
            or not isinstance(files, dict):
        raise ManifestError(f"{p}: not a {MANIFEST_FORMAT} manifest (format, algorithm 'sha256', files)")
    for name, ent in files.items():
        if not _safe_name(name):
            raise ManifestError(f"{p}: file name {name!r} is not a relative path inside the checkpoint")
        if not (isinstance(ent, dict) and isinstance(ent.get("sha256"), str) and _HEX64.match(ent["sha256"])
                and isinstance(ent.get("size"), int) and ent["size"] >= 0):
            raise ManifestError(f"{p}: entry {name!r} needs a lowercase hex 'sha256' and an integer 'size'")
    return m


def verify_manifest(root: str | os.PathLike, required: bool = False, must_list: tuple[str, ...] | set[str] = (),
                    hashes: dict[str, str] | None = None, workers: int = 4) -> dict | None:
    """Check every file ``root``'s manifest lists: present, the listed size, the listed sha256.

    Returns the manifest, or None when there is none and ``required`` is false. ``must_list``: file
    names the caller will read, which the manifest must cover (a reader never reads an unchecked
    file). ``hashes``: sha256 already computed for some files (name -> hex), reused instead of
    reading them again. Raises ``ManifestError`` naming the first file that differs.
    """
    root = Path(root)
    if not has_manifest(root) and not required:
        return None
    m = read_manifest(root)
    files = m["files"]
    unlisted = sorted(set(must_list) - set(files))
    if unlisted:
        raise ManifestError(f"{root / unlisted[0]} is not in {MANIFEST_NAME} (a file added after the checkpoint "
                            f"was written): refusing to read it")
    todo = []
    for name in sorted(files):
        p = root / name
        if not p.is_file() or p.is_symlink():
            raise ManifestError(f"{p} is listed in {MANIFEST_NAME} but missing (or not a regular file)")
        size = p.stat().st_size
        if size != files[name]["size"]:
            raise ManifestError(f"{p}: {size} bytes, the manifest says {files[name]['size']} (truncated or "
                                f"replaced after it was written): restore the checkpoint or fetch it again")
        if not (hashes and name in hashes):
            todo.append(name)
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        got = dict(zip(todo, pool.map(lambda n: sha256_file(root / n), todo)))
    got.update({n: h for n, h in (hashes or {}).items() if n in files})
    for name in sorted(files):
        if got[name] != files[name]["sha256"]:
            raise ManifestError(f"{root / name}: sha256 {got[name]} does not match {MANIFEST_NAME} "
                                f"({files[name]['sha256']}): the file changed after it was written (corruption or "
                                f"tampering); restore the checkpoint or fetch it again")
    return m
