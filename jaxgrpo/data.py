"""Prompt data: tasks (arithmetic generator, JSONL files) and grain pipelines.

Everything here runs on the host and reads its whole source eagerly, so that a bad file or
a prompt too long for the compiled sampler fails in seconds, before any compilation.

Rows are plain dicts `{"question": str, "answer": str, ...}`. A run turns them into:
- `PromptBatches`: shuffled, repeated, per-process batches for training, whose position
  `get_state()` returns for the checkpoint and `set_state()` restores on resume;
- `validation_batches`: a fixed, ordered list of batches, padded to equal counts on every
  process, with a `valid_B` flag on each row.

On a pod, training batches are global: every process shuffles the same list with the same
seed, and process p keeps rows [p*B/P, (p+1)*B/P) of each global batch of B prompts, so the
global batch (and the run's losses) do not depend on how many processes share it, and a
checkpoint's data position resumes on any number of hosts. Validation rows are dealt out
`process_index::process_count`; its metrics are sums over prompts, so order does not matter.
"""

from __future__ import annotations

import json
import math
import os
import zlib
from typing import Any, Sequence

import grain
import numpy as np

from jaxgrpo import rewards
from jaxgrpo.model.tokenizer import Tokenizer

# A path `@<folder>/NAME` names a file packaged with jaxgrpo under jaxgrpo/assets/<folder>
# (GSM8K, MIT licence; the calculator task's rows), so configs can say
# train_path='@gsm8k/train.jsonl' without knowing the install location.
DATA_ASSETS = ("gsm8k", "calc3")
_ASSETS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets")
SOURCES = ("arithmetic", "jsonl")


class DataError(ValueError):
  """A data problem, explained in one line that names the file (and line) at fault."""


def resolve_path(path: str) -> str:
  """Maps `@gsm8k/NAME` (or another of DATA_ASSETS) to the packaged
  `jaxgrpo/assets/gsm8k/NAME`; other paths unchanged."""
  for folder in DATA_ASSETS:
    if path.startswith(f"@{folder}/"):
      return os.path.join(_ASSETS_DIR, folder, path[len(folder) + 2:])
  return path


def load_jsonl(path: str, question_key: str = "question",
               answer_key: str = "answer") -> list[dict[str, Any]]:
  """Reads every row of a JSONL file.

  Blank lines are skipped. Each row becomes `{"question": str, "answer": str}` plus its other
  columns unchanged; numeric answers are turned into strings.

  Raises:
    DataError: missing file, a line that is not a JSON object, a missing or non-text field,
      or no rows at all. The message names `path` and the 1-based line number.
  """
  if not os.path.isfile(resolve_path(path)):
    raise DataError(f"{path}: no such file")
  rows = []
  # Bytes, decoded line by line, so that a bad byte is reported with its line number.
  with open(resolve_path(path), "rb") as f:
    for line_no, raw in enumerate(f, start=1):
      where = f"{path}:{line_no}"
      try:
        line = raw.decode("utf-8")
      except UnicodeDecodeError as e:
        raise DataError(f"{where}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
      if not line.strip():
        continue
      try:
        obj = json.loads(line)
      except json.JSONDecodeError as e:
        # e.msg without json's own "line 1 column 9" (a line, not the file): the file's
        # line is in `where`, and a second line number would only mislead.
        raise DataError(f"{where}: not valid JSON ({e.msg})") from None
      if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
      rows.append(_row(obj, question_key, answer_key, where))
  if not rows:
    raise DataError(f"{path}: empty dataset (0 usable rows)")
  return rows


def _row(obj: dict[str, Any], question_key: str, answer_key: str, where: str) -> dict:
  """A data row: `question` and `answer` as text, read from their keys (a dotted key reads
  a nested field: `reward_model.ground_truth`), and every other column unchanged."""
  row = {k: v for k, v in obj.items() if k not in (question_key, answer_key)}
  clash = sorted(set(row) & set(rewards.RESERVED_COLUMNS))
  if clash:  # every column reaches the rewards as a keyword (scorer.Scorer)
    raise DataError(f"{where}: column {clash[0]!r} is a name the rewards are given "
                    f"already; rename it (reserved: {', '.join(rewards.RESERVED_COLUMNS)})")
  row["question"] = _question_field(obj, question_key, where)
  row["answer"] = _text_field(obj, answer_key, where)
  return row


def is_messages(value) -> bool:
  """Whether a question is a chat conversation (a list of {role, content} messages, as
  verl's Parquet files, TRL's conversational datasets and NeMo-RL's message logs hold the
  prompt), not text."""
  return isinstance(value, list)


def _question_field(obj: dict[str, Any], key: str, where: str):
  """The question: text, or a non-empty list of {"role": str, "content": str} messages
  (kept as plain dicts of those two keys; the chat template renders them)."""
  value = _field(obj, key, where)
  if not isinstance(value, (list, tuple)):
    return _text_field(obj, key, where)
  messages = []
  for i, m in enumerate(value):
    if not (isinstance(m, dict) and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)):
      raise DataError(f"{where}: field {key!r} is a list but its item {i} is not a chat "
                      f"message {{'role': text, 'content': text}} ({str(m)[:60]})")
    messages.append({"role": m["role"], "content": m["content"]})
  if not messages:
    raise DataError(f"{where}: field {key!r} is an empty list of chat messages")
  return messages


