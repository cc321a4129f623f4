"""Curriculum probe: phase 1 a short chat copy task (user 'A*B' -> assistant 'A*B'), phase 2 tools-calc."""
import sys, time, json, random, torch
from k3core.config import K3Config
from k3core.checkpoint.hf import _with_tokenizer
from k3core.rl.envs import load_env
from k3core.rl.episodes import reference_trajectory
from k3core.rl.prompting import PromptFormat
from k3core.rl.train import RLSequence, sft_step, pack_sequences
from k3core.rl.trainer_state import make_optimizer
from k3core.rl.data import training_prompts, heldout_prompts
from k3core.tokenizer import load_tokenizer, BUNDLED_K3_BPE
from k3core.model import K3ForCausalLM
batch, lr, steps1, steps2, seed = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
cfg, _ = _with_tokenizer(K3Config.preset("small"), "bpe")
tok = load_tokenizer(BUNDLED_K3_BPE); env = load_env("tools-calc"); fmt = PromptFormat.of(tok, env, "auto")
class Copy:
    system_prompt = None
    def prompts(self, rng, n): return [f"{rng.randint(100,999)}*{rng.randint(100,999)}" for _ in range(n)]
copy = Copy(); cfmt = PromptFormat.of(tok, copy, "auto")
torch.manual_seed(seed); m = K3ForCausalLM(cfg); m.reset_parameters(seed)
opt = make_optimizer(m, lr)
def tc_seqs(ps):
    out = []
    for p in ps:
        ep = reference_trajectory(fmt, env, p); out.append(RLSequence(ep.prompt_ids, ep.output_ids, loss_mask=ep.loss_mask))
    return out
def copy_seqs(ps): return [RLSequence(cfmt.prompt_ids(p), cfmt.answer_ids(p)) for p in ps]
held_tc = tc_seqs(heldout_prompts(env, seed, 64, "tools-calc"))
held_cp = copy_seqs(copy.prompts(random.Random("held"), 64))
@torch.no_grad()
def exact(held):
    m.eval(); b = pack_sequences(held, fmt.pad_id); m.use_inference_caches = False
    out = m(b["input_ids"], b["valid"], return_logits=True)
    ok = (out.logits.argmax(-1) == b["targets"]) | ~b["gen_mask"].bool()
    m.train(); return round(ok.all(-1).float().mean().item(), 3)
print("copy seq tokens", len(held_cp[0].prompt_ids) + len(held_cp[0].output_ids), flush=True)
t0 = time.perf_counter(); rng = random.Random(seed)
for s in range(steps1 + steps2):
    if s < steps1:
        seqs = copy_seqs(copy.prompts(rng, batch * 4))
    else:
        seqs = tc_seqs(training_prompts(env, seed + 7919, s, batch, "tools-calc"))
    l = sft_step(m, opt, seqs, fmt.pad_id)["loss"]
    if s % 10 == 0 or s == steps1 + steps2 - 1:
        e = {"copy": exact(held_cp)} if s < steps1 and s % 50 == 0 else ({"tc": exact(held_tc)} if s >= steps1 and s % 50 == 0 else {})
        print(json.dumps({"step": s + 1, "phase": 1 if s < steps1 else 2, "loss": round(l, 4), **e, "t": round(time.perf_counter() - t0, 1)}), flush=True)
print(json.dumps({"final_tc_exact": exact(held_tc)}))
