"""The fast engine (`--engine fast`, the default): the same passes and the same replies as the plain engine of
infra/passes.py, computed with less repeated work. Nothing of the algorithm names this file: arco.py and warmup.py
call the passes' interface (training_passes, generate, policy_act, RubricModel.annotate), which runs the engine
a backbone was loaded with (Backbone.engine: FAST, chosen by --engine through infra/engines.py).

Top to bottom: 1. shared prefixes run once (SharedPrefix); 2. packing, each shared token once in a row with a
tree-shaped mask (pack, packed_steps, reference_logq), in passes of at most --pass-tokens tokens (token_passes);
3. the training passes (fast_passes), a unit longer than the budget recomputed in the backward; 4. decoding
(decode): a packed prefill, rows leaving as they finish, a PromptMemo of a rollout's previous round; 5. what it
refuses at load (check_supported), and the engine itself (FAST).

Every piece is checked against the plain engine or transformers' own code, computed in the test on the same
machine (tests/test_rubric_model.py, tests/test_engines.py): equal up to floating-point rounding.
"""
from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from infra.models import Backbone, ModelLoadError, trainable_parameters
from infra.passes import Engine, Generation, Pass, end_of_reply, length_batches, lm_logits


# ----------------------------------------------------------------------------------------
# 1. Sequences that share a prefix: computed once, its keys and values reused
# ----------------------------------------------------------------------------------------
# The passes of one trajectory start alike: π's prompts share the system prompt and the question,
# μ's also the "Steps so far" header, and every prompt of a batch shares the system prompt. A causal
# model gives the prefix the same hidden states in every sequence, so the prefix is run once and its
# keys/values are given to each sequence's remainder (exact up to floating-point rounding, tested).
# Training runs each remainder alone (batch 1, no padding); generation runs the remainders as one
# batch, padded between the prefix and the text.


def common_prefix_length(seqs: Sequence[Sequence[int]], limit: int) -> int:
    """How many leading tokens all `seqs` share, at most `limit`."""
    first, n = seqs[0], 0
    while n < limit and all(len(s) > n and s[n] == first[n] for s in seqs):
        n += 1
    return n


def _cache(bb: Backbone, kv: Sequence[tuple[torch.Tensor, torch.Tensor]], rows: int = 1, growing: bool = False):
    """A fresh transformers cache holding the prefix's keys/values (repeated for `rows` sequences);
    `growing` for decoding (see _GrowingLayer)."""
    from transformers import DynamicCache
    cache = DynamicCache(ddp_cache_data=[(k, v) for k, v in kv] or None, config=bb.model.config)
    if rows > 1:
        cache.batch_repeat_interleave(rows)
    if growing:
        for layer in cache.layers:
            layer.__class__ = _growing_layer_class()
    return cache


@functools.cache
def _growing_layer_class():
    """A transformers DynamicLayer that writes each step's keys/values into spare room at the end of
    its buffers instead of concatenating: concatenation copies the whole cache at every decoding
    step, which was half of the decoding time on a 2-core CPU (profiled)."""
    from transformers.cache_utils import DynamicLayer

    class _GrowingLayer(DynamicLayer):
        def update(self, key_states, value_states, *args, **kwargs):
            key_states = as_values(key_states, value_states)   # see kv_rows: exact, and a third less memory
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            n, m = self.get_seq_length(), key_states.shape[-2]
            room = getattr(self, "room", None)
            if room is None or room[0].data_ptr() != self.keys.data_ptr() or room[0].shape[-2] < n + m \
                    or room[0].shape[0] != key_states.shape[0]:
                shape = list(key_states.shape)
                shape[-2] = n + m + 64
                room = (key_states.new_empty(shape), value_states.new_empty(shape))
                if n:
                    room[0][..., :n, :] = self.keys
                    room[1][..., :n, :] = self.values
                self.room = room
            room[0][..., n:n + m, :] = key_states
            room[1][..., n:n + m, :] = value_states
            self.keys, self.values = room[0][..., :n + m, :], room[1][..., :n + m, :]
            return self.keys, self.values
    return _GrowingLayer


