"""An environment's observation as tokens of its episode: text appended as it is, or chat
messages rendered by the model's own chat template.

An observation is what `step` returns between two assistant turns (envs.py):

  text      a str: tokenized alone and appended, as the environment wrote it (a model
            without a chat template, or an environment that writes its own framing);
  messages  a dict {"role": ..., "content": str} or a list of them, e.g. the tools
            environment's {"role": "tool", "content": "56088"}: rendered by the chat template
            the prompts were rendered with, so the model reads tool output in the format it
            was tuned on (Qwen: `<tool_response>` blocks in a user turn; Llama 3: an
            `ipython` turn).

Messages are rendered as verl's tool agent loop and TRL render tool responses: by the
token difference between the template's rendering of a conversation with the messages
(and the next assistant turn opened: add_generation_prompt) and without them. The
conversation is a probe, [user, assistant]: what comes after an assistant turn does not
depend on what was said before it in any template we know, and the probe is checked to be
prefix-preserving (the tokens without the messages are a prefix of the tokens with them).
A template that renders an assistant turn differently once a message follows it (Qwen3's
drops the empty `<think>` block of its last turn) is probed again with an assistant turn
that reasons (`<think>...</think>`, as the policy's turns do); one that is prefix-preserving
for neither cannot continue an episode and is refused (one line at start-up for an
environment that declares `uses_chat_template`, else the episode fails).

Before the difference comes the template's close of the assistant turn that the policy's
sampled turn lacks: the text that follows an assistant message's content in the template
(`<|im_end|>\\n` for Qwen, `<|eot_id|>` for Llama 3), less its first token when the turn
ended with that token (the sampler's end token), whole when the turn ended elsewhere (at a
stop string such as `</tool_call>`).

Truncation comes before templating: `env.max_observation_tokens` bounds everything an
observation appends (framing included, the width the turn programs were compiled for), and
what must go is cut from the environment's text, never from the framing: the messages'
contents share the room left (each keeps at most an equal share of it, the shorter ones
whole), each cut on `env.observation_truncation_side` ('right' keeps its start, 'left' its
end, 'middle' both ends; as Hugging Face tokenizers name their truncation sides). A cut is
counted (observation_truncated_fraction). A text observation is cut by its tokens.
"""

from __future__ import annotations

import dataclasses

SIDES = ("right", "left", "middle")
_MARK = "jaxgrpo-probe"  # the probe's assistant content: found in the rendering by rfind
# The probe's assistant turns, tried in order (module doc): plain, then reasoning.
_ASSISTANT_TURNS = (_MARK, f"<think>\nprobe\n</think>\n\n{_MARK}")
_PROBE_USER = {"role": "user", "content": "probe"}


class ObservationError(ValueError):
  """An observation that cannot become tokens (bad messages, a template that does not
  continue a conversation), in one line."""


@dataclasses.dataclass
class Rendered:
  ids: list[int]     # what the episode appends
  cut: bool          # some of the environment's text was cut
  text: str          # the environment's text (every message's content), for the <unk> check


def messages_of(observation) -> list[dict] | None:
  """The observation's messages, None for text; ObservationError for anything else."""
  if observation is None or isinstance(observation, str):
    return None
  messages = [observation] if isinstance(observation, dict) else observation
  if not isinstance(messages, list) or not messages:
    raise ObservationError(f"observation is {type(observation).__name__}; allowed: a str, a "
                           "message {'role': ..., 'content': str} or a non-empty list of them")
  for m in messages:
    if not (isinstance(m, dict) and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)):
      raise ObservationError(f"observation message is {m!r:.80}; allowed: a dict with "
                             "'role' and 'content' strings")
  return messages


def cut_ids(ids: list[int], keep: int, side: str) -> list[int]:
  """`keep` of `ids`, cut on `side` (module doc)."""
  if len(ids) <= keep:
    return list(ids)
  if keep <= 0:
    return []
  if side == "right":
    return ids[:keep]
  if side == "left":
    return ids[len(ids) - keep:]
  head = (keep + 1) // 2
  return ids[:head] + ids[len(ids) - (keep - head):]


