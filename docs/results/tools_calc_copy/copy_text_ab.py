"""Copy phase through the product function: whole prompts vs operands only, same seed and steps."""
import sys, time, random, torch
from k3core.checkpoint.hf import _with_tokenizer
from k3core.config import K3Config
from k3core.model import K3ForCausalLM
from k3core.rl.envs import load_env
from k3core.rl.prompting import PromptFormat
from k3core.rl.train import pack_sequences
from k3core.rl.warmup import supervised_warmup, copy_sequence
from k3core.tokenizer import BUNDLED_K3_BPE, load_tokenizer
which, steps, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
cfg = _with_tokenizer(K3Config.preset("small"), "bpe")[0]
base = load_env("tools-calc")
class Operands:
    def prompts(self, rng, n): return [p.removeprefix("Compute ").rstrip(".") for p in base.prompts(rng, n)]
env = base if which == "whole" else Operands()
fmt = PromptFormat.of(load_tokenizer(BUNDLED_K3_BPE), env)
held = pack_sequences([copy_sequence(fmt, p) for p in env.prompts(random.Random("held"), 64)], fmt.pad_id)
torch.manual_seed(seed); m = K3ForCausalLM(cfg); m.reset_parameters(seed)
@torch.no_grad()
def exact():
    m.eval(); pred = m(held["input_ids"], held["valid"], return_logits=True).logits.argmax(-1); m.train()
    return float(((pred == held["targets"]) | ~held["gen_mask"].bool()).all(-1).float().mean())
t0 = time.perf_counter()
def prog(done, total):
    if done % 20 == 0: print(which, done, round(time.perf_counter() - t0), exact(), flush=True)
supervised_warmup(m, env, "tools-calc", fmt, 0, 16, 1e-3, seed, progress=prog, copy_steps=steps)