def _field(obj: dict[str, Any], key: str, where: str):
  """obj[key], a dotted key walking into nested objects."""
  if key in obj:
    return obj[key]
  value, path = obj, []
  for part in key.split("."):
    if not isinstance(value, dict) or part not in value:
      fields = ", ".join(value) if isinstance(value, dict) else type(value).__name__
      raise DataError(f"{where}: missing field {key!r} (fields"
                      f"{' of ' + '.'.join(path) if path else ''}: {fields})")
    value, path = value[part], path + [part]
  return value


def load_rows(path: str, question_key: str = "question",
              answer_key: str = "answer") -> list[dict[str, Any]]:
  """Every row of a data file: JSONL, Parquet (`.parquet`), or a folder that Hugging Face
  `datasets` wrote with `save_to_disk` (its Arrow files); the same keys and rules as
  `load_jsonl`. Parquet and Arrow need pyarrow (`pip install -e '.[parquet]'`)."""
  resolved = resolve_path(path)
  is_folder = os.path.isdir(resolved) and os.path.isfile(os.path.join(resolved, "state.json"))
  if not (resolved.endswith(".parquet") or is_folder):
    return load_jsonl(path, question_key, answer_key)
  if not os.path.exists(resolved):
    raise DataError(f"{path}: no such file")
  try:
    import pyarrow  # pylint: disable=g-import-not-at-top
    import pyarrow.ipc  # pylint: disable=g-import-not-at-top,unused-import
    import pyarrow.parquet  # pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    raise DataError(f"{path}: reading Parquet and Arrow needs pyarrow; "
                    "pip install -e '.[parquet]'") from None
  try:
    if is_folder:
      with open(os.path.join(resolved, "state.json")) as f:
        files = [os.path.join(resolved, d["filename"]) for d in json.load(f)["_data_files"]]
      table = pyarrow.concat_tables([pyarrow.ipc.open_stream(p).read_all() for p in files])
    else:
      table = pyarrow.parquet.read_table(resolved)
  except (OSError, ValueError, KeyError, pyarrow.ArrowException) as e:
    raise DataError(f"{path}: not a readable {'datasets folder' if is_folder else 'Parquet file'}"
                    f" ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
  for key in (question_key, answer_key):
    if key.split(".")[0] not in table.column_names:
      raise DataError(f"{path}: no column {key!r} (columns: {', '.join(table.column_names)})")
  rows = [_row(obj, question_key, answer_key, f"{path}: row {i}")
          for i, obj in enumerate(table.to_pylist())]
  if not rows:
    raise DataError(f"{path}: empty dataset (0 usable rows)")
  return rows


def _text_field(obj: dict[str, Any], key: str, where: str) -> str:
  value = _field(obj, key, where)
  if isinstance(value, (int, float)) and not isinstance(value, bool):
    return str(value)
  if not isinstance(value, str):
    raise DataError(f"{where}: field {key!r} is {type(value).__name__}, expected text")
  return value


def is_val_pair(a: int, b: int, num_digits: int) -> bool:
  """The held-out rule: `a+b` is a validation problem iff crc32("a+b=") % 10 == 0.

  The rule depends only on the operands (zero-padded to `num_digits`), not on any seed, so
  no training run of any seed or size ever trains on a validation problem.
  """
  question = f"{a:0{num_digits}d}+{b:0{num_digits}d}="
  return zlib.crc32(question.encode()) % 10 == 0


def arithmetic_examples(num_examples: int, num_digits: int = 3, seed: int = 0,
                        split: str = "train") -> list[dict[str, str]]:
  """Returns distinct addition problems `{"question": "123+456=", "answer": "0579"}`.

  Operands are zero-padded to `num_digits`, the answer to `num_digits + 1` digits, so every
  problem has the same token length. Train and val are disjoint by `is_val_pair` (about a
  tenth of all pairs are val). The list is a deterministic function of the arguments.
  """
  if split not in ("train", "val"):
    raise DataError(f"arithmetic: unknown split {split!r} (allowed: train, val)")
  if not 1 <= num_digits <= 9:
    raise DataError(f"arithmetic: num_digits={num_digits}, expected 1..9")
  want_val, base = split == "val", 10**num_digits
  rng = np.random.default_rng([seed, int(want_val)])
  # Small spaces (up to 3 digits) are scanned as one permutation, so a request is met
  # exactly or refused; larger ones are sampled at random and duplicates rejected.
  candidates = rng.permutation(base * base) if base <= 1000 else None
  rows, seen, cursor = [], set(), 0
  while len(rows) < num_examples:
    if candidates is None:
      chunk = rng.integers(0, base * base, size=4096)
    elif cursor < len(candidates):
      chunk, cursor = candidates[cursor:cursor + 4096], cursor + 4096
    else:
      raise DataError(f"arithmetic: only {len(rows)} distinct {split} problems with "
                      f"num_digits={num_digits}, asked for {num_examples}")
    for key in chunk.tolist():
      a, b = divmod(key, base)
      if key in seen or is_val_pair(a, b, num_digits) != want_val:
        continue
      seen.add(key)
      rows.append({"question": f"{a:0{num_digits}d}+{b:0{num_digits}d}=",
                   "answer": f"{a + b:0{num_digits + 1}d}"})
      if len(rows) == num_examples:
        break
  return rows


def render_prompt(template, row: dict[str, Any]) -> str:
  """Fills `template` from the row's fields, e.g. "Question: {question}\\nAnswer:".

  `template` may also be a callable row -> text (a chat-formatted prompt, see ChatPrompt).
  A question of chat messages needs that: a text template cannot render a conversation.
  """
  if callable(template):
    return template(row)
  if is_messages(row.get("question")):
    raise DataError("the question is a list of chat messages, which only a chat template "
                    "renders (data.use_chat_template=True with a model.hf_checkpoint)")
  try:
    return template.format(**row)
  except (KeyError, IndexError) as e:
    raise DataError(f"prompt template {template!r} names {e} but the row has fields: "
                    f"{', '.join(row)}") from None
  except ValueError as e:  # Unbalanced braces and similar format-string mistakes.
    raise DataError(f"prompt template {template!r} is malformed ({e})") from None


def tokenize_prompts(tokenizer: Tokenizer, prompts: Sequence[str],
                     max_prompt_length: int) -> tuple[np.ndarray, np.ndarray]:
  """Returns (`prompt_tokens_BxL` int32, `prompt_mask_BxL` bool), left-padded to L.

  Left padding puts every prompt's last token in the same column, where the sampler starts
  generating. A prompt longer than `max_prompt_length` is an error, never truncated: a cut
  question has a different answer.
  """
  ids_list = tokenizer.encode_batch(prompts)
  _check_lengths(ids_list, prompts, range(len(prompts)), max_prompt_length)
  return pad_left(ids_list, tokenizer.pad_id, max_prompt_length)


def pad_left(ids_list: Sequence[Sequence[int]], pad_id: int,
              max_prompt_length: int) -> tuple[np.ndarray, np.ndarray]:
  """Left-pads id lists already checked to fit in `max_prompt_length` (also a multi-turn
  episode's contexts: episodes.py)."""
  tokens_BxL = np.full((len(ids_list), max_prompt_length), pad_id, dtype=np.int32)
  mask_BxL = np.zeros((len(ids_list), max_prompt_length), dtype=bool)
  for i, ids in enumerate(ids_list):
    if ids:
      tokens_BxL[i, -len(ids):] = ids
      mask_BxL[i, -len(ids):] = True
  return tokens_BxL, mask_BxL


def _check_lengths(ids_list: Sequence[Sequence[int]], prompts: Sequence[str],
                   row_ids: Sequence[int], max_prompt_length: int) -> None:
  """Raises a DataError naming the first prompt that does not fit, and how many do not."""
  too_long = [k for k, ids in enumerate(ids_list) if len(ids) > max_prompt_length]
  if too_long:
    k = too_long[0]
    longest = max(len(ids_list[j]) for j in too_long)
    raise DataError(
        f"prompt {row_ids[k]} ({prompts[k][:40]!r}...) is {len(ids_list[k])} tokens, longer "
        f"than max_prompt_length={max_prompt_length} ({len(too_long)} of {len(ids_list)} "
        f"prompts are too long, the longest {longest}); raise the limit or drop long rows")


def _shard(rows: Sequence[Any], process_index: int | None,
           process_count: int | None) -> tuple[list[int], int, int]:
  """Returns the indices `process_index::process_count` of `rows` and the two numbers."""
  # Imported here so that data can be loaded and checked without starting jax.
  import jax  # pylint: disable=g-import-not-at-top
  index = jax.process_index() if process_index is None else process_index
  count = jax.process_count() if process_count is None else process_count
  if not 0 <= index < count:
    raise DataError(f"process_index={index} is outside 0..{count - 1}")
  return list(range(index, len(rows), count)), index, count


def _prepare(rows: Sequence[dict[str, Any]], row_ids: Sequence[int], tokenizer: Tokenizer,
             template: str, max_prompt_length: int) -> list[dict[str, Any]]:
  """Renders and tokenizes rows `row_ids` once, so a too-long prompt fails at startup."""
  prompts = [render_prompt(template, rows[i]) for i in row_ids]
  # A chat template writes its own begin-of-text marker, so no second BOS is added.
  ids_list = tokenizer.encode_batch(prompts, add_bos=getattr(template, "add_bos", True))
  _check_lengths(ids_list, prompts, row_ids, max_prompt_length)
  # `row`: every column reaches the rewards (scorer.Scorer).
  return [{"prompt": p, "ids": ids, "row_id": i, "row": rows[i], "question": rows[i]["question"],
           "answer": rows[i]["answer"],
           "source": source_of(rows[i])}
          for p, ids, i in zip(prompts, ids_list, row_ids)]


def _collate(records: Sequence[dict[str, Any]], pad_id: int,
             max_prompt_length: int) -> dict[str, Any]:
  tokens_BxL, mask_BxL = pad_left([r["ids"] for r in records], pad_id, max_prompt_length)
  return {"prompt_tokens_BxL": tokens_BxL, "prompt_mask_BxL": mask_BxL,
          "row_ids_B": np.array([r["row_id"] for r in records], dtype=np.int32),
          "prompts": [r["prompt"] for r in records],
          "questions": [r["question"] for r in records],
          "answers": [r["answer"] for r in records],
          "sources": [r["source"] for r in records],
          "rows": [r["row"] for r in records]}


class ChatPrompt:
  """A row -> chat-formatted prompt: the user turn is `template` filled from the row, then
  the model's chat template renders it with the assistant's turn opened. A question that is
  a list of chat messages is rendered as it is, every message (system ones too) in order,
  as verl and TRL render such prompts; `template` is not applied to it."""

  add_bos = False

  def __init__(self, template: str, chat, tools: list[dict] | None = None):
    self.template, self.chat, self.tools = template, chat, tools

  def __call__(self, row: dict[str, Any]) -> str:
    if is_messages(row.get("question")):
      return self.chat.render(row["question"], tools=self.tools)
    return self.chat.render([{"role": "user", "content": render_prompt(self.template, row)}],
                            tools=self.tools)

  def __repr__(self) -> str:
    return f"ChatPrompt({self.template!r})"


class PromptBatches:
  """Infinite, shuffled training batches: this process's slice of each global batch.

  Each epoch is a fresh permutation of all rows (grain's `repeat` reseeds the shuffle per
  epoch from `seed`); a batch may span two epochs. `batch_size` is the global batch (all
  processes together); this process gets its `batch_size / process_count` consecutive rows
  of it. Each batch is a dict with `prompt_tokens_BxL` (int32), `prompt_mask_BxL` (bool),
  `row_ids_B` (int32, indices into `rows`), `batch_offset` (this slice's first row in the
  global batch), `prompts`, `questions`, `answers` (lists of str) and `rows` (the data's
  rows themselves, every column, for the rewards).

  Every process renders and tokenizes every row at startup (cheap next to a step, and a
  too-long prompt then fails on all hosts alike); only its slice is collated.
  """

  def __init__(self, rows: Sequence[dict[str, Any]], tokenizer: Tokenizer, batch_size: int,
               max_prompt_length: int, template: str = "{question}", seed: int = 0,
               process_index: int | None = None, process_count: int | None = None):
    _, self.process_index, self.process_count = _shard(rows, process_index, process_count)
    if batch_size < 1:
      raise DataError(f"batch_size={batch_size}, expected at least 1")
    if batch_size % self.process_count:
      raise DataError(f"batch_size={batch_size} does not split over {self.process_count} "
                      "processes")
    if not rows:
      raise DataError("training: empty dataset (0 usable rows)")
    records = _prepare(rows, range(len(rows)), tokenizer, template, max_prompt_length)
    self.num_rows, self.batch_size, self.seed = len(records), batch_size, seed
    self.local_batch_size = batch_size // self.process_count
    offset = self.process_index * self.local_batch_size
    pad_id = tokenizer.pad_id
    self._records, self._pad_id, self._width = records, pad_id, max_prompt_length

    def collate(global_records):
      batch = _collate(global_records[offset:offset + self.local_batch_size], pad_id,
                       max_prompt_length)
      batch["batch_offset"] = offset
      return batch

    dataset = (grain.MapDataset.source(records).seed(seed).shuffle().repeat(None)
               .batch(batch_size, drop_remainder=True, batch_fn=collate))
    # num_threads=0: the rows are in memory, and reader threads would only contend for
    # the GIL with the training loop.
    self._iterator = iter(dataset.to_iter_dataset(
        grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)))

  def __iter__(self) -> PromptBatches:
    return self

  def collate_rows(self, row_ids: Sequence[int]) -> dict[str, Any]:
    """The batch of the given rows (indices into `rows`), as `next` collates one: partial
    rollouts (run/partial_rollouts.py) score groups that entered in different batches."""
    return _collate([self._records[i] for i in row_ids], self._pad_id, self._width)

  def __next__(self) -> dict[str, Any]:
    return next(self._iterator)

  def _fingerprint(self) -> dict[str, int]:
    # No process numbers: the position in the global order is the same on every host.
    return {"seed": self.seed, "num_rows": self.num_rows, "batch_size": self.batch_size}

  def get_state(self) -> dict[str, Any]:
    """Returns the position to checkpoint: grain's iterator state plus what it depends on."""
    return {"iterator": self._iterator.get_state(), **self._fingerprint()}

  def set_state(self, state: dict[str, Any]) -> None:
    """Resumes at `state`; refuses one saved with other data, seed or global batch size."""
    saved = {k: state.get(k) for k in self._fingerprint()}
    if saved != self._fingerprint():
      raise DataError(f"data iterator state was saved for {saved}, but this run has "
                      f"{self._fingerprint()}; the resumed data order would differ")
    self._iterator.set_state(state["iterator"])


