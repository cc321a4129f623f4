"""``k3rl checkpoint init|fetch|validate|quantize``: the command line of ``k3core.checkpoint``.

    k3rl checkpoint init --preset tiny --out ckpt/ [--format bf16|mxfp4] [--seed N]
    k3rl checkpoint fetch URL DIR [--pin pin.json] [--workers 8]
    k3rl checkpoint validate DIR [--pin pin.json] [--report report.json] [--roundtrip] [--write-pin pin.json]
    k3rl checkpoint quantize SRC DST

``add_checkpoint_subcommands(subparsers)`` adds a ``checkpoint`` command with these four
subcommands to an argparse subparsers object; each sets ``fn`` (and ``func``) to a handler
``handler(args) -> int`` exit status: 0 success, 1 a checkpoint that failed validation or a pin, or
a transfer that failed after the storage client's retries, 2 bad input (unknown preset, missing
directory, a config that cannot be quantised, storage access denied or a bucket that does not exist).
Heavy imports happen inside the handlers, so building the parser stays cheap.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

__all__ = ["add_checkpoint_subcommands", "cmd_init", "cmd_fetch", "cmd_validate", "cmd_quantize"]


def _err(msg: str, code: int) -> int:
    print(f"k3rl checkpoint: error: {msg}", file=sys.stderr)
    return code


def _size(text: str) -> int:
    """Bytes, with an optional K/M/G/T suffix (powers of 1000, as HF's "5GB")."""
    t = text.strip().upper().removesuffix("B")
    mult = {"K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}.get(t[-1:], 1)
    try:
        v = int(float(t[:-1] if mult > 1 else t) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size such as 5GB or 200000000, got {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return v


def _seed(text: str) -> int:
    """A seed as ``init:PRESET:SEED`` takes it (a non-negative integer), so both spellings name the same
    checkpoints."""
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return int(text)


def _workers(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def cmd_init(a) -> int:
    from k3core.checkpoint.hf import DEFAULT_MAX_SHARD_BYTES, init_checkpoint

    try:
        r = init_checkpoint(a.preset, a.out, seed=a.seed, format=a.format,
                            max_shard_bytes=a.max_shard_bytes or DEFAULT_MAX_SHARD_BYTES, tokenizer=a.tokenizer)
    except ValueError as e:
        return _err(str(e), 2)
    print(f"{r.path}: fresh '{a.preset}' checkpoint (seed {a.seed}, {r.target}), {len(r.shards)} shards, "
          f"{r.num_keys} tensors, {r.total_size / 2**20:.1f} MiB, tokenizer {a.tokenizer}")
    return 0


def cmd_fetch(a) -> int:
    from k3core.checkpoint.fetch import FetchError, fetch
    from k3core.checkpoint.pin import PinMismatchError
    from k3core.storage import StorageError

    try:
        r = fetch(a.url, a.dir, pin=a.pin, workers=a.workers, progress=None if a.progress else False)
    except PinMismatchError as e:
        return _err(str(e), 1)
    except StorageError as e:  # permanent (access, credentials, bucket): 2; else the transfer failed: 1
        if e.permanent:
            return _err(f"{e}; {a.dir} is untouched", 2)
        return _err(f"{e}; {a.dir} is untouched, and what arrived is kept: run the same command to resume", 1)
    except (FetchError, ImportError, FileNotFoundError, ValueError) as e:
        return _err(str(e), 2)
    print(f"{r.dest}: {len(r.downloaded)} files fetched ({r.bytes_downloaded / 2**20:.1f} MiB), "
          f"{len(r.skipped)} already in place, {r.seconds:.1f} s")
    return 0


def cmd_validate(a) -> int:
    from k3core.checkpoint.pin import make_pin, write_pin
    from k3core.checkpoint.validate import CheckpointValidationError, validate_checkpoint
    from k3core.config import K3Config

    try:
        config = K3Config.preset(a.preset) if a.preset else None
    except ValueError as e:
        return _err(str(e), 2)
    if not os.path.isdir(a.dir):  # a wrong path is bad usage, not an invalid checkpoint
        return _err(f"{a.dir} is not a directory: give the checkpoint's directory (config.json, index, shards)", 2)
    try:
        rep = validate_checkpoint(a.dir, config=config, pin=a.pin, report_path=a.report, roundtrip=a.roundtrip,
                                  workers=a.workers)
    except CheckpointValidationError as e:
        return _err(f"checkpoint {a.dir} is NOT valid: {e}", 1)
    if rep["format"] == "dcp":
        print(f"{a.dir}: valid DCP trainer state: {rep['manifest']['files']} files match its manifest, "
              f".metadata unpickled safely ({rep['items']} items in {len(rep['data_files'])} data files)"
              + (f"; report {a.report}" if a.report else ""))
        if a.write_pin:
            return _err("--write-pin pins public-layout checkpoints; a trainer state is held by its manifest", 2)
        return 0
    if a.write_pin:
        write_pin(make_pin(a.dir), a.write_pin)
    c = rep["counts"]
    print(f"{a.dir}: valid {rep['format']} checkpoint: {c['text_tensors']} text tensors ({c['mxfp4_pairs']} MXFP4 "
          f"pairs) in {c['shards']} shards, {c['file_bytes'] / 2**20:.1f} MiB hashed"
          + (f", {c['out_of_scope_tensors']} vision tensors out of scope" if c["out_of_scope_tensors"] else "")
          + (", round trip bit-exact" if rep["roundtrip"] else "")
          + (f"; report {a.report}" if a.report else "") + (f"; pin {a.write_pin}" if a.write_pin else ""))
    if a.json:
        print(json.dumps({k: v for k, v in rep.items() if k != "files"}, indent=2))
    return 0


def cmd_quantize(a) -> int:
    from k3core.checkpoint.hf import DEFAULT_MAX_SHARD_BYTES, CheckpointFormatError, quantize_checkpoint
    from k3core.checkpoint.manifest import ManifestError

    try:
        r = quantize_checkpoint(a.src, a.dst, max_shard_bytes=a.max_shard_bytes or DEFAULT_MAX_SHARD_BYTES)
    except ManifestError as e:
        return _err(f"source checkpoint {a.src} failed its integrity check: {e}", 1)
    except (ValueError, FileNotFoundError, CheckpointFormatError) as e:
        return _err(str(e), 2)
    print(f"{r.path}: MXFP4 checkpoint, {len(r.shards)} shards, {r.num_keys} tensors, {r.total_size / 2**20:.1f} MiB")
    return 0


def add_checkpoint_subcommands(subparsers) -> argparse.ArgumentParser:
    """Register ``checkpoint {init,fetch,validate,quantize}`` on ``subparsers``; returns the parser."""
    cp = subparsers.add_parser("checkpoint", help="public-layout checkpoints: init, fetch, validate, quantize")
    sub = cp.add_subparsers(dest="checkpoint_cmd", required=True)

    def handler(p, fn):
        p.set_defaults(fn=fn, func=fn)

    p = sub.add_parser("init", help="a fresh seeded random checkpoint in the public HF layout",
                       epilog="example: k3rl checkpoint init --preset tiny --out ckpt/tiny --seed 0")
    p.add_argument("--preset", required=True, help="tiny, small, medium or full")
    p.add_argument("--out", required=True, help="checkpoint directory (replaced as a whole)")
    p.add_argument("--format", choices=["bf16", "mxfp4"], default="bf16",
                   help="bf16 weights, or routed experts as MXFP4 weight_packed/weight_scale pairs (default bf16)")
    p.add_argument("--seed", type=_seed, default=0,
                   help="weight seed, a non-negative integer: same preset and seed, same bytes (default 0)")
    p.add_argument("--max-shard-bytes", type=_size, default=None, help="shard bound (default 5GB)")
    p.add_argument("--tokenizer", default="bytes",
                   help="bytes (the CPU presets' byte vocabulary, no tokenizer files), bpe (the bundled 2k-token BPE "
                        "in the release's layout, with K3's special tokens and chat template) or DIR (a tokenizer in "
                        "the release's layout, tiktoken.model + tokenizer_config.json, or a tokenizer.json): its data "
                        "files are copied, never its code, and the config's vocabulary follows it (default bytes)")
    handler(p, cmd_init)

    p = sub.add_parser("fetch", help="copy a checkpoint from a URL (file, memory, s3, hf://org/name@rev): "
                       "parallel, resumable, pinned; DIR must be new, empty or an earlier fetch of URL, and is "
                       "replaced only by a complete fetch",
                       epilog="example: k3rl checkpoint fetch hf://moonshotai/Kimi-K3@<rev> /data/k3 --pin k3.pin.json")
    p.add_argument("url", help="source checkpoint: file://, memory://, s3://, hf://org/name@revision")
    p.add_argument("dir", help="local destination directory (new, empty, or an earlier fetch of URL)")
    p.add_argument("--pin", default=None, help="JSON pin: config_sha256, index_sha256 [, files]")
    p.add_argument("--workers", type=_workers, default=8, help="parallel file transfers")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no stderr progress bar")
    handler(p, cmd_fetch)

    p = sub.add_parser("validate", help="fail-closed audit: structure vs config, sha256 of every file against the "
                       "pin and k3rl's manifest, optional round trip; a trainer state (DCP): its manifest and "
                       "metadata, nothing loaded",
                       epilog="exit status 0 valid, 1 invalid (the first failed check is printed), 2 bad arguments")
    p.add_argument("dir", help="a checkpoint directory, a trainer state, or a run checkpoint (runs/ID/checkpoints/iter-N)")
    p.add_argument("--pin", default=None, help="JSON pin the checkpoint must match")
    p.add_argument("--report", default=None, help="write the JSON report here (only when valid)")
    p.add_argument("--roundtrip", action="store_true", help="also check public -> native -> public bit for bit")
    p.add_argument("--preset", default=None, help="the model it must be (default: its own config.json)")
    p.add_argument("--write-pin", default=None, help="after passing, write a pin of this checkpoint here")
    p.add_argument("--workers", type=_workers, default=4, help="files hashed at once")
    p.add_argument("--json", action="store_true", help="print the report (without per-file hashes)")
    handler(p, cmd_validate)

    p = sub.add_parser("quantize", help="bf16 checkpoint -> MXFP4 routed experts (the release format), streamed; "
                       "DST must be a new or empty directory apart from SRC")
    p.add_argument("src", help="bf16 checkpoint directory to read")
    p.add_argument("dst", help="new or empty directory for the MXFP4 checkpoint (not SRC, not inside it)")
    p.add_argument("--max-shard-bytes", type=_size, default=None, help="shard bound (default 5GB)")
    handler(p, cmd_quantize)
    return cp
