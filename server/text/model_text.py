"""What routes ask of the served model's tokenizer: tokenize, detokenize, think tags,
structured-output grammars.

:class:`ModelText` is a part of :class:`~server.engine.engine.Engine` (which
derives from it): these calls run on the routes' worker threads, never on the
engine thread, and touch no engine state beyond the loaded model, the
output processor (token bytes) and the compiled-grammar cache.
"""

from __future__ import annotations

from typing import Any

from server.protocol import ChatPrompt, ThinkTags
from server.refusal import Rejected, Why
from server.settings import Settings
from server.settings_sections import parse_bytes
from server.text.prompts import RequestRejected, out_of_vocab, tokenize_prompt, vocab_size
from server.text.think_tags import opens_thinking, think_tags


def grammar_cache(settings: Settings) -> Any:
    """The engine's compiled-grammar cache, bounded by ``limits.grammar_cache_bytes``.

    Imported here, not at the top: server.text.schemas loads llguidance.
    """
    from server.text.schemas import GrammarCache

    return GrammarCache(parse_bytes(settings.limits.grammar_cache_bytes))



class ModelText:
    """Text calls on the served model (see the module docstring).

    Expects ``loaded`` (the LoadedModel, None before the load), ``output`` (its
    OutputProcessor) and ``grammars`` (a :func:`grammar_cache`) on the instance.
    """

    loaded: Any
    output: Any
    grammars: Any

    def compile_constraint(self, response_format: dict[str, Any] | None = None,
                           schema: dict[str, Any] | None = None, *, name: str = "schema",
                           param: str = "response_format",
                           calls: dict[str, Any] | None = None) -> Any:
        """The grammar for a ``response_format``, or for a JSON ``schema`` (tool calls).

        ``calls`` (the schema of one call to the tools the model may call) lets a
        JSON ``response_format`` be answered with tagged tool calls instead.

        Blocks for the first schema of a model (~0.4 s: llguidance's token
        index); call it from a worker thread. Cached, thread-safe
        (:mod:`server.text.schemas`).

        Returns:
            The compiled constraint for ``SamplingParams.constraint``, or None
            when the output is free text.

        Raises:
            ConstraintError: The format or schema cannot be enforced (a 400).
        """
        from server.text.schemas import (
            compile_json_schema,
            compile_response_format,
        )

        tokenizer = self.loaded.tokenizer
        if schema is not None:
            return compile_json_schema(schema, tokenizer, name=name, param=param,
                                       cache=self.grammars)
        return compile_response_format(response_format, tokenizer, calls, cache=self.grammars)

    def thinking(self, template_kwargs: tuple[tuple[str, Any], ...] = ()
                 ) -> tuple[ThinkTags, bool] | None:
        """The served model's think tags, and whether a generation prompt rendered with
        ``template_kwargs`` leaves a block open (the answer starts inside it); None for a
        model without think tags. May render the template once: a worker thread's."""
        tokenizer = self.loaded.tokenizer if self.loaded is not None else None
        tags = think_tags(tokenizer) if tokenizer is not None else None
        if tags is None:
            return None
        return tags, opens_thinking(tokenizer, tags, template_kwargs)

    def tokenize(self, prompt: str | ChatPrompt, add_special: bool = True,
                 parse_special: bool = True) -> list[int] | Rejected:
        """The ids a generation request with ``prompt`` would run on, or why not.

        ``add_special=False`` or ``parse_special=False`` (text only) tokenize as
        llama.cpp's ``/tokenize`` options say, no longer as a generation would.
        Blocks (a long prompt takes about a second): call it from a worker thread.
        """
        try:
            return tokenize_prompt(self.loaded, prompt, add_special, parse_special)
        except RequestRejected as exc:
            return exc.event

    def token_pieces(self, ids: list[int]) -> list[bytes]:
        """Each id's own bytes (a token may hold part of a UTF-8 character)."""
        return [self.output.token_bytes(token) for token in ids]

    def token_strs(self, ids: list[int]) -> list[str]:
        """Each id as the vocabulary writes it (``Ġworld``), as vLLM's ``token_strs``."""
        return list(self.loaded.tokenizer.convert_ids_to_tokens(ids))

    def detokenize(self, ids: list[int]) -> str | Rejected:
        """The text ``ids`` decode to, or a refusal naming an id outside the vocabulary."""
        bad = out_of_vocab(self.loaded, ids)
        if bad is not None:
            return Rejected(Why.OUT_OF_VOCAB, {"token": bad, "vocab": vocab_size(self.loaded)},
                            "tokens")
        return self.loaded.tokenizer.decode(ids)
