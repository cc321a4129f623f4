"""What a real SGLang server needs to serve a k3rl checkpoint as k3rl computes it.

Owns: ``serving_problems(config, server_info)`` (the reasons, none when fine, that an SGLang server
answering ``/get_server_info`` with ``server_info`` would compute ``config``'s model wrongly), the test
of whether a server is SGLang at all, and ``launch_command`` (the ``sglang.launch_server`` command line
of ``k3rl sglang-server``, with the ``attn-res-cw-refresh`` fix switched on in its environment).
Does not own: HTTP (``k3core.rollout.client`` asks the server), the fix itself
(``k3core.rollout.sglang_fix``).

Checked against SGLang ``SGLANG_CHECKED_VERSION`` (tests/interop; docs/interop.md says what is proven).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from k3core.config import SGLANG_ATTN_RES_BLOCK_H, K3Config
from k3core.rollout import sglang_fix

SGLANG_CHECKED_VERSION = "0.5.23"

# Server dtypes that compute a bf16 checkpoint as stored; float16 would round every weight and activation.
_DTYPES_OK = ("auto", "bfloat16", "float32")


def is_sglang(server_info) -> bool:
    """An SGLang server's ``/get_server_info`` answer: its server arguments plus ``version``
    (``build_server_info`` in ``sglang/srt/utils/common.py``). k3rl's own rollout server has none."""
    return isinstance(server_info, dict) and all(k in server_info for k in ("version", "dtype", "model_path"))


def serving_problems(config: K3Config, server_info: dict) -> list[str]:
    """Why an SGLang server described by ``server_info`` would serve ``config`` wrongly (empty: it would not)."""
    problems = []
    version = server_info.get("version", "?")
    if config.hidden_size % SGLANG_ATTN_RES_BLOCK_H:
        problems.append(
            f"hidden_size {config.hidden_size} is not a multiple of {SGLANG_ATTN_RES_BLOCK_H}: SGLang {version}'s AttnRes "
            f"aggregation kernel (sglang/srt/layers/attn_residual.py) reads the hidden dimension in blocks of "
            f"{SGLANG_ATTN_RES_BLOCK_H} and computes this model wrongly; train a preset SGLang can serve "
            "(--preset serve-small) or serve with `k3rl rollout-server`")
    dtype = str(server_info.get("dtype"))
    if dtype not in _DTYPES_OK:
        problems.append(f"the server runs --dtype {dtype}; the checkpoint is bfloat16: restart it with --dtype bfloat16 "
                        "(k3rl sglang-server does)")
    quant = server_info.get("quantization")
    want = "compressed-tensors" if config.quantization_config is not None else None
    if quant not in (None, want):
        problems.append(f"the server runs --quantization {quant}, the checkpoint is "
                        f"{'MXFP4 (compressed-tensors)' if want else 'bf16'}: it would serve a differently quantised "
                        f"model; restart it with {'--quantization compressed-tensors' if want else 'no --quantization'}")
    if server_info.get("skip_tokenizer_init") is False:
        problems.append("the server decodes text with a tokenizer (no --skip-tokenizer-init); k3rl checkpoints "
                        "speak token ids: restart it with --skip-tokenizer-init")
    return problems


def launch_command(checkpoint: str | os.PathLike, *, host: str = "127.0.0.1", port: int = 30000,
                   dtype: str = "bfloat16", quantization: str = "auto", weight_version: str | None = None,
                   extra: list[str] | None = None) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) that start SGLang's server on ``checkpoint`` the way k3rl needs it. Refuses
    (``ValueError``, every reason) a checkpoint SGLang would compute wrongly."""
    cfg_path = Path(checkpoint) / "config.json"
    if not cfg_path.is_file():
        raise ValueError(f"{checkpoint}: no config.json; point --checkpoint at a checkpoint directory in the "
                         "public layout (e.g. one made by `k3rl checkpoint init --preset serve-small`)")
    config = K3Config.from_json_file(cfg_path)
    if quantization == "auto":
        quantization = "compressed-tensors" if config.quantization_config is not None else "none"
    planned = {"version": SGLANG_CHECKED_VERSION, "dtype": dtype, "model_path": str(checkpoint),
               "quantization": None if quantization == "none" else quantization, "skip_tokenizer_init": True}
    problems = serving_problems(config, planned)
    if problems:
        raise ValueError(f"SGLang would serve {checkpoint} wrongly:\n  - " + "\n  - ".join(problems))
    argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(checkpoint),
            "--skip-tokenizer-init", "--dtype", dtype, "--host", host, "--port", str(port),
            "--enable-return-routed-experts"]
    if quantization != "none":
        argv += ["--quantization", quantization]
    if weight_version is not None:
        argv += ["--weight-version", str(weight_version)]
    argv += list(extra or [])
    fixes = {s for s in os.environ.get(sglang_fix.ENV, "").split(",") if s} | {sglang_fix.FIX_NAME}
    env = dict(os.environ, **{sglang_fix.ENV: ",".join(sorted(fixes))})
    return argv, env