def validation_batches(rows: Sequence[dict[str, Any]], tokenizer: Tokenizer,
                       batch_size: int, max_prompt_length: int,
                       template: str = "{question}", process_index: int | None = None,
                       process_count: int | None = None) -> list[dict[str, Any]]:
  """Returns this process's validation batches, in row order, unshuffled.

  Every process gets the same number of batches, ceil(ceil(n / processes) / batch_size),
  because the validation step is a collective. Rows beyond this process's share repeat its
  last row (or the last row overall if its share is empty) with `valid_B` False, so they
  fill the shape and must be left out of every metric. Batches have the keys of
  `PromptBatches` plus `valid_B` (bool).
  """
  if not rows:
    raise DataError("validation: empty dataset (0 usable rows)")
  if batch_size < 1:
    raise DataError(f"validation batch_size={batch_size}, expected at least 1")
  shard, _, count = _shard(rows, process_index, process_count)
  num_batches = math.ceil(math.ceil(len(rows) / count) / batch_size)
  filler = shard[-1] if shard else len(rows) - 1
  valid = [True] * len(shard) + [False] * (num_batches * batch_size - len(shard))
  padded = shard + [filler] * (len(valid) - len(shard))
  records = _prepare(rows, padded, tokenizer, template, max_prompt_length)
  batches = []
  for start in range(0, len(records), batch_size):
    batch = _collate(records[start:start + batch_size], tokenizer.pad_id, max_prompt_length)
    batch["valid_B"] = np.array(valid[start:start + batch_size], dtype=bool)
    batches.append(batch)
  return batches


