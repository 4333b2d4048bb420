"""What the module swaps of fused_norms.py and fused_mlp.py share: whether a module class is known
to compute what a reference class does (its forward, to the character, is the reference's), and
the swap of every such module of a model for its replacement."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import torch


def swap_modules(
    model: torch.nn.Module,
    wanted: Callable[[torch.nn.Module], bool],
    replacement: Callable[[torch.nn.Module], torch.nn.Module],
) -> int:
    """Put ``replacement(child)`` in place of every module of ``model`` that ``wanted`` accepts;
    returns how many. They are all found before any is replaced, so no replacement is visited."""
    swaps = [
        (parent, name, child) for parent in model.modules() for name, child in parent.named_children() if wanted(child)
    ]
    for parent, name, child in swaps:
        setattr(parent, name, replacement(child))
    return len(swaps)


@functools.cache
def forward_is(cls: type, reference: type[torch.nn.Module], suffix: str, *methods: str) -> bool:
    """Whether ``cls`` is a module class whose name ends in ``suffix`` and whose forward's source
    (and that of each of ``methods`` it calls) is ``reference``'s, comment lines aside: the many
    architectures that copy Llama's modules keep their code to the character, so the same text
    computes the same."""
    if not issubclass(cls, torch.nn.Module) or not cls.__name__.endswith(suffix):
        return False
    try:
        return all(_code(getattr(cls, name)) == _code(getattr(reference, name)) for name in ("forward", *methods))
    except (AttributeError, OSError, TypeError):  # no source to compare: not known to be the reference's
        return False


def _code(function: Callable) -> list[str]:
    """A function's source lines, without those that hold only a comment (a copy names its model)."""
    return [line for line in inspect.getsource(function).splitlines() if not line.strip().startswith("#")]
