"""Prompt templates as versioned resources: what an agent reads so APO (or a person) can change it.

A prompt lives in a ``Resources`` snapshot as a :class:`agl.types.PromptTemplate` under the prompt's
name (by convention the agent's name: ``resources.prompts["writer"]``). The change to an existing
agent is one line — read the prompt through :func:`prompt` instead of a constant::

    system_message = agl.prompt("writer", default=WRITER_SYSTEM)

Inside a rollout run by the :class:`agl.Runner`, :func:`prompt` resolves from the resources the
rollout was enqueued with (the runner sets them with :func:`resources_context`); outside one, or when
the snapshot has no prompt of that name, it returns ``default``. The first time a rollout reads a
prompt it records an ``agl.prompt`` span (name, content version, resources version, where it came
from, the text), so a trace says exactly which prompt version the agent ran with — and a baseline run
tells APO the agent's default prompts without the user copying them.

A prompt's version is its content hash (:func:`prompt_version`): the same text is the same version
in every run, and a rollout's ``resources_version`` pins the whole snapshot it used.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import string
from collections.abc import Iterator
from typing import Any

from agl import semconv
from agl.types import PromptTemplate, Resources

__all__ = [
    "placeholders",
    "prompt",
    "prompt_template",
    "prompt_version",
    "resources_context",
    "current_resources",
]

#: (resources of the running rollout, prompt names already recorded in its trace)
_CURRENT: contextvars.ContextVar[tuple[Resources | None, set[str]] | None] = contextvars.ContextVar(
    "agl_resources", default=None
)


def prompt_version(template: str | PromptTemplate) -> str:
    """The content version of a prompt: 12 hex digits of the SHA-256 of its text (and engine)."""
    if isinstance(template, PromptTemplate):
        text = template.template if template.engine == "f-string" else f"jinja\0{template.template}"
    else:
        text = str(template)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]


def placeholders(template: str) -> set[str]:
    """The ``{field}`` names of an f-string template; ``ValueError`` when it does not parse
    (a stray brace), which is how APO refuses rewrites that would break ``format``."""
    names = set()
    for _, field, _, _ in string.Formatter().parse(template):
        if field is not None:
            names.add(field.split(".")[0].split("[")[0])
    return names


@contextlib.contextmanager
def resources_context(resources: Resources | None) -> Iterator[None]:
    """Make ``resources`` what :func:`prompt` reads in this context (the runner wraps each rollout)."""
    token = _CURRENT.set((resources, set()))
    try:
        yield
    finally:
        try:
            _CURRENT.reset(token)
        except ValueError:  # exited in another context (a copied one); nothing to restore
            pass


def current_resources() -> Resources | None:
    """The resources snapshot of the rollout running now (None outside a runner's rollout)."""
    value = _CURRENT.get()
    return value[0] if value is not None else None


def prompt_template(name: str, resources: Resources | None = None) -> PromptTemplate | None:
    """The ``PromptTemplate`` called ``name`` in ``resources`` (default: the running rollout's)."""
    res = resources if resources is not None else current_resources()
    if res is None:
        return None
    item = res.items.get(name)
    return item if isinstance(item, PromptTemplate) else None


def prompt(
    name: str, /, *, default: str | None = None, resources: Resources | None = None, **values: Any
) -> str:
    """The text of prompt ``name`` for the running rollout, formatted with ``values`` when given.

    Resolution: ``resources`` (or the running rollout's snapshot) → ``default``. A name found nowhere
    with no default is a ``KeyError`` naming what was available. The first read of each name in a
    rollout records an ``agl.prompt`` span with its version.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"a prompt name must be a non-empty string, got {name!r}")
    res = resources if resources is not None else current_resources()
    template = prompt_template(name, res)
    source = "resources"
    if template is None:
        if default is None:
            known = sorted(res.prompts) if res is not None else []
            raise KeyError(
                f"no prompt {name!r} in the rollout's resources (has: {', '.join(known) or 'none'}) "
                "and no default= given"
            )
        template, source = PromptTemplate(template=default), "default"
    _record(name, template, source, res)
    return template.format(**values) if values else template.template


def _record(name: str, template: PromptTemplate, source: str, res: Resources | None) -> None:
    """One ``agl.prompt`` span per prompt name per rollout (only inside a rollout)."""
    from agl.tracing.provider import current_rollout, get_tracer

    state = _CURRENT.get()
    if state is None or current_rollout() is None:
        return
    seen = state[1]
    if name in seen:
        return
    seen.add(name)
    attrs: dict[str, Any] = {
        semconv.AGL_PROMPT_NAME: name,
        semconv.AGL_PROMPT_VERSION: prompt_version(template),
        semconv.AGL_PROMPT_SOURCE: source,
        semconv.AGL_PROMPT_TEMPLATE: template.template,
        semconv.AGL_PROMPT_ENGINE: template.engine,
    }
    if res is not None:
        attrs[semconv.AGL_RESOURCES_VERSION] = res.version
    get_tracer(__name__).start_span(semconv.SPAN_PROMPT, attributes=attrs).end()
