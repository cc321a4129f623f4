"""The bad-input catalog: every input k3rl takes (command lines, run settings as deployments pass
them, config.json, checkpoints, environment modules, rollout-server requests), fed wrong on purpose.

Each case is one row of a table: the input, the outcome it must get (exit status 2; a
``SettingsError`` for deployment parameters; an HTTP 4xx for the server) and a fragment of the
one message that names the problem. For every command-line case, also: no traceback, exactly one
``error:`` line, nothing under the test's files changed or created (a published run and the
checkpoints included), and no pipeline flow reached (``flows.pipeline`` is a tripwire, so a check
that happened only inside a stage fails here). Most cases call ``flows.cli.main`` in process; a
few run ``python -m flows.cli`` as a subprocess to hold the same end to end (exit status, no
traceback, no Prefect database), one of them on a read-only filesystem.

``docs/reliability.md`` ("Bad inputs") is generated from these tables:
``python tests/flows/test_bad_inputs.py`` rewrites that section, and a test below fails when it is
out of date. Server cases already covered by ``tests/k3core/rollout/test_server_hardening.py``
(limits, NaN/inf sampling values, API key, weight roots) are not repeated here.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run as a script (doc generation)
    sys.path.insert(0, str(REPO))

from flows.cli import main  # noqa: E402

# `run …` in the tables: a run id that is already published under the root, so every refusal is
# also shown to leave a published run alone.
RUN = "run --preset tiny --run-id pub --artifacts {root}"


@dataclass(frozen=True)
class Case:
    id: str
    area: str
    input: str  # a command line after `k3rl` ({placeholders} name the test's files), a JSON settings
    #             object, or "METHOD /path BODY" for the rollout server
    outcome: str  # "exit 2", "SettingsError" or "HTTP 4xx"
    says: str  # a fragment of the message

    @property
    def status(self) -> int:
        return int(self.outcome.split()[-1])


def _run(id, flags, says, area="run flags"):
    return Case(id, area, f"{RUN} {flags}", "exit 2", says)


CLI_CASES = [
    # ---- k3rl run: one flag wrong
    _run("run-samples-per-prompt-0", "--samples-per-prompt 0", "--samples-per-prompt must be >= 1, got 0"),
    _run("run-prompts-per-iteration-negative", "--prompts-per-iteration -3", "--prompts-per-iteration must be >= 1"),
    _run("run-max-new-tokens-0", "--max-new-tokens 0", "--max-new-tokens must be >= 1"),
    _run("run-top-p-2", "--top-p 2", "--top-p must lie in (0, 1], got 2.0"),
    _run("run-top-p-0", "--top-p 0", "--top-p must lie in (0, 1], got 0.0"),
    _run("run-top-p-nan", "--top-p nan", "--top-p must be a finite number, got nan"),
    _run("run-lr-nan", "--lr nan", "--lr must be a finite number, got nan"),
    _run("run-lr-negative", "--lr -1e-4", "--lr must be >= 0.0"),
    _run("run-lr-not-a-number", "--lr fast", "argument --lr: invalid float value: 'fast'"),
    _run("run-temperature-inf", "--temperature inf", "--temperature must be a finite number, got inf"),
    _run("run-temperature-negative", "--temperature -1", "--temperature must be >= 0.0, got -1.0"),
    _run("run-kl-coef-nan", "--kl-coef nan", "--kl-coef must be a finite number"),
    _run("run-iterations-negative", "--iterations -1", "--iterations must be >= 0, got -1"),
    _run("run-iterations-fraction", "--iterations 2.5", "argument --iterations: invalid int value: '2.5'"),
    _run("run-seed-negative", "--seed -1", "--seed must be >= 0"),
    _run("run-warmup-batch-0", "--warmup-batch 0", "--warmup-batch must be >= 1"),
    _run("run-warmup-copy-steps-negative", "--warmup-copy-steps -5", "--warmup-copy-steps must be >= 0"),
    _run("run-eval-prompts-0", "--eval-prompts 0", "--eval-prompts must be >= 1"),
    _run("run-ppo-epochs-0", "--ppo-epochs 0", "--ppo-epochs must be >= 1"),
    _run("run-clip-eps-low-1.5", "--clip-eps-low 1.5", "--clip-eps-low must be < 1"),
    _run("run-tis-cap-0", "--tis-cap 0", "--tis-cap must be > 0"),
    _run("run-loss-aggregation-unknown", "--loss-aggregation mean", "--loss-aggregation: unknown mode 'mean'"),
    _run("run-max-staleness-negative", "--max-staleness -1", "--max-staleness must be >= 0"),
    _run("run-max-staleness-2-refill", "--max-staleness 2 --refill-rounds 1", "--max-staleness 2 with --refill-rounds 1"),
    _run("run-in-flight-unknown", "--in-flight finish --max-staleness 1", "--in-flight: unknown choice 'finish'"),
    _run("run-in-flight-sync", "--in-flight continue", "--in-flight continue acts on the batch sampled ahead"),
    _run("run-qat-maybe", "--qat maybe", "argument --qat: expected true or false, got 'maybe'"),
    _run("run-unknown-flag", "--learning-rate 1e-4", "unrecognized arguments: --learning-rate"),
    _run("run-dtype-unknown", "--dtype half", "--dtype: unknown dtype 'half'; choose one of auto, float32, bfloat16"),
    _run("run-dtype-bf16-fsdp", "--dtype bfloat16 --train-procs 2",
         "--dtype bfloat16 with --train-procs > 1: FSDP2 shards parameters of one dtype"),
    _run("run-decode-unknown", "--decode fast", "--decode: unknown decode mode 'fast'; choose one of auto, dynamic, static, graph"),
    _run("run-decode-graph-on-cpu", "--decode graph --device cpu",
         "--decode graph replays CUDA graphs: use it with --device cuda"),
    _run("run-preset-unknown", "--preset huge", "--preset: unknown preset 'huge'; choose one of"),
    _run("run-task-runner-unknown", "--task-runner spark", "--task-runner: unknown runner 'spark'; choose one of local, dask, ray"),
    _run("run-rollout-url-ftp", "--rollout-url ftp://host", "--rollout-url 'ftp://host': use 'local' or an http(s):// URL"),
    _run("run-dask-address-without-dask", "--dask-address tcp://127.0.0.1:8786", "--dask-address needs --task-runner dask"),
    _run("run-kl-coef-with-train-procs", "--kl-coef 0.1 --train-procs 2", "--kl-coef with --train-procs > 1"),
    _run("run-reward-timeout-inf", "--reward-timeout inf", "--reward-timeout must be a finite number"),
    Case("run-id-traversal", "run flags", "run --preset tiny --run-id ../victim --artifacts {root}", "exit 2",
         "--run-id '../victim': use letters, digits"),
    Case("run-id-empty", "run flags", "run --preset tiny --run-id '' --artifacts {root}", "exit 2", "--run-id '':"),
    Case("run-id-slash", "run flags", "run --preset tiny --run-id a/b --artifacts {root}", "exit 2", "--run-id 'a/b':"),
    # ---- k3rl run --source
    _run("source-missing-dir", "--source {tmp}/no-such-ckpt", "no-such-ckpt: no such directory; give a checkpoint "
         "directory", "run --source"),
    _run("source-missing-file-url", "--source file://{tmp}/no-such-ckpt", "no such directory", "run --source"),
    _run("source-unknown-protocol", "--source foo://bucket/ckpt", "no fsspec filesystem for protocol 'foo'",
         "run --source"),
    _run("source-is-a-file", "--source {ck}/config.json", "config.json is a file; give the checkpoint's directory",
         "run --source"),
    _run("source-not-a-checkpoint", "--source {empty}", "[config] {empty}/config.json is missing", "run --source"),
    _run("source-init-bad-seed", "--source init:tiny:abc", "expected init:PRESET[:SEED[:TOKENIZER]]", "run --source"),
    _run("source-init-unknown-preset", "--source init:huge:1", "expected init:PRESET[:SEED[:TOKENIZER]]", "run --source"),
    _run("source-init-empty", "--source init:", "expected init:PRESET[:SEED[:TOKENIZER]]", "run --source"),
    _run("source-init-other-preset", "--source init:small:0", "makes a 'small' checkpoint but --preset is 'tiny'",
         "run --source"),
    _run("source-other-preset", "--preset small --source {ck}", "not a usable 'small' checkpoint: [config]",
         "run --source"),
    # ---- checkpoints given as --source (structure read from the headers, nothing hashed)
    _run("source-truncated-shard", "--source {ck_truncated}", "[shard_format]", "checkpoint files"),
    _run("source-missing-shard", "--source {ck_missing_shard}", "[missing_shard] model-00002-of-00003.safetensors",
         "checkpoint files"),
    _run("source-wrong-shape", "--source {ck_wrong_shape}", "[shape] 'language_model.model.embed_tokens.weight'", "checkpoint files"),
    _run("source-no-index", "--source {ck_no_index}", "[index]", "checkpoint files"),
    _run("source-index-traversal", "--source {ck_index_traversal}", "is not a plain file name", "checkpoint files"),
    # ---- config.json of a checkpoint
    _run("source-config-not-json", "--source {ck_config_not_json}", "not valid JSON", "config.json"),
    _run("source-config-missing-keys", "--source {ck_config_missing_keys}", "[config]", "config.json"),
    _run("source-config-wrong-type", "--source {ck_config_wrong_type}", "[config]", "config.json"),
    Case("model-info-config-not-json", "config.json", "model-info --config {cfg_not_json}", "exit 2", "not valid JSON"),
    Case("model-info-config-not-object", "config.json", "model-info --config {cfg_list}", "exit 2",
         "config.json must hold a JSON object, got list"),
    Case("model-info-config-missing-keys", "config.json", "model-info --config {cfg_missing_keys}", "exit 2",
         "config.json has no latent_moe_use_norm"),
    Case("model-info-config-wrong-type", "config.json", "model-info --config {cfg_wrong_type}", "exit 2",
         "hidden_size"),
    Case("model-info-config-other-model", "config.json", "model-info --config {cfg_llama}", "exit 2",
         "unsupported model_type 'llama'"),
    Case("model-info-config-missing", "config.json", "model-info --config {tmp}/none.json", "exit 2",
         "none.json: no such file"),
    Case("model-info-preset-unknown", "config.json", "model-info --preset huge", "exit 2", "unknown preset 'huge'"),
    # ---- artifact root
    _run("artifacts-is-a-file", "--artifacts {ck}/config.json", "config.json is a file, not a directory",
         "artifact root"),
    _run("artifacts-under-a-file", "--artifacts {ck}/config.json/sub", "is a file, so the artifact root cannot be "
         "created there", "artifact root"),
    _run("artifacts-unknown-protocol", "--artifacts foo://bucket/k3rl", "no filesystem for foo://", "artifact root"),
    # ---- environment plugins (--env module:factory)
    _run("env-missing-module", "--env k3rl_catalog_absent:make_env", "cannot import module 'k3rl_catalog_absent'",
         "environment"),
    _run("env-raises-on-import", "--env k3rl_catalog_raises:make_env", "importing module 'k3rl_catalog_raises' "
         "raised RuntimeError: no GPU quota", "environment"),
    _run("env-syntax-error", "--env k3rl_catalog_syntax:make_env", "module 'k3rl_catalog_syntax' has a syntax error",
         "environment"),
    _run("env-exits-on-import", "--env k3rl_catalog_exits:make_env", "raised SystemExit", "environment"),
    _run("env-missing-dependency", "--env k3rl_catalog_needs:make_env", "imports 'k3rl_catalog_not_installed', "
         "which is not installed", "environment"),
    _run("env-no-such-factory", "--env k3rl_catalog_noreward:nope", "has no attribute 'nope'", "environment"),
    _run("env-lacks-reward", "--env k3rl_catalog_noreward:make_env", "without reward", "environment"),
    _run("env-factory-raises", "--env k3rl_catalog_factory_raises:make_env", "make_env() raised KeyError",
         "environment"),
    _run("env-factory-needs-arguments", "--env json:loads", "json.loads() raised TypeError", "environment"),
    _run("env-unknown-builtin", "--env bogus", "unknown environment 'bogus'", "environment"),
    _run("env-no-factory-named", "--env k3rl_catalog_noreward:", "expected 'module.path:factory'", "environment"),
    _run("env-empty", "--env ''", "--env is empty", "environment"),
    # ---- k3rl prepare: the same checks
    Case("prepare-lr-nan", "prepare", "prepare --preset tiny --run-id pub --artifacts {root} --lr nan", "exit 2",
         "--lr must be a finite number"),
    Case("prepare-source-missing", "prepare", "prepare --preset tiny --run-id pub --artifacts {root} "
         "--source {tmp}/no-such-ckpt", "exit 2", "no such directory"),
    Case("prepare-env-syntax-error", "prepare", "prepare --preset tiny --run-id pub --artifacts {root} "
         "--env k3rl_catalog_syntax:make_env", "exit 2", "has a syntax error"),
    # ---- k3rl status
    Case("status-missing-run", "status", "status --run-id nope --artifacts {root}", "exit 2",
         "no run 'nope' under"),
    Case("status-run-id-traversal", "status", "status --run-id ../.. --artifacts {root}", "exit 2",
         "--run-id '../..'"),
    # ---- k3rl checkpoint validate / fetch / quantize / init
    Case("validate-missing-dir", "checkpoint commands", "checkpoint validate {tmp}/no-such-ckpt", "exit 2",
         "is not a directory: give the checkpoint's directory"),
    Case("validate-a-file", "checkpoint commands", "checkpoint validate {ck}/config.json", "exit 2", "is not a directory"),
    Case("validate-preset-unknown", "checkpoint commands", "checkpoint validate {ck} --preset huge", "exit 2",
         "unknown preset 'huge'"),
    Case("validate-workers-0", "checkpoint commands", "checkpoint validate {ck} --workers 0", "exit 2",
         "argument --workers: expected a positive integer, got 0"),
    Case("fetch-missing-source", "checkpoint commands", "checkpoint fetch {tmp}/no-such-ckpt {tmp}/dest", "exit 2",
         "no-such-ckpt: no files found"),
    Case("fetch-unknown-protocol", "checkpoint commands", "checkpoint fetch foo://bucket/ckpt {tmp}/dest", "exit 2",
         "no fsspec filesystem for protocol 'foo'"),
    Case("fetch-not-a-checkpoint", "checkpoint commands", "checkpoint fetch {notckpt} {tmp}/dest", "exit 2",
         "is not a checkpoint in the public layout"),
    Case("fetch-workers-0", "checkpoint commands", "checkpoint fetch {ck} {tmp}/dest --workers 0", "exit 2",
         "argument --workers: expected a positive integer"),
    Case("quantize-missing-source", "checkpoint commands", "checkpoint quantize {tmp}/no-such-ckpt {tmp}/q", "exit 2",
         "no-such-ckpt is not a checkpoint directory (no config.json)"),
    Case("quantize-already-mxfp4", "checkpoint commands", "checkpoint quantize {ck_mxfp4} {tmp}/q", "exit 2",
         "is already quantised"),
    Case("init-preset-unknown", "checkpoint commands", "checkpoint init --preset huge --out {tmp}/i", "exit 2",
         "unknown preset 'huge'"),
    Case("init-seed-negative", "checkpoint commands", "checkpoint init --preset tiny --out {tmp}/i --seed -1", "exit 2",
         "argument --seed: expected a non-negative integer, got '-1'"),
    Case("init-format-unknown", "checkpoint commands", "checkpoint init --preset tiny --out {tmp}/i --format fp8", "exit 2",
         "argument --format: invalid choice: 'fp8'"),
    Case("init-max-shard-bytes-0", "checkpoint commands", "checkpoint init --preset tiny --out {tmp}/i --max-shard-bytes 0",
         "exit 2", "size must be positive"),
    # ---- k3rl rollout-server / serve
    Case("rollout-server-missing-checkpoint", "rollout-server flags", "rollout-server --checkpoint {tmp}/no-such-ckpt",
         "exit 2", "no config.json; point --checkpoint at a checkpoint directory"),
    Case("rollout-server-truncated-shard", "rollout-server flags", "rollout-server --checkpoint {ck_truncated_manifest}",
         "exit 2", "the manifest says"),
    Case("rollout-server-config-not-json", "rollout-server flags", "rollout-server --checkpoint {ck_config_not_json}",
         "exit 2", "not valid JSON"),
    Case("rollout-server-port-out-of-range", "rollout-server flags", "rollout-server --checkpoint {ck} --port 70000",
         "exit 2", "a TCP port lies in 0..65535"),
    Case("rollout-server-max-batch-0", "rollout-server flags", "rollout-server --checkpoint {ck} --max-batch 0", "exit 2",
         "argument --max-batch: must be >= 1, got 0"),
    Case("rollout-server-max-body-0", "rollout-server flags", "rollout-server --checkpoint {ck} --max-body-bytes 0",
         "exit 2", "max_body_bytes must be >= 1, got 0"),
    Case("rollout-server-log-level-unknown", "rollout-server flags", "rollout-server --checkpoint {ck} --log-level loud",
         "exit 2", "argument --log-level: invalid choice: 'loud'"),
    Case("serve-with-checkpoint", "rollout-server flags", "serve --checkpoint {ck}", "exit 2",
         "use `k3rl rollout-server --checkpoint DIR`"),
    # ---- k3rl plan and its hardware description files (JSON/YAML)
    Case("plan-hardware-unknown", "plan", "plan --preset tiny --hardware zzz", "exit 2", "unknown hardware 'zzz'"),
    Case("plan-hardware-bad-yaml", "plan", "plan --preset tiny --hardware {hw_bad_yaml}", "exit 2", "not valid YAML"),
    Case("plan-hardware-bad-json", "plan", "plan --preset tiny --hardware {hw_bad_json}", "exit 2", "not valid JSON"),
    Case("plan-hardware-not-an-object", "plan", "plan --preset tiny --hardware {hw_list}", "exit 2",
         "must be an object (mapping), got list"),
    Case("plan-hardware-unknown-field", "plan", "plan --preset tiny --hardware {hw_unknown_field}", "exit 2",
         "unknown hardware fields ['hbm_gib']"),
    Case("plan-hardware-wrong-type", "plan", "plan --preset tiny --hardware {hw_wrong_type}", "exit 2",
         "hbm_gb must be a number, got 'lots'"),
    Case("plan-tp-0", "plan", "plan --preset tiny --tp 0", "exit 2", "argument --tp: expected a positive integer"),
    Case("plan-preset-unknown", "plan", "plan --preset huge", "exit 2", "argument --preset: invalid choice: 'huge'"),
    Case("plan-config-not-json", "plan", "plan --config {cfg_not_json}", "exit 2", "not valid JSON"),
    # ---- no command
    Case("no-subcommand", "usage", "", "exit 2", "the following arguments are required: cmd"),
    Case("unknown-subcommand", "usage", "train", "exit 2", "invalid choice: 'train'"),
]

# Deployment parameters (`rl_run`'s `settings`, as the UI's form or `--param settings=...` send
# them): refused while the flow's parameters are validated, before any stage, with this message.
SETTINGS_CASES = [
    Case("settings-unknown-section", "deployment settings", '{"rollouts": {"temperature": 0.7}}', "SettingsError",
         "unknown setting 'rollouts'"),
    Case("settings-unknown-key", "deployment settings", '{"grpo": {"learning_rate": 0.001}}', "SettingsError",
         "section 'grpo' has no setting 'learning_rate'"),
    Case("settings-string-for-int", "deployment settings", '{"rollout": {"samples_per_prompt": "8"}}',
         "SettingsError", "--samples-per-prompt must be an integer, got '8'"),
    Case("settings-bool-for-int", "deployment settings", '{"pipeline": {"iterations": true}}', "SettingsError",
         "--iterations must be an integer, got True"),
    Case("settings-nan", "deployment settings", '{"grpo": {"lr": NaN}}', "SettingsError",
         "--lr must be a finite number, got nan"),
    Case("settings-infinity", "deployment settings", '{"rollout": {"temperature": Infinity}}', "SettingsError",
         "--temperature must be a finite number, got inf"),
    Case("settings-null-preset", "deployment settings", '{"model": {"preset": null}}', "SettingsError",
         "--preset must be a string, got None"),
    Case("settings-list-for-float", "deployment settings", '{"grpo": {"kl_coef": [0.1]}}', "SettingsError",
         "--kl-coef must be a number, got [0.1]"),
    Case("settings-flat-unknown", "deployment settings", '{"temprature": 0.7}', "SettingsError",
         "unknown setting 'temprature'"),
    Case("settings-run-id-path", "deployment settings", '{"pipeline": {"run_id": "../../etc"}}', "SettingsError",
         "--run-id '../../etc'"),
]

# Requests to `k3rl rollout-server` (the app in process, a tiny checkpoint behind it).
HTTP_CASES = [
    Case("http-body-not-object", "HTTP request", 'POST /generate [1, 2]', "HTTP 400", "the body must be a JSON object"),
    Case("http-body-empty", "HTTP request", 'POST /generate ', "HTTP 400", "the body is not JSON"),
    Case("http-no-prompt", "HTTP request", 'POST /generate {"sampling_params": {}}', "HTTP 400",
         "give exactly one of 'input_ids' (token ids) and 'text'"),
    Case("http-text-and-ids", "HTTP request", 'POST /generate {"text": "a", "input_ids": [1]}', "HTTP 400",
         "give exactly one of"),
    Case("http-input-ids-empty", "HTTP request", 'POST /generate {"input_ids": []}', "HTTP 400",
         "'input_ids' must be a non-empty list of token ids"),
    Case("http-input-ids-strings", "HTTP request", 'POST /generate {"input_ids": ["a", "b"]}', "HTTP 400",
         "'input_ids' must be a non-empty list of token ids"),
    Case("http-input-ids-bools", "HTTP request", 'POST /generate {"input_ids": [true]}', "HTTP 400",
         "'input_ids' must be a non-empty list of token ids"),
    Case("http-token-id-out-of-vocab", "HTTP request", 'POST /generate {"input_ids": [1000000000]}', "HTTP 400",
         "token id 1000000000 is outside the vocabulary [0, 260)"),
    Case("http-token-id-negative", "HTTP request", 'POST /generate {"input_ids": [-1]}', "HTTP 400",
         "token id -1 is outside the vocabulary"),
    Case("http-input-ids-empty-prompt", "HTTP request", 'POST /generate {"input_ids": [[1], []]}', "HTTP 400",
         "'input_ids' must be a non-empty list of token ids or a list of such lists"),
    Case("http-sampling-params-count", "HTTP request", 'POST /generate {"input_ids": [1], "sampling_params": '
         '[{}, {}]}', "HTTP 400", "2 sampling_params for 1 prompts"),
    Case("http-return-logprob-string", "HTTP request", 'POST /generate {"input_ids": [1], "return_logprob": "yes"}',
         "HTTP 400", "'return_logprob' must be true or false, got 'yes'"),
    Case("http-rid-not-string", "HTTP request", 'POST /generate {"input_ids": [1], "rid": 5}', "HTTP 400",
         "'rid' must be a string, got 5"),
    Case("http-stop-not-string", "HTTP request", 'POST /generate {"input_ids": [1], "sampling_params": '
         '{"stop": 5}}', "HTTP 400", "sampling_params.stop must be a non-empty string or a list of at most 64 of them"),
    Case("http-n-0", "HTTP request", 'POST /generate {"input_ids": [1], "sampling_params": {"n": 0}}', "HTTP 400",
         "sampling_params.n must be an integer in [1,"),
    Case("http-min-p-unsupported", "HTTP request", 'POST /generate {"input_ids": [1], "sampling_params": '
         '{"min_p": 0.5}}', "HTTP 400", "sampling_params.min_p must be 0.0 (the only value this server supports), got 0.5"),
    Case("http-text-not-string", "HTTP request", 'POST /generate {"text": 5}', "HTTP 400",
         "'text' must be a string or a non-empty list of strings"),
    Case("http-sampling-params-not-object", "HTTP request", 'POST /generate {"input_ids": [1], "sampling_params": '
         '"greedy"}', "HTTP 400", "'sampling_params' must be an object"),
    Case("http-sampling-param-unknown", "HTTP request", 'POST /generate {"input_ids": [1], "sampling_params": '
         '{"beam_width": 4}}', "HTTP 400", "unsupported sampling_params ['beam_width']"),
    Case("http-max-new-tokens-0", "HTTP request", 'POST /generate {"input_ids": [1], "sampling_params": '
         '{"max_new_tokens": 0}}', "HTTP 400", "sampling_params.max_new_tokens must be an integer in [1,"),
    Case("http-temperature-string", "HTTP request", 'POST /generate {"input_ids": [1], "sampling_params": '
         '{"temperature": "hot"}}', "HTTP 400", "sampling_params.temperature must be a finite number"),
    Case("http-stream", "HTTP request", 'POST /generate {"input_ids": [1], "stream": true}', "HTTP 400",
         "streaming is not supported"),
    Case("http-unknown-field", "HTTP request", 'POST /generate {"input_ids": [1], "lora_path": "x"}', "HTTP 400",
         "unsupported fields ['lora_path']"),
    Case("http-update-no-path", "HTTP request", 'POST /update_weights_from_disk {}', "HTTP 400",
         "'model_path' (a string: the path of a checkpoint directory in the public layout) is required"),
    Case("http-update-path-not-string", "HTTP request", 'POST /update_weights_from_disk {"model_path": 5}',
         "HTTP 400", "'model_path' must be a string"),
    Case("http-update-bad-version", "HTTP request", 'POST /update_weights_from_disk {"model_path": "{ck}", '
         '"weight_version": [1]}', "HTTP 400", "'weight_version' must be a non-negative integer"),
    Case("http-update-string-version", "HTTP request", 'POST /update_weights_from_disk {"model_path": "{ck}", '
         '"weight_version": "v-rollback"}', "HTTP 400", "versions are ordered, a string is not"),
    Case("http-update-load-format", "HTTP request", 'POST /update_weights_from_disk {"model_path": "{ck}", '
         '"load_format": "pt"}', "HTTP 400", "'load_format' must be 'auto' or 'safetensors', got 'pt'"),
    Case("http-generate-get", "HTTP request", 'GET /generate ', "HTTP 405", "Method Not Allowed"),
    Case("http-unknown-endpoint", "HTTP request", 'POST /v1/completions {}', "HTTP 404", "Not Found"),
]

SUBPROCESS_IDS = ["run-lr-nan", "source-missing-dir", "env-syntax-error", "validate-missing-dir"]

ENV_MODULES = {
    "k3rl_catalog_raises": "raise RuntimeError('no GPU quota')\n",
    "k3rl_catalog_syntax": "def make_env(:\n    pass\n",
    "k3rl_catalog_exits": "import sys\nsys.exit(3)\n",
    "k3rl_catalog_needs": "import k3rl_catalog_not_installed\n",
    "k3rl_catalog_noreward": ("class Env:\n    def prompts(self, rng, n):\n        return ['a'] * n\n\n\n"
                              "def make_env():\n    return Env()\n"),
    "k3rl_catalog_factory_raises": "def make_env():\n    return {}['dataset_path']\n",
}


# ------------------------------------------------------------------------------------ the files
def _build_world(d: Path) -> dict[str, str]:
    """Every file the cases name, under ``d``: a published run, good and broken checkpoints, broken
    configs, hardware files and environment modules. Returns the placeholders."""
    from safetensors.torch import load_file, save_file

    from k3core.checkpoint.hf import init_checkpoint

    w = {"tmp": str(d)}
    root = d / "root"
    (root / "runs" / "pub" / "iter-0000").mkdir(parents=True)
    (root / "runs" / "pub" / "latest.json").write_text('{"iteration": 1}')
    (root / "runs" / "pub" / "iter-0000" / "metrics.json").write_text('{"reward": 0.5}')
    (root / "runs" / "pub" / "settings.json").write_text("{}")
    w["root"] = str(root)
    (d / "empty").mkdir()
    w["empty"] = str(d / "empty")
    (d / "notckpt").mkdir()
    (d / "notckpt" / "README.md").write_text("notes, not weights")
    w["notckpt"] = str(d / "notckpt")

    ck = d / "ck"
    init_checkpoint("tiny", ck, seed=0)
    w["ck"] = str(ck)
    init_checkpoint("tiny", d / "ck_mxfp4", seed=0, format="mxfp4")
    w["ck_mxfp4"] = str(d / "ck_mxfp4")
    sharded = d / "ck_sharded"
    init_checkpoint("tiny", sharded, seed=0, max_shard_bytes=250_000)
    shards = sorted(sharded.glob("model-*.safetensors"))
    assert len(shards) == 3, shards  # the case ids name the middle one

    def variant(name: str, base: Path = ck) -> Path:
        p = d / name
        shutil.copytree(base, p)
        w[name] = str(p)
        return p

    p = variant("ck_truncated", sharded)
    shard = p / shards[0].name
    os.truncate(shard, shard.stat().st_size // 2)
    p = variant("ck_truncated_manifest")  # with its manifest: the loader's integrity check finds it
    shard = next(p.glob("model-*.safetensors"))
    os.truncate(shard, shard.stat().st_size - 1000)
    p = variant("ck_missing_shard", sharded)
    (p / shards[1].name).unlink()
    p = variant("ck_wrong_shape")
    shard = next(p.glob("model-*.safetensors"))
    tensors = load_file(shard)
    tensors["language_model.model.embed_tokens.weight"] = tensors["language_model.model.embed_tokens.weight"][:-1].clone()
    save_file(tensors, shard)
    variant("ck_no_index")
    (d / "ck_no_index" / "model.safetensors.index.json").unlink()
    p = variant("ck_index_traversal")
    index = json.loads((p / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: "../ck/" + v for k, v in index["weight_map"].items()}
    (p / "model.safetensors.index.json").write_text(json.dumps(index))

    good = json.loads((ck / "config.json").read_text())
    p = variant("ck_config_not_json")
    (p / "config.json").write_text('{"model_type": "kimi_k3", ')
    p = variant("ck_config_missing_keys")
    (p / "config.json").write_text(json.dumps({"model_type": "kimi_k3", "text_config": {"model_type": "kimi_linear"}}))
    p = variant("ck_config_wrong_type")
    bad = json.loads(json.dumps(good))
    bad["text_config"]["hidden_size"] = "64"
    (p / "config.json").write_text(json.dumps(bad))

    cfgs = d / "configs"
    cfgs.mkdir()
    for name, text in {"cfg_not_json": "{not json", "cfg_list": "[1, 2]",
                       "cfg_missing_keys": json.dumps({"model_type": "kimi_k3", "text_config": {"model_type": "kimi_linear"}}),
                       "cfg_wrong_type": json.dumps(bad), "cfg_llama": json.dumps({"model_type": "llama"}),
                       "hw_bad_yaml": "name: [unclosed\n", "hw_bad_json": "{", "hw_list": "[1]",
                       "hw_unknown_field": json.dumps({"base": "h200", "hbm_gib": 80}),
                       "hw_wrong_type": json.dumps({"base": "h200", "hbm_gb": "lots"})}.items():
        suffix = ".yaml" if name == "hw_bad_yaml" else ".json"
        (cfgs / f"{name}{suffix}").write_text(text)
        w[name] = str(cfgs / f"{name}{suffix}")

    envs = d / "envs"
    envs.mkdir()
    for name, text in ENV_MODULES.items():
        (envs / f"{name}.py").write_text(text)
    w["envs"] = str(envs)
    return w


def _argv(case: Case, w: dict[str, str]) -> list[str]:
    return shlex.split(case.input.format(**w))


def _snapshot(d: Path) -> dict[str, str]:
    """Every file and directory under ``d`` (bytecode caches aside) with a hash of its bytes."""
    out = {}
    for p in sorted(d.rglob("*")):
        rel = str(p.relative_to(d))
        if "__pycache__" in rel:
            continue
        out[rel] = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad-inputs")
    w = _build_world(d)
    sys.path.insert(0, w["envs"])
    yield d, w
    sys.path.remove(w["envs"])
    for name in ENV_MODULES:
        sys.modules.pop(name, None)


@pytest.fixture
def tripwire(monkeypatch):
    """The flows a command starts and the server's event loop, replaced by recorders: a command that
    reaches one has passed its checks, so the input was not refused before the work."""
    import uvicorn

    import flows.pipeline as pipeline

    touched: list[str] = []

    def wire(name):
        def reached(*a, **k):
            touched.append(name)
            raise RuntimeError(f"{name} reached: the input was not refused before the work")
        return reached
    for name in ("rl_run", "prepare", "rl_iteration"):
        monkeypatch.setattr(pipeline, name, wire(f"flows.pipeline.{name}"))
    monkeypatch.setattr(uvicorn, "run", wire("uvicorn.run"))
    return touched


def _one_error(err: str) -> bool:
    """Exactly one line of the form ``k3rl[ subcommand]: error: ...`` (argparse's usage line and a
    settings error's list of problems may surround it)."""
    return sum(1 for line in err.splitlines() if line.startswith("k3rl") and ": error: " in line) == 1


# ------------------------------------------------------------------------------------ the tests
@pytest.mark.parametrize("case", CLI_CASES, ids=lambda c: c.id)
def test_command_line_refuses_bad_input_before_any_work(case, world, tripwire, capsys):
    d, w = world
    before = _snapshot(d)
    try:
        code = main(_argv(case, w))
    except SystemExit as e:  # argparse's usage errors
        code = e.code
    err = capsys.readouterr().err
    assert (code, case.says.format(**w) in err) == (case.status, True), err
    assert "Traceback" not in err and _one_error(err), err
    assert not tripwire
    assert _snapshot(d) == before  # the published run, the checkpoints: nothing changed or created


@pytest.mark.parametrize("case", SETTINGS_CASES, ids=lambda c: c.id)
def test_deployment_settings_are_refused_with_every_problem_named(case):
    from k3core.settings import RLSettings, SettingsError

    with pytest.raises(SettingsError) as e:
        RLSettings.from_dict(json.loads(case.input))
    assert case.says in str(e.value)


@pytest.fixture(scope="module")
def server(world):
    from starlette.testclient import TestClient

    from k3core.rollout.checkpoints import engine_from_checkpoint
    from k3core.rollout.server import ServerLimits, create_app, tokenizer_for

    d, w = world
    engine = engine_from_checkpoint(w["ck"], max_batch=8, max_queue=32)
    app = create_app(engine, tokenizer_for(engine.config), w["ck"], limits=ServerLimits(weight_roots=(str(d),)))
    with TestClient(app) as client:
        yield client, engine


@pytest.mark.parametrize("case", HTTP_CASES, ids=lambda c: c.id)
def test_rollout_server_answers_4xx_naming_the_problem(case, server, world):
    client, engine = server
    method, path, body = case.input.split(" ", 2)
    version = engine.weight_version
    r = client.request(method, path, content=body.replace("{ck}", world[1]["ck"]).encode(),
                       headers={"Content-Type": "application/json"})
    payload = r.json()
    message = (payload.get("error") or {}).get("message") or payload.get("message") or payload.get("detail") or ""
    assert (r.status_code, case.says in message) == (case.status, True), payload
    assert engine.weight_version == version  # a refused update leaves the served weights alone
    ok = client.post("/generate", json={"input_ids": [256, 1], "sampling_params": {"max_new_tokens": 2}})
    assert ok.status_code == 200  # and the server still answers


def _python_env(w: dict[str, str], prefect_home: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), w["envs"]]), "PREFECT_HOME": str(prefect_home),
            "OMP_NUM_THREADS": "1"}