def val_files(val_path: str) -> list[tuple[str | None, str]]:
  """`data.val_path` -> [(source name or None, path)]: one path, or several separated by
  commas, each optionally `name=path`. With several files each is a source, named by its
  `name=` or its file name without extension; a single unnamed file names no source."""
  entries = [e.strip() for e in val_path.split(",") if e.strip()]
  out = []
  for entry in entries:
    name, sep, path = entry.partition("=")
    if not sep:
      name, path = None, entry
    elif not name or not path:
      raise DataError(f"data.val_path: {entry!r} is not 'name=path'")
    if name is None and len(entries) > 1:
      name = os.path.splitext(os.path.basename(path))[0]
    out.append((name, path))
  names = [n for n, _ in out if n is not None]
  if len(set(names)) != len(names):
    raise DataError(f"data.val_path={val_path!r}: two files have the same source name "
                    f"({', '.join(names)}); name them, e.g. gsm8k=@gsm8k/test.jsonl")
  return out


# The columns that name a row's source, first found wins: ours, and verl's (its Parquet
# files carry `data_source`, e.g. "openai/gsm8k").
SOURCE_COLUMNS = ("source", "data_source")


def source_of(row: dict[str, Any]) -> str | None:
  """A row's validation source (SOURCE_COLUMNS), None when it names none."""
  for column in SOURCE_COLUMNS:
    if row.get(column) is not None:
      return str(row[column])
  return None