class SharedPrefix:
    """A group of token sequences whose longest common prefix is run through the decoder once.

    `keep[i]` tokens at the end of sequence i stay out of the prefix (the positions a loss reads
    must be computed with the remainder). `hidden` holds the prefix's last hidden states [n, H], float32
    (each sequence's first n, which μ's Eq. 2 pools with the rest). A `parent` is a SharedPrefix of a larger
    group these sequences belong to
    (e.g. a whole batch, sharing the system prompt): this prefix continues it. With `detach`, the
    sequences see the prefix through detached leaves whose gradients `backward_prefix` sends through
    the prefix once: a loss can then be backpropagated group by group, or sequence by sequence,
    without repeating the prefix's backward.
    """

    def __init__(self, bb: Backbone, seqs: Sequence[Sequence[int]], keep: Sequence[int], detach: bool = False,
                 parent: "SharedPrefix | None" = None):
        self.bb, self.seqs = bb, [list(s) for s in seqs]
        self.n = common_prefix_length(self.seqs, min(len(s) - k for s, k in zip(self.seqs, keep)))
        start = parent.n if parent else 0
        kv, hidden = (parent.kv, parent.hidden) if parent else ([], None)
        self._graph = None
        if self.n > start:
            kwargs = {}
            if start:
                kwargs = {"cache": _cache(bb, kv), "position_ids": torch.arange(start, self.n, device=bb.device)[None]}
            with bb.autocast():
                out = bb.model.get_decoder()(input_ids=torch.tensor([self.seqs[0][start:self.n]], device=bb.device),
                                             use_cache=True, **kwargs)
            kv = [(layer.keys, layer.values) for layer in out.cache.layers]
            own = out.last_hidden_state[0].float()
            hidden = torch.cat([hidden, own]) if start else own
            if detach and torch.is_grad_enabled():
                self._graph = [t for pair in kv for t in pair] + [hidden]
                kv = [(k.detach().requires_grad_(), v.detach().requires_grad_()) for k, v in kv]
                hidden = hidden.detach().requires_grad_()
        self.kv, self.hidden = kv, hidden

    def backward_prefix(self) -> None:
        """With `detach`: the gradients gathered on the prefix's leaves, through the prefix, once (and on
        into its parent's leaves)."""
        if self._graph is None:
            return
        leaves = [t for pair in self.kv for t in pair] + [self.hidden]
        pairs = [(g, leaf.grad) for g, leaf in zip(self._graph, leaves) if leaf.grad is not None and g.requires_grad]
        if pairs:
            torch.autograd.backward([g for g, _ in pairs], [d for _, d in pairs])
        self._graph = None


# ----------------------------------------------------------------------------------------
# 2. Packing: the rest of a group in one row, each shared token once (tree-shaped masks)
# ----------------------------------------------------------------------------------------

@dataclass
class Packed:
    """Sequences that share beginnings, packed into one row for one decoder pass: a token that several
    sequences hold at the same place (a system prompt, a question, a trajectory's history so far) is
    computed once, and each token attends to exactly the tokens before it in its own sequences (a
    tree-shaped attention mask). Exact: the same hidden states as one pass per sequence, up to
    floating-point rounding (tested)."""
    ids: list[int]                   # every shared beginning once, depth-first
    positions: list[int]             # each token's position in its sequences
    allow: torch.Tensor              # [L, L] bool: token q attends to token k
    paths: list[list[int]]           # per sequence: the packed index of each of its tokens after `start`


