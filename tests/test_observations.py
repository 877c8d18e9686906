"""observations.py: an environment's observation as tokens, by the model's own chat template.

Fixtures: tests/fixtures/hf/qwen2 (the Qwen2 parity fixture: a ChatML template that writes
a tool message as a `tool` turn) and tests/fixtures/templates/{qwen2.5, llama3.1} (tokenizer
files only, templates in the formats of Qwen2.5 and Llama 3.1: make_template_fixtures.py).
"""

import os

import pytest

from jaxgrpo import envs, observations
from jaxgrpo.model import chat, hf

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
FOLDERS = {"qwen2": os.path.join(FIXTURES, "hf", "qwen2"),
           "qwen2.5": os.path.join(FIXTURES, "templates", "qwen2.5"),
           "llama3.1": os.path.join(FIXTURES, "templates", "llama3.1")}
# What each model writes to call the calculator (its parser's format).
CALLS = {"qwen2": '<tool_call>\n{"name": "calculator", "arguments": {"expression": "123*456"}}'
                  '\n</tool_call>',
         "llama3.1": '{"name": "calculator", "parameters": {"expression": "123*456"}}'}
CALLS["qwen2.5"] = CALLS["qwen2"]
TOOLS = envs.tool_schemas("tools", '{"tools": "calculator"}')


def _load(name):
  return hf.hf_tokenizer(FOLDERS[name]), chat.ChatTemplate.from_folder(FOLDERS[name])


def _ids(tok, text):
  return tok.encode(text, add_bos=False)


@pytest.mark.parametrize("name", ["qwen2", "qwen2.5", "llama3.1"])
@pytest.mark.parametrize("ended", [True, False])
def test_an_observation_is_the_templates_difference_with_and_without_it(name, ended):
  tok, template = _load(name)
  renderer = observations.Renderer(tok, template, TOOLS, max_tokens=200)
  user = {"role": "user", "content": "What is 123*456?"}
  # The policy's turn: the call, ended by the end token, or (ended=False) stopped at the
  # call's end (a stop string), which the observation must then close.
  turn = _ids(tok, CALLS[name] + (tok.eos_token if ended else ""))
  tool = {"role": "tool", "content": "56088"}
  out = renderer.render([tool], turn)
  conversation = [user, {"role": "assistant", "content": CALLS[name]}]
  without = _ids(tok, template.render(conversation, add_generation_prompt=False, tools=TOOLS))
  with_ = _ids(tok, template.render(conversation + [tool], add_generation_prompt=True,
                                    tools=TOOLS))
  # The episode (prompt, the sampled turn, the observation) is exactly the template's
  # rendering of the conversation with the tool message and the next turn opened ...
  prompt = _ids(tok, template.render([user], tools=TOOLS))
  assert prompt + turn + out.ids == with_
  # ... so the observation ends with its difference from the rendering without it, and
  # what comes before that closes the assistant's turn as the template closes it (all of
  # the close when the turn stopped at </tool_call>, what follows the end token else).
  diff = with_[len(without):]
  close = out.ids[:len(out.ids) - len(diff)]
  assert out.ids[len(close):] == diff and prompt + turn + close == without
  assert len(close) == (1 if ended and name != "llama3.1" else 0 if ended else
                        len(_ids(tok, tok.eos_token + ("" if name == "llama3.1" else "\n"))))
  assert not out.cut and out.text == "56088"


def test_the_renderings_as_token_strings():
  # docs/environments.md shows these (the Qwen2 fixture and the two formats).
  shown = {}
  for name in FOLDERS:
    tok, template = _load(name)
    turn = _ids(tok, CALLS[name] + tok.eos_token)
    ids = observations.Renderer(tok, template, TOOLS, max_tokens=200).render(
        [envs.tool_message("56088")], turn).ids
    shown[name] = tok.hf.decode(ids, skip_special_tokens=False)
  assert shown == {
      "qwen2": "\n<|im_start|>tool\n56088<|im_end|>\n<|im_start|>assistant\n",
      "qwen2.5": "\n<|im_start|>user\n<tool_response>\n56088\n</tool_response><|im_end|>\n"
                 "<|im_start|>assistant\n",
      "llama3.1": "<|start_header_id|>ipython<|end_header_id|>\n\n56088<|eot_id|>"
                  "<|start_header_id|>assistant<|end_header_id|>\n\n"}


