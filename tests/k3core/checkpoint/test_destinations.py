"""``checkpoint quantize`` and ``checkpoint fetch`` write only into a directory they may replace (the
CLI exits 2 and nothing is touched otherwise). Reference: the bytes of every file before the command."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import pytest

from flows.cli_checkpoint import add_checkpoint_subcommands
from k3core.checkpoint.files import sha256_file
from k3core.checkpoint.hf import init_checkpoint
from k3core.checkpoint.validate import validate_checkpoint


def cli(*argv) -> int:
    parser = argparse.ArgumentParser(prog="k3rl")
    add_checkpoint_subcommands(parser.add_subparsers(dest="cmd"))
    args = parser.parse_args(["checkpoint", *argv])
    return args.fn(args)


def tree(d: Path) -> dict[str, str]:
    return {p.relative_to(d).as_posix(): sha256_file(p) for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("q") / "bf16"
    init_checkpoint("tiny", d, seed=2)
    return d


@pytest.fixture
def src(built, tmp_path) -> Path:
    return Path(shutil.copytree(built, tmp_path / "bf16"))


def test_quantize_refuses_its_own_source_and_overlaps(src, tmp_path, capsys):
    before = tree(src)
    for dst in (src, tmp_path / "bf16" / ".." / "bf16", src / "mx", tmp_path):
        assert cli("quantize", str(src), str(dst)) == 2
        assert "overlaps" in capsys.readouterr().err
    assert tree(src) == before and not (src / "mx").exists()


def test_quantize_refuses_a_non_empty_destination(src, tmp_path, capsys):
    other = tmp_path / "other"
    init_checkpoint("tiny", other, seed=5)
    before = tree(other)
    assert cli("quantize", str(src), str(other)) == 2
    assert "not an empty directory" in capsys.readouterr().err
    assert tree(other) == before
    (tmp_path / "empty").mkdir()
    assert cli("quantize", str(src), str(tmp_path / "empty")) == 0  # empty or new: fine
    assert validate_checkpoint(tmp_path / "empty")["format"] == "mxfp4"


def test_cli_fetch_refuses_its_source_and_a_foreign_destination(src, tmp_path, capsys):
    before = tree(src)
    assert cli("fetch", str(src), str(src), "--no-progress") == 2
    assert "overlaps" in capsys.readouterr().err
    other = tmp_path / "other"
    init_checkpoint("tiny", other, seed=5)
    kept = tree(other)
    assert cli("fetch", src.as_uri(), str(other), "--no-progress") == 2
    assert "not a fetch k3rl made" in capsys.readouterr().err
    assert tree(src) == before and tree(other) == kept
    assert cli("fetch", src.as_uri(), str(tmp_path / "new"), "--no-progress") == 0
    assert validate_checkpoint(tmp_path / "new")["manifest"]["checked"]  # the source's manifest came along
