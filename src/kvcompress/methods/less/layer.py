"""The LESS cache layer: a ``CompressedLayer`` that folds every token it evicts into a low-rank state first.

Per sequence and KV head it keeps ``H`` ``[B, H_kv, R, D]`` and ``z`` ``[B, H_kv, R]`` in float32 (under quantized
storage too: ``LessQuantizedLayer``) side by side in one buffer, so folding tokens in (``[H | z] += ψ(k)ᵀ [v | 1]``,
Eqs. 4–5) and reading the state (``φ(q) [H | z]``) are one matmul each. ``before_eviction`` copies out the real
tokens being evicted before their slots are freed. A fold is a dozen small operations per layer (ψ is a two-layer
MLP), each costing far more than its arithmetic on a decoding step; a state is read only by its layer's next
attention, so the layers stage their evicted keys and values (``stage``) and the forward folds them all when it
closes: ψ as one batched MLP over every layer's victims (the ψ weights views of one buffer), one outer product, one
addition and one ratio ``H / z`` (states and ratios views of one buffer where their shapes agree). Whatever reads a
state first folds what is staged (``settle``), so only the order of additions changes.
"""

from __future__ import annotations

import dataclasses

import torch

from kvcompress.core.contract import StatsRequest
from kvcompress.core.forward import agree
from kvcompress.core.grad_mode import without_grad
from kvcompress.core.layer import CompressedLayer
from kvcompress.core.quantized_layer import QuantizedLayer
from kvcompress.core.softmax import _joined
from kvcompress.methods.less.kernels import psi_features
from kvcompress.methods.less.low_rank_slots import state_ratio


class LessLayer(CompressedLayer):
    """Compressed keys/values plus LESS's state ``H``, ``z`` of everything evicted."""

    def __init__(self, policy, inv_freq: torch.Tensor | None = None) -> None:
        super().__init__(policy, inv_freq)
        # [H | z] and H / z (None: to be computed) without what is staged; the folds may make them stacked views
        self.stored_low_rank: torch.Tensor | None = None
        self.stored_ratio: torch.Tensor | None = None
        self.folded = False  # something was evicted (and folded, or staged to be) since the last reset
        self.staged = False  # evicted tokens wait to be folded at the end of the forward (``stage``)

    @property
    def low_rank(self) -> torch.Tensor | None:
        """``[H | z]`` ``[B, H_kv, R, D + 1]`` with every eviction so far folded in."""
        settle(self)
        return self.stored_low_rank

    @property
    def ratio(self) -> torch.Tensor | None:
        """``H / z`` ``[B, H_kv, R, D]`` (0 where ``z = 0``), as a decoding step reads the state (``low_rank_slots``):
        a working copy derived from ``H``, not counted again in ``kv_nbytes``."""
        low_rank = self.low_rank
        if self.stored_ratio is None and low_rank is not None:
            self.stored_ratio = state_ratio(low_rank)
        return self.stored_ratio

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        batch, heads, _, dim = value_states.shape
        kernels = self.policy.config.kernel_set  # R: the trained kernels', else the config's
        rank = self.policy.config.rank if kernels is None else kernels.layers[0].rank
        self.stored_low_rank = torch.zeros(batch, heads, rank, dim + 1, dtype=torch.float32, device=self.device)

    @without_grad
    def before_eviction(self, victims: torch.Tensor | None, dropped: torch.Tensor | None) -> None:
        """Add ``ψ(k)ᵀ v`` and ``ψ(k)`` of the real tokens about to be evicted to ``H`` and ``z`` (Eqs. 4–5):
        the ``victims`` ``[B, H_kv, e]`` slots, or the ``dropped`` ``[B, H_kv, W]`` ones."""
        if self.policy.weights is None:  # evicting before any attention (not reached through the attention function)
            raise RuntimeError("LESS kernels are set at the layer's first attention; evict only after attention")
        if self.policy.inert:  # ψ ≡ 0: nothing to fold, the state stays empty
            return
        if victims is None:
            evicted = dropped & self.valid
            count = int(evicted.sum(-1).max()) if evicted.numel() else 0
            if count == 0:
                return
            victims = evicted.to(torch.int8).sort(dim=-1, descending=True, stable=True).indices[..., :count]
            # rows evicting fewer than ``count`` (per-head budgets) fill up with kept slots: those fold nothing
            weight = evicted.gather(-1, victims)
        else:
            weight = None if self.all_valid else self.valid.gather(-1, victims)  # padding and free slots fold nothing
        self.folded = True
        stage(self, *self.read_slots(victims), weight)  # folded with the other layers' at the forward's end, or now

    def read_slots(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[B, H_kv, e, D]`` of the slots ``index`` ``[B, H_kv, e]`` as attention reads them."""
        pair = self.keys, self.values
        return tuple(tensor.gather(2, index[..., None].expand(*index.shape, tensor.shape[-1])) for tensor in pair)

    def reset(self) -> None:
        settle(self)
        super().reset()
        self.stored_low_rank = self.stored_ratio = None
        self.folded = False

    def move_batch(self, move) -> None:
        super().move_batch(move)
        if self.is_initialized:
            self.stored_low_rank, self.stored_ratio = move(self.low_rank), None

    def side_nbytes(self, metadata: bool) -> int:
        """Bytes of the state's ``H``, or of ``z`` (``metadata``), 0 before the first tokens: ``H`` counts with the
        keys and values (it stands in for the evicted ones), ``z`` with the metadata."""
        state = self.stored_low_rank
        return 0 if state is None else state[..., -1 if metadata else slice(-1)].numel() * state.element_size()


class LessQuantizedLayer(LessLayer, QuantizedLayer):
    """LESS over quantized slots (``kv_bits`` below 16): the stored tokens in KIVI codes, ``H``, ``z`` in float32.

    A forward with no gradient reads the codes (``core.quantized_attention``): the sparse part's output and
    log-normaliser, then Eq. 3 in log-sum-exp form (``LessPolicy.with_low_rank``), so a decoding step mixes the state
    in by the log-normaliser, not by the 16-bit layer's one softmax (``low_rank_slots``): equal to float rounding. The
    evicted tokens are read from the codes too (``QuantizedSlotBuffers.read_at``: what attention read, bit for bit).
    A forward recorded for a backward pass attends over the dequantized view as the 16-bit layer does."""

    def codes_readable(self) -> bool:
        return not torch.is_grad_enabled() and self.policy.position_mode != "cache"

    def attend(self, query, key, value, mask, scaling):
        if not self._reads_codes:
            return super().attend(query, key, value, mask, scaling)
        policy = self.policy
        policy.layer_kernels(query.shape[1], key.shape[1], key.shape[-1], query.device)  # set at the first attention
        request = policy.stats if policy.wants_stats(self) else StatsRequest()
        if not self.folded:  # nothing folded yet: exactly the base policy's attention
            return self.attend_codes(query, mask, scaling, request)
        output, stats = self.attend_codes(query, mask, scaling, dataclasses.replace(request, lse=True))
        return policy.with_low_rank(self, query, output, stats)

    read_slots = QuantizedLayer.read_slots


FOLDS = "less-folds"  # the forward's job and its staged folds


def stage(layer, keys: torch.Tensor, values: torch.Tensor, weight: torch.Tensor | None) -> None:
    """Leave ``layer``'s fold of its evicted ``keys``/``values`` ``[B, H_kv, e, D]`` (``weight`` ``[B, H_kv, e]``: 0
    where no token, ``None``: all real) to the end of an open forward of several layers, else fold them now."""
    forward = layer.forward_pass
    if not (forward.shared and forward.is_open):
        fold(forward, [(layer, keys, values, weight)])
        return
    forward.cached(FOLDS, list).append((layer, keys, values, weight))
    layer.staged = True
    forward.at_end(FOLDS, lambda: fold_staged(forward))


def settle(layer) -> None:
    """Fold what is staged if some of it is ``layer``'s (about to be read); the others' folds come with it."""
    if layer.staged:
        fold_staged(layer.forward_pass)


@without_grad
def fold_staged(forward) -> None:
    """Fold everything staged in ``forward``: together where the shapes agree (a decoding step), else one by one."""
    waiting = forward.cached(FOLDS, list)
    staged = list(waiting)
    waiting.clear()
    for layer, *_ in staged:
        layer.staged = False
    if len({(keys.shape, weight is None) for _, keys, _, weight in staged}) == 1:
        fold(forward, staged)
    else:
        for item in staged:
            fold(forward, [item])


def fold(forward, staged: list) -> None:
    """Add ``ψ(k)ᵀ [v | 1]`` of each ``(layer, keys, values, weight)`` in ``staged`` (as ``stage`` takes them, all of
    one shape) to the layer's state."""
    layers, keys, values, weights = zip(*staged, strict=True)
    psi = _stacked_psi(forward, layers) if len(layers) > 1 else layers[0].policy.weights.psi
    features = psi_features(_joined(keys, 1), *psi)  # keys [B, n * H_kv, e, D]
    if weights[0] is not None:
        features = features * _joined(weights, 1)[..., None]
    values = _joined(values, 1).float()
    _add(forward, layers, features.transpose(-1, -2) @ torch.cat([values, values.new_ones(*values.shape[:-1], 1)], -1))


