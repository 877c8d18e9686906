"""tools.py: the built-in `tools` environment, its tool schemas and the calculator."""

import pytest

from jaxgrpo import envs, tools


def calculator_call(expression):
  return ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "'
          + expression + '"}}\n</tool_call><|im_end|>')


def test_a_turn_with_a_call_gets_the_result_as_a_tool_message():
  env = tools.Tools("calculator")
  observation, reward, done, info = env.step(None, calculator_call("123*456"))
  # A tool message: the episode runner renders it with the model's own chat template
  # (tests/test_observations.py), never ChatML written here.
  assert observation == [{"role": "tool", "content": "56088"}]
  assert (reward, done, info) == (None, False, {"tool_calls": 1, "tool_errors": 0})
  # Without a chat template: the parser's bare blocks.
  assert tools.Tools("calculator", chat="none").step(None, calculator_call("7*6"))[0] == (
      "<tool_response>42</tool_response>")
  assert envs.uses_chat_template("tools", "") and not envs.uses_chat_template(
      "tools", '{"chat": "none"}')


def test_llama3_json_calls_are_the_whole_turn():
  env = tools.Tools("calculator", parser="llama3_json")
  call = '{"name": "calculator", "parameters": {"expression": "6*7"}}'
  assert env.step(None, call + "<|eot_id|>") == (
      [{"role": "tool", "content": "42"}], None, False, {"tool_calls": 1, "tool_errors": 0})
  # After <|python_tag|>, ended by <|eom_id|>, two calls separated by ';'.
  observation, _, _, info = env.step(None, f"<|python_tag|>{call}; {call}<|eom_id|>")
  assert [m["content"] for m in observation] == ["42", "42"] and info["tool_calls"] == 2
  # A turn that does not start with '{' is the final answer; a broken one is an error.
  assert env.step(None, "The answer is 42.<|eot_id|>")[2] is True
  observation, _, done, info = env.step(None, '{"name": "calculator", "parame<|eot_id|>')
  assert "not JSON" in observation[0]["content"] and not done and info["tool_errors"] == 1
  # Hermes blocks are not Llama calls (and the reverse).
  assert env.step(None, calculator_call("1+1"))[2] is True
  assert tools.Tools().step(None, call + "<|eot_id|>")[2] is True


def test_a_users_parser_is_registered_by_name():
  @tools.parser("_test_bracket")
  class Bracket:  # [[calculator: 2+3]]
    stop_strings = ("]]",)

    def parse(self, text):
      return [tools.Call("calculator", {"expression": e}) for e in
              __import__("re").findall(r"\[\[calculator: (.*?)\]\]", text)]

    def bare(self, responses):
      return " ".join(f"=> {r}" for r in responses)

  env = tools.Tools(parser="_test_bracket", chat="none", stop_at_call_end=True)
  assert env.step(None, "[[calculator: 2+3]]") == ("=> 5", None, False,
                                                   {"tool_calls": 1, "tool_errors": 0})
  assert env.stop_strings == ("]]",) and "_test_bracket" in tools.parsers()
  with pytest.raises(tools.ToolError, match="parser='nope'; allowed: _test_bracket, hermes, "
                     "llama3_json"):
    tools.Tools(parser="nope")
  with pytest.raises(tools.ToolError, match="has no parse"):
    tools.parser("_bad")(type("NoParse", (), {}))


def test_a_turn_without_a_call_ends_the_episode():
  assert tools.Tools().step(None, "The answer is \\boxed{5}<|im_end|>") == (
      None, None, True, {"tool_calls": 0, "tool_errors": 0})


@pytest.mark.parametrize("body, error", [
    ("{not json}", "Error: the tool call is not JSON"),
    ('{"name": "search", "arguments": {}}', "Error: unknown tool 'search'; tools: calculator"),
    ('{"name": "calculator", "arguments": {"expr": "1"}}',
     "Error: calculator: missing a required argument: 'expression'"),
    ('{"name": "calculator", "arguments": {"expression": "__import__(\'os\')"}}',
     "Error: calculator: not allowed in arithmetic"),
    ('{"name": "calculator", "arguments": {"expression": "1/0"}}',
     "Error: calculator: division by zero"),
    ('["calculator"]', 'Error: a tool call is {"name": ..., "arguments": {...}}'),
])
def test_malformed_calls_get_an_error_response_not_a_crash(body, error):
  observation, _, done, info = tools.Tools(chat="none").step(
      None, f"<tool_call>{body}</tool_call>")
  assert error in observation and not done
  assert info == {"tool_calls": 1, "tool_errors": 1}