def pack(seqs: Sequence[Sequence[int]], start: int = 0) -> Packed:
    """The prefix tree of `seqs` from position `start` on (the tokens before it: a SharedPrefix's cache)."""
    ids: list[int] = []
    positions: list[int] = []
    segments: list[tuple[int, int, int]] = []          # (first, end, parent segment) in the packed row
    paths: list[list[int]] = [[] for _ in seqs]

    def visit(idx, depth, parent):
        n = depth
        while all(len(seqs[i]) > n for i in idx) and len({seqs[i][n] for i in idx}) == 1:
            n += 1
        first = len(ids)
        ids.extend(seqs[idx[0]][depth:n])
        positions.extend(range(depth, n))
        segments.append((first, len(ids), parent))
        me = len(segments) - 1
        for i in idx:
            paths[i].extend(range(first, len(ids)))
        below: dict[int, list[int]] = {}
        for i in idx:
            if len(seqs[i]) > n:
                below.setdefault(seqs[i][n], []).append(i)
        for sub in below.values():
            visit(sub, n, me)
    visit(list(range(len(seqs))), start, -1)
    allow = torch.zeros(len(ids), len(ids), dtype=torch.bool)
    above = torch.zeros(len(segments), len(ids), dtype=torch.bool)     # the tokens of a segment's ancestors
    for k, (first, end, parent) in enumerate(segments):
        if parent >= 0:
            above[k] = above[parent]
            above[k, segments[parent][0]:segments[parent][1]] = True
        allow[first:end] = above[k]
        allow[first:end, first:end] = torch.ones(end - first, end - first, dtype=torch.bool).tril()
    return Packed(ids, positions, allow, paths)


def packed_hidden(bb: Backbone, packed: Packed, root: SharedPrefix | None = None) -> torch.Tensor:
    """One decoder pass over a packed row (after `root`'s cached prefix): last hidden states [L, H]."""
    n = root.n if root else 0
    mask = torch.ones(len(packed.ids), n + len(packed.ids), dtype=torch.bool)
    mask[:, n:] = packed.allow
    kwargs = {"cache": _cache(bb, root.kv), "use_cache": True} if n else {}
    with bb.autocast():
        return bb.model.get_decoder()(input_ids=torch.tensor([packed.ids], device=bb.device),
                                      position_ids=torch.tensor([packed.positions], device=bb.device),
                                      attention_mask=mask[None, None].to(bb.device), **kwargs).last_hidden_state[0]


@dataclass
class StepPass:
    """What a loss needs from one sequence (prompt + response)."""
    logprobs: torch.Tensor                # [R] log p(response token | before it)
    kl: torch.Tensor | None = None        # [R] the caller's per-token KL to p_ref, when ref_logq is given
    hidden: torch.Tensor | None = None    # [L, H] the last hidden states of all its positions (fp32), with `hidden`


def packed_steps(bb: Backbone, seqs: Sequence[Sequence[int]], response_lens: Sequence[int],
                 root: SharedPrefix | None = None, ref_logq: Sequence[torch.Tensor] | None = None,
                 temperature: float = 1.0, kl: Callable | None = None, hidden: bool = False) -> list[StepPass]:
    """One packed pass (`pack`) over sequences that continue `root`: for each, the log-probs of its last
    `response_lens[i]` tokens under softmax(logits / temperature) (the LM head on those positions only), given
    the reference's log-softmax there the caller's per-token `kl` of the two, and with `hidden` its last hidden
    states (the root's, then its own)."""
    n = root.n if root else 0
    packed = pack(seqs, n)
    h = packed_hidden(bb, packed, root)
    outs = []
    for i, (seq, r) in enumerate(zip(seqs, response_lens)):
        hp = h[torch.tensor(packed.paths[i], device=h.device)]
        logq = torch.log_softmax(lm_logits(bb, hp[len(seq) - r - 1 - n:len(seq) - 1 - n]).float() / temperature, -1)
        target = torch.tensor(seq[len(seq) - r:], device=h.device)
        states = (torch.cat([root.hidden, hp.float()]) if n else hp.float()) if hidden else None
        outs.append(StepPass(logq.gather(-1, target[:, None])[:, 0],
                             kl(logq, ref_logq[i]) if ref_logq is not None else None, states))
    return outs


