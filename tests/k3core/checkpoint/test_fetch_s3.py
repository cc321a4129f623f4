"""``k3rl checkpoint fetch s3://...`` against a real S3 server (moto's, on 127.0.0.1, through s3fs):
the fetched checkpoint validates and equals the source byte for byte; transient server errors are
retried through; a permanent one (access denied, a missing bucket) exits 2 with one message naming
the object and the fix, the destination untouched, and the next fetch resumes. Faults are the
server's answers (``tests/s3_local.py``), not patches of k3rl's code."""

import uuid
from pathlib import Path

import pytest

from flows.cli import main
from k3core.checkpoint.fetch import RECORD_NAME
from k3core.checkpoint.files import sha256_file
from k3core.checkpoint.hf import init_checkpoint


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("src") / "ck"
    init_checkpoint("tiny", d, seed=5, max_shard_bytes=120_000)
    return d


@pytest.fixture
def s3_source(local_s3, source, monkeypatch, tmp_path):
    """(server, URL): the source checkpoint uploaded to a fresh bucket; this process pointed at the
    server and nowhere else."""
    local_s3.configure(monkeypatch, tmp_path)
    bucket = f"k3rl-{uuid.uuid4().hex[:12]}"
    fs = local_s3.filesystem()
    fs.mkdir(bucket)
    for p in source.iterdir():
        fs.put_file(str(p), f"{bucket}/ckpts/tiny/{p.name}")
    yield local_s3, f"s3://{bucket}/ckpts/tiny"
    local_s3.clear_faults()


def tree(d: Path) -> dict[str, str]:
    return {p.relative_to(d).as_posix(): sha256_file(p) for p in sorted(d.rglob("*"))
            if p.is_file() and p.name != RECORD_NAME}


def error_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def test_fetch_from_s3_validates_and_retries_transient_errors(s3_source, source, tmp_path, capsys):
    server, url = s3_source
    shards = sorted(p.name for p in source.glob("model-*.safetensors"))
    path = url.removeprefix("s3:/")
    slow = server.fail("GET", f"{path}/{shards[1]}", status=503, code="SlowDown", times=2)
    internal = server.fail("GET", f"{path}/config.json", status=500, code="InternalError", times=1)
    dest = tmp_path / "dst"
    assert main(["checkpoint", "fetch", url, str(dest), "--workers", "3", "--no-progress"]) == 0
    assert slow.hits == 2 and internal.hits == 1  # the server failed those requests, the client retried them
    assert tree(dest) == tree(source)
    assert main(["checkpoint", "validate", str(dest)]) == 0
    assert "valid bf16 checkpoint" in capsys.readouterr().out
    # a second fetch of the same URL: everything is in place (same ETags, same bytes)
    assert main(["checkpoint", "fetch", url, str(dest), "--no-progress"]) == 0
    assert "0 files fetched" in capsys.readouterr().out


def test_access_denied_exits_2_untouched_then_the_next_fetch_resumes(s3_source, source, tmp_path, capsys):
    server, url = s3_source
    shards = sorted(p.name for p in source.glob("model-*.safetensors"))
    denied = server.fail("GET", f"{url.removeprefix('s3:/')}/{shards[-1]}", status=403, code="AccessDenied")
    dest = tmp_path / "dst"
    assert main(["checkpoint", "fetch", url, str(dest), "--workers", "1", "--no-progress"]) == 2
    err = error_lines(capsys)
    assert len(err) == 1, err  # one message, no traceback
    assert f"cannot read {url}/{shards[-1]}: access denied" in err[0] and "AWS_ACCESS_KEY_ID" in err[0]
    assert f"{dest} is untouched" in err[0]
    assert denied.hits >= 1 and not dest.exists()  # nothing half-published
    staged = dest.parent / f".{dest.name}.fetching"
    kept = {p.name for p in staged.iterdir()} - {RECORD_NAME}
    assert set(shards[:-1]) <= kept  # what arrived is kept for the next run

    server.clear_faults()  # the user fixes the bucket policy and runs the same command
    n0 = len(server.requests)
    assert main(["checkpoint", "fetch", url, str(dest), "--no-progress"]) == 0
    assert tree(dest) == tree(source)
    fetched_again = {p.rsplit("/", 1)[-1] for m, p in server.requests[n0:] if m == "GET" and "/ckpts/tiny/" in p}
    assert fetched_again == {shards[-1]}  # only the file that was refused


def test_missing_bucket_and_missing_credentials_exit_2_with_one_message(s3_source, tmp_path, monkeypatch, capsys):
    server, url = s3_source
    assert main(["checkpoint", "fetch", "s3://no-such-bucket-k3rl/ckpts/tiny", str(tmp_path / "a"),
                 "--no-progress"]) == 2
    err = error_lines(capsys)
    assert len(err) == 1 and "s3://no-such-bucket-k3rl/ckpts/tiny: not found" in err[0] and "bucket" in err[0], err
    assert not (tmp_path / "a").exists()

    import fsspec.config

    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setitem(fsspec.config.conf, "s3", {"endpoint_url": server.endpoint, "skip_instance_cache": True})
    assert main(["checkpoint", "fetch", url, str(tmp_path / "b"), "--no-progress"]) == 2
    err = error_lines(capsys)
    assert len(err) == 1 and f"cannot list {url}: no usable credentials" in err[0], err
    assert "AWS_ACCESS_KEY_ID" in err[0] and not (tmp_path / "b").exists()


def test_an_endpoint_that_does_not_answer_exits_1_and_says_where_to_look(s3_source, tmp_path, monkeypatch, capsys):
    """Not permanent (the network may come back): exit 1, naming the endpoint settings to check."""
    import socket

    import fsspec.config

    _, url = s3_source
    with socket.socket() as s:  # a port on 127.0.0.1 that nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")  # botocore's retries of the refused connection, kept short
    monkeypatch.setitem(fsspec.config.conf, "s3", {"endpoint_url": dead, "skip_instance_cache": True})
    assert main(["checkpoint", "fetch", url, str(tmp_path / "d"), "--no-progress"]) == 1
    err = error_lines(capsys)
    assert len(err) == 1 and f"cannot list {url}: the storage endpoint did not answer" in err[0], err
    assert "AWS_ENDPOINT_URL_S3" in err[0] and "run the same command" in err[0]
    assert not (tmp_path / "d").exists()