@pytest.mark.parametrize("case_id", SUBPROCESS_IDS)
def test_end_to_end_exit_2_one_message_no_traceback(case_id, world, tmp_path):
    d, w = world
    case = next(c for c in CLI_CASES if c.id == case_id)
    before = _snapshot(d)
    p = subprocess.run([sys.executable, "-m", "flows.cli", *_argv(case, w)], capture_output=True, text=True,
                       env=_python_env(w, tmp_path / "prefect"), cwd=tmp_path, timeout=300)
    assert (p.returncode, case.says.format(**w) in p.stderr) == (2, True), p.stderr
    assert "Traceback" not in p.stderr and _one_error(p.stderr), p.stderr
    assert not list((tmp_path / "prefect").rglob("*.db"))  # no Prefect database: Prefect never started
    assert _snapshot(d) == before


def test_debug_flag_prints_the_traceback_too(world, tmp_path):
    d, w = world
    p = subprocess.run([sys.executable, "-m", "flows.cli", *shlex.split(RUN.format(**w)), "--lr", "nan", "--debug"],
                       capture_output=True, text=True, env=_python_env(w, tmp_path / "prefect"), cwd=tmp_path,
                       timeout=300)
    assert p.returncode == 2
    assert "Traceback (most recent call last)" in p.stderr and "SettingsError" in p.stderr
    assert p.stderr.rstrip().splitlines()[-1] == "  - --lr must be a finite number, got nan"


