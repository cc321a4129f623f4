"""The packed (varlen) layout: several sequences concatenated into one row, described by offsets.

Owns: ``VarlenLayout``, built once per forward from ``cu_seqlens`` (int32 ``[N + 1]``, offsets of the
N sequences in the row ``[1, T]``, flash-attention's and fla's convention), with what every layer
needs to keep sequences apart: per-token position ids restarting at 0 for each sequence, the
sequence id of every token, and the scatter between the row and a right-padded ``[N, T_max]`` batch.
Does not own: the layers' use of it (``kda.py``: the short convolution and ``cu_seqlens`` for the KDA
operator; ``mla.py``: the block-diagonal causal attention) or the packing of RL batches
(``k3core.rl.train``).

Which parts of K3 depend on a token's neighbours, and so on the layout: the KDA short convolution
(the previous ``kernel - 1`` tokens), the KDA recurrence (the state) and MLA (every earlier token).
Everything else is per token: RMSNorm, the AttnRes mix (over depth, at one position), the MoE router
(no capacity limit, no auxiliary loss, a frozen bias) and its replay (``forced_routing`` names the
experts per position). K3's MLA is NoPE: no rotary embedding reads the position ids; they place each
token in the padded batch (``to_padded``) that the CPU attention paths compute on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3core.device import to_device


@dataclass(frozen=True)
class VarlenLayout:
    """N sequences packed along one row of T tokens.

    cu_seqlens ``[N + 1]`` int32 on the host (fla's kernels take it with a host copy, which spares
    them a device-to-host read; the torch paths read it on the host anyway) and
    ``cu_seqlens_device``, the same offsets int64 on the activations' device (what fla's kernels
    index), copied once per forward for every KDA layer; position_ids ``[1, T]`` and seq_ids ``[T]``
    int64 on the activations' device; lengths and max_len on the host.
    """

    cu_seqlens: torch.Tensor
    position_ids: torch.Tensor
    seq_ids: torch.Tensor
    lengths: tuple[int, ...]
    max_len: int
    cu_seqlens_device: torch.Tensor

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: torch.Tensor | list[int], total: int,
                        device: torch.device | str = "cpu") -> VarlenLayout:
        """Checks that the offsets rise strictly from 0 to ``total`` (no empty sequence: it would
        have nothing to predict and a zero-length block in every kernel)."""
        cu = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
        if isinstance(cu_seqlens, torch.Tensor) and (cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point()):
            raise ValueError(f"cu_seqlens must be a 1-D integer tensor [N + 1], got {cu_seqlens.dtype} "
                             f"{tuple(cu_seqlens.shape)}")
        if len(cu) < 2 or cu[0] != 0 or cu[-1] != total or any(b <= a for a, b in zip(cu[:-1], cu[1:])):
            raise ValueError(f"cu_seqlens must rise strictly from 0 to the row's {total} tokens (every "
                             f"sequence non-empty), got {cu}")
        lengths = tuple(b - a for a, b in zip(cu[:-1], cu[1:]))
        lens = torch.tensor(lengths)
        seq_ids = torch.repeat_interleave(torch.arange(len(lengths)), lens)
        starts = torch.tensor(cu[:-1])
        position_ids = torch.arange(total) - starts[seq_ids]
        # the three device tensors travel in one host -> device copy (``to_device``: no host sync)
        on_device = to_device(torch.cat([position_ids, seq_ids, torch.tensor(cu)]), device)
        return cls(torch.tensor(cu, dtype=torch.int32), on_device[:total].unsqueeze(0), on_device[total:2 * total],
                   lengths, max(lengths), on_device[2 * total:])

    @property
    def num_sequences(self) -> int:
        return len(self.lengths)

    def _padded_index(self) -> torch.Tensor:
        """Row index in the flattened ``[N * T_max]`` padded batch of every packed token ``[T]``."""
        return self.seq_ids * self.max_len + self.position_ids[0]

    def to_padded(self, x: torch.Tensor) -> torch.Tensor:
        """``[1, T, ...]`` -> right-padded ``[N, T_max, ...]`` (zeros after each sequence's end)."""
        out = x.new_zeros(self.num_sequences * self.max_len, *x.shape[2:])
        out = out.index_copy(0, self._padded_index(), x[0])
        return out.view(self.num_sequences, self.max_len, *x.shape[2:])

    def from_padded(self, y: torch.Tensor) -> torch.Tensor:
        """``[N, T_max, ...]`` -> ``[1, T, ...]``: the inverse of ``to_padded`` on the real tokens."""
        return y.reshape(self.num_sequences * self.max_len, *y.shape[2:]).index_select(0, self._padded_index()).unsqueeze(0)

    def block_causal_mask(self) -> torch.Tensor:
        """Boolean ``[T, T]``: query i may attend key j when both lie in one sequence and j <= i (the
        block-diagonal causal mask). Quadratic in the row: for tests and small rows, not the
        training path."""
        same = self.seq_ids.unsqueeze(1) == self.seq_ids.unsqueeze(0)
        T = self.seq_ids.numel()
        causal = torch.ones(T, T, dtype=torch.bool, device=self.seq_ids.device).tril()
        return same & causal
