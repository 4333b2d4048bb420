"""A chat template checked as transformers renders it: in its sandbox, with loop controls
(``{% break %}``) and its ``{% generation %}`` block, so that a template the model server would
take is never refused up front (`serve --chat-template`, ``spec.model.chatTemplate``)."""

from __future__ import annotations

import jinja2
import jinja2.ext
import jinja2.sandbox


def holds_jinja(text: str) -> bool:
    """Whether ``text`` is a template's text rather than a file's name, as vLLM's --chat-template
    tells them apart: it holds ``{``, ``}`` or a line break."""
    return any(c in text for c in "{}\n")


class _GenerationBlock(jinja2.ext.Extension):
    """transformers' ``{% generation %}...{% endgeneration %}`` (it marks the assistant's
    tokens for training masks): for parsing, a plain block."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


_ENVIRONMENT = jinja2.sandbox.ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
)


def template_problem(text: str) -> str | None:
    """Why ``text`` is no chat template transformers could render, or None."""
    if not holds_jinja(text):
        return "it holds no Jinja ({, } or a line break): as --chat-template it would be read as a file name"
    try:
        _ENVIRONMENT.parse(text)
    except jinja2.TemplateSyntaxError as exc:
        return f"line {exc.lineno}: {exc.message}"
    return None