def test_an_unexpected_failure_is_one_line_naming_debug(monkeypatch, capsys):
    import flows.cli as cli

    def broken(a):
        raise KeyError("checkpoint_cmd")
    monkeypatch.setattr(cli, "cmd_status", broken)
    assert cli.main(["status", "--run-id", "x"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "KeyError: 'checkpoint_cmd'" in err and "k3rl --debug status" in err
    assert cli.main(["status", "--debug", "--run-id", "x"]) == 1
    assert "Traceback (most recent call last)" in capsys.readouterr().err


def test_read_only_artifact_root_is_refused_and_left_alone(world, tmp_path):
    """A published run on a read-only filesystem (a bind mount remounted read-only in a private mount
    namespace; without root, plain permissions): exit 2 naming the root, before any work."""
    d, w = world
    ro = tmp_path / "ro-root"
    shutil.copytree(Path(w["root"]), ro)
    before = _snapshot(ro)
    argv = [sys.executable, "-m", "flows.cli", "run", "--preset", "tiny", "--run-id", "pub", "--artifacts", str(ro)]
    if os.geteuid() != 0:
        for p in [ro, *ro.rglob("*")]:
            p.chmod(0o555 if p.is_dir() else 0o444)
        cmd = argv
    else:  # root ignores permission bits: a read-only mount is what refuses it
        if shutil.which("unshare") is None:
            pytest.skip("needs unshare(1) to mount the root read-only when running as root")
        probe = subprocess.run(["unshare", "-m", "true"], capture_output=True)
        if probe.returncode != 0:
            pytest.skip(f"unshare -m not permitted here: {probe.stderr.decode().strip()}")
        cmd = ["unshare", "-m", "sh", "-c", 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && exec "$@"',
               str(ro), *argv]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=_python_env(w, tmp_path / "prefect"),
                           cwd=tmp_path, timeout=300)
    finally:
        for q in [ro, *ro.rglob("*")]:
            q.chmod(0o755 if q.is_dir() else 0o644)
    assert (p.returncode, "is not writable" in p.stderr, str(ro) in p.stderr) == (2, True, True), p.stderr
    assert "Traceback" not in p.stderr and _one_error(p.stderr), p.stderr
    assert _snapshot(ro) == before


def test_a_resumed_run_does_not_recheck_a_source_it_has_already_fetched(tmp_path):
    """The source is read once, by the fetch stage; a run that has published it resumes even if the
    source directory is gone since (the check would otherwise refuse a resumable run)."""
    from flows.preflight import check_settings
    from k3core.artifacts import COMPLETE
    from k3core.settings import RLSettings

    s = RLSettings.from_dict({"preset": "tiny", "run_id": "r", "artifacts": str(tmp_path), "source": str(tmp_path / "gone")})
    with pytest.raises(ValueError, match="no such directory"):
        check_settings(s)
    (tmp_path / "runs" / "r" / "source").mkdir(parents=True)
    (tmp_path / "runs" / "r" / "source" / COMPLETE).write_text("")
    check_settings(s)


# ------------------------------------------------------------------------------------ the doc
DOC = REPO / "docs" / "reliability.md"
SECTION = "## Bad inputs"


def render_section() -> str:
    """The "Bad inputs" section of docs/reliability.md, from the tables above."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    def shown(case: Case) -> str:
        if case.area in ("deployment settings", "HTTP request"):
            return case.input
        text = "k3rl " + case.input
        return text.replace(f"k3rl {RUN}", "k3rl run …") if text.startswith(f"k3rl {RUN}") else text

    cases = CLI_CASES + SETTINGS_CASES + HTTP_CASES
    areas: dict[str, int] = {}
    for case in cases:
        areas[case.area] = areas.get(case.area, 0) + 1
    paragraphs = [
        f"{len(cases)} inputs fed wrong on purpose, by area: " + ", ".join(f"{k} {v}" for k, v in areas.items())
        + ". Generated from the case tables of `tests/flows/test_bad_inputs.py` (`python "
        "tests/flows/test_bad_inputs.py` rewrites this section; a test fails when it is stale).",
        "For every command line: exit status 2, one `error:` message naming the problem and the fix, no "
        "traceback (`k3rl --debug` adds it), no pipeline flow reached, and nothing under the test's files "
        f"changed or created (a published run and the checkpoints). {len(SUBPROCESS_IDS)} of them, a "
        "read-only artifact root (a read-only mount) and `--debug` also run as a subprocess, where no "
        "Prefect database is created. A deployment's settings object: `SettingsError`, which fails the flow "
        "run before any stage. A server request: the 4xx shown, the served weights unchanged, the next valid "
        "request answered. Data lost: none.",
        "`k3rl run …` is `k3rl run --preset tiny --run-id pub --artifacts {root}`, `{root}` holding a "
        "published run. `{ck}` is a valid tiny checkpoint; `{ck_*}` its broken copies (a shard truncated, "
        "deleted, re-saved with the embedding one row short; the index deleted or naming `../` paths; "
        "config.json not JSON, without the model's keys, or with a string for `hidden_size`).",
        "Held elsewhere, not repeated here: server limits, NaN/inf sampling values, the API key and weight "
        "roots (`tests/k3core/rollout/test_server_hardening.py`); dataset environments and reward-sandbox "
        "settings (`tests/flows/test_cli_dataset.py`); Dask addresses (`tests/flows/test_scale_out.py`); "
        "fetch and quantize destinations (`tests/k3core/checkpoint/test_fetch.py`, `test_destinations.py`). "
        "`k3rl checkpoint validate` of a broken checkpoint exits 1, as its help says: there the checkpoint "
        "is what is judged, not the usage (`tests/k3core/checkpoint/test_validate.py`, `test_integrity.py`).",
    ]
    lines = [SECTION, ""]
    for text in paragraphs:
        lines += textwrap.wrap(text, 100, break_on_hyphens=False, break_long_words=False) + [""]
    lines += [
             "| id | area | input | outcome | message (fragment) |", "|---|---|---|---|---|"]
    for case in cases:
        lines.append(f"| `{case.id}` | {case.area} | `{cell(shown(case))}` | {case.outcome} | {cell(case.says)} |")
    return "\n".join(lines) + "\n"


def _doc_with_section(doc: str) -> str:
    section = render_section()
    if SECTION not in doc:
        return doc.rstrip("\n") + "\n\n" + section
    head, rest = doc.split(SECTION, 1)
    nxt = rest.find("\n## ")
    tail = rest[nxt + 1:] if nxt >= 0 else ""
    return head + section + ("\n" + tail if tail else "")


def test_every_case_id_is_unique_and_the_doc_is_current():
    ids = [c.id for c in CLI_CASES + SETTINGS_CASES + HTTP_CASES]
    assert len(ids) == len(set(ids)) and set(SUBPROCESS_IDS) <= set(ids)
    doc = DOC.read_text()
    assert _doc_with_section(doc) == doc, "docs/reliability.md is stale: run python tests/flows/test_bad_inputs.py"
    for case_id in ids:
        assert f"| `{case_id}` |" in doc


if __name__ == "__main__":
    DOC.write_text(_doc_with_section(DOC.read_text() if DOC.exists() else "# Reliability\n"))
    print(f"{DOC}: {SECTION} rewritten")
