"""The KL penalty to the frozen reference holds the policy near it: the same RL run from a fresh
tiny model (same seed, prompts and sampling seeds), once without the penalty and once with a large
coefficient; the policy's exact KL to the starting model (full softmax over the vocabulary at every
position of fixed sequences, independent of the k3 estimate the loss uses) ends clearly smaller with
the penalty. Also: the reference stage's logprobs of a model against itself make the penalty zero."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.usefixtures("single_thread")

ITERATIONS, PROMPTS, GROUP, MAX_NEW = 8, 8, 8, 6


class LowercaseShare:
    name = "lowercase-share"

    def prompts(self, rng, n):
        return ["say:" + "".join(rng.choice("abcdefgh") for _ in range(rng.randint(2, 4))) + "=" for _ in range(n)]

    def reward(self, prompt, completion):
        return sum("a" <= c <= "z" for c in completion) / len(completion) if completion else 0.0


def _exact_kl(policy, reference, config) -> float:
    """Mean over positions of KL(policy || reference), summed over the whole vocabulary."""
    from k3core.tokenizer import ByteTokenizer

    tok = ByteTokenizer(config)
    texts = [f"say:{w}={c}" for w, c in (("abc", "cba"), ("hgfe", "xyz"), ("dd", "qqqq"), ("bead", "a1b2"))]
    ids = [tok.encode(t) for t in texts]
    L = max(map(len, ids))
    x = torch.full((len(ids), L), tok.pad_id, dtype=torch.long)
    valid = torch.zeros(len(ids), L, dtype=torch.bool)
    for b, s in enumerate(ids):
        x[b, :len(s)] = torch.tensor(s)
        valid[b, :len(s)] = True
    with torch.no_grad():
        for m in (policy, reference):
            m.eval()
            m.use_inference_caches = False
        lp = torch.log_softmax(policy(x, valid).logits.float(), -1)
        lq = torch.log_softmax(reference(x, valid).logits.float(), -1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    return float(kl[valid].mean())


def test_large_kl_coefficient_keeps_the_policy_near_the_reference():
    from k3core.config import K3Config
    from k3core.rl.loop import rl_in_process
    from k3core.settings import GRPOSettings

    config = K3Config.preset("tiny")
    runs = {}
    for coef in (0.0, 5.0):
        settings = GRPOSettings(lr=3e-3, ppo_epochs=2, minibatches=2, kl_coef=coef)
        runs[coef] = rl_in_process(LowercaseShare(), "test:lowercase-share", config, 0, ITERATIONS, settings,
                                   PROMPTS, GROUP, MAX_NEW, heldout=4)
    ref = runs[5.0]["reference"]
    assert runs[0.0]["reference"] is None
    free, held = _exact_kl(runs[0.0]["model"], ref, config), _exact_kl(runs[5.0]["model"], ref, config)
    assert free > 0.01, free  # without the penalty the policy moves measurably
    assert held < 0.25 * free, (held, free)
    # the penalised run reports its k3 estimate per update; it starts at zero (the policy is the reference)
    first = runs[5.0]["metrics"][0]
    assert first["per_update"][0]["kl_ref"] == pytest.approx(0.0, abs=1e-6)
    assert all("kl_ref" in m for m in runs[5.0]["metrics"] if not m["skipped"])


def test_reference_logprobs_of_the_policy_itself_give_no_penalty():
    """reference_logprobs_table computes what the trainer computes: a reference equal to the trainer
    gives kl_ref 0 and the same loss as no reference at all (the penalty's gradient is zero there)."""
    import copy

    from k3core.config import K3Config
    from k3core.model import K3ForCausalLM
    from k3core.rl.data import heldout_prompts
    from k3core.rl.tables import rollout_table, score_table
    from k3core.rl.train import reference_logprobs_table, train_on_table
    from k3core.rl.trainer_state import make_optimizer
    from k3core.rl.weights import engine_from_model
    from k3core.rollout.engine import SamplingParams
    from k3core.settings import GRPOSettings
    from k3core.rl.prompting import PromptFormat
    from k3core.tokenizer import ByteTokenizer

    config = K3Config.preset("tiny")
    torch.manual_seed(0)
    model = K3ForCausalLM(config)
    model.reset_parameters(0)
    tok = ByteTokenizer(config)
    env = LowercaseShare()
    engine = engine_from_model(copy.deepcopy(model).eval(), 0, quantized=False)
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, n=4, seed=5, stop_token_ids=(tok.eos_id,))
    batch = rollout_table(engine, PromptFormat.of(tok, mode="raw"), heldout_prompts(env, 0, 4, "t"), params, 0)
    scored, _ = score_table(batch, env, "t", 4)
    settings = GRPOSettings(kl_coef=1.0, micro_batch_tokens=40)
    ref = reference_logprobs_table(copy.deepcopy(model), scored, settings, tok.pad_id)
    assert ref.num_rows == scored.num_rows
    assert [len(x) for x in ref.column("ref_logprobs").to_pylist()] == \
        [len(x) for x in scored.column("output_ids").to_pylist()]
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    with_kl = train_on_table(a, make_optimizer(a, 1e-3), scored, settings, tok.pad_id, reference=ref)
    without = train_on_table(b, make_optimizer(b, 1e-3), scored, GRPOSettings(micro_batch_tokens=40), tok.pad_id)
    assert with_kl["kl_ref"] == pytest.approx(0.0, abs=1e-6)
    assert with_kl["loss"] == pytest.approx(without["loss"], abs=1e-6)
    with pytest.raises(ValueError, match="reference"):
        train_on_table(copy.deepcopy(model), make_optimizer(b, 1e-3), scored, settings, tok.pad_id)
