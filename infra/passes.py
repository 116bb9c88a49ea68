"""The passes every loss reads and the replies every rollout samples (plumbing beneath the updates): chat prompts,
generation (`generate`, `policy_act`), token log-probs and the per-token KL, and the training passes — defined
once here as the `plain` engine (one ordinary forward per sequence, a plain sampling loop: the code to read and
to port). The `fast` engine (infra/fast.py) computes the same numbers with less repeated work; a backbone runs the
engine it was loaded with (`Backbone.engine`, chosen by --engine in infra/engines.py), the plain one by default.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from infra.models import Backbone


# ----------------------------------------------------------------------------------------
# Generation
# ----------------------------------------------------------------------------------------

# End-of-turn markers of common chat templates; generation stops at any of them.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<end_of_turn>")


@dataclass
class Generation:
    text: str                   # the decoded reply, special tokens dropped, stripped
    token_ids: list[int]        # generated ids, up to and including the end-of-turn token if one came
    prompt_ids: list[int]       # the prompt it continued (chat template applied)


def chat_prompt_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    """Token ids of chat messages under the tokenizer's chat template. A hybrid-thinking template (Qwen3's)
    is told not to think (`enable_thinking=False`: the agent's replies are one action, as in the paper);
    templates without that switch ignore it."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         enable_thinking=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def end_of_turn_ids(bb: Backbone) -> list[int]:
    ids = set()
    for source in (bb.tokenizer.eos_token_id, getattr(bb.model.generation_config, "eos_token_id", None)):
        ids.update(source if isinstance(source, list) else [source] if source is not None else [])
    vocab = bb.tokenizer.get_vocab()
    ids.update(vocab[t] for t in END_OF_TURN_TOKENS if t in vocab)
    return sorted(ids)


def encode_response(bb: Backbone, text: str) -> list[int]:
    """Ids of a reply as the model would write it: the text, then the end-of-turn token.

    For targets that were not sampled (teacher actions, teacher rubrics): SFT and the
    log-probs of Eq. 3/7 score these ids after the chat prompt.
    """
    ids = bb.tokenizer(text, add_special_tokens=False)["input_ids"]
    vocab = bb.tokenizer.get_vocab()
    eot = next((vocab[t] for t in END_OF_TURN_TOKENS if t in vocab), bb.tokenizer.eos_token_id)
    return ids + [eot]


def length_batches(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Indices grouped in batches of similar length (less padding)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


@dataclass
class Engine:
    """One way of computing what the algorithm asks of a model: the training passes of an update and the replies
    of a generation call, the same numbers whichever computes them (tests/test_engines.py): PLAIN below, FAST in
    infra/fast.py; infra/engines.py names them for --engine."""
    passes: Callable        # (bb, seqs, response lens, units, token budget, temperature, kl, reference, hidden)
                            #   → (the Passes, one per group of units; the backward of what they share)
    decode: Callable        # (bb, prompt ids, max_new_tokens, temperature, batch_size, steer, hidden, memo, seeds)
                            #   → (Generation, last hidden states [L, H] or None) per prompt, in order
    memo: Callable          # () → what policy_act keeps from one round of a rollout to the next (or None)
    check: Callable         # (model, name) → None, or raises ModelLoadError for a model it cannot compute


def generate(bb: Backbone, prompts: Sequence[list[dict] | list[int]], max_new_tokens: int = 64,
             temperature: float = 0.7, batch_size: int = 16, memo=None,
             seeds: Sequence[int] | None = None) -> list[Generation]:
    """Sampling (temperature > 0) or greedy decoding (temperature 0) of chat replies, each stopping at its
    end-of-turn token, by the backbone's engine (plain_decode, or infra.fast.decode: the same tokens).

    `prompts` are chat message lists (the chat template is applied here) or token ids. Sampling is
    plain temperature sampling (no top-k / top-p, whatever the model's own generation config says),
    so the sampled tokens follow exactly the softmax(logits / T) of the p_θ whose log-probs the losses
    use. The output keeps the input order; `batch_size` and `memo` (the engine's, from policy_act) are
    the fast engine's. `seeds` (one per prompt) give each prompt its own random stream.
    """
    ids = [list(p) if p and isinstance(p[0], int) else chat_prompt_ids(bb.tokenizer, p) for p in prompts]
    return [g for g, _ in engine_of(bb).decode(bb, ids, max_new_tokens, temperature, batch_size, memo=memo,
                                               seeds=seeds)]


def policy_act(bb: Backbone, temperature: float, max_new_tokens: int, batch_size: int):
    """A policy as env.rollout's `act`: generation (sampling, or greedy at temperature 0), one memo of the
    engine's per rollout (the fast engine's runs only what a round's prompts add to the previous round's).
    env.rollout passes per-prompt seeds when it was given per-trajectory seeds (--sampling trajectory)."""
    memo = engine_of(bb).memo()
    return lambda prompts, seeds=None: generate(bb, prompts, max_new_tokens=max_new_tokens, temperature=temperature,
                                                batch_size=batch_size, memo=memo, seeds=seeds)


def end_of_reply(bb: Backbone) -> tuple[list[int], int]:
    """The ids that end a reply (end_of_turn_ids), and the one a `steer` callback writes to end it (the
    chat template's own end-of-turn token where the model has it): the same for every engine."""
    stops = end_of_turn_ids(bb)
    return stops, next((t for t in stops if t == bb.tokenizer.convert_tokens_to_ids(END_OF_TURN_TOKENS[0])), stops[0])


@torch.no_grad()
def plain_decode(bb: Backbone, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float = 0.0,
                 batch_size: int = 16, steer: Callable[[list[int], int, torch.Tensor], int] | None = None,
                 hidden: bool = False,
                 memo=None, seeds: Sequence[int] | None = None) -> list[tuple[Generation, torch.Tensor | None]]:
    """The plain engine's generation: one prompt at a time, the model's own KV cache (transformers), one token
    per step. Greedy (temperature 0) takes the argmax of the fp32 logits; sampling draws from softmax(logits / T)
    in fp32 with torch.multinomial, from the prompt's own generator when `seeds` are given (one per prompt: its
    tokens then depend on its seed alone, as in fast.decode), else from torch's global one. A reply ends at an
    end-of-turn token or at max_new_tokens. `steer(its new ids, the drawn token, the step's logits [V])` returns
    the token written in place of the drawn one (μ's rubric frames: RubricModel.steer). With `hidden` (greedy) every
    new token is fed once too, so the last hidden states of prompt + reply (what μ's Eq. 2 pools) come with the
    text. `batch_size` and `memo` are unused. Returns (Generation, hidden states [L, H] float32 or None) per prompt,
    in order."""
    if hidden and temperature > 0:
        raise ValueError("decode: `hidden` is for greedy decoding")
    stops, _ = end_of_reply(bb)
    decoder, was_training, out = bb.model.get_decoder(), bb.model.training, []
    bb.model.eval()                                         # no LoRA dropout while decoding
    try:
        for i, prompt in enumerate(prompts):
            stream = torch.Generator(device=bb.device).manual_seed(seeds[i]) if seeds and temperature > 0 else None
            feed, cache, states, new, done = list(prompt), None, [], [], False
            while True:
                with bb.autocast():                         # the new tokens, after the cached ones
                    res = decoder(input_ids=torch.tensor([feed], device=bb.device), cache=cache, use_cache=True)
                cache, h = res.cache, res.last_hidden_state[0].float()          # [new tokens, H]
                if hidden:
                    states.append(h)
                if done:                                    # (`hidden`: the reply's last token, fed once)
                    break
                logits = lm_logits(bb, h[-1])                                   # [V], float32
                if temperature > 0:
                    tok = int(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=stream))
                else:
                    tok = int(logits.argmax())
                new.append(steer(new, tok, logits) if steer is not None else tok)
                done = new[-1] in stops or len(new) >= max_new_tokens
                if done and not hidden:
                    break
                feed = new[-1:]
            text = bb.tokenizer.decode(new, skip_special_tokens=True).strip()
            out.append((Generation(text, new, list(prompt)), torch.cat(states) if hidden else None))
    finally:
        bb.model.train(was_training)
    return out


def policy_sequences(bb: Backbone, steps) -> tuple[list[list[int]], list[int]]:
    """The token ids of π's steps as π read and wrote them (its prompt h_t, then its action a_t: the ids it
    generated, or the action re-encoded), and each action's length."""
    actions = [list(st.output_ids or encode_response(bb, st.output)) for st in steps]
    return [chat_prompt_ids(bb.tokenizer, st.prompt) + a for st, a in zip(steps, actions)], [len(a) for a in actions]


# ----------------------------------------------------------------------------------------
# Token log-probs and KL
# ----------------------------------------------------------------------------------------

def pad_right(seqs: Sequence[Sequence[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and attention mask. Right padding keeps every real token at its
    natural position (0, 1, ...), so padded and unpadded passes agree."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(list(s), dtype=torch.long)
        mask[i, :len(s)] = 1
    return ids.to(device), mask.to(device)


def last_hidden_states(bb: Backbone, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The decoder's last hidden states [B, L, H] (after the final norm: what the LM head
    reads), without the LM head: the vocabulary projection is skipped entirely."""
    decoder = bb.model.get_decoder()
    with bb.autocast():
        return decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state


@dataclass
class ResponseLogprobs:
    """Per-token results for a batch of responses, left-aligned and padded to [B, R]."""
    logprobs: torch.Tensor                  # [B, R] log p(response token | prompt, earlier tokens); 0 at padding
    mask: torch.Tensor                      # [B, R] bool, True on real response tokens

    def sums(self) -> torch.Tensor:
        """log p(response | prompt) per sequence, [B]."""
        return self.logprobs.sum(-1)


def response_positions(prompt_lens: Sequence[int], response_lens: Sequence[int], device):
    """Where the responses sit in right-padded (prompt + response) rows: the [B, R] mask of real
    response tokens and, row-major over that mask, each token's row and the position that
    predicts it (the one before it)."""
    p_len = torch.tensor(list(prompt_lens), device=device)
    r_len = torch.tensor(list(response_lens), device=device)
    steps = torch.arange(max(1, int(r_len.max())), device=device)
    resp_mask = steps[None, :] < r_len[:, None]                             # [B, R]
    rows = torch.arange(len(p_len), device=device)[:, None].expand_as(resp_mask)[resp_mask]
    pos = (p_len[:, None] - 1 + steps[None, :])[resp_mask]                  # predicts the token at pos + 1
    return resp_mask, rows, pos


def sequence_logprobs(bb: Backbone, prompt_ids: Sequence[Sequence[int]],
                      response_ids: Sequence[Sequence[int]], temperature: float = 1.0) -> ResponseLogprobs:
    """log p(response tokens | prompt) for a batch of (prompt, response) pairs: one right-padded forward
    pass of the decoder, then only the positions that predict a response token go through the LM head —
    on SmolLM2 the 49k-word projection is about half the cost of a full pass. Gradients flow when grad is
    enabled. `temperature`: the log-softmax of logits / T (the distribution π samples from at T). (The passes
    the losses read: training_passes.)"""
    if len(prompt_ids) != len(response_ids):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(response_ids)} responses")
    if any(len(p) == 0 for p in prompt_ids):
        raise ValueError("every prompt needs at least one token")
    ids, mask = pad_right([list(p) + list(r) for p, r in zip(prompt_ids, response_ids)],
                          bb.tokenizer.pad_token_id, bb.device)
    hidden = last_hidden_states(bb, ids, mask)                              # [B, L, H]
    resp_mask, rows, pos = response_positions([len(p) for p in prompt_ids], [len(r) for r in response_ids], bb.device)
    logits = lm_logits(bb, hidden[rows, pos]) / temperature                   # [N, V] fp32, response positions only
    token_logp = -F.cross_entropy(logits, ids[rows, pos + 1], reduction="none")
    logprobs = torch.zeros(resp_mask.shape, device=hidden.device, dtype=token_logp.dtype)
    return ResponseLogprobs(logprobs.masked_scatter(resp_mask, token_logp), resp_mask)


def lm_logits(bb: Backbone, hidden: torch.Tensor) -> torch.Tensor:
    """Logits in float32 (log-softmax and the KL need it) from hidden states of any dtype: the hidden
    states are cast to the head's dtype first (bf16 weights on a GPU, fp32 on CPU)."""
    head = bb.model.get_output_embeddings()
    with bb.autocast():
        return head(hidden.to(head.weight.dtype)).float()


# ----------------------------------------------------------------------------------------
# Training passes: one interface, two engines
# ----------------------------------------------------------------------------------------
@dataclass
class Pass:
    """One training pass over the sequences `index`: what the losses read, padded."""
    index: list[int]
    logprobs: torch.Tensor                # [n, R] log p(response token | before it) at the pass's T, float32; 0 at padding
    mask: torch.Tensor                    # [n, R] bool, True on response tokens
    kl: torch.Tensor | None               # [n, R] the caller's per-token KL of p_θ to p_ref (its `kl` function)
    hidden: torch.Tensor | None           # [n, L, H] each sequence's last hidden states, float32 (with `hidden`)
    hidden_mask: torch.Tensor | None      # [n, L] bool, True on each sequence's own positions

    @classmethod
    def of(cls, index, logprobs: list, kl: list | None, hidden: list | None) -> "Pass":
        width = max([1] + [len(x) for x in logprobs])
        device = logprobs[0].device
        pad = lambda xs: torch.stack([F.pad(x.float(), (0, width - len(x))) for x in xs])    # noqa: E731
        lengths = lambda xs: torch.tensor([len(x) for x in xs], device=device)            # noqa: E731
        mask = torch.arange(width, device=device)[None] < lengths(logprobs)[:, None]
        states = states_mask = None
        if hidden is not None:
            states = torch.nn.utils.rnn.pad_sequence([h.float() for h in hidden], batch_first=True)
            states_mask = torch.arange(states.shape[1], device=device)[None] < lengths(hidden)[:, None]
        return cls(list(index), pad(logprobs), mask, pad(kl) if kl is not None else None, states, states_mask)


class TrainingPasses:
    """The passes of one update: iterate over them (a Pass each, the caller backpropagates each pass's loss), then
    `backward_shared()`: the backward of what the passes share — the fast engine runs the common beginning of the
    sequences once and sends the gradients every pass gathered on it through it once, here (the plain engine shares
    nothing: no work)."""

    def __init__(self, passes, backward_shared: Callable[[], None]):
        self._passes, self._backward_shared = passes, backward_shared

    def __iter__(self):
        return iter(self._passes)

    def backward_shared(self) -> None:
        self._backward_shared()


def training_passes(bb: Backbone, seqs: Sequence[Sequence[int]], response_lens: Sequence[int],
                    budget: int | None = 1024, units: Sequence[Sequence[int]] | None = None,
                    share: Callable[[int], slice] | None = None, temperature: float = 1.0,
                    kl: Callable | None = None, reference: Callable | None = None,
                    hidden: bool = False) -> TrainingPasses:
    """The passes of one update over `seqs`, the last `response_lens[i]` tokens of each being its response:
    a `Pass` per group of sequences, each unit of `units` (index lists, e.g. the steps of a trajectory, which
    Eq. 5 couples; default: each sequence alone) whole in one pass, computed by the backbone's engine
    (Backbone.engine). The caller backpropagates each pass's loss, then calls `backward_shared()`. `budget`: the
    most tokens in a pass of the fast engine (None: one pass per unit). `share` (torchrun): n units → this rank's
    slice. `temperature` T: log-probs (and the KL's two distributions) of softmax(logits / T). `kl`, the caller's
    per-token KL function of two log-softmaxes [R, V] (arco.token_kl), with `reference`, the caller's context in
    which the backbone is the reference model (arco.reference): Pass.kl. `hidden`: each sequence's last hidden
    states (Pass.hidden, for μ's Eq. 2)."""
    if (kl is None) != (reference is None):
        raise ValueError("training_passes: `kl` and `reference` come together")
    units = [list(u) for u in units] if units is not None else [[i] for i in range(len(seqs))]
    if share is not None:
        units = units[share(len(units))]
    if not units:
        return TrainingPasses([], lambda: None)
    return TrainingPasses(*engine_of(bb).passes(bb, [list(x) for x in seqs], list(response_lens), units, budget,
                                                temperature, kl, reference, hidden))


def plain_passes(bb: Backbone, seqs: list[list[int]], lens: list[int], units: list[list[int]], budget: int,
                 temperature: float, kl: Callable | None, reference: Callable | None, hidden: bool):
    """The plain engine: one ordinary forward pass per sequence, the reference's by a second one in `reference`;
    one Pass per unit, nothing shared. No packing, no shared prefix, no checkpointing (`budget` unused)."""
    def response_logq(states: torch.Tensor, r: int) -> torch.Tensor:      # [L, H] → log-softmax at the r
        return torch.log_softmax(lm_logits(bb, states[len(states) - r - 1:len(states) - 1]) / temperature, -1)

    def run():
        for unit in units:
            logprobs, kls, states = [], [], []
            for i in unit:
                ids = torch.tensor([seqs[i]], device=bb.device)
                h = last_hidden_states(bb, ids, torch.ones_like(ids))[0]                        # [L, H]
                logq = response_logq(h, lens[i])                                               # [R, V]
                logprobs.append(logq.gather(-1, ids[0, len(seqs[i]) - lens[i]:, None])[:, 0])
                if kl is not None:
                    with torch.no_grad(), reference(bb):
                        ref = response_logq(last_hidden_states(bb, ids, torch.ones_like(ids))[0], lens[i])
                    kls.append(kl(logq, ref))
                if hidden:
                    states.append(h.float())
            yield Pass.of(unit, logprobs, kls if kl is not None else None, states if hidden else None)
    return run(), lambda: None


# The plain engine (--engine plain): no memo between a rollout's rounds, any model it can load.
PLAIN = Engine(passes=plain_passes, decode=plain_decode, memo=lambda: None, check=lambda model, name: None)


def engine_of(bb: Backbone) -> Engine:
    """The engine a backbone was loaded with (Backbone.engine), the plain one when none was chosen."""
    return bb.engine or PLAIN
