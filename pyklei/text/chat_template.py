"""Chat templates: the model's own Jinja template, rendered the way Hugging Face renders it.

A GGUF file carries its chat template as ``tokenizer.chat_template`` (a Jinja2 string).
:func:`render` gives the same text as transformers' ``apply_chat_template(..., tokenize=False)``:

* a sandbox, ``jinja2.sandbox.ImmutableSandboxedEnvironment`` (templates are untrusted code:
  no attribute access to internals, no mutation of lists/dicts), with ``trim_blocks=True`` and
  ``lstrip_blocks=True`` and the ``loopcontrols`` extension (``{% break %}``, ``{% continue %}``);
* ``{% generation %}...{% endgeneration %}`` blocks are accepted and render their body;
* the variables ``messages``, ``add_generation_prompt``, ``tools``, ``documents``, the special
  tokens given by the caller (``bos_token``, ``eos_token``, ...) and any extra keyword;
* the functions ``raise_exception(msg)`` and ``strftime_now(fmt)``, and a ``tojson`` filter with
  Hugging Face's semantics (``json.dumps`` with ``ensure_ascii=False``, no HTML escaping, keyword
  arguments ``indent``, ``separators``, ``sort_keys``, ``ensure_ascii``); ``namespace`` refuses
  attribute names starting with ``_``.

No template
    :func:`render` raises :class:`MissingChatTemplateError` when the template is ``None`` or
    empty, unless the caller asks for a fallback with ``fallback="chatml"``: pyklei then uses
    :data:`CHATML_TEMPLATE` and emits a ``UserWarning`` saying so. The fallback is never silent
    and never the default, since a wrong template degrades a model without any visible error.

Errors from the template itself (``raise_exception``, syntax errors, sandbox violations) are
raised as :class:`ChatTemplateError`.

Content apart from the template
    :class:`ContentMarks` marks the special-token texts in a chat's content before the template
    runs, so that ``Tokenizer.apply_chat_template(tokenize=True)`` can tell them from the
    tokens the template writes and encode them as ordinary text.
"""
from __future__ import annotations

import json
import re
import secrets
import warnings
from datetime import datetime
from functools import lru_cache
from typing import Any, Mapping, Sequence

__all__ = ["render", "compile_template", "check_template_kwargs", "ChatTemplateError", "ContentMarks",
           "MissingChatTemplateError", "CHATML_TEMPLATE"]

#: The documented fallback: ChatML (``<|im_start|>role\ncontent<|im_end|>\n``), no system prompt
#: of its own, ``<|im_start|>assistant\n`` as the generation prompt.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ChatTemplateError(ValueError):
    """The chat template failed: syntax error, sandbox violation or ``raise_exception``."""


class MissingChatTemplateError(ChatTemplateError):
    """The model file has no chat template (``tokenizer.chat_template``)."""


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes <, >, &, ' for HTML and takes only `indent`; chat templates
    # expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise_exception(message: str):
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=32)
def _environment():
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(jinja2.ext.Extension):
        """``{% generation %}body{% endgeneration %}`` renders ``body`` (transformers uses the
        tag to find assistant tokens; rendering is unchanged)."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class SafeNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):  # noqa: N805 -- same signature trick as jinja2.utils.Namespace
            self, rest = args[0], args[1:]
            for name in dict(*rest, **kwargs):
                SafeNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, *rest, **kwargs)

        def __setitem__(self, name, value):
            SafeNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols, GenerationBlock])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = SafeNamespace
    return env


@lru_cache(maxsize=64)
def compile_template(template: str):
    """The compiled Jinja template (cached by its text)."""
    import jinja2

    try:
        return _environment().from_string(template)
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"chat template does not compile: {e}") from e


def _plain(value: Any) -> Any:
    """A deep copy made of plain JSON-like types, so the template sees no foreign objects."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value] if isinstance(value, list) else tuple(_plain(v) for v in value)
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        return _plain(value.item())
    return str(value)


def _check_messages(messages) -> None:
    """Each message a dict with a string role and string content (content may be absent or
    None only beside tool_calls, as in the OpenAI and Hugging Face formats): a template given
    None would fail on a string concatenation deep inside Jinja, far from the mistake."""
    if isinstance(messages, (Mapping, str, bytes)) or not isinstance(messages, Sequence):
        raise TypeError("messages must be a list of dicts with 'role' and 'content'")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise TypeError(f"message {i} must be a dict with 'role' and 'content', got {m!r}")
        if not isinstance(m.get("role"), str) or not m.get("role"):
            raise ValueError(f"message {i} has no 'role' string (e.g. 'user'), got {m.get('role')!r}")
        content = m.get("content")
        if not isinstance(content, str) and not (content is None and m.get("tool_calls")):
            raise ValueError(f"message {i} ({m['role']}): 'content' must be a string, got {content!r}")


