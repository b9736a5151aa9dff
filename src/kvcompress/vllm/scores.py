"""Worker side of the scored block policies (H2O, cascade, BUZZ): attention mass per KV block, and the kept slots
refilled from it.

Each attention layer keeps one float32 score per KV block of the pool and KV head (``[num_blocks, num_kv_heads]``,
indexed by the physical block id, so no per-request state and a few bytes per block of the cache). In every step:

1. the score of a block whose first token is written in this step is reset (the block is new to its request: a
   freed block handed out again starts from zero);
2. the step's queries attend to the keys the kernel would attend to (the compacted block table and sequence
   lengths of the step's metadata, keys and values read back through ``kvcompress.vllm.layout.KeyLayout``):
   softmax over the kept keys, causal inside a prefill chunk, the probabilities summed over the block's tokens,
   the step's queries and the query heads sharing each KV head, and added to the blocks' scores (cascade: an EMA);
3. in each request whose step moves blocks out of the recent window, per KV head, the policy's rule decides which
   blocks the front slots hold (H2O: the best-scored; cascade: the acceptance rule; BUZZ: the middle's buffer and
   segmented heavy hitters): winners are copied over the slots they take (keys, values and score: whole
   ``[block, head]`` slabs, so the kernel's layout does not matter), and the leaving blocks are then dropped by the
   metadata builder and freed by the scheduler.

vLLM's CPU kernel (``cpu_attention_with_kv_cache``) returns the attention output only, neither probabilities nor
log-sum-exps. Two ways to get both, chosen by the policy's ``scoring``:

* ``one_pass``: vLLM's kernel does not run; step 2 also multiplies the same probabilities by the kept
  values and writes the attention output, so each step's query-key products are computed once (in torch:
  ``num_heads x kept_tokens x head_size`` multiply-adds per decode query and layer for each of QK and PV, plus a
  gather of the kept keys and values; prefill chunks in query slices of ``QUERY_SLICE``). The output equals the
  kernel's up to float32 rounding (tested against vLLM's kernel), the scores are those of the second pass, bit for
  bit.
* ``second_pass`` (default, the faster on CPU): vLLM's kernel computes the output, then step 2 recomputes the
  query-key products and softmax over the same keys for the mass (the kernel's QK half again, plus the key gather).

The scores are exact H2O sums (up to float32 rounding): what is approximated is the unit, a whole block kept or
evicted per KV head instead of single tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvcompress.vllm.carry import CarryStep, LayerCarry, Replay
from kvcompress.vllm.layout import KeyLayout
from kvcompress.vllm.policies import BuzzBlocks, CascadeBlocks, H2OBlocks

QUERY_SLICE = 256  # prefill queries scored at once: bounds the probabilities held to heads x 256 x kept tokens


@dataclass
class RefillRow:
    """A request whose step moves ``leaving`` blocks (ids) out of the window; ``slots`` are its heavy slots (ids).

    ``request``, ``first_slot`` and ``first_leaving`` (the logical indices of ``slots[0]`` and ``leaving[0]``) let
    the layer record which logical block each slot holds (``kvcompress.vllm.carry``).
    """

    slots: torch.Tensor
    leaving: torch.Tensor
    request: str | None = None
    first_slot: int = 0
    first_leaving: int = 0


@dataclass
class H2OReplay:
    """A request recomputed in this step after a preemption (``kvcompress.vllm.carry``): ``blocks``, the ids of its
    recomputed logical blocks; ``kept``, the logical blocks it kept when its first run stopped, ``count`` tokens in;
    ``queries`` (``[start, end)``), the recompute's query rows past ``count``, which attend to ``mass_blocks`` (the
    kept blocks, then those written since: ``mass_tokens`` tokens); ``refill``, the boundary they cross, if any."""

    request: str
    row: int
    blocks: torch.Tensor
    kept: torch.Tensor
    queries: tuple[int, int]
    mass_blocks: torch.Tensor
    mass_tokens: int
    refill: RefillRow | None
    carried: Replay | None = None  # the carry's record of this step of the recompute


@dataclass
class ScoredStep:
    """The block H2O work of one step, shared by all layers (built once by the metadata builder)."""

    policy: H2OBlocks | CascadeBlocks | BuzzBlocks
    layout: KeyLayout
    num_reqs: int
    refill: list[RefillRow]
    carry: CarryStep | None = None
    one_pass: bool = False  # the attention output is computed by the scoring pass (vLLM's kernel is skipped)
    replays: list[H2OReplay] = field(default_factory=list)
    recomputing: list[Replay] = field(default_factory=list)  # recompute steps before the first run's count
    departures_kept: dict[str, torch.Tensor] = field(default_factory=dict)  # request -> ids of its kept blocks


class BlockScores:
    """One layer's accumulated attention mass per KV block and KV head (see the module docstring)."""

    def __init__(self) -> None:
        self.scores: torch.Tensor | None = None
        self.carry = LayerCarry()

    def step(
        self, step: ScoredStep, query: torch.Tensor, kv_cache: torch.Tensor, metadata, scale: float, output=None
    ) -> None:
        """Steps 1-3 of the module docstring for this layer; ``query`` is ``[tokens, num_heads, head_size]``.

        Before step 1, requests leaving the batch park their kept blocks' scores and slots' origin; after step 2,
        each step of a recompute copies the origin blocks it completed into their slots, and the step reaching the
        first run's count gives the scores back (``kvcompress.vllm.carry``). Rows being recomputed add no mass and
        refill nothing of their own. With ``output`` (``[tokens, num_heads,
        head_size]``, the one-pass mode: vLLM's kernel did not run), step 2 also writes the attention output there,
        before any block of this step is moved.
        """
        if self.scores is None:
            self.scores = torch.zeros(kv_cache.shape[0], kv_cache.shape[1], device=kv_cache.device)
        if step.carry:
            self._park(step)
        block_size = step.policy.block_size
        slots = metadata.slot_mapping[: metadata.num_actual_tokens]
        self.scores[slots[(slots >= 0) & (slots % block_size == 0)] // block_size] = 0
        num_reqs = step.num_reqs
        starts = metadata.query_start_loc[: num_reqs + 1]
        seq_lens, table = metadata.seq_lens[:num_reqs], metadata.block_table[:num_reqs]
        skip = step.carry.rows() if step.carry is not None else set()
        gamma = step.policy.gamma if isinstance(step.policy, CascadeBlocks) else None
        if gamma is not None:
            decay(self.scores, starts, seq_lens, table, gamma, block_size, skip)
        add_attention_mass(
            self.scores, step.layout, kv_cache, query, starts, seq_lens, table, scale, skip, gamma, output
        )
        for recompute in step.recomputing:
            parked = self.carry.parked.get(recompute.request)
            if parked is not None and parked["origin"] is not None:
                self.carry.restore_front(kv_cache, parked["origin"], recompute, block_size)
        for replay in step.replays:
            self._replay(step, replay, query, kv_cache, scale)
        for row in step.refill:
            self._refill(step, kv_cache, row)

    def _refill(self, step: ScoredStep, kv_cache: torch.Tensor, row: RefillRow) -> None:
        if isinstance(step.policy, CascadeBlocks):
            cascade_refill(self.scores, kv_cache, row, step.policy, self.carry)
        elif isinstance(step.policy, BuzzBlocks):
            buzz_refill(self.scores, kv_cache, row, step.policy, self.carry)
        else:
            refill(self.scores, kv_cache, row, self.carry)

    def _park(self, step: ScoredStep) -> None:
        carry = self.carry
        for departure in step.carry.departures:
            kept = step.departures_kept[departure.request]
            carry.parked[departure.request] = {
                "origin": carry.origin.pop(departure.request, None),
                "scores": self.scores[kept].clone(),  # [kept blocks, H_kv], before this step can reset them
            }
        for request, _ in step.carry.returned:
            parked = carry.parked.pop(request, None)
            if parked is not None and parked["origin"] is not None:
                carry.origin[request] = parked["origin"]
        carry.drop(step.carry)

    def _replay(self, step: ScoredStep, replay: H2OReplay, query, kv_cache, scale: float) -> None:
        """The first run's slots and scores back (``_restore``), then the recompute's tokens past its count as its
        next step."""
        if not self._restore(step, replay, kv_cache):
            return
        start, end = replay.queries
        gamma = step.policy.gamma if isinstance(step.policy, CascadeBlocks) else None
        if gamma is not None:  # the kept blocks' EMA decays over the replayed queries
            kept = replay.mass_blocks[: -(-replay.mass_tokens // step.policy.block_size)]
            self.scores[kept] = self.scores[kept] * gamma ** (end - start)
        weights = _ema_weights(end - start, gamma, query.device) if gamma is not None else None
        _prefill_mass(
            self.scores, step.layout, kv_cache, query[start:end], replay.mass_tokens, replay.mass_blocks, scale, weights
        )
        if replay.refill is not None:
            self._refill(step, kv_cache, replay.refill)

    def _restore(self, step: ScoredStep, replay: H2OReplay, kv_cache) -> bool:
        """The last step of a recompute: the origin blocks it completed into their slots, the slots' origin and the
        kept blocks' scores as the first run left them (``False``: nothing was parked for the request)."""
        parked = self.carry.parked.pop(replay.request, None)
        if parked is None:
            return False
        if parked["origin"] is not None:
            self.carry.restore_front(kv_cache, parked["origin"], replay.carried, step.policy.block_size)
            self.carry.origin[replay.request] = parked["origin"]
        self.scores[replay.blocks[replay.kept]] = parked["scores"]
        return True


def decay(scores, starts, seq_lens, block_table, gamma: float, block_size: int, skip=frozenset()) -> None:
    """Block cascade's EMA: multiply the scores of each request's kept blocks by ``gamma`` per query of its step."""
    query_lens = (starts[1:] - starts[:-1]).to(scores.dtype)
    if skip:
        query_lens[list(skip)] = 0
    num_blocks = -(-int(seq_lens.max()) // block_size) if len(seq_lens) else 0
    blocks = block_table[:, :num_blocks].long()
    valid = torch.arange(num_blocks, device=blocks.device) < (-(-seq_lens // block_size)).unsqueeze(1)
    factor = (gamma**query_lens).unsqueeze(1).expand(-1, num_blocks)[valid]
    ids = blocks[valid]
    scores[ids] = scores[ids] * factor.unsqueeze(1)


def _ema_weights(num_queries: int, gamma: float, device) -> torch.Tensor:
    """Query ``m`` of ``q`` counts ``(1 - gamma) gamma^(q - 1 - m)`` in the EMA after the step (closed form)."""
    return (1 - gamma) * gamma ** torch.arange(num_queries - 1, -1, -1, device=device, dtype=torch.float32)


def add_attention_mass(
    scores,
    layout: KeyLayout,
    kv_cache,
    query,
    starts,
    seq_lens,
    block_table,
    scale,
    skip=frozenset(),
    gamma=None,
    output: torch.Tensor | None = None,
) -> None:
    """Add to ``scores[block, kv_head]`` the attention mass the queries of each request give each kept block.

    ``starts`` (``[num_reqs + 1]``) splits ``query`` by request; request ``r`` attends to the first ``seq_lens[r]``
    tokens of the blocks ``block_table[r]``, its last query to all of them, causally before. Rows in ``skip``
    (recomputed requests, scored by their replay) add nothing. With ``gamma`` (block cascade's EMA, after
    ``decay``), query ``m`` of a step of ``q`` weighs ``(1 - gamma) gamma^(q - 1 - m)``.

    With ``output`` (``[tokens, num_heads, head_size]``), the same pass also writes the attention output of every
    query there (rows in ``skip`` included): the probabilities that give the mass are multiplied by the kept
    values, so one pass replaces vLLM's kernel and the second pass (the one-pass mode of the scored policies).
    """
    query_lens = starts[1:] - starts[:-1]
    counted = torch.ones(len(query_lens), device=query.device)
    if skip:
        counted[list(skip)] = 0
    decoding = query_lens == 1
    rows = decoding.nonzero().flatten()
    if output is None:
        rows = rows[counted[rows] > 0]
    if len(rows):
        weight = counted[rows] * (1.0 if gamma is None else 1 - gamma)
        out = _decode_mass(
            scores,
            layout,
            kv_cache,
            query[starts[rows]],
            seq_lens[rows],
            block_table[rows],
            scale,
            weight,
            output is not None,
        )
        if out is not None:
            output[starts[rows]] = out.to(output.dtype)
    for r in (~decoding & (query_lens > 0)).nonzero().flatten().tolist():
        if output is None and not counted[r]:
            continue
        start, end = int(starts[r]), int(starts[r + 1])
        weights = None if gamma is None else _ema_weights(end - start, gamma, query.device)
        target = None if output is None else output[start:end]
        _prefill_mass(
            scores,
            layout,
            kv_cache,
            query[start:end],
            int(seq_lens[r]),
            block_table[r],
            scale,
            weights,
            target,
            bool(counted[r]),
        )


def _decode_mass(
    scores, layout, kv_cache, query, seq_lens, block_table, scale, weight, with_output: bool = False
) -> torch.Tensor | None:
    """One query per request, all requests at once (padded to the longest; padding gets probability 0); request
    ``r``'s mass weighted ``weight[r]`` (a float or ``[R]``). With ``with_output``, also the attention output
    ``[R, num_heads, head_size]`` (float32) from the same probabilities."""
    block_size = layout.shape[1]
    num_blocks = -(-int(seq_lens.max()) // block_size)
    blocks = block_table[:, :num_blocks].long()
    keys = layout.read_blocks(kv_cache, blocks)  # [R, H_kv, T, D]
    num_reqs, num_kv_heads, tokens, head_size = keys.shape
    grouped = query.float().view(num_reqs, num_kv_heads, -1, head_size)
    logits = torch.einsum("rkgd,rktd->rkgt", grouped, keys) * scale
    logits.masked_fill_(torch.arange(tokens, device=keys.device) >= seq_lens.view(-1, 1, 1, 1), float("-inf"))
    probabilities = logits.softmax(dim=-1)
    mass = probabilities.sum(dim=2).view(num_reqs, num_kv_heads, num_blocks, block_size).sum(dim=3)
    weight = torch.as_tensor(weight, dtype=mass.dtype, device=mass.device)
    mass = mass * weight.view(-1, 1, 1) if weight.dim() else mass * weight
    heads = torch.arange(num_kv_heads, device=keys.device).view(1, -1, 1)
    scores.index_put_((blocks.unsqueeze(1).expand_as(mass), heads.expand_as(mass)), mass, accumulate=True)
    if not with_output:
        return None
    values = layout.read_blocks(kv_cache, blocks, values=True)  # [R, H_kv, T, D]
    return torch.einsum("rkgt,rktd->rkgd", probabilities, values).reshape(num_reqs, -1, head_size)


def _prefill_mass(
    scores, layout, kv_cache, query, seq_len: int, block_table, scale, weights=None, output=None, counted=True
) -> None:
    """A prefill chunk of one request: its queries are the last ``len(query)`` of its ``seq_len`` tokens (query ``m``
    weighted ``weights[m]``, if given). With ``output`` (``[len(query), num_heads, head_size]``), also the attention
    output of each query, from the same probabilities; ``counted=False``: the output only, no mass."""
    block_size = layout.shape[1]
    num_blocks = -(-seq_len // block_size)
    blocks = block_table[:num_blocks].long()
    keys = layout.read_blocks(kv_cache, blocks)[:, :seq_len]  # [H_kv, T, D]
    values = None if output is None else layout.read_blocks(kv_cache, blocks, values=True)[:, :seq_len]
    num_kv_heads, _, head_size = keys.shape
    first = seq_len - len(query)
    mass = torch.zeros(num_kv_heads, num_blocks * block_size, device=keys.device)
    for start in range(0, len(query), QUERY_SLICE):  # slices of queries, not single tokens
        part = query[start : start + QUERY_SLICE].float()
        grouped = part.view(len(part), num_kv_heads, -1, head_size).permute(1, 2, 0, 3)  # [H_kv, G, q, D]
        logits = torch.einsum("kgqd,ktd->kgqt", grouped, keys) * scale
        positions = torch.arange(first + start, first + start + len(part), device=keys.device).view(-1, 1)
        logits.masked_fill_(torch.arange(seq_len, device=keys.device) > positions, float("-inf"))
        probabilities = logits.softmax(dim=-1)
        if values is not None:
            out = torch.einsum("kgqt,ktd->qkgd", probabilities, values).reshape(len(part), -1, head_size)
            output[start : start + len(part)] = out.to(output.dtype)
        if weights is not None:
            probabilities = probabilities * weights[start : start + len(part)].view(1, 1, -1, 1)
        mass[:, :seq_len] += probabilities.sum(dim=(1, 2))
    if counted:
        scores[blocks] += mass.view(num_kv_heads, num_blocks, block_size).sum(dim=2).T


def refill(scores: torch.Tensor, kv_cache: torch.Tensor, row: RefillRow, carry: LayerCarry | None = None) -> None:
    """Per KV head, keep the best-scored of ``row.slots`` and ``row.leaving`` in the slots (see the module docstring).

    A slot that stays keeps its place; each leaving winner overwrites one losing slot, the first losing slot
    receiving the first winner in block order. Ties go to the lower candidate (``topk``'s order on CPU). With
    ``carry``, the logical block each slot now holds is recorded under ``row.request``.
    """
    candidates = torch.cat([row.slots, row.leaving])
    heavy = len(row.slots)
    chosen = torch.zeros(len(candidates), scores.shape[1], dtype=torch.bool, device=scores.device)
    chosen.scatter_(0, scores[candidates].topk(heavy, dim=0).indices, True)  # [candidates, H_kv]
    losers = (chosen[:heavy].int()).argsort(dim=0, stable=True)  # per head, losing slots first
    winners = (~chosen[heavy:]).int().argsort(dim=0, stable=True)  # per head, winning leaving blocks first
    pairs = min(heavy, len(row.leaving))
    replaced = (~chosen[:heavy]).sum(dim=0)  # per head: as many losing slots as leaving winners
    valid = torch.arange(pairs, device=scores.device).unsqueeze(1) < replaced.unsqueeze(0)  # [pairs, H_kv]
    j, heads = valid.nonzero(as_tuple=True)
    targets = row.slots[losers[j, heads]]
    sources = row.leaving[winners[j, heads]]
    kv_cache[targets, heads] = kv_cache[sources, heads]
    scores[targets, heads] = scores[sources, heads]
    if carry is not None and row.request is not None:
        front = row.first_slot + heavy
        origin = carry.origin_of(row.request, scores.shape[1], front, scores.device).clone()
        origin[heads, row.first_slot + losers[j, heads]] = row.first_leaving + winners[j, heads]
        carry.origin[row.request] = origin


def cascade_refill(
    scores: torch.Tensor, kv_cache: torch.Tensor, row: RefillRow, policy: CascadeBlocks, carry: LayerCarry | None
) -> None:
    """Block cascade: each block of ``row.leaving`` (in order) leaves cascade 0 and goes through the cascades'
    acceptance rule (``CascadeBlocks``), per KV head: an accepting cascade takes it into its oldest slot and passes
    the displaced block on; a cascade that does not accept keeps the larger-EMA of it and its newest block (ties:
    the incoming block). ``row.slots``: the ids of the cascades' slots (logical ``row.first_slot`` on)."""
    num_kv_heads = scores.shape[1]
    origin = None
    if carry is not None and row.request is not None:
        origin = carry.origin_of(row.request, num_kv_heads, policy.sink_blocks, scores.device).clone()
    for k, block in enumerate(row.leaving.tolist()):
        logical = row.first_leaving + k
        kv, score = kv_cache[block].clone(), scores[block].clone()  # [H_kv, block, 2 * head], [H_kv]
        source = torch.full((num_kv_heads,), logical, device=scores.device)
        for _, accepts, slot in policy.offers(logical):
            target = int(row.slots[slot - row.first_slot])
            if accepts:
                displaced = kv_cache[target].clone(), scores[target].clone()
                kv_cache[target], scores[target] = kv, score
                if origin is not None:
                    origin[:, slot], source = source, origin[:, slot].clone()
                kv, score = displaced
            else:
                wins = score >= scores[target]  # [H_kv]
                kv_cache[target] = torch.where(wins.view(-1, 1, 1), kv, kv_cache[target])
                scores[target] = torch.where(wins, score, scores[target])
                if origin is not None:
                    origin[:, slot] = torch.where(wins, source, origin[:, slot])
    if origin is not None:
        carry.origin[row.request] = origin


def buzz_survivors(scores: torch.Tensor, old: int, stride: int, old_stride: int, every: int) -> torch.Tensor:
    """BUZZ's eviction over the middle's candidates (``scores``: ``[old + new, H_kv]``, old blocks first): per KV
    head, the candidate indices that survive (``[kept, H_kv]``, old survivors then new, in order): old blocks
    0, ``old_stride``, ...; the earliest highest-scored block of each hive of ``stride`` new blocks; then every
    ``every``-th survivor."""
    num_kv_heads = scores.shape[1]
    new = len(scores) - old
    hives = -(-new // stride)
    padded = torch.full((hives * stride, num_kv_heads), float("-inf"), dtype=scores.dtype, device=scores.device)
    padded[:new] = scores[old:]
    best = padded.view(hives, stride, num_kv_heads).argmax(dim=1)  # the first maximum: ties to the earliest
    best = best + old + torch.arange(hives, device=scores.device).unsqueeze(1) * stride
    old_kept = torch.arange(0, old, old_stride, device=scores.device).unsqueeze(1).expand(-1, num_kv_heads)
    return torch.cat([old_kept, best])[::every]


def buzz_refill(
    scores: torch.Tensor, kv_cache: torch.Tensor, row: RefillRow, policy: BuzzBlocks, carry: LayerCarry | None
) -> None:
    """Block BUZZ: each block of ``row.leaving`` (in order) leaves the window into the middle (``BuzzBlocks``): into
    the next free slot (all KV heads), or, when the middle is full, BUZZ's eviction over the middle and it, whose
    survivors are copied per KV head into the first slots (keys, values and scores). ``row.slots``: the ids of the
    middle's slots (logical ``row.first_slot`` on)."""
    num_kv_heads = scores.shape[1]
    heads = torch.arange(num_kv_heads, device=scores.device)
    origin = None
    if carry is not None and row.request is not None:
        origin = carry.origin_of(row.request, num_kv_heads, policy.sink_blocks, scores.device).clone()
    first = row.first_slot
    for k, block in enumerate(row.leaving.tolist()):
        logical = row.first_leaving + k
        old, new = policy.state(logical - policy.first_sink_blocks)
        if old + new < policy.threshold:  # a free slot: the block joins the new buffer there
            kv_cache[row.slots[old + new]] = kv_cache[block]
            scores[row.slots[old + new]] = scores[block]
            if origin is not None:
                origin[:, first + old + new] = logical
            continue
        candidates = torch.cat([row.slots[: old + new], row.leaving[k : k + 1]])
        every = policy.thinned(old, new + 1)[1]
        chosen = buzz_survivors(scores[candidates], old, policy.stride, policy.old_stride, every)  # [kept, H_kv]
        sources = candidates[chosen]  # [kept, H_kv] block ids
        kept = len(chosen)
        targets = row.slots[:kept].unsqueeze(1).expand_as(sources)
        kv_cache[targets, heads] = kv_cache[sources, heads]  # the right side is gathered before any write
        scores[targets, heads] = scores[sources, heads]
        if origin is not None:
            labels = torch.cat([origin[:, first : first + old + new].T, torch.full((1, num_kv_heads), logical)])
            origin[:, first : first + kept] = labels.to(origin.device)[chosen, heads].T
    if origin is not None:
        carry.origin[row.request] = origin
