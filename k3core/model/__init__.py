"""The Kimi K3 text backbone: layers and K3ForCausalLM (see k3.py)."""

from k3core.model.cache import K3Cache
from k3core.model.k3 import K3ForCausalLM, K3Output, token_logprobs

__all__ = ["K3Cache", "K3ForCausalLM", "K3Output", "token_logprobs"]