@torch.no_grad()
def reference_logq(bb: Backbone, seqs: Sequence[Sequence[int]], response_lens: Sequence[int],
                   root: SharedPrefix | None, temperature: float, reference: Callable) -> list[torch.Tensor]:
    """log p_ref over the vocabulary at each response position of each sequence ([R, V] each), p_ref =
    the backbone in the caller's `reference` context (π_ref, μ_ref: arco.reference): the no-grad side of the
    KL. `root`: a SharedPrefix made in that context too."""
    n = root.n if root else 0
    with reference(bb):
        packed = pack(seqs, n)
        h = packed_hidden(bb, packed, root)
        return [torch.log_softmax(lm_logits(bb, h[torch.tensor(packed.paths[i][len(s) - r - 1 - n:len(s) - 1 - n],
                                                               device=h.device)]) / temperature, -1)
                for i, (s, r) in enumerate(zip(seqs, response_lens))]


def token_passes(seqs: Sequence[Sequence[int]], budget: int | None, start: int = 0,
                 units: Sequence[Sequence[int]] | None = None) -> list[list[list[int]]]:
    """Cut a batch into training passes whose packed rows (`pack`) hold at most `budget` tokens: memory.

    `units` (default: each sequence alone) are index lists kept in one pass, such as the steps of a
    trajectory, which Eq. 5 couples. Returns the passes in order; a pass is a list of parts, each part
    one packed row; a pass has several parts only when one unit alone exceeds the budget (its parts
    are then recomputed in the backward, gradient checkpointing)."""
    units = units if units is not None else [[i] for i in range(len(seqs))]
    if budget is None:                    # no budget: each unit is a pass
        return [[list(u)] for u in units]
    size = lambda idx: len(pack([seqs[i] for i in idx], start).ids)     # noqa: E731
    passes: list[list[list[int]]] = []
    for unit in units:
        unit = list(unit)
        if passes and len(passes[-1]) == 1 and size(passes[-1][0] + unit) <= budget:
            passes[-1][0] += unit
        elif size(unit) <= budget or len(unit) == 1:
            passes.append([unit])
        else:
            parts: list[list[int]] = []
            for i in unit:
                if parts and size(parts[-1] + [i]) <= budget:
                    parts[-1].append(i)
                else:
                    parts.append([i])
            passes.append(parts)
    return passes


# ----------------------------------------------------------------------------------------
# 3. The training passes of the fast engine (infra.passes.training_passes with engine FAST)
# ----------------------------------------------------------------------------------------

def fast_passes(bb: Backbone, seqs: list[list[int]], lens: list[int], units: list[list[int]], budget: int,
                temperature: float, kl: Callable | None, reference: Callable | None, hidden: bool):
    """The fast engine: the units' common beginning runs once (SharedPrefix, for the reference too), the
    rest in packed rows (packed_steps) of at most `budget` tokens (token_passes); a unit longer than that
    alone is cut into parts recomputed in the backward (gradient checkpointing). The passes see the common
    beginning through detached leaves: its backward, once, is the returned `backward_shared`."""
    from torch.utils.checkpoint import checkpoint
    mine = [i for u in units for i in u]
    keep = [lens[i] + 1 for i in mine]
    root = SharedPrefix(bb, [seqs[i] for i in mine], keep, detach=True)
    if kl is not None:
        with torch.no_grad(), reference(bb):
            ref_root = SharedPrefix(bb, [seqs[i] for i in mine], keep)

    def part(idx):                        # one packed row
        sub, sub_lens = [seqs[i] for i in idx], [lens[i] for i in idx]
        ref = reference_logq(bb, sub, sub_lens, ref_root, temperature, reference) if kl is not None else None
        outs = packed_steps(bb, sub, sub_lens, root, ref, temperature, kl, hidden)
        return [o.logprobs for o in outs], [o.kl for o in outs], [o.hidden for o in outs]

    def run():
        for parts in token_passes(seqs, budget, root.n, units):
            res = [part(parts[0])] if len(parts) == 1 else [checkpoint(part, p, use_reentrant=False) for p in parts]
            yield Pass.of([i for p in parts for i in p], [x for r in res for x in r[0]],
                          [x for r in res for x in r[1]] if kl is not None else None,
                          [x for r in res for x in r[2]] if hidden else None)
    return run(), root.backward_prefix


# ----------------------------------------------------------------------------------------
# 4. Decoding: a packed prefill, rows leaving the batch, a memo of the previous round's prompts
# ----------------------------------------------------------------------------------------

