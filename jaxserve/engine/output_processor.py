"""OutputProcessor: sampled tokens -> text, logprobs, stop checks and ``RequestOutput`` deltas.

The engine core hands it each token read back from the runner (``process_token``); it appends
the token to its sequence, detokenizes incrementally, collects logprobs, decides whether the
sequence has finished (EOS, stop token ids, stop strings on the text, max_tokens,
max_model_len) and builds the deltas the clients receive (``make_output``). It makes every
stop decision: ``finish_reason`` and ``stop_reason`` have no other writer (the engine reports
a complete grammar, a failure or an abort through ``complete_grammar``, ``fail`` and
``abort``). It owns the per-sequence output state (text, what was sent, logprobs), created by
``add_request`` and freed by ``free``.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from jaxserve.engine.outputs import CompletionOutput, Logprob, RequestOutput
from jaxserve.engine.request import Request, Sequence
from jaxserve.engine.tokenizer import Tokenizer
from jaxserve.runner.step import RunnerOutput


@dataclasses.dataclass
class _SeqOutput:
    detokenizer: Any  # IncrementalDetokenizer; None for a pooling request (no text out)
    text: str = ""
    num_text_sent: int = 0  # characters of `text` already streamed
    num_tokens_sent: int = 0
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0


class OutputProcessor:
    def __init__(
        self, tokenizer: Tokenizer, eos_token_ids: tuple[int, ...], max_model_len: int
    ) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self._seqs: dict[str, _SeqOutput] = {}  # seq_id -> its output state

    def add_request(self, request: Request) -> None:
        params = request.params
        for seq in request.seqs:
            # NOTE: a pooling request decodes no token: no detokenizer, whose start was three
            # quarters of queuing an embedding (16 us of 22 here; 10,000 texts at a time).
            detokenizer = None
            if request.pooling is None:
                detokenizer = self.tokenizer.detokenizer(
                    request.prompt_token_ids, params.skip_special_tokens
                )
            self._seqs[seq.seq_id] = _SeqOutput(
                detokenizer=detokenizer,
                logprobs=[] if params.logprobs is not None else None,
            )

    def free(self, request: Request) -> None:
        for seq in request.seqs:
            self._seqs.pop(seq.seq_id, None)

    # -- one token -------------------------------------------------------------------------

    def process_token(self, seq: Sequence, result: RunnerOutput, row: int) -> None:
        """Append the token sampled for ``seq`` (row ``row`` of ``result``); sets
        ``seq.finish_reason`` when it ends the sequence."""
        token = int(result.token_ids[row])
        params = seq.params
        state = self._seqs[seq.seq_id]
        seq.append_token(token)
        if result.logprobs is not None:
            state.cumulative_logprob += float(result.logprobs[row])
            if state.logprobs is not None:
                state.logprobs.append(self._token_logprobs(token, result, row, params.logprobs))
        num_out = seq.num_resolved_outputs
        is_stop_id = token in params.stop_token_id_set
        is_stop_token = is_stop_id or (not params.ignore_eos and token in self.eos_token_ids)
        if is_stop_token and num_out >= params.min_tokens:
            seq.finish_reason = "stop"
            seq.stop_reason = token if is_stop_id else None
            return  # the stop token's text is not part of the output
        state.text += state.detokenizer.add([token])
        if params.stop and num_out >= params.min_tokens and self._check_stop_strings(seq, state):
            return
        assert params.max_tokens is not None  # filled in by check_request
        if num_out >= params.max_tokens or seq.num_prompt_tokens + num_out >= self.max_model_len:
            seq.finish_reason = "length"

    def complete_grammar(self, seq: Sequence) -> None:
        """The sequence's grammar is complete (nothing more may follow): it stops, unless its
        token already ended it."""
        if not seq.is_finished:
            seq.finish_reason = "stop"

    def finish_prompt(self, seq: Sequence) -> None:
        """A pooling sequence's last prompt chunk has run: it ends (nothing is generated)."""
        seq.finish_reason, seq.stop_reason = "stop", None

    def fail(self, seq: Sequence, error: str) -> None:
        """The sequence failed (on the device, or while its output was processed)."""
        seq.finish_reason, seq.stop_reason = "error", error

    def abort(self, seq: Sequence) -> None:
        seq.finish_reason, seq.stop_reason = "abort", None

    def _token_logprobs(
        self, token: int, result: RunnerOutput, row: int, num_top: int | None
    ) -> dict[int, Logprob]:
        """The chosen token with its rank, then the top ``num_top`` alternatives."""
        assert result.logprobs is not None and result.ranks is not None
        assert result.top_ids is not None and result.top_logprobs is not None
        entry = {token: Logprob(float(result.logprobs[row]), int(result.ranks[row]))}
        top = zip(result.top_ids[row, :num_top], result.top_logprobs[row, :num_top], strict=True)
        for tid, lp in top:
            entry.setdefault(int(tid), Logprob(float(lp), None))
        rank = 1
        for tid in list(entry):
            if entry[tid].rank is None:
                entry[tid].rank = rank
            rank += 1
        for tid, value in entry.items():
            value.decoded_token = self.tokenizer.decode([tid], skip_special_tokens=False)
        return entry

    @staticmethod
    def _check_stop_strings(seq: Sequence, state: _SeqOutput) -> bool:
        params = seq.params
        longest = max(len(s) for s in params.stop)
        # Only the tail can hold a new match: the last token's text plus a stop's length.
        window_start = max(0, state.num_text_sent - longest)
        best: tuple[int, str] | None = None
        for stop in params.stop:
            pos = state.text.find(stop, window_start)
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, stop)
        if best is None:
            return False
        pos, stop = best
        end = pos + len(stop) if params.include_stop_str_in_output else pos
        state.text = state.text[:end]
        seq.finish_reason, seq.stop_reason = "stop", stop
        return True

    def add_prompt_logprobs(self, seq: Sequence, start: int, arrays: tuple) -> None:
        request = seq.request
        if request.prompt_logprobs is None:
            request.prompt_logprobs = [None]
        lp, ranks, top_ids, top_lp = arrays
        k = seq.params.prompt_logprobs or 0
        for j in range(len(lp)):
            token = request.prompt_token_ids[start + j + 1]
            entry = {token: Logprob(float(lp[j]), int(ranks[j]))}
            for r, (tid, v) in enumerate(zip(top_ids[j, :k], top_lp[j, :k], strict=True), start=1):
                entry.setdefault(int(tid), Logprob(float(v), r))
            for tid, value in entry.items():
                value.decoded_token = self.tokenizer.decode([tid], skip_special_tokens=False)
            request.prompt_logprobs.append(entry)

    # -- deltas ----------------------------------------------------------------------------

    def make_output(self, request: Request, seqs: list[Sequence]) -> RequestOutput:
        """What ``seqs`` produced since their last output (all samples, ranked, for best_of)."""
        params = request.params
        finished = request.is_finished
        chosen = seqs
        best_of = request.returns_best_of
        if best_of:
            ranked = sorted(
                request.seqs, key=lambda s: self._seqs[s.seq_id].cumulative_logprob, reverse=True
            )
            chosen = ranked[: params.n]
        completions = [
            self._completion(seq, out_index if best_of else seq.index)
            for out_index, seq in enumerate(chosen)
        ]
        prompt_logprobs = None
        if request.prompt_logprobs is not None and not request.prompt_logprobs_sent:
            if len(request.prompt_logprobs) == len(request.prompt_token_ids):
                prompt_logprobs = list(request.prompt_logprobs)
                request.prompt_logprobs_sent = True
        if finished and request.metrics is not None:
            request.metrics.finished_time = time.time()
        error = None
        if finished and any(s.finish_reason == "error" for s in request.seqs):
            error = next(str(s.stop_reason) for s in request.seqs if s.finish_reason == "error")
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=completions,
            finished=finished,
            prompt_logprobs=prompt_logprobs,
            num_cached_tokens=request.num_cached_tokens,
            metrics=request.metrics,
            error=error,
        )

    def _completion(self, seq: Sequence, index: int) -> CompletionOutput:
        params = seq.params
        state = self._seqs[seq.seq_id]
        finished, resolved = seq.is_finished, seq.num_resolved_outputs
        if finished:
            text_end = len(state.text)
        elif params.stop and not params.include_stop_str_in_output:
            hold = max(len(s) for s in params.stop) - 1  # a stop string may be starting
            text_end = max(state.num_text_sent, len(state.text) - hold)
        else:
            text_end = len(state.text)
        delta_text = state.text[state.num_text_sent : text_end]
        new_tokens = seq.output_token_ids[state.num_tokens_sent : resolved]
        new_logprobs = None
        if state.logprobs is not None:
            new_logprobs = state.logprobs[state.num_tokens_sent :]
        state.num_text_sent = text_end
        state.num_tokens_sent = resolved
        return CompletionOutput(
            index=index,
            text=delta_text,
            token_ids=new_tokens,
            cumulative_logprob=state.cumulative_logprob if params.logprobs is not None else None,
            logprobs=new_logprobs,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        )
