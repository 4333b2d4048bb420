"""A chat template checked as transformers renders it: in its sandbox, with loop controls
(``{% break %}``) and its ``{% generation %}`` block, so that a template the model server would
take is never refused up front (`serve --chat-template`, ``spec.model.chatTemplate``)."""

from __future__ import annotations

import jinja2
import jinja2.ext
import jinja2.sandbox

# What tells the text of a template from a file's name, as vLLM's --chat-template tells them
JINJA_CHARS = "{}\n"


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
    if not any(c in text for c in JINJA_CHARS):
        return "it holds no Jinja ({, } or a line break): as --chat-template it would be read as a file name"
    try:
        _ENVIRONMENT.parse(text)
    except jinja2.TemplateSyntaxError as exc:
        return f"line {exc.lineno}: {exc.message}"
    return None