@pytest.mark.parametrize("name", ["qwen2", "qwen2.5", "llama3.1"])
@pytest.mark.parametrize("side", observations.SIDES)
def test_a_long_observation_is_cut_before_templating_and_keeps_its_framing(name, side):
  tok, template = _load(name)
  turn = _ids(tok, CALLS[name] + tok.eos_token)
  long_text = "0123456789" * 20
  framing = observations.Renderer(tok, template, TOOLS, max_tokens=200).framing()
  limit = 2 * framing + 30  # two messages framed, room for some of the text
  renderer = observations.Renderer(tok, template, TOOLS, max_tokens=limit, side=side)
  out = renderer.render([envs.tool_message(long_text), envs.tool_message("42")], turn)
  assert out.cut and len(out.ids) <= limit
  text = tok.hf.decode(out.ids, skip_special_tokens=False)
  # The framing is whole: the same as a rendering of the kept text, opened and closed as
  # the template writes them (it is that rendering, with the contents cut).
  first = _content(text, name, 0)
  assert _content(text, name, 1) == "42"  # the short message is kept whole
  assert 0 < len(first) < len(long_text)
  if side == "right":
    assert long_text.startswith(first)
  elif side == "left":
    assert long_text.endswith(first)
  else:
    assert long_text.startswith(first[:len(first) // 2]) and long_text.endswith(
        first[-(len(first) // 2):])
  whole = observations.Renderer(tok, template, TOOLS, max_tokens=400).render(
      [envs.tool_message(first), envs.tool_message("42")], turn)
  assert out.ids == whole.ids


def _content(text: str, name: str, k: int) -> str:
  """The k-th tool response's text in a rendered observation."""
  if name == "qwen2":
    return text.split("<|im_start|>tool\n")[k + 1].split("<|im_end|>")[0]
  if name == "qwen2.5":
    return text.split("<tool_response>\n")[k + 1].split("\n</tool_response>")[0]
  return text.split("ipython<|end_header_id|>\n\n")[k + 1].split("<|eot_id|>")[0]


def test_text_observations_are_cut_by_their_tokens_on_each_side():
  tok, _ = _load("qwen2")
  ids = _ids(tok, "abcdefghij")
  for side, kept in (("right", ids[:4]), ("left", ids[-4:]), ("middle", ids[:2] + ids[-2:])):
    out = observations.Renderer(tok, None, max_tokens=4, side=side).render("abcdefghij", [])
    assert out.ids == kept and out.cut
  assert observations.shares([3, 50, 40], 40) == [3, 19, 18]  # 3 whole, the rest in halves
  assert observations.shares([3, 5], 40) == [3, 5]


# Qwen3's way with reasoning (written for this test): an assistant turn after the last
# user message shows its <think> block, an empty one while it is the last message, and
# none once a message follows it unless it has reasoning.
QWEN3 = """{%- set ns = namespace(last_user=0) %}
{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}
{%- for m in messages %}
  {%- if m.role == 'assistant' %}
    {%- set content = m.content.split('</think>')[-1].lstrip('\\n') %}
    {%- set reasoning = m.content.split('</think>')[0].split('<think>')[-1].strip('\\n') if '</think>' in m.content else '' %}
    {%- if loop.index0 > ns.last_user and (loop.last or reasoning) %}
      {{- '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content + '<|im_end|>\\n' }}
    {%- else %}
      {{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}
    {%- endif %}
  {%- elif m.role == 'tool' %}
    {{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}
  {%- else %}
    {{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}
  {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""


def test_a_template_that_drops_an_empty_think_block_is_probed_with_reasoning():
  tok, _ = _load("qwen2")
  template = chat.ChatTemplate("qwen3-like", QWEN3, {})
  user = {"role": "user", "content": "2*3?"}
  written = "<think>\nmultiply\n</think>\n\n" + CALLS["qwen2"]
  turn = _ids(tok, written + "<|im_end|>")
  out = observations.Renderer(tok, template, max_tokens=200).render(
      [envs.tool_message("6")], turn)
  prompt = _ids(tok, template.render([user]))
  tool = envs.tool_message("6")
  assert prompt + turn + out.ids == _ids(tok, template.render(
      [user, {"role": "assistant", "content": written}, tool]))


def test_a_template_that_rewrites_earlier_turns_is_refused_naming_the_fix():
  tok, _ = _load("qwen2")
  # Numbers every turn by the count of messages: adding one renumbers all of them.
  template = chat.ChatTemplate("renumbering", "{% for m in messages %}[{{ messages|length }}]"
                               "{{ m.content }}{% endfor %}", {})
  renderer = observations.Renderer(tok, template, max_tokens=100)
  with pytest.raises(observations.ObservationError, match=(
      "renumbering: the chat template is not prefix-preserving: a conversation rendered "
      "with 'tool' messages after an assistant turn changes its tokens before them .*; an "
      "episode only appends, so use a template that renders earlier turns as they were")):
    renderer.render([envs.tool_message("6")], [])
  with pytest.raises(observations.ObservationError, match="run has no chat template"):
    observations.Renderer(tok, None, max_tokens=100).render([envs.tool_message("6")], [])


@pytest.mark.parametrize("bad, why", [
    ([], "a non-empty list"), (3, "observation is int"),
    ([{"role": "tool"}], "a dict with 'role' and 'content' strings"),
    ({"role": "tool", "content": 5}, "a dict with 'role' and 'content' strings")])
def test_observations_that_are_neither_text_nor_messages_are_refused(bad, why):
  with pytest.raises(observations.ObservationError, match=why):
    observations.messages_of(bad)
  with pytest.raises(ValueError, match="step's observation (message )?is"):
    envs.check_step((bad, None, False, {}))


def test_gemma_3_frames_a_user_observation_and_refuses_a_tool_role_in_one_line():
  # Gemma 3's template knows alternating user and model turns only: after a model turn that
  # ended with <end_of_turn>, a user message is "\n<start_of_turn>user\n...<end_of_turn>\n"
  # and the next model turn's opening; a tool message makes the template raise, which is
  # one ObservationError naming the roles (a one-line refusal at startup, not a traceback).
  folder = os.path.join(FIXTURES, "hf", "gemma3")
  tok, template = hf.hf_tokenizer(folder), chat.ChatTemplate.from_folder(folder)
  renderer = observations.Renderer(tok, template, max_tokens=64)
  turn = _ids(tok, "It is 56088.<end_of_turn>")
  ids = renderer.render({"role": "user", "content": "Check it."}, turn).ids
  assert tok.hf.decode(ids, skip_special_tokens=False) == (
      "\n<start_of_turn>user\nCheck it.<end_of_turn>\n<start_of_turn>model\n")
  with pytest.raises(observations.ObservationError,
                     match=r"Conversation roles must alternate.*cannot render \['tool'\]"):
    renderer.render([envs.tool_message("56088")], turn)