def shares(lengths: list[int], room: int) -> list[int]:
  """How many tokens each content keeps of `room`: the shortest first, each at most an
  equal share of what is left (so a short one is kept whole, the long ones share the rest)."""
  keep, left = [0] * len(lengths), max(room, 0)
  order = sorted(range(len(lengths)), key=lengths.__getitem__)
  for k, i in enumerate(order):
    keep[i] = min(lengths[i], left // (len(order) - k))
    left -= keep[i]
  return keep


class Renderer:
  """Observations -> token ids for one run: its tokenizer, its chat template (None: the
  prompts are plain text, and only text observations can be appended), the tools its
  prompts show, and the limit."""

  def __init__(self, tokenizer, chat=None, tools: list[dict] | None = None, *,
               max_tokens: int, side: str = "right"):
    if side not in SIDES:
      raise ObservationError(f"truncation side {side!r}; allowed: {', '.join(SIDES)}")
    self.tokenizer, self.chat, self.tools = tokenizer, chat, tools
    self.max_tokens, self.side = max_tokens, side
    self._assistant: str | None = None  # the probe's assistant turn that works (found once)
    self._without_cache: dict[str, tuple[list[int], list[int]]] = {}

  def _encode(self, text: str) -> list[int]:
    return self.tokenizer.encode(text, add_bos=False)

  def _without(self, assistant: str, fresh: bool = False) -> tuple[list[int], list[int]]:
    """The probe rendered without messages: (its ids, the close of its assistant turn),
    made once per probe turn (a template that renders today's date renders it anew when a
    rendering stops matching: `fresh`)."""
    if fresh or assistant not in self._without_cache:
      text = self.chat.render([_PROBE_USER, {"role": "assistant", "content": assistant}],
                              add_generation_prompt=False, tools=self.tools)
      close = text[text.rfind(_MARK) + len(_MARK):]
      self._without_cache[assistant] = (self._encode(text), self._encode(close))
    return self._without_cache[assistant]

  def _continuation(self, messages: list[dict], assistant: str) -> tuple[list[int], list[int]]:
    """(the close of the probe's assistant turn, the tokens the messages add after it);
    ObservationError if the template does not continue the probe."""
    base = [_PROBE_USER, {"role": "assistant", "content": assistant}]
    try:
      text = self.chat.render(base + messages, add_generation_prompt=True, tools=self.tools)
    except ValueError as e:  # the template refuses the conversation (chat.ChatTemplateError)
      # Gemma's template knows user and model turns only, alternating: no tool role.
      roles = sorted({m["role"] for m in messages})
      raise ObservationError(
          f"{e}: it cannot render {roles} messages after an assistant turn; return the "
          "observation as a role the template has (Gemma: 'user') or as text") from None
    ids_with = self._encode(text)
    ids_without, close = self._without(assistant)
    if ids_with[:len(ids_without)] != ids_without:
      ids_without, close = self._without(assistant, fresh=True)
    if ids_with[:len(ids_without)] != ids_without:
      at = next((i for i, (a, b) in enumerate(zip(ids_with, ids_without)) if a != b),
                min(len(ids_with), len(ids_without)))
      raise ObservationError(
          f"{self.chat.source}: the chat template is not prefix-preserving: a conversation "
          f"rendered with {messages[0]['role']!r} messages after an assistant turn changes "
          f"its tokens before them (token {at}: "
          f"{self.tokenizer.hf.decode(ids_without[at:at + 8], skip_special_tokens=False)!r} "
          f"becomes {self.tokenizer.hf.decode(ids_with[at:at + 8], skip_special_tokens=False)!r})"
          "; an episode only appends, so use a template that renders earlier turns as they "
          "were (the model folder's tokenizer_config.json chat_template), or return the "
          "observation as text")
    return close, ids_with[len(ids_without):]

  def probe(self, messages: list[dict]) -> tuple[list[int], list[int]]:
    """_continuation with the first probe assistant turn the template continues."""
    if self.chat is None:
      raise ObservationError("the observation is chat messages and the run has no chat "
                             "template (data.use_chat_template=False, or a model without "
                             "one): return text, or use a model.hf_checkpoint with "
                             "data.use_chat_template=True")
    turns = (self._assistant,) if self._assistant else _ASSISTANT_TURNS
    for assistant in turns[:-1]:
      try:
        out = self._continuation(messages, assistant)
      except ObservationError:
        continue
      self._assistant = assistant
      return out
    out = self._continuation(messages, turns[-1])  # the last one's error is the one said
    self._assistant = turns[-1]
    return out

  def framing(self, role: str = "tool") -> int:
    """Tokens the template adds around one empty `role` message after a turn that ended
    with its end token: what max_tokens must exceed (checked at start-up)."""
    close, added = self.probe([{"role": role, "content": ""}])
    return len(close) - 1 + len(added)

  def render(self, observation, turn_ids: list[int]) -> Rendered:
    """The tokens to append after a sampled turn (its ids: did it end with the template's
    end of turn?); ObservationError if it cannot be appended within max_tokens."""
    messages = messages_of(observation)
    if messages is None:
      ids = self._encode(observation)
      kept = cut_ids(ids, self.max_tokens, self.side)
      return Rendered(kept, len(kept) < len(ids), observation)
    text = "".join(m["content"] for m in messages)
    contents = [self._encode(m["content"]) for m in messages]
    room, cut = sum(map(len, contents)), False
    while True:
      close, added = self.probe(messages)
      ended = bool(close) and bool(turn_ids) and turn_ids[-1] == close[0]
      ids = close[1:] + added if ended else close + added
      over = len(ids) - self.max_tokens
      if over <= 0:
        return Rendered(ids, cut, text)
      # Cut the contents only. Re-encoded within the framing a cut text may merge with it
      # differently, so the rendering is measured again until it fits.
      room -= over
      if room < 0:
        raise ObservationError(
            f"the chat template's framing of {len(messages)} message(s) takes "
            f"{len(ids) - sum(len(c) for c in contents)}+ tokens; env.max_observation_tokens="
            f"{self.max_tokens} leaves no room for their text")
      keep = shares([len(c) for c in contents], room)
      contents = [cut_ids(c, k, self.side) for c, k in zip(contents, keep)]
      messages = [dict(m, content=self._decode(c)) for m, c in zip(messages, contents)]
      cut = True

  def _decode(self, ids: list[int]) -> str:
    # A cut inside a character's bytes decodes to U+FFFD at the edge: dropped.
    return self.tokenizer.hf.decode(ids, skip_special_tokens=False).strip("\ufffd")

