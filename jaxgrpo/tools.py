"""The built-in `tools` environment: plain Python functions the policy calls the way instruct
models call tools (Qwen2.5 / Qwen3 and the Hermes format they share).

    config.env.name = "tools"
    config.env.kwargs = '{"tools": "calculator"}'      # comma-separated tool names

A tool is a function with a type hint on every argument and a docstring, registered with
`@jaxgrpo.tools.tool` (in a file named in config.user_modules) or named as
`module:function`. Its JSON schema (name, the docstring's first paragraph, typed
arguments) goes to the chat template as `tools=`, so the model sees the tools in the
system prompt its template writes for them. The model calls one as

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "123*456"}}
    </tool_call>

and every call in a turn is run; the results come back as the next observation,
`<tool_response>` blocks in a user turn (ChatML: `chat='chatml'`, the default) or bare
(`chat='none'`, for a model without a chat template). A turn without a call ends the
episode (its text is the final answer the configured rewards score). A call that is not
JSON, names no known tool or has wrong arguments, and a tool that raises, get an error text
as their response (counted in `tool_errors`), never a crash. A turn's calls are capped by
`max_calls_per_turn` (default 4); responses longer than `env.max_observation_tokens` are
truncated by the episode runner.

`calculator` (built in) evaluates arithmetic exactly with a parser of its own (Python's ast
restricted to numbers, + - * / // % ** and parentheses, with bounds on size): never `eval`.
"""

from __future__ import annotations

import ast
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
_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


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


# ------------------------------------------------------------------ the environment
# (registered as `tools` by envs.py, which imports this module)

class Tools:
  """Runs the tool calls of each turn; a turn without one ends the episode (module doc)."""

  def __init__(self, tools: str = "calculator", chat: str = "chatml",
               max_calls_per_turn: int = 4, stop_at_call_end: bool = False):
    """tools: comma-separated names; chat: 'chatml' (responses in a user turn, as Qwen's
    template writes them) or 'none' (bare <tool_response> blocks); stop_at_call_end: end a
    turn at `</tool_call>` too (a stop string), not only at the end token."""
    if chat not in ("chatml", "none"):
      raise ToolError(f"tools: chat={chat!r}; allowed: chatml, none")
    self.tools = dict(resolve(n.strip()) for n in str(tools).split(",") if n.strip())
    if not self.tools:
      raise ToolError("tools: no tool named; allowed: a comma-separated list of "
                      f"{', '.join(sorted(_TOOLS))} (or module:function)")
    self.chat, self.max_calls = chat, int(max_calls_per_turn)
    self.stop_strings = ("</tool_call>",) if stop_at_call_end else ()

  def tool_schemas(self) -> list[dict]:
    return [schema(fn, name) for name, fn in self.tools.items()]

  def reset(self, row, seed):
    del row, seed
    return None

  def run_call(self, body: str) -> tuple[str, bool]:
    """One call's response text and whether it is an error."""
    try:
      call = json.loads(body)
    except json.JSONDecodeError as e:
      return f"Error: the tool call is not JSON ({e.msg})", True
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
      return 'Error: a tool call is {"name": ..., "arguments": {...}}', True
    fn = self.tools.get(call["name"])
    if fn is None:
      return f"Error: unknown tool {call['name']!r}; tools: {', '.join(self.tools)}", True
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
      try:
        arguments = json.loads(arguments)
      except json.JSONDecodeError:
        pass
    if not isinstance(arguments, dict):
      return "Error: the arguments are not a JSON object", True
    try:
      inspect.signature(fn).bind(**arguments)
    except TypeError as e:
      return f"Error: {call['name']}: {e}", True
    try:
      return str(fn(**arguments)), False
    except Exception as e:  # pylint: disable=broad-except
      return f"Error: {call['name']}: {e}", True

  def step(self, state, text: str):
    bodies = _CALL.findall(text)
    # An opened call that was never closed (the turn ran out of tokens or ended early).
    unclosed = text.count("<tool_call>") > len(bodies)
    if not bodies and not unclosed:
      return None, None, True, {"tool_calls": 0, "tool_errors": 0}
    responses, errors = [], 0
    for body in bodies[:self.max_calls]:
      response, failed = self.run_call(body.strip())
      responses.append(response)
      errors += failed
    if unclosed:
      responses.append("Error: a <tool_call> without </tool_call>")
      errors += 1
    if len(bodies) > self.max_calls:
      responses.append(f"Error: at most {self.max_calls} tool calls a turn; the rest were not run")
      errors += 1
    return (self.observation(text, responses), None, False,
            {"tool_calls": len(bodies) + unclosed, "tool_errors": errors})

  def observation(self, text: str, responses: list[str]) -> str:
    if self.chat == "none":
      return "".join(f"<tool_response>{r}</tool_response>" for r in responses)
    body = "\n".join(f"<tool_response>\n{r}\n</tool_response>" for r in responses)
    # The model's turn is closed by its end token; a turn stopped at </tool_call> is closed
    # here. Then the responses as a user turn, and the assistant's turn opened again.
    close = "" if text.endswith("<|im_end|>") else "<|im_end|>"
    return f"{close}\n<|im_start|>user\n{body}<|im_end|>\n<|im_start|>assistant\n"