def _add(forward, layers: tuple, update: torch.Tensor) -> None:
    """Add ``update`` ``[B, n * H_kv, R, D + 1]`` to the states of ``layers``: one addition and one ratio for the
    whole cache where every layer folded and the states are stacked (a decoding step), else one per layer."""
    every = len(layers) == len(forward.layers) and all(a is b for a, b in zip(layers, forward.layers, strict=True))
    states = [layer.stored_low_rank for layer in layers] if every else []
    if every and all(state is not None for state in states) and agree(states):
        state, views = forward.stacked("less-state", states, dim=1)
        ratios = [
            state_ratio(own) if layer.stored_ratio is None else layer.stored_ratio
            for layer, own in zip(layers, states, strict=True)
        ]
        ratio, ratio_views = forward.stacked("less-ratio", ratios, dim=1)
        state.add_(update)
        state_ratio(state, out=ratio)
        for layer, view, ratio_view in zip(layers, views, ratio_views, strict=True):
            layer.stored_low_rank, layer.stored_ratio = view, ratio_view
        return
    heads = update.shape[1] // len(layers)
    for i, layer in enumerate(layers):
        layer.stored_low_rank.add_(update[:, i * heads : (i + 1) * heads])
        layer.stored_ratio = None


def _stacked_psi(forward, layers: tuple) -> tuple[torch.Tensor, ...]:
    """ψ's weights of ``layers`` stacked along the heads: the policies hold views of them (kernels are frozen)."""
    policies = [layer.policy for layer in layers]
    columns = zip(*(policy.weights.psi for policy in policies), strict=True)
    stacked = [forward.stacked(f"less-psi-{i}", list(column)) for i, column in enumerate(columns)]
    for index, policy in enumerate(policies):
        own = policy.weights.psi
        if any(own[i] is not views[index] for i, (_, views) in enumerate(stacked)):
            policy.weights = policy.weights._replace(psi=tuple(views[index] for _, views in stacked))
    return tuple(buffer for buffer, _ in stacked)
