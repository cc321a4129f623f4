"""Warm-up speed probe: steps until tools-calc's copy is learned, small preset, BPE."""
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
batch, lr, steps, seed = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
envspec = sys.argv[5] if len(sys.argv) > 5 else "tools-calc"
cfg, _ = _with_tokenizer(K3Config.preset("small"), "bpe")
tok = load_tokenizer(BUNDLED_K3_BPE); env = load_env(envspec); fmt = PromptFormat.of(tok, env, "auto")
torch.manual_seed(seed); m = K3ForCausalLM(cfg); m.reset_parameters(seed)
opt = make_optimizer(m, lr)
def seqs_of(ps):
    out = []
    for p in ps:
        ep = reference_trajectory(fmt, env, p); out.append(RLSequence(ep.prompt_ids, ep.output_ids, loss_mask=ep.loss_mask))
    return out
held = seqs_of(heldout_prompts(env, seed, 64, envspec))
@torch.no_grad()
def exact():
    m.eval(); b = pack_sequences(held, fmt.pad_id); m.use_inference_caches = False
    out = m(b["input_ids"], b["valid"], return_logits=True)
    pred = out.logits.argmax(-1); ok = (pred == b["targets"]) | ~b["gen_mask"].bool()
    m.train(); return ok.all(-1).float().mean().item() if ok.dim() == 2 else None
t0 = time.perf_counter()
for s in range(steps):
    ps = training_prompts(env, seed + 7919, s, batch, envspec)
    l = sft_step(m, opt, seqs_of(ps), fmt.pad_id)["loss"]
    if s % 10 == 0 or s == steps - 1:
        e = exact() if s % 50 == 49 or s == steps - 1 else -1
        print(json.dumps({"step": s + 1, "loss": round(l, 4), "exact": e, "t": round(time.perf_counter() - t0, 1)}), flush=True)
