"""Chat templates: a model folder's `chat_template` (tokenizer_config.json), rendered with
jinja2 the way transformers' `apply_chat_template` renders it, so instruct models see the
prompt format they were tuned on.

transformers compiles the template in an immutable sandbox with `trim_blocks` and
`lstrip_blocks`, adds a `tojson` filter and the globals `raise_exception` and
`strftime_now`, and passes the tokenizer's special tokens (`bos_token`, `eos_token`, ...) as
variables. The same is done here, with `tools` (a multi-turn environment's tool schemas);
`documents` and other extras are not supported. Where we deviate: `strftime_now` renders a
fixed date (`date`, the run's data.chat_template_date), not the clock's, so a prompt that
shows today's date (Llama 3.1's "Today Date") is the same on a resume or an evaluation on
another day.
"""

from __future__ import annotations

import datetime
import json
import os
from typing import Any, Sequence

import jinja2
from jinja2 import sandbox


class ChatTemplateError(ValueError):
  """A missing or broken chat template, naming the file."""


def _raise(message):
  raise jinja2.exceptions.TemplateError(message)


class ChatTemplate:
  """`render(messages, add_generation_prompt=True)` -> the prompt text."""

  def __init__(self, source: str, template: str, special_tokens: dict[str, Any],
               date: datetime.date | None = None):
    """date: what strftime_now renders (midnight of it); None: the clock's now, as
    transformers does."""
    self.source = source
    env = sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, separators=None, \
        sort_keys=False: json.dumps(x, indent=indent, ensure_ascii=ensure_ascii,
                                    separators=separators, sort_keys=sort_keys)
    env.globals["raise_exception"] = _raise
    now = (lambda: datetime.datetime.combine(date, datetime.time())) if date else \
        datetime.datetime.now
    env.globals["strftime_now"] = lambda fmt: now().strftime(fmt)
    # Whether the template reads the date at all (a run records it only then).
    self.reads_date = "strftime_now" in template
    try:
      self._template = env.from_string(template)
    except jinja2.exceptions.TemplateError as e:
      raise ChatTemplateError(f"{source}: chat_template does not compile ({e})") from None
    self._special = special_tokens
    # Whether the template reads `tools` at all (Qwen2.5's and Llama 3.1's do): a template
    # that does not cannot show a multi-turn environment's tools to the model.
    self.shows_tools = "tools" in template
    self.text = template

  @classmethod
  def from_folder(cls, folder: str, date: datetime.date | None = None) -> "ChatTemplate":
    path = os.path.join(folder, "tokenizer_config.json")
    try:
      with open(path) as f:
        settings = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
      raise ChatTemplateError(f"{path}: cannot read ({e})") from None
    template = settings.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
      template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if not template:
      raise ChatTemplateError(f"{path}: no chat_template")
    text = lambda v: v.get("content") if isinstance(v, dict) else v
    special = {k: text(v) for k, v in settings.items() if k.endswith("_token")}
    return cls(path, template, special, date)

  def render(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True,
             tools: list[dict] | None = None) -> str:
    """tools: function schemas (OpenAI's format) the template shows the model, as
    transformers passes `tools=`; None renders as without (the templates test `if tools`)."""
    extra = {} if tools is None else {"tools": tools}
    try:
      return self._template.render(messages=list(messages),
                                   add_generation_prompt=add_generation_prompt,
                                   **self._special, **extra)
    except jinja2.exceptions.TemplateError as e:
      raise ChatTemplateError(f"{self.source}: chat_template failed: {e}") from None
