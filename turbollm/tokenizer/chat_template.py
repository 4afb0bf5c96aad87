"""Render a model's chat template: a list of messages in, the prompt text out.

Chat templates are Jinja2 programs shipped with the model (``tokenizer.chat_template`` in a GGUF,
``chat_template`` in a Hugging Face ``tokenizer_config.json``). They are untrusted code, so they
run in Jinja2's `ImmutableSandboxedEnvironment`, set up the way transformers does it
(``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson`` that does not
escape HTML, and the globals ``raise_exception`` and ``strftime_now``), so a template renders
here exactly as it does there.

A GGUF without a template gets one from `FALLBACK_TEMPLATES` when its architecture has a
well-known format (the Gemma family); otherwise `resolve_chat_template` raises.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any, Iterable, Mapping

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from turbollm.errors import InvalidRequestError, ModelFormatError


class ChatTemplateError(InvalidRequestError):
    """The messages cannot be rendered: the model has no template, or its template rejected them."""


# Gemma's turn format, written for models whose GGUF has no template. Roles are "user" and
# "model"; Gemma has no system role, so a system message is folded into the first user turn,
# separated by a blank line (a lone system message becomes a user turn). Content is trimmed;
# a list of parts renders its text parts.
GEMMA_TEMPLATE = """\
{{- bos_token -}}
{%- set ns = namespace(system='') -%}
{%- if messages and messages[0]['role'] == 'system' -%}
  {%- set ns.system = messages[0]['content'] if messages[0]['content'] is string
      else messages[0]['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('\n') -%}
  {%- set turns = messages[1:] or [{'role': 'user', 'content': ''}] -%}
{%- else -%}
  {%- set turns = messages -%}
{%- endif -%}
{%- for message in turns -%}
  {%- if (message['role'] == 'user') != (loop.index0 is even) -%}
    {{- raise_exception('Gemma conversations must alternate user and assistant turns, starting with user') -}}
  {%- endif -%}
  {%- set content = message['content'] if message['content'] is string
      else message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('') -%}
  {%- if loop.first and ns.system -%}
    {%- set content = ns.system | trim + '\n\n' + content | trim -%}
  {%- endif -%}
  {{- '<start_of_turn>' + ('model' if message['role'] == 'assistant' else 'user') + '\n' -}}
  {{- content | trim + '<end_of_turn>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<start_of_turn>model\n' -}}
{%- endif -%}
"""

# general.architecture -> template, for GGUF files that ship none.
FALLBACK_TEMPLATES: dict[str, str] = {
    "gemma": GEMMA_TEMPLATE,
    "gemma2": GEMMA_TEMPLATE,
    "gemma3": GEMMA_TEMPLATE,
}


def resolve_chat_template(own: str | None, architecture: str | None) -> str:
    """The template to use: the model's `own`, else the fallback for `architecture`; raises if neither."""
    if own:
        return own
    if architecture in FALLBACK_TEMPLATES:
        return FALLBACK_TEMPLATES[architecture]
    raise ChatTemplateError(
        f"this model has no chat template (none in its files, and no built-in one for architecture "
        f"{architecture!r}; built-in: {', '.join(sorted(FALLBACK_TEMPLATES))}); "
        "send a plain completion prompt instead, or pass a template explicitly"
    )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML; chat templates want plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=32)
def compile_chat_template(template: str) -> jinja2.Template:
    """Compile `template` in the sandbox (cached); a syntax error raises ModelFormatError."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ModelFormatError(f"the chat template does not compile (line {e.lineno}): {e.message}") from None


def _plain_messages(messages: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as plain dicts, keys whose value is None dropped (`content=None` breaks many templates)."""
    out = []
    for message in messages:
        if hasattr(message, "model_dump"):  # pydantic models, e.g. a parsed API request
            message = message.model_dump()
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"a chat message must be a mapping with 'role' and 'content', got {message!r}")
        out.append({k: v for k, v in message.items() if v is not None})
    return out


def render_chat_template(template: str, messages: Iterable[Mapping[str, Any]], *,
                         add_generation_prompt: bool = True, special_tokens: Mapping[str, str | None] | None = None,
                         tools: list[dict] | None = None, documents: list[dict] | None = None,
                         **kwargs: Any) -> str:
    """Render `template` for `messages`.

    `special_tokens` maps names such as ``bos_token`` / ``eos_token`` to their text (None values
    are left undefined); `tools`, `documents` and any other keyword arguments are passed to the
    template as variables, keyword arguments taking precedence. A message the template refuses
    (``raise_exception``) or a render failure raises ChatTemplateError.
    """
    compiled = compile_chat_template(template)
    variables = {k: v for k, v in (special_tokens or {}).items() if v is not None}
    variables.update(kwargs)
    try:
        return compiled.render(messages=_plain_messages(messages), tools=tools, documents=documents,
                               add_generation_prompt=add_generation_prompt, **variables)
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"the chat template rejected the messages: {e}") from None
    except (TypeError, KeyError, IndexError, AttributeError, ValueError) as e:
        raise ChatTemplateError(f"the chat template failed on these messages: {type(e).__name__}: {e}") from None
