"""The built-in `tools` environment: plain Python functions the policy calls the way instruct
models call tools, in the model family's own format.

    config.env.name = "tools"
    config.env.kwargs = '{"tools": "calculator"}'      # comma-separated tool names

A tool is a function with a type hint on every argument and a docstring, registered with
`@jaxgrpo.tools.tool` (in a file named in config.user_modules) or named as
`module:function`. Its JSON schema (name, the docstring's first paragraph, typed
arguments) goes to the chat template as `tools=`, so the model sees the tools in the
system prompt its template writes for them.

How a turn's calls are read is the model family's format, a parser (`parser` in
env.kwargs): 'hermes' (the default: Qwen2.5, Qwen3, Hermes)

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "123*456"}}
    </tool_call>

or 'llama3_json' (Llama 3.1-3.3: the turn is `{"name": ..., "parameters": {...}}`), or one
of the user's own (`@jaxgrpo.tools.parser`). Every call in a turn is run; the results come
back as the next observation: one `tool` message per call (`chat='template'`, the default),
which the episode runner renders with the model's own chat template (observations.py: a
Qwen template writes `<tool_response>` blocks in a user turn, Llama 3's an `ipython` turn),
or the parser's bare text (`chat='none'`, for a model without a chat template). A turn
without a call ends the episode (its text is the final answer the configured rewards
score). A call that is not JSON, names no known tool or has wrong arguments, and a tool
that raises, get an error text as their response (counted in `tool_errors`), never a crash.
A turn runs at most `max_calls_per_turn` tools (default 4); the environment's text is cut to
`env.max_observation_tokens` by the episode runner, before templating.

`calculator` (built in) evaluates arithmetic exactly with a parser of its own (Python's ast
restricted to numbers, + - * / // % ** and parentheses, with bounds on size): never `eval`.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import json
import operator
import re
import typing
from typing import Callable

_TOOLS: dict[str, Callable] = {}
_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array",
               dict: "object"}


class ToolError(ValueError):
  """A tool that cannot be offered (no type hints, unknown name), in one line."""


def tool(fn: Callable | None = None, *, name: str | None = None):
  """Registers a function as a tool: `@tool` or `@tool(name="other")`."""
  def wrap(f):
    schema(f, name)  # checked now: a tool without hints fails at import, naming it
    _TOOLS[name or f.__name__] = f
    return f
  return wrap(fn) if fn is not None else wrap


def schema(fn: Callable, name: str | None = None) -> dict:
  """The function's tool schema as chat templates take it (OpenAI's function format)."""
  name = name or fn.__name__
  try:
    hints = typing.get_type_hints(fn)
  except Exception as e:  # pylint: disable=broad-except
    raise ToolError(f"tool {name!r}: its type hints do not resolve ({e})") from None
  properties, required = {}, []
  for arg, param in inspect.signature(fn).parameters.items():
    if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
      raise ToolError(f"tool {name!r}: *{arg} / **{arg} cannot be described to the model")
    hint = hints.get(arg)
    if hint is None:
      raise ToolError(f"tool {name!r}: argument {arg!r} has no type hint; allowed: "
                      f"{', '.join(t.__name__ for t in _JSON_TYPES)}")
    base = typing.get_origin(hint) or hint
    if base not in _JSON_TYPES:
      raise ToolError(f"tool {name!r}: argument {arg!r} is {hint!r}; allowed: "
                      f"{', '.join(t.__name__ for t in _JSON_TYPES)}")
    properties[arg] = {"type": _JSON_TYPES[base]}
    if param.default is param.empty:
      required.append(arg)
  doc = inspect.getdoc(fn)
  if not doc:
    raise ToolError(f"tool {name!r}: no docstring (the model reads it to know what the tool "
                    "does)")
  return {"type": "function", "function": {
      "name": name, "description": doc.split("\n\n")[0].replace("\n", " "),
      "parameters": {"type": "object", "properties": properties, "required": required}}}


def resolve(name: str) -> tuple[str, Callable]:
  """A tool by its registered name or as `module:function`."""
  if name in _TOOLS:
    return name, _TOOLS[name]
  if ":" in name:
    module, _, attr = name.partition(":")
    try:
      fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
      raise ToolError(f"tool {name!r}: cannot import ({e})") from None
    schema(fn, attr)
    return attr, fn
  raise ToolError(f"unknown tool {name!r}; registered: {', '.join(sorted(_TOOLS))} (or "
                  "module:function)")


# ------------------------------------------------------------------ the calculator tool

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_DIGITS, _MAX_EXPONENT, _MAX_CHARS = 100, 64, 200


def arithmetic(expression: str):
  """Evaluates + - * / // % ** and parentheses over int and float literals; ValueError
  for anything else or numbers past the bounds (no names, calls or attributes exist here)."""
  if len(expression) > _MAX_CHARS:
    raise ValueError(f"expression longer than {_MAX_CHARS} characters")
  try:
    tree = ast.parse(expression.strip(), mode="eval")
  except SyntaxError:
    raise ValueError(f"not an arithmetic expression: {expression!r}") from None

  def value(node):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
      return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
      return _UNARY[type(node.op)](value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
      left, right = value(node.left), value(node.right)
      if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
        raise ValueError(f"exponent {right} is larger than {_MAX_EXPONENT}")
      out = _BINARY[type(node.op)](left, right)
      if isinstance(out, int) and abs(out) >= 10 ** _MAX_DIGITS:
        raise ValueError(f"a number with more than {_MAX_DIGITS} digits")
      return out
    raise ValueError(f"not allowed in arithmetic: {ast.unparse(node)!r}")

  try:
    return value(tree.body)
  except ZeroDivisionError:
    raise ValueError("division by zero") from None


@tool
def calculator(expression: str) -> str:
  """Evaluates an arithmetic expression exactly: numbers, + - * / // % ** and parentheses.

  Returns the value as text."""
  out = arithmetic(expression)
  if isinstance(out, float) and out.is_integer():
    out = int(out)
  return str(out)


# ------------------------------------------------------------------ tool-call parsers

@dataclasses.dataclass
class Call:
  """One tool call read from a turn: a name and its arguments, or why it cannot be read
  (`error`: the response the model gets instead of a result)."""

  name: str | None = None
  arguments: dict | None = None
  error: str | None = None


_PARSERS: dict[str, type] = {}


def parser(name: str):
  """Class decorator: `@parser("name")` makes a tool-call format `env.kwargs` can name as
  `{"parser": "name"}`. The class (made without arguments) has `parse(text) -> list[Call]`
  (the calls of one assistant turn, [] for a final answer), and optionally `stop_strings`
  (what ends a turn right after a call, for `stop_at_call_end`), `bare(responses) -> str`
  (the observation for a model without a chat template) and `template_mark` (a string the
  chat templates of its model family contain: start-up warns when the model's lacks it)."""
  def wrap(cls):
    if not callable(getattr(cls, "parse", None)):
      raise ToolError(f"tool-call parser {name!r} ({cls.__qualname__}) has no parse(text) method")
    _PARSERS[name] = cls
    return cls
  return wrap


def parsers() -> list[str]:
  return sorted(_PARSERS)


def from_json(obj, arguments_key: str = "arguments") -> Call:
  """A call from a decoded JSON object {"name": ..., arguments_key: {...}}."""
  if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
    return Call(error=f'Error: a tool call is {{"name": ..., "{arguments_key}": {{...}}}}')
  arguments = obj.get(arguments_key, obj.get("arguments", {}))
  if isinstance(arguments, str):  # some models write the arguments as a JSON string
    try:
      arguments = json.loads(arguments)
    except json.JSONDecodeError:
      pass
  if not isinstance(arguments, dict):
    return Call(obj["name"], error="Error: the arguments are not a JSON object")
  return Call(obj["name"], arguments)


def _json(body: str, arguments_key: str = "arguments") -> Call:
  try:
    return from_json(json.loads(body), arguments_key)
  except json.JSONDecodeError as e:
    return Call(error=f"Error: the tool call is not JSON ({e.msg})")


@parser("hermes")
class Hermes:
  """Qwen2.5, Qwen3, QwQ and Hermes models: `<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>` blocks anywhere in the turn, any number; without a chat template, each
  response comes back as a `<tool_response>...</tool_response>` block."""

  stop_strings = ("</tool_call>",)
  template_mark = "<tool_call>"  # what a chat template made for this format mentions
  _CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
  
  def parse(self, text: str) -> list[Call]:
    bodies = self._CALL.findall(text)
    calls = [_json(body.strip()) for body in bodies]
    # An opened call that was never closed (the turn ran out of tokens or ended early).
    if text.count("<tool_call>") > len(bodies):
      calls.append(Call(error="Error: a <tool_call> without </tool_call>"))
    return calls

  def bare(self, responses: list[str]) -> str:
    return "".join(f"<tool_response>{r}</tool_response>" for r in responses)


@parser("llama3_json")
class Llama3Json:
  """Llama 3.1-3.3 with custom tools (JSON tool calling): the whole turn is
  `{"name": ..., "parameters": {...}}` (optionally after `<|python_tag|>`; several separated
  by `;`), closed by `<|eot_id|>` or `<|eom_id|>`; a turn that does not start with `{` is a
  final answer. Responses go back as `ipython` (tool) messages; without a chat template,
  as their bare text."""

  stop_strings = ()
  template_mark = "ipython"
  _ENDS = ("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>")

  def parse(self, text: str) -> list[Call]:
    body = text.strip()
    for end in self._ENDS:
      body = body.removesuffix(end).rstrip()
    body = body.removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
      return []
    calls, decoder, at = [], json.JSONDecoder(), 0
    while at < len(body):
      try:
        obj, at = decoder.raw_decode(body, at)
      except json.JSONDecodeError as e:
        return calls + [Call(error=f"Error: the tool call is not JSON ({e.msg})")]
      calls.append(from_json(obj, "parameters"))
      while at < len(body) and body[at] in "; \n\t":
        at += 1
    return calls

  def bare(self, responses: list[str]) -> str:
    return "\n".join(responses)


# ------------------------------------------------------------------ the environment
# (registered as `tools` by envs.py, which imports this module)

CHATS = ("template", "none")


class Tools:
  """Runs the tool calls of each turn; a turn without one ends the episode (module doc)."""

  # The observation is chat messages: loading checks the model's chat template renders them
  # (envs.py: uses_chat_template), unless chat='none' (set per instance below).
  uses_chat_template = True

  def __init__(self, tools: str = "calculator", chat: str = "template",
               parser: str = "hermes", max_calls_per_turn: int = 4,
               stop_at_call_end: bool = False):
    """tools: comma-separated names; chat: 'template' (each response a `tool` message,
    rendered by the model's chat template) or 'none' (the parser's bare text, for a model
    without one); parser: the tool-call format (`parsers()`); stop_at_call_end: end a turn
    at the parser's call end (Hermes: `</tool_call>`) too, not only at the end token."""
    if chat not in CHATS:
      raise ToolError(f"tools: chat={chat!r}; allowed: {', '.join(CHATS)}")
    if parser not in _PARSERS:
      raise ToolError(f"tools: parser={parser!r}; allowed: {', '.join(parsers())} (or one "
                      "registered with @jaxgrpo.tools.parser in config.user_modules)")
    self.tools = dict(resolve(n.strip()) for n in str(tools).split(",") if n.strip())
    if not self.tools:
      raise ToolError("tools: no tool named; allowed: a comma-separated list of "
                      f"{', '.join(sorted(_TOOLS))} (or module:function)")
    self.chat, self.max_calls = chat, int(max_calls_per_turn)
    self.uses_chat_template = chat == "template"
    self.parser, self.parser_name = _PARSERS[parser](), parser
    self.stop_strings = (tuple(getattr(self.parser, "stop_strings", ()))
                         if stop_at_call_end else ())

  def tool_schemas(self) -> list[dict]:
    return [schema(fn, name) for name, fn in self.tools.items()]

  def reset(self, row, seed):
    del row, seed
    return None

  def run_call(self, call: Call) -> tuple[str, bool]:
    """One call's response text and whether it is an error."""
    if call.error is not None:
      return call.error, True
    fn = self.tools.get(call.name)
    if fn is None:
      return f"Error: unknown tool {call.name!r}; tools: {', '.join(self.tools)}", True
    try:
      inspect.signature(fn).bind(**call.arguments)
    except TypeError as e:
      return f"Error: {call.name}: {e}", True
    try:
      return str(fn(**call.arguments)), False
    except Exception as e:  # pylint: disable=broad-except
      return f"Error: {call.name}: {e}", True

  def step(self, state, text: str):
    calls = self.parser.parse(text)
    if not calls:
      return None, None, True, {"tool_calls": 0, "tool_errors": 0}
    # The cap bounds the tools run a turn; a call that cannot be read runs nothing, and its
    # error is always answered (the model learns what it wrote wrong).
    responses, errors, run = [], 0, 0
    for call in calls:
      if call.error is None and run == self.max_calls:
        continue
      run += call.error is None
      response, failed = self.run_call(call)
      responses.append(response)
      errors += failed
    if run < sum(c.error is None for c in calls):
      responses.append(f"Error: at most {self.max_calls} tool calls a turn; the rest were not run")
      errors += 1
    return (self.observation(responses), None, False,
            {"tool_calls": len(calls), "tool_errors": errors})

  def observation(self, responses: list[str]):
    """Tool messages, which the episode runner renders with the model's chat template
    (observations.py); chat='none': the parser's bare text."""
    if self.chat == "none":
      return self.parser.bare(responses)
    return [{"role": "tool", "content": r} for r in responses]
