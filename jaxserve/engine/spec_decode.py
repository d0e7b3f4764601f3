"""Speculative decoding on the engine's side: drafting, what a verify step accepted, counters.

A ``Proposer`` drafts tokens for the step's decoding sequences (``EngineCore`` asks it before
scheduling, with every token of those sequences known on the host); the scheduler puts each
draft after its sequence's last token in the step (``ScheduledSeq.draft_token_ids``), the runner
samples a token at each of the k + 1 positions with the request's own sampling parameters, and
``accepted_run`` says how many drafts the target model agreed with: the sampled token at
position j equal to draft j. The sequence then gains the sampled tokens of positions 0..a:
the accepted drafts and one more, the target's own.

That is lossless for a deterministic draft (n-gram, a greedy draft model): the token at each
position is sampled from the target's distribution exactly as without speculation, and the
rejection sampler's rule for a one-hot draft q (accept d with probability p(d); on rejection
sample from p with d removed) gives the same distribution as sampling x ~ p and accepting d
when x == d, which is what this does (docs/speculative_decoding.md).

``NgramProposer`` is vLLM's prompt lookup; a model-based drafter (a draft model, an EAGLE-3
head, MTP layers) implements the same protocol.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Sequence as Seq
from typing import Any, Protocol

import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.engine.request import Sequence
from jaxserve.engine_config import EngineConfig, SpeculativeConfig
from jaxserve.runner.step import DeviceDrafts

_LOG = logging.getLogger(__name__)


class Proposer(Protocol):
    """Drafts tokens for the sequences of a step.

    ``propose`` gets the running sequences that decode in the coming step, each with every
    token known on the host (no pending token), and returns seq id -> up to ``k`` tokens that
    would follow its last one (no entry, or [], drafts nothing). ``free`` forgets a sequence's
    state (it finished, or was preempted: a resumed one comes back with its tokens). A drafter
    with device work of its own (a draft model) runs it inside ``propose``; asked ``on_device``
    it may leave the drafts there (``DeviceDrafts``: the verify step reads them on the device,
    the host once that step is read back)."""

    def propose(
        self, seqs: Seq[Sequence], k: int, on_device: bool = False
    ) -> dict[str, list[int]] | DeviceDrafts: ...
    def free(self, seq_id: str) -> None: ...


# When drafting does not pay (``DraftPayoff``): over the last PAYOFF_WINDOW steps that could
# draft, fewer than PAYOFF_MIN_GAIN accepted tokens per decoding sequence a step. A step that may
# draft is read back before the next one is scheduled, so it gives up the overlap of the host's
# work with the device's (5-8% of a batch-1 step: 0.3-0.5 ms of host work in a 6 ms step on
# the H100), and a model drafter adds its own time; 10% more tokens a step is where drafting
# starts to pay for that. A first choice, to be tuned with ``benchmarks/spec_decode.py``.
PAYOFF_WINDOW = 32
PAYOFF_MIN_GAIN = 0.1
PAYOFF_PAUSE_STEPS = 256  # the first pause; each pause in a row doubles it, up to the max
PAYOFF_MAX_PAUSE_STEPS = 4096


@dataclasses.dataclass
class DraftPayoff:
    """Whether drafting pays on this workload, so that speculation never makes it slower:
    after ``PAYOFF_WINDOW`` steps that could draft and gained on average fewer than
    ``PAYOFF_MIN_GAIN`` accepted tokens per decoding sequence (prompt lookup on text that does
    not repeat, a draft that disagrees), drafting pauses for a number of steps (asynchronous
    scheduling resumes meanwhile), then tries again; each pause in a row is twice as long."""

    pause_until: int = 0  # the engine step from which drafting may resume
    num_pauses: int = 0
    last_gain: float = 0.0  # the mean gain that caused the last pause
    _gains: collections.deque[float] = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=PAYOFF_WINDOW)
    )
    _next_pause: int = PAYOFF_PAUSE_STEPS

    def may_draft(self, step: int) -> bool:
        return step >= self.pause_until

    def record(self, step: int, decoding: int, accepted: int) -> bool:
        """A step that could draft: ``decoding`` sequences were asked for drafts, ``accepted``
        drafted tokens were accepted. True when drafting pauses from now."""
        if decoding <= 0:
            return False
        self._gains.append(accepted / decoding)
        if len(self._gains) < PAYOFF_WINDOW:
            return False
        gain = sum(self._gains) / len(self._gains)
        if gain >= PAYOFF_MIN_GAIN:
            self._next_pause = PAYOFF_PAUSE_STEPS  # it pays: a later pause starts short again
            return False
        self.pause_until, self.last_gain = step + self._next_pause, gain
        self._next_pause = min(2 * self._next_pause, PAYOFF_MAX_PAUSE_STEPS)
        self._gains.clear()
        self.num_pauses += 1
        return True

    def describe_pause(self, step: int) -> str:
        return (
            f"Speculative decoding pauses for {self.pause_until - step} steps: the last "
            f"{PAYOFF_WINDOW} steps that could draft gained {self.last_gain:.3f} accepted tokens "
            f"per sequence, under {PAYOFF_MIN_GAIN} (asynchronous scheduling resumes meanwhile)"
        )


@dataclasses.dataclass
class _History:
    tokens: np.ndarray  # i32[capacity], the first `length` are prompt + output
    length: int = 0


class NgramProposer:
    """Prompt lookup (vLLM's ``NgramProposer``): the longest suffix of prompt + output, of
    ``min_n`` to ``max_n`` tokens, that occurred earlier in them proposes the tokens that
    followed its most recent earlier occurrence. On the host: each sequence's tokens are kept
    in a numpy buffer grown as it generates, and the search is one vectorised compare of the
    last token against the history, then a check of the few candidates backwards."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self._histories: dict[str, _History] = {}

    def free(self, seq_id: str) -> None:
        self._histories.pop(seq_id, None)

    def _tokens(self, seq: Sequence) -> np.ndarray:
        """The sequence's known tokens as an array (its buffer brought up to date)."""
        n = seq.num_tokens
        history = self._histories.get(seq.seq_id)
        if history is None or history.length > n:
            history = self._histories[seq.seq_id] = _History(np.zeros(max(64, 2 * n), np.int32))
        if history.tokens.shape[0] < n:
            grown = np.zeros(2 * n, np.int32)
            grown[: history.length] = history.tokens[: history.length]
            history.tokens = grown
        if history.length < n:
            history.tokens[history.length : n] = seq.token_ids(history.length, n)
            history.length = n
        return history.tokens[:n]

    def propose(self, seqs: Seq[Sequence], k: int, on_device: bool = False) -> dict[str, list[int]]:
        """Its drafts are the host's own (``on_device`` asks nothing of it)."""
        drafts = {}
        for seq in seqs:
            draft = self.propose_tokens(self._tokens(seq), k)
            if draft:
                drafts[seq.seq_id] = draft
        return drafts

    def propose_tokens(self, tokens: np.ndarray, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the longest matching suffix n-gram, or []."""
        n = tokens.shape[0]
        if n < self.min_n + 1:
            return []
        # Ends of earlier occurrences of the last token (not the last token itself).
        ends = np.flatnonzero(tokens[: n - 1] == tokens[n - 1])
        best_len, best_end = 0, -1
        length = 1
        while ends.size:
            if length >= self.min_n:
                best_len, best_end = length, int(ends[-1])  # the most recent occurrence
            if length == self.max_n:
                break
            ends = ends[ends >= length]  # room for one more token before it
            ends = ends[tokens[ends - length] == tokens[n - 1 - length]]
            length += 1
        if best_len < self.min_n:
            return []
        return tokens[best_end + 1 : best_end + 1 + k].tolist()


@dataclasses.dataclass(frozen=True)
class DrafterTarget:
    """What a model-based drafter needs of the target: the engine's settings, the target's
    config and tokenizer, its ``max_model_len``, and the runner (``eagle3`` runs the target's
    weights, read from it at each call)."""

    engine: EngineConfig
    model_config: ModelConfig
    tokenizer: Any  # engine.tokenizer.Tokenizer
    max_model_len: int
    runner: Any = None  # runner.runner.Runner


def make_proposer(config: SpeculativeConfig, target: DrafterTarget | None = None) -> Proposer:
    """The drafter of ``config`` (its method built: ``SpeculativeConfig.check_built``); a model
    drafter (``draft_model``, ``eagle3``, ``mtp``) is loaded here and checked against
    ``target``; the engine compiles its programs (``warmup``) once the runner has warmed up
    (an EAGLE-3 or MTP drafter's read the runner's KV cache)."""
    config.check_built()
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if target is None:
        raise ValueError(f"speculative_config method={config.method!r} needs the target model")
    if config.method == "mtp":
        return _mtp_proposer(config, target)
    assert config.model is not None  # SpeculativeConfig checks it
    if config.method == "draft_model":
        return _draft_model_proposer(config, target)
    if config.method == "eagle3":
        return _eagle3_proposer(config, target)
    raise AssertionError(f"no drafter for the built method {config.method!r}")


def _draft_model_proposer(config: SpeculativeConfig, target: DrafterTarget) -> Proposer:
    from jaxserve.engine.tokenizer import Tokenizer
    from jaxserve.runner import draft_model
    from jaxserve.runner.devices import resolve_drafter_quantization, resolve_dtype

    assert config.model is not None
    engine, runner = target.engine, target.runner
    draft_model.check_one_host(runner, config.method)
    dtype = resolve_dtype(engine)
    draft_config, weights, tp = draft_model.load_draft(
        config.model,
        target.model_config,
        target.tokenizer,
        Tokenizer(config.model),
        dtype,
        target_tp=None if runner is None else runner.tp,  # under TP: split on its mesh
        scheme=resolve_drafter_quantization(config.quantization, config.model),
    )
    proposer = draft_model.DraftModelProposer(
        draft_config,
        weights,
        engine,
        target.max_model_len,
        min(config.max_batch_size, engine.resolved_max_num_seqs),
        config.num_speculative_tokens,
        dtype,
        tp,
        runner,
    )
    _LOG.info("Speculative draft model %s: %s", config.model, proposer.describe())
    return proposer


def _eagle3_proposer(config: SpeculativeConfig, target: DrafterTarget) -> Proposer:
    import jax

    from jaxserve.runner import draft_model, eagle3_proposer
    from jaxserve.runner.devices import resolve_drafter_quantization, resolve_dtype

    assert config.model is not None and target.runner is not None
    engine, runner = target.engine, target.runner
    draft_model.check_one_host(runner, config.method)
    dtype = resolve_dtype(engine)
    if not isinstance(runner.weights.embed, jax.Array):  # still loading (warm-up overlaps it)
        runner.wait_for_weights()  # a head without embed_tokens shares the target's
    # Under TP the head is split on the runner's mesh, as the target's layers are.
    scheme = resolve_drafter_quantization(config.quantization, config.model)
    head_config, head, tp = eagle3_proposer.load_head(
        config.model, target.model_config, runner, dtype, scheme
    )
    proposer = eagle3_proposer.Eagle3Proposer(
        head_config,
        head,
        target.model_config,
        runner,
        engine,
        target.max_model_len,
        min(config.max_batch_size, engine.resolved_max_num_seqs),
        config.num_speculative_tokens,
        dtype,
        tp,
    )
    _LOG.info("Speculative EAGLE-3 head %s: %s", config.model, proposer.describe())
    return proposer


def _mtp_proposer(config: SpeculativeConfig, target: DrafterTarget) -> Proposer:
    import jax

    from jaxserve.models.loading.mtp_checkpoint import require_mtp_layers
    from jaxserve.runner import draft_model, mtp_proposer
    from jaxserve.runner.devices import resolve_dtype

    assert target.runner is not None
    engine, runner = target.engine, target.runner
    draft_model.check_one_host(runner, config.method)
    require_mtp_layers(engine.model_dir)  # no MTP layers: an error before waiting for the weights
    dtype = resolve_dtype(engine)
    if not isinstance(runner.weights.embed, jax.Array):  # still loading (warm-up overlaps it)
        runner.wait_for_weights()  # the layers share the target's embedding (and lm_head)
    # Under TP the layers are split on the runner's mesh, as the target's own layers are.
    layers, tp = mtp_proposer.load_layers(engine.model_dir, target.model_config, runner, dtype)
    proposer = mtp_proposer.MtpProposer(
        layers,
        target.model_config,
        runner,
        engine,
        target.max_model_len,
        min(config.max_batch_size, engine.resolved_max_num_seqs),
        config.num_speculative_tokens,
        dtype,
        tp,
    )
    _LOG.info("Speculative MTP: %s", proposer.describe())
    return proposer


def accepted_run(drafts: list[int], token_ids: np.ndarray, row: int) -> list[int]:
    """The tokens a verify step gives a sequence whose rows start at ``row``: the sampled
    tokens of its positions up to the first that differs from its draft (the accepted
    drafts, then the target's own token)."""
    sampled = token_ids[row : row + len(drafts) + 1]
    for j, token in enumerate(drafts):
        if int(sampled[j]) != token:
            return [int(t) for t in sampled[: j + 1]]
    return [int(t) for t in sampled]


@dataclasses.dataclass
class SpecDecodeStats:
    """vLLM's ``spec_decode_*`` counters, cumulative since start: drafts verified (one per
    sequence per step with drafted tokens), tokens drafted, drafts accepted, and accepted
    drafts by their position in the draft."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = dataclasses.field(default_factory=list)

    def add(self, num_drafted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_pos) < num_drafted:
            self.accepted_per_pos += [0] * (num_drafted - len(self.accepted_per_pos))
        for pos in range(accepted):
            self.accepted_per_pos[pos] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verify step gave a sequence, on average: 1 + accepted drafts per draft
        (vLLM's mean acceptance length); 1.0 before any draft."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def copy(self) -> SpecDecodeStats:
        return dataclasses.replace(self, accepted_per_pos=list(self.accepted_per_pos))