def _next_token_logits(bb: Backbone, hidden: torch.Tensor) -> torch.Tensor:
    """The LM head on the few rows of a decoding step, as (W hᵀ)ᵀ: the same product, which MKL runs
    1.5–2× faster than F.linear's h Wᵀ for 8–32 rows on a 49k-token vocabulary (measured on the 2-core
    CPU; a tenth of a decoding step)."""
    head = bb.model.get_output_embeddings()
    with bb.autocast():                     # decoding keeps h in fp32; bf16 weights need bf16 rows (issue 31)
        logits = (head.weight @ hidden.to(head.weight.dtype).t()).t()
    return (logits if head.bias is None else logits + head.bias).float()     # float32: sampling and log-probs


PREFILL_TOKENS = 1024      # the longest packed row of a prefill (its attention costs the square of it)


class PromptMemo:
    """The keys/values of the prompts of one `decode` call, kept for the next call with the same weights.

    π's prompt at round t of a rollout repeats its prompt at round t − 1 up to the end of the history
    so far (system prompt, question, earlier steps; env.policy_messages), so with a memo a rollout
    computes each token of a history once instead of once per round: the next prefill runs only what
    follows the longest stored beginning (exact up to floating-point rounding, tested). It holds the
    latest call's prompts only, at most `max_tokens` tokens, and forgets them when the adapter's
    parameters change (an optimizer step): stored keys/values belong to one set of weights. Each stored
    prompt is let go as soon as the last of the call's prompts that start with it has been prefilled (a
    rollout's round reads each of the previous round's prompts once), so the previous round's memo shrinks
    while this round's grows instead of both being held to the end of the call (RESULTS, "memory")."""

    def __init__(self, max_tokens: int = 32768):
        self.max_tokens, self.entries, self.fresh, self.weights = max_tokens, [], [], None
        self.plan, self.readers = {}, Counter()      # this call's prompts → (entry, length); readers per entry

    def begin(self, bb: Backbone, prompts: Sequence[Sequence[int]]) -> None:
        weights = (id(bb.model), tuple(p._version for p in trainable_parameters(bb.model)))
        if weights != self.weights:
            self.entries, self.weights = [], weights
        self.fresh = []
        self.plan = {tuple(s): self._longest(s) for s in prompts}       # each prompt's stored beginning
        self.readers = Counter(self.plan[tuple(s)][0] for s in prompts)   # how many prompts read each entry

    def _longest(self, seq: Sequence[int]) -> tuple[int | None, int]:
        best, n = None, 0
        for i, (ids, _) in enumerate(self.entries):
            m = common_prefix_length([ids, seq], min(len(ids), len(seq) - 1))
            if m > n:
                best, n = i, m
        return best, n

    def longest(self, seq: Sequence[int]) -> tuple[list, int]:
        """The stored keys/values that share the longest beginning with `seq`, and its length (at most
        len(seq) − 1: the last prompt token is always run, its hidden state picks the first reply token)."""
        i, n = self.plan.get(tuple(seq)) or self._longest(seq)
        if i is None:
            return [], 0
        kv = self.entries[i][1]
        self.readers[i] -= 1
        if self.readers[i] <= 0:                 # its last reader: the stored keys/values are let go
            self.entries[i] = (self.entries[i][0], None)
        return kv, n

    def store(self, seq: Sequence[int], kv: list) -> None:
        if sum(len(ids) for ids, _ in self.fresh) + len(seq) <= self.max_tokens:
            self.fresh.append((list(seq), kv))

    def end(self) -> None:
        self.entries, self.fresh, self.plan, self.readers = self.fresh, [], {}, Counter()


def kv_rows(layers: list) -> list:
    """One prompt's keys/values, kept (memo, decoding cache) with the keys in the values' dtype. Under bf16
    autocast RoPE's float32 cos/sin promote the keys to float32 while the values stay bf16, and attention
    (SDPA or matmul, both on autocast's bf16 list) casts the keys to bf16 at every call: keeping them in
    bf16 gives the same numbers and a third less memory (RESULTS, "memory"). Elsewhere both share a dtype."""
    return [(as_values(k, v), v) for k, v in layers]


