"""A rollout-engine process for the cross-process transfer tests: JSON lines in on stdin, JSON lines out.

Run as ``python transfer_engine_worker.py PRESET DEVICE THREADS``. It builds two engines of the preset
(``float``: plain weights; ``w4a8``: packed MXFP4 experts) at version 0 from an arbitrary seed, then
answers one request per line:
- ``{"op": "load", "engine": E, "payload": {...}}`` -> ``load_payload`` (receive against the engine,
  then ``load_weights``): ``{"ok": true, "version": v}`` or ``{"ok": false, "error": "TransferError: ..."}``
- ``{"op": "logprobs", "engine": E, "ids": [[...]]}`` -> the engine's per-token logprobs of ``ids[:, 1:]``
  as base64 fp32 bytes (exact), and its version
- ``{"op": "generate", "engine": E}`` -> a short greedy generation still works: output lengths, version
- ``{"op": "digests", "engine": E, "algo": A}`` -> digest of every engine tensor
- ``{"op": "quit"}``

``Worker`` below is the tests' side of that protocol (imported by file path: the tests run with
``--import-mode=importlib``).
"""

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import torch


class Worker:
    """This script as a subprocess on ``device``: call it with a request's fields, get the reply."""

    def __init__(self, device: str = "cpu", preset: str = "tiny"):
        threads = str(torch.get_num_threads())
        env = dict(os.environ, OMP_NUM_THREADS=threads) if device == "cpu" else dict(os.environ)
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__)), preset, device, threads],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        assert json.loads(self.proc.stdout.readline())["ready"]

    def __call__(self, **req) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, "worker died"
        return json.loads(line)

    def logprobs(self, engine: str, ids: torch.Tensor) -> torch.Tensor:
        r = self(op="logprobs", engine=engine, ids=ids.tolist())
        return torch.frombuffer(bytearray(base64.b64decode(r["logprobs"])), dtype=torch.float32).view(r["shape"])

    def close(self):
        self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
        self.proc.stdin.flush()
        self.proc.wait(timeout=60)


def main() -> None:
    preset, device, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
    torch.set_num_threads(threads)
    from k3core.config import K3Config
    from k3core.model import K3ForCausalLM
    from k3core.rl.weights import engine_from_model
    from k3core.rollout.engine import SamplingParams
    from k3core.transfer import TransferError, engine_tensors, load_payload, tensor_digest

    config = K3Config.preset(preset)

    def fresh(seed: int) -> K3ForCausalLM:
        m = K3ForCausalLM(config)
        m.reset_parameters(seed)
        return m.to(device)

    engines = {"float": engine_from_model(fresh(101), 0, quantized=False),
               "w4a8": engine_from_model(fresh(102), 0, quantized=True)}
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        op = req["op"]
        if op == "quit":
            break
        eng = engines[req["engine"]]
        try:
            if op == "load":
                out = {"ok": True, "version": load_payload(eng, req["payload"])}
            elif op == "logprobs":
                ids = torch.tensor(req["ids"], device=device)
                with torch.no_grad():
                    lp = eng.model(ids[:, :-1], targets=ids[:, 1:], return_logprobs=True).logprobs
                out = {"ok": True, "version": eng.weight_version,
                       "logprobs": base64.b64encode(lp.float().cpu().contiguous().numpy().tobytes()).decode(),
                       "shape": list(lp.shape)}
            elif op == "generate":
                comps = eng.generate([[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=3, temperature=0.0),
                                     pad_id=config.pad_token_id)
                out = {"ok": True, "version": eng.weight_version, "lengths": [len(c.output_ids) for c in comps],
                       "versions": [c.weight_version for c in comps]}
            elif op == "digests":
                out = {"ok": True, "digests": {k: tensor_digest(v, req["algo"]) for k, v in engine_tensors(eng).items()}}
            else:
                out = {"ok": False, "error": f"unknown op {op!r}"}
        except TransferError as e:
            out = {"ok": False, "error": f"TransferError: {e}", "version": eng.weight_version}
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
