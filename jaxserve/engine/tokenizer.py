"""Tokenizer, chat template and incremental detokenization.

The tokenizer comes from the model directory through transformers' ``AutoTokenizer`` (the chat
template may live in ``tokenizer_config.json`` or ``chat_template.jinja``). Chat templates
render only in a sandboxed, immutable Jinja environment; requests cannot supply a template and
only allow-listed template keyword arguments pass through.
"""

from __future__ import annotations

import datetime
import functools
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

_LOG = logging.getLogger(__name__)

# Keyword arguments a request may pass to the chat template (everything else is a 400).
ALLOWED_TEMPLATE_KWARGS = frozenset({"enable_thinking", "thinking", "reasoning_effort"})


class TemplateError(ValueError):
    """The chat template could not render the given messages."""


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=8)
def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.filters["tojson"] = _tojson
    return env.from_string(source)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """``tojson`` as Hugging Face templates expect it (transformers' chat-template filter):
    keys in their order and no HTML escaping, unlike Jinja's own filter, so tools render as
    the model saw them in training."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def has_tokenizer_files(model_dir: str | os.PathLike[str]) -> bool:
    from pathlib import Path

    names = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
    return any((Path(model_dir) / name).is_file() for name in names)


def dummy_hf_tokenizer(vocab_size: int):
    """A word-level tokenizer with one token ``<t{i}>`` per id, for random-weight models that
    ship no tokenizer (``--load-format dummy`` with a config-only directory)."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<t{i}>": i for i in range(vocab_size)}
    rust = RustTokenizer(models.WordLevel(vocab, unk_token="<t0>"))
    rust.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=rust, unk_token="<t0>", eos_token="<t1>")


def load_tokenizer(config: Any, vocab_size: int) -> Tokenizer:
    """The tokenizer of an ``EngineConfig``'s model: a dummy one for dummy weights that ship
    none (``--load-format dummy`` with a config-only directory)."""
    if config.load_format == "dummy" and not has_tokenizer_files(config.tokenizer_dir):
        _LOG.warning(
            "%s has no tokenizer: using a dummy one (token <tN> per id)", config.tokenizer_dir
        )
        tokenizer = Tokenizer(None, dummy_vocab_size=vocab_size)
    else:
        tokenizer = Tokenizer(config.tokenizer_dir)
    if getattr(config, "chat_template", None):
        tokenizer.chat_template = read_chat_template(config.chat_template)
    return tokenizer


def read_chat_template(value: str) -> str:
    """``--chat-template``, as vLLM takes it: a Jinja file, or the template itself. Checked at
    start: a missing file or a template that does not parse is a ``ValueError`` naming it."""
    path = Path(value)
    looks_inline = "{{" in value or "{%" in value
    if not looks_inline and not path.is_file():
        raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")
    source = value if looks_inline else path.read_text()
    try:
        _compile_template(source)
    except jinja2.TemplateSyntaxError as exc:
        where = "the template" if looks_inline else str(path)
        raise ValueError(f"--chat-template: {where} does not parse: {exc}") from None
    return source


class Tokenizer:
    """A model's tokenizer: encode, decode, chat template, special tokens."""

    def __init__(self, model_dir: str | os.PathLike[str] | None, dummy_vocab_size: int = 0) -> None:
        if model_dir is None:
            self._hf = dummy_hf_tokenizer(dummy_vocab_size)
        else:
            from transformers import AutoTokenizer

            self._hf = AutoTokenizer.from_pretrained(str(model_dir))
        self.vocab_size: int = len(self._hf)
        self.eos_token_id: int | None = self._hf.eos_token_id
        self.bos_token_id: int | None = self._hf.bos_token_id
        self.chat_template: str | None = self._hf.chat_template

    @property
    def hf_tokenizer(self) -> Any:
        """The Hugging Face tokenizer underneath (the grammar engine reads its vocabulary)."""
        return self._hf

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        rust = getattr(self._hf, "_tokenizer", None)
        if rust is None:
            return self._hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        # NOTE: the Rust decode_batch releases the GIL while it runs (decode holds it): eight
        # /detokenize calls of 600,000 ids held a neighbour's request for 2.3 s on the H200.
        text = rust.decode_batch([list(token_ids)], skip_special_tokens=skip_special_tokens)[0]
        if self._hf.clean_up_tokenization_spaces:
            text = self._hf.clean_up_tokenization(text)
        return text

    def convert_ids_to_tokens(self, token_ids: Sequence[int]) -> list[str]:
        return self._hf.convert_ids_to_tokens(list(token_ids))

    def is_special(self, token_id: int) -> bool:
        return token_id in self._hf.all_special_ids

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render messages to the prompt text, in a sandbox."""
        if self.chat_template is None:
            raise TemplateError("this model has no chat template; use /v1/completions")
        unknown = set(template_kwargs) - ALLOWED_TEMPLATE_KWARGS
        if unknown:
            raise TemplateError(
                f"chat_template_kwargs {sorted(unknown)} are not allowed; "
                f"allowed: {sorted(ALLOWED_TEMPLATE_KWARGS)}"
            )
        special = self._hf.special_tokens_map
        try:
            return _compile_template(self.chat_template).render(
                messages=messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                bos_token=special.get("bos_token", ""),
                eos_token=special.get("eos_token", ""),
                **template_kwargs,
            )
        except jinja2.TemplateError as exc:
            raise TemplateError(f"chat template failed: {exc}") from exc

    def detokenizer(self, prompt_ids: Sequence[int], skip_special_tokens: bool = True):
        return IncrementalDetokenizer(self, prompt_ids, skip_special_tokens)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, never half a UTF-8 character.

    Uses the Rust ``tokenizers.decoders.DecodeStream`` (a few microseconds a token), primed
    with the last prompt tokens so leading spaces decode as they would in context. Slow
    (Python) tokenizers fall back to decoding a short window each time.
    """

    CONTEXT_TOKENS = 5

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        context = [int(t) for t in prompt_ids[-self.CONTEXT_TOKENS :]]
        self._rust = getattr(tokenizer._hf, "_tokenizer", None)
        self._stream = None
        if self._rust is not None:
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        self.token_ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self.text = ""

    def add(self, new_ids: Sequence[int]) -> str:
        """Append tokens; return the newly completed text (possibly empty)."""
        if self._stream is not None and self._rust is not None:
            delta = ""
            for token in new_ids:
                chunk = self._stream.step(self._rust, int(token))
                if chunk:
                    delta += chunk
            self.text += delta
            return delta
        self.token_ids.extend(new_ids)
        decode = self._tokenizer.decode
        prefix = decode(self.token_ids[self._prefix_offset : self._read_offset], self._skip_special)
        full = decode(self.token_ids[self._prefix_offset :], self._skip_special)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        self.text += delta
        return delta


def end_of_sequence_ids(
    model_config: Any, model_dir: Path, tokenizer: Tokenizer
) -> tuple[int, ...]:
    """Every id that ends a sequence: the config's, generation_config.json's (instruct models
    stop on e.g. <|im_end|>) and the tokenizer's."""
    eos = set(model_config.eos_token_ids)
    path = model_dir / "generation_config.json"
    if path.is_file():
        extra = json.loads(path.read_text()).get("eos_token_id")
        if extra is not None:
            eos.update(extra if isinstance(extra, list) else (extra,))
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    return tuple(sorted(eos))