def test_an_unclosed_call_and_too_many_calls_are_errors():
  env = tools.Tools(max_calls_per_turn=1, chat="none")
  observation, _, _, info = env.step(None, calculator_call("1+1") + "<tool_call>{")
  assert "2" in observation and "without </tool_call>" in observation
  assert info == {"tool_calls": 2, "tool_errors": 1}
  observation, _, _, info = env.step(None, calculator_call("1+1") * 2)
  assert "at most 1 tool calls a turn" in observation and info["tool_errors"] == 1


def test_the_calculator_is_exact_and_refuses_everything_but_arithmetic():
  assert tools.calculator("123456789 * 987654321") == "121932631112635269"
  assert tools.calculator("(2 + 3) ** 2 - 7 // 2") == "22"
  assert tools.calculator("1 / 4") == "0.25" and tools.calculator("6 / 3") == "2"
  for bad in ("x + 1", "open('f')", "(1).real", "[1, 2]", "2 ** 1000", "9" * 300):
    with pytest.raises(ValueError):
      tools.arithmetic(bad)


def test_schemas_come_from_type_hints_and_docstrings():
  def add(a: int, b: float = 1.0, note: str = "") -> float:
    """Adds two numbers.

    More text the model does not need."""
    return a + b
  assert tools.schema(add) == {"type": "function", "function": {
      "name": "add", "description": "Adds two numbers.",
      "parameters": {"type": "object", "required": ["a"], "properties": {
          "a": {"type": "integer"}, "b": {"type": "number"}, "note": {"type": "string"}}}}}

  def untyped(a, b: int):
    """No hint on a."""
  with pytest.raises(tools.ToolError, match="tool 'untyped': argument 'a' has no type hint"):
    tools.tool(untyped)

  def undocumented(a: int):
    pass
  with pytest.raises(tools.ToolError, match="no docstring"):
    tools.schema(undocumented)


def test_tools_by_module_and_name_and_the_environment_registry():
  env = envs.instance("tools", '{"tools": "jaxgrpo.tools:calculator", "chat": "none"}')
  assert list(env.tools) == ["calculator"]
  assert envs.tool_schemas("tools", '{"tools": "calculator"}')[0]["function"]["name"] == (
      "calculator")
  with pytest.raises(tools.ToolError, match="unknown tool 'nope'"):
    tools.Tools("nope")
  with pytest.raises(tools.ToolError, match="chat='html'; allowed: template, none"):
    tools.Tools(chat="html")
  assert envs.stop_strings("tools", '{"stop_at_call_end": true}') == ("</tool_call>",)


def test_the_chat_template_shows_the_tools_schemas():
  # A ChatML template with Qwen2.5's tools block (shortened): the prompt lists each schema
  # as JSON in the system turn, as transformers' apply_chat_template(tools=...) renders it.
  from jaxgrpo import data  # pylint: disable=g-import-not-at-top
  from jaxgrpo.model import chat  # pylint: disable=g-import-not-at-top
  template = ("{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}\n"
              "{{ t | tojson }}{% endfor %}\n</tools><|im_end|>\n{% endif %}"
              "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
              "{% endfor %}<|im_start|>assistant\n")
  schemas = envs.tool_schemas("tools", '{"tools": "calculator"}')
  prompt = data.ChatPrompt("{question}", chat.ChatTemplate("test", template, {}),
                           tools=schemas)({"question": "2*3?"})
  # (trim_blocks, as transformers renders: no newline after a block tag)
  assert prompt.startswith('<|im_start|>system\n<tools>{"type": "function", "function": '
                           '{"name": "calculator", "description": "Evaluates')
  assert "</tools><|im_end|>\n<|im_start|>user\n2*3?<|im_end|>\n" in prompt
  assert chat.ChatTemplate("test", template, {}).shows_tools