# Names a caller's template keywords may not set: the renderer's own (the conversation, the
# tools, the special tokens of the file).
_RESERVED = frozenset({"messages", "add_generation_prompt", "tools", "documents", "bos_token",
                       "eos_token", "template", "fallback"})


def check_template_kwargs(kwargs) -> dict:
    """A caller's extra template variables (OpenAI-compatible servers' ``chat_template_kwargs``,
    e.g. ``{"enable_thinking": false}`` for Qwen3), checked where a request enters: a JSON
    object of identifier keys, none of the renderer's own names. Returns a plain copy."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping):
        raise TypeError(f"chat_template_kwargs must be an object of template variables, got {kwargs!r}")
    for k in kwargs:
        if not isinstance(k, str) or not k.isidentifier():
            raise ValueError(f"chat_template_kwargs: {k!r} is not a template variable name")
        if k in _RESERVED:
            raise ValueError(f"chat_template_kwargs: {k!r} is set by pyklei itself; pass it "
                             f"through its own argument")
    return _plain(dict(kwargs))


def render(template: str | None, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, *,
           bos_token: str = "", eos_token: str = "", tools: Sequence[Mapping] | None = None,
           documents: Sequence[Mapping] | None = None, fallback: str | None = None, **kwargs: Any) -> str:
    """Render ``messages`` (dicts with ``role`` and ``content``) with a chat template.

    ``template`` is the model's ``tokenizer.chat_template``. When it is missing, this raises
    :class:`MissingChatTemplateError`, unless ``fallback="chatml"``, which renders with
    :data:`CHATML_TEMPLATE` and warns. Extra keywords are passed to the template (for example
    ``unk_token``, ``pad_token``, ``date_string``, ``enable_thinking``).
    """
    import jinja2

    _check_messages(messages)
    if not template:
        if fallback is None:
            raise MissingChatTemplateError(
                "this model has no chat template (tokenizer.chat_template); pass a template, or "
                "fallback='chatml' to use ChatML knowingly")
        if fallback != "chatml":
            raise ValueError(f"unknown chat template fallback {fallback!r} (only 'chatml')")
        warnings.warn("the model has no chat template; using the ChatML fallback", UserWarning, stacklevel=2)
        template = CHATML_TEMPLATE
    compiled = compile_template(template)
    try:
        return compiled.render(messages=_plain(list(messages)), add_generation_prompt=add_generation_prompt,
                               tools=_plain(tools), documents=_plain(documents), bos_token=bos_token,
                               eos_token=eos_token, **_plain(kwargs))
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(str(e)) from e


class ContentMarks:
    """Marks around the special-token texts in a chat's content, put there before the template
    runs, so that the rendered text tells them from the tokens the template writes itself.
    A mark is a private-use character, a nonce drawn for this call and another private-use
    character: content cannot forge one, and a template that cuts or escapes one is caught
    (a template that escaped a mark would leave the text between them in the template's own
    text, where its special tokens would be parsed)."""

    def __init__(self, special_re):
        self.special_re = special_re
        self.nonce = f"{secrets.randbelow(10 ** 16):016d}"   # digits: no filter changes their case
        self.open = f"\ue000{self.nonce}\ue001"
        self.close = f"\ue002{self.nonce}\ue003"
        self.count = 0             # special-token texts marked

    def wrap(self, value):
        """A copy of ``value`` (strings, dicts, lists, tuples) with every special-token text in
        its strings, dict keys included, between marks; other values as they are."""
        if isinstance(value, str):
            return self.special_re.sub(self._mark, value)
        if isinstance(value, Mapping):
            return {self.wrap(k): self.wrap(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.wrap(v) for v in value]
        if isinstance(value, tuple):
            return tuple(self.wrap(v) for v in value)
        return value

    def _mark(self, m) -> str:
        self.count += 1
        return self.open + m.group() + self.close

    def segments(self, text: str) -> list[tuple[str, bool]] | None:
        """The rendered text as (text, is_content) segments with the marks taken out, or None
        when a mark was cut or altered (its nonce is left outside a whole pair)."""
        out, pos = [], 0
        span = re.compile(re.escape(self.open) + "(.*?)" + re.escape(self.close), re.S)
        for m in span.finditer(text):
            out.append((text[pos:m.start()], False))
            out.append((m.group(1), True))
            pos = m.end()
        out.append((text[pos:], False))
        if any(self.nonce in t for t, _ in out):
            return None
        return out