def as_values(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    return keys.to(values.dtype)


def _rows_packed(bb: Backbone, seqs: Sequence[Sequence[int]], hidden: bool = False) -> tuple[list, list, list]:
    """Each prompt's keys/values ([heads, len, head_dim] per layer), with `hidden` its last hidden states [len, H]
    (else None), and the hidden state of its last token: the common prefix once (SharedPrefix), the rest packed so
    that every shared token is computed once (`pack`, rows of at most PREFILL_TOKENS)."""
    root = SharedPrefix(bb, seqs, [1] * len(seqs))
    n, dev = root.n, bb.device
    rows_kv, states, last = [None] * len(seqs), [None] * len(seqs), [None] * len(seqs)
    for (run,) in token_passes(seqs, PREFILL_TOKENS, n):
        packed = pack([seqs[i] for i in run], n)
        kv_n = len(packed.ids)
        mask = torch.ones(kv_n, n + kv_n, dtype=torch.bool)
        mask[:, n:] = packed.allow
        with bb.autocast():
            res = bb.model.get_decoder()(input_ids=torch.tensor([packed.ids], device=dev), use_cache=True,
                                         position_ids=torch.tensor([packed.positions], device=dev),
                                         attention_mask=mask[None, None].to(dev), **({"cache": _cache(bb, root.kv)}
                                                                                   if n else {}))
        h = res.last_hidden_state[0].float()
        for j, i in enumerate(run):
            path = torch.tensor(packed.paths[j], device=dev)
            if hidden:
                states[i] = torch.cat([root.hidden, h[path]]) if n else h[path]
            last[i] = h[path[-1]]
            rows_kv[i] = kv_rows([tuple(torch.cat([part[0, :, :n], part[0, :, n:][:, path]], 1)
                                        for part in (layer.keys, layer.values)) for layer in res.cache.layers])
    return rows_kv, states, last


def _rows_from_memo(bb: Backbone, seqs: Sequence[Sequence[int]], stored: Sequence[tuple[list, int]]) -> tuple[list, list]:
    """Each prompt's keys/values and last hidden state, given the keys/values of its first `n_i` tokens
    (`stored`): one batched pass over the rest, every row seeing its own stored tokens (a right-padded
    cache) and then its own new tokens."""
    dev, pad = bb.device, bb.tokenizer.pad_token_id or 0
    n = [m for _, m in stored]
    width, new = max(n), max(len(s) - m for s, m in zip(seqs, n))
    cache = [tuple(torch.stack([torch.nn.functional.pad(kv[layer][part][:, :m], (0, 0, 0, width - m))
                                for kv, m in stored]) for part in (0, 1)) for layer in range(len(stored[0][0]))]
    ids = [list(s[m:]) + [pad] * (new - len(s) + m) for s, m in zip(seqs, n)]
    mask = [[1] * m + [0] * (width - m) + [1] * (len(s) - m) + [0] * (new - len(s) + m) for s, m in zip(seqs, n)]
    with bb.autocast():
        res = bb.model.get_decoder()(input_ids=torch.tensor(ids, device=dev), use_cache=True,
                                     attention_mask=torch.tensor(mask, device=dev), cache=_cache(bb, cache),
                                     position_ids=torch.tensor([list(range(m, m + new)) for m in n], device=dev))
    h = res.last_hidden_state.float()
    rows_kv = [kv_rows([tuple(torch.cat([part[i, :, :m], part[i, :, width:width + len(s) - m]], 1)
                              for part in (layer.keys, layer.values)) for layer in res.cache.layers])
               for i, (s, m) in enumerate(zip(seqs, n))]
    return rows_kv, [h[i, len(s) - m - 1] for i, (s, m) in enumerate(zip(seqs, n))]


def _prefill(bb: Backbone, seqs: Sequence[Sequence[int]], memo: PromptMemo | None = None, hidden: bool = False):
    """The prompts of a decoding batch as one batch cache, right-padded between each prompt and what is
    generated. With a `memo` holding a beginning of every prompt, only the rest is run (_rows_from_memo);
    otherwise the prompts are packed (_rows_packed). Returns the cache, its attention mask [B, width], with
    `hidden` each prompt's last hidden states (else Nones; never with the memo) and the hidden state of each
    prompt's last token."""
    stored = [memo.longest(s) for s in seqs] if memo is not None else []
    if stored and all(m > 0 for _, m in stored):
        (rows_kv, last), states = _rows_from_memo(bb, seqs, stored), [None] * len(seqs)
    else:
        rows_kv, states, last = _rows_packed(bb, seqs, hidden)
    if memo is not None:
        for s, kv in zip(seqs, rows_kv):
            memo.store(s, kv)
    width = max(len(q) for q in seqs)
    kv = [tuple(torch.stack([torch.nn.functional.pad(row[layer][part], (0, 0, 0, width - row[layer][part].shape[1]))
                             for row in rows_kv]) for part in (0, 1)) for layer in range(len(rows_kv[0]))]
    mask = torch.tensor([[1] * len(q) + [0] * (width - len(q)) for q in seqs], device=bb.device)
    return _cache(bb, kv, growing=True), mask, states, torch.stack(last)


@torch.no_grad()
def decode(bb: Backbone, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float = 0.0,
           batch_size: int = 16, steer: Callable[[list[int], int, torch.Tensor], int] | None = None,
           hidden: bool = False, memo: PromptMemo | None = None,
           seeds: Sequence[int] | None = None) -> list[tuple[Generation, torch.Tensor | None]]:
    """Batched decoding with a KV cache, the batch's common prefix run once (SharedPrefix).

    Greedy (temperature 0): a row leaves the batch when it is done — at an end-of-turn token or at
    max_new_tokens; `steer(its new ids, the drawn token, the step's logits [V])` returns the token written in
    place of the drawn one (μ's rubric frames: RubricModel.steer). With `hidden` every token is fed
    once (greedy only), so the last hidden states of prompt + reply (what μ's Eq. 2 pools) come with the text: a
    score pass for free. Sampling (temperature > 0) draws as transformers' generate
    does — softmax(logits / T) in fp32, one torch.multinomial over the whole batch at every step until
    every row is done — so a seed gives the same tokens (up to floating-point rounding); a finished row
    leaves the forward pass but stays in the draw with a placeholder distribution (one draw per row
    takes Exp(1) noise over the whole [B, V] tensor, whatever the probabilities: the other rows' tokens
    do not change; tested against transformers). With `seeds` (one per prompt) each row draws from its own
    generator instead, so its tokens depend on its seed alone, not on which rows share its batch: what
    makes a data-parallel run's rollouts those of the single-process run (arco.py --sampling trajectory).
    A `memo` (PromptMemo) reuses the keys/values of the
    previous call's prompts. Returns (Generation, hidden states [L, H] float32 or None) per prompt, in the input
    order.
    """
    if hidden and (memo is not None or temperature > 0):
        raise ValueError("decode: `hidden` is for greedy decoding without a memo (which skips prompt tokens)")
    stops, _ = end_of_reply(bb)
    sample = temperature > 0
    out: list = [None] * len(prompts)
    was_training = bb.model.training
    bb.model.eval()                                 # no LoRA dropout while decoding
    decoder = bb.model.get_decoder()
    dev = bb.device
    if memo is not None:
        memo.begin(bb, prompts)
    try:
        for batch in length_batches([len(p) for p in prompts], batch_size):
            seqs = [list(prompts[i]) for i in batch]
            cache, mask, states, h_last = _prefill(bb, seqs, memo, hidden)
            fed: list[list[torch.Tensor]] = [[] for _ in seqs]      # `hidden`: each new token's, as it is fed
            streams = [torch.Generator(device=dev).manual_seed(seeds[i]) for i in batch] if sample and seeds else None
            last = torch.tensor([len(q) - 1 for q in seqs], device=dev)
            new: list[list[int]] = [[] for _ in seqs]
            rows = list(range(len(seqs)))            # the rows in the cache, in order
            alive = list(rows)                       # the rows still writing
            while True:
                logits = _next_token_logits(bb, h_last)
                if streams:                          # one generator per row: its own draws only
                    probs = torch.softmax(logits / temperature, -1)
                    pick = [int(torch.multinomial(probs[k], 1, generator=streams[row])) for k, row in enumerate(rows)]
                elif sample:                         # transformers' sampling: every row of the batch draws
                    live = torch.tensor(rows, device=dev)
                    probs = logits.new_full((len(seqs), logits.shape[-1]), 1.0 / logits.shape[-1])
                    probs[live] = torch.softmax(logits / temperature, -1)
                    pick = torch.multinomial(probs, 1)[live, 0].tolist()
                else:
                    pick = logits.argmax(-1).tolist()
                for k, (row, tok) in enumerate(zip(rows, pick)):
                    if row in alive:
                        new[row].append(steer(new[row], tok, logits[k]) if steer is not None else tok)
                ended = [row for row in alive if new[row][-1] in stops or len(new[row]) >= max_new_tokens]
                writing = set(alive)                 # rows whose newest token is fed next (for `hidden`)
                alive = [row for row in alive if row not in ended]
                # `hidden` (greedy): a row's last token is fed once more
                feed = [row for row in rows if row in alive or (hidden and not sample and row in ended)]
                if not feed:
                    break
                if feed != rows:
                    keep = torch.tensor([rows.index(r) for r in feed], device=dev)
                    cache.batch_select_indices(keep)
                    mask, last = mask[keep], last[keep]
                    rows = feed
                last = last + 1
                mask = torch.cat([mask, torch.ones(len(rows), 1, dtype=torch.long, device=dev)], 1)
                tokens = torch.tensor([new[r][-1] for r in rows], device=dev)[:, None]
                with bb.autocast():
                    res = decoder(input_ids=tokens, attention_mask=mask, position_ids=last[:, None], cache=cache,
                                  use_cache=True)
                cache, h_last = res.cache, res.last_hidden_state[:, -1].float()
                if hidden:
                    fresh = [k for k, r in enumerate(rows) if r in writing]
                    for k in fresh:
                        fed[rows[k]].append(h_last[k])
            for row, i in enumerate(batch):
                text = bb.tokenizer.decode(new[row], skip_special_tokens=True).strip()
                full = torch.cat([states[row], torch.stack(fed[row])]) if hidden else None
                out[i] = (Generation(text, new[row], seqs[row]), full)
        if memo is not None:
            memo.end()
    finally:
        bb.model.train(was_training)
    return out


# ----------------------------------------------------------------------------------------
# 5. What the engine refuses at load, and the engine itself
# ----------------------------------------------------------------------------------------

def check_supported(model: torch.nn.Module, name: str) -> None:
    """Refuse, at load, what the fast engine would silently mis-compute: every cache layer is turned into
    a plain growing layer (_cache) and packed passes attend through 4-D tree masks (pack), so a model
    with sliding-window layers, or one running an attention backend other than SDPA or eager, is out
    (the plain engine, which runs the model's own forward and cache, takes it)."""
    config = model.config
    backend = getattr(config, "_attn_implementation", "sdpa") or "sdpa"
    if backend not in ("sdpa", "eager"):
        raise ModelLoadError(f"model {name!r} runs attention backend {backend!r}; the packed passes need "
                             f"'sdpa' or 'eager' (their tree-shaped masks are 4-D), or use --engine plain")
    sliding = "sliding_attention" in (getattr(config, "layer_types", None) or []) or (
        getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None))
    if sliding:
        raise ModelLoadError(f"model {name!r} has sliding-window attention layers, which the growing KV "
                             f"cache of decode and the packed passes do not implement; use a model with "
                             f"full attention in every layer (as Qwen3-4B-Instruct-2507, SmolLM2, Llama 3), "
                             f"or --engine plain")


# The engine: `--engine fast` (Backbone.engine) runs these.
FAST = Engine(passes=fast_passes, decode=decode, memo=PromptMemo, check=check_supported)