def source_names(rows: Sequence[dict[str, Any]]) -> list[str]:
  """The sorted source names of validation rows ([] when no row names one). A row without a
  source in a set where others have one counts as source 'other'."""
  names = [source_of(r) for r in rows]
  if all(n is None for n in names):
    return []
  return sorted({n or "other" for n in names})


def make_sources(data_config: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
  """Returns (train_rows, val_rows) for a data config (a ConfigDict or any object).

  Fields: `source` is 'arithmetic' or 'jsonl'.
  - arithmetic: `num_train_examples` and `num_val_examples` problems of `num_digits`
    digits from `arithmetic_examples` (disjoint splits), drawn with `seed` (default 0).
  - jsonl: rows of `train_path` and `val_path` (JSONL, Parquet or a `datasets` folder:
    `load_rows`), read with `question_key`/`answer_key` (dotted for a nested field).
    A path `@gsm8k/train.jsonl` or `@gsm8k/test.jsonl` names the packaged GSM8K files.
    `num_train_examples` > 0 keeps the first that many train rows (0: all). With a
    `val_path`, `num_val_examples` > 0 keeps its first that many rows (0: all) of each of
    its files (`val_files`: several, comma-separated, each a validation source). With an
    empty `val_path`, the last `num_val_examples` rows of train are held out as val and
    are not trained on.
  """
  source = getattr(data_config, "source", None)
  num_train = int(getattr(data_config, "num_train_examples", 0) or 0)
  num_val = int(getattr(data_config, "num_val_examples", 0) or 0)
  if source == "arithmetic":
    num_digits = int(getattr(data_config, "num_digits", 3))
    seed = int(getattr(data_config, "seed", 0))
    return (arithmetic_examples(num_train, num_digits, seed, "train"),
            arithmetic_examples(num_val, num_digits, seed, "val"))
  if source != "jsonl":
    raise DataError(f"data.source={source!r} is unknown (allowed: {', '.join(SOURCES)})")
  keys = {"question_key": getattr(data_config, "question_key", "question"),
          "answer_key": getattr(data_config, "answer_key", "answer")}
  train_path = getattr(data_config, "train_path", "")
  val_path = getattr(data_config, "val_path", "")
  if not train_path:
    raise DataError("data.train_path is empty; source='jsonl' needs a JSONL file")
  train = load_rows(train_path, **keys)
  if val_path:
    val = []
    for name, path in val_files(val_path):
      rows = load_rows(path, **keys)
      rows = rows[:num_val] if num_val > 0 else rows
      if name is not None:  # a row's own source column wins over its file's name
        rows = [{**r, "source": source_of(r) or name} for r in rows]
      val += rows
  else:
    if not 0 < num_val < len(train):
      raise DataError(f"{train_path}: data.val_path is empty, so val is the last "
                      f"num_val_examples rows of train; need 0 < num_val_examples < "
                      f"{len(train)}, got {num_val}")
    train, val = train[:-num_val], train[-num_val:]
  if num_train > 0:
    train = train[:num_train]
  return train, val
