"""Host-side loading shared by the commands (train, evaluate, export, serve, the benches and
launch/compile_check.py): the policy (architecture, parameters or where to stream them from,
tokenizer), the data (training and validation rows, checked for what the tokenizer can
encode), the validation batches, and the point a run resumes from. Every problem with the
user's input is one of USER_ERRORS, raised before anything compiles.
"""

from __future__ import annotations

import collections
import datetime
import dataclasses
import os
import string
import sys
import warnings

from jaxgrpo import config as config_lib
from jaxgrpo import data as data_lib
from jaxgrpo.model import hf
from jaxgrpo.runtime import config_checks

USER_ERRORS = (config_lib.ConfigError, data_lib.DataError, hf.PretrainedError)


@dataclasses.dataclass
class Data:
  train_rows: list
  val_rows: list
  val_sources: list  # names, [] for one source
  template: object  # data.prompt_template, or a ChatPrompt around it


def chat_template_date(values: dict, saved: dict | None = None) -> dict:
  """The config values (a dict, before validation) with data.chat_template_date fixed: ''
  becomes the day a recorded run started (`saved`, its config.json, when it recorded one)
  or today's, so every prompt a chat template dates is the same for the run's whole life.
  Only with a chat template; a config without the key is left as it is."""
  data = values.get("data", {})
  if data.get("chat_template_date") == "" and data.get("use_chat_template"):
    recorded = ((saved or {}).get("data") or {}).get("chat_template_date")
    data["chat_template_date"] = recorded or datetime.date.today().isoformat()
  return values


def load_data(config, tokenizer) -> Data:
  """The training and validation rows (max_val_samples applied), checked on the host."""
  train_rows, val_rows = data_lib.make_sources(config.data)
  if config.grpo.max_val_samples:  # the first rows of each source: a mixture keeps every part
    kept, counts = [], collections.Counter()
    for row in val_rows:
      source = data_lib.source_of(row)
      counts[source] += 1
      if counts[source] <= config.grpo.max_val_samples:
        kept.append(row)
    val_rows = kept
  val_sources = data_lib.source_names(val_rows)
  check_source_metrics(config, val_sources)
  d = config.data
  _check_messages(config, train_rows, val_rows)
  template = d.prompt_template
  if d.use_chat_template:
    from jaxgrpo.model import chat  # pylint: disable=g-import-not-at-top
    try:
      chat_template = chat.ChatTemplate.from_folder(
          hf.resolve(config.model.hf_checkpoint),
          datetime.date.fromisoformat(d.chat_template_date) if d.chat_template_date else None)
    except chat.ChatTemplateError as e:
      raise config_lib.ConfigError(f"config.data.use_chat_template=True: {e}") from None
    tools = env_tools(config)
    if tools and not chat_template.shows_tools and _primary():
      print(f"warning: environment {config.env.name!r} offers tools "
            f"({', '.join(t['function']['name'] for t in tools)}) but the chat template of "
            f"{config.model.hf_checkpoint} does not show tools to the model; describe them in "
            "data.prompt_template", file=sys.stderr, flush=True)
    template = data_lib.ChatPrompt(d.prompt_template, chat_template, tools=tools)
  check_observations(config, tokenizer, template)
  # Before the batches: their length check would otherwise report prompts of <unk> tokens
  # as too long, hiding that the model cannot read them.
  warning = check_encodable(tokenizer, template, train_rows, val_rows, model_name(config))
  if warning and _primary():
    print(warning, file=sys.stderr, flush=True)
  return Data(train_rows, val_rows, val_sources, template)


def _check_messages(config, train_rows, val_rows) -> None:
  """Questions that are chat messages (verl's `prompt` column) need the model's chat
  template: one line naming the key when there is none; a warning when
  data.prompt_template would be set aside for them."""
  d = config.data
  if not any(data_lib.is_messages(r["question"]) for r in (*train_rows, *val_rows)):
    return
  if not d.use_chat_template:
    why = _no_chat_template(config)
    raise config_lib.ConfigError(
        f"config.data.question_key={d.question_key!r}: the column holds chat messages (a "
        f"list of {{role, content}}), which only a chat template renders, and {why}; allowed: "
        "model.hf_checkpoint=<a Hugging Face folder> with data.use_chat_template=True, or a "
        "column of text")
  if d.prompt_template != "{question}" and _primary():
    print(f"warning: data.prompt_template={d.prompt_template!r} is not applied to the "
          f"questions that are chat messages (column {d.question_key!r}): they are rendered "
          "as they are by the model's chat template; set data.prompt_template='{question}' "
          "to silence this", file=sys.stderr, flush=True)


def per_process(config, key: str) -> int:
  """config.grpo.<key>, a global batch size, divided over the processes."""
  import jax  # pylint: disable=g-import-not-at-top
  procs, value = jax.process_count(), config.grpo[key]
  if value % procs:
    raise config_lib.ConfigError(
        f"config.grpo.{key}={value}: allowed: a multiple of the {procs} processes")
  return value // procs


def validation_batches(config, tokenizer, data: Data) -> list:
  """This process's validation batches (every process holds a slice of each)."""
  return data_lib.validation_batches(data.val_rows, tokenizer,
                                     per_process(config, "val_batch_size"),
                                     config.data.max_prompt_length, template=data.template)


# Training prompts checked for unknown tokens, spread evenly over the file (every validation
# prompt is checked): enough to find a character class the vocabulary lacks, cheap at startup.
UNKNOWN_SAMPLE = 1000


_SHOWN_PIECES = 8  # unknown characters named in the warning or error


def check_encodable(tokenizer, template, train_rows, val_rows, model: str) -> str | None:
  """Prompts the tokenizer cannot encode faithfully: text of theirs that becomes its unknown
  token (a character or word-level vocabulary; a byte-level BPE has none).

  Returns None when every checked prompt encodes, else one warning line naming how many do
  not and their first unknown characters. Raises a DataError when none encodes: the model
  would train on <unk> tokens and learn nothing from the text.
  """
  if tokenizer.unk_id is None:
    return None
  stride = max(1, -(-len(train_rows) // UNKNOWN_SAMPLE))  # ceil: at most UNKNOWN_SAMPLE rows
  train_ids = range(0, len(train_rows), stride)
  rows = list(val_rows) + [train_rows[i] for i in train_ids]
  pieces = tokenizer.unknown_pieces([data_lib.render_prompt(template, r) for r in rows])
  bad = [i for i, p in enumerate(pieces) if p]
  if not bad:
    return None
  distinct = list(dict.fromkeys(piece for i in bad for piece in pieces[i]))
  shown = ", ".join(repr(p) for p in distinct[:_SHOWN_PIECES])
  shown += ", ..." if len(distinct) > _SHOWN_PIECES else ""
  checked = (f"{len(rows)} prompts checked ({len(val_rows)} validation, {len(train_ids)} "
             f"of {len(train_rows)} training)")
  unk = tokenizer.hf.id_to_token(tokenizer.unk_id)
  what = (f"the tokenizer of {model} ({tokenizer.vocab_size} tokens) cannot encode and turns "
          f"into {unk}: {shown} ({len(distinct)} distinct")
  if len(bad) < len(rows):
    first = (f"validation prompt {bad[0]}" if bad[0] < len(val_rows) else
             f"training row {train_ids[bad[0] - len(val_rows)]}")
    return (f"warning: {len(bad)} of the {checked} have text that {what}; first in {first}); "
            f"the model sees {unk} in place of that text")
  text = _literal_text(template)
  in_template = sum(p in text for p in distinct)
  raise data_lib.DataError(
      f"every one of the {checked} has text that {what}"
      + (f", {in_template} of them in data.prompt_template's own text" if in_template else "")
      + "); use a model whose tokenizer covers the data and the template (e.g. "
      "model.hf_checkpoint=<a Hugging Face folder>), or change data.prompt_template")


def _literal_text(template) -> str:
  """The fixed text of a prompt template (a ChatPrompt's user template), fields left out."""
  template = getattr(template, "template", template)
  return "".join(literal for literal, *_ in string.Formatter().parse(template))


def model_name(config) -> str:
  m = config.model
  if m.hf_checkpoint:
    return f"model.hf_checkpoint={m.hf_checkpoint!r}"
  if m.checkpoint:
    return f"model.checkpoint={m.checkpoint!r}"
  return f"the random init (a character vocabulary for data.source={config.data.source!r})"


def check_source_metrics(config, sources) -> None:
  """A per-source stop or best metric (`pass@4/gsm8k`) must name a source of the data."""
  for key, metric in (("grpo.stop_at_validation_metric", config.grpo.stop_at_validation_metric),
                      ("checkpoint.best_metric", config.checkpoint.best_metric)):
    source = (metric or "").partition("/")[2]
    if source and source not in sources:
      allowed = ", ".join(sources) if sources else "none: the validation rows name no source"
      raise config_lib.ConfigError(
          f"config.{key}={metric!r}: no validation source {source!r}; sources in the data: "
          f"{allowed}")


def _primary() -> bool:
  """Process 0, which prints the start-up warnings of every process."""
  import jax  # pylint: disable=g-import-not-at-top
  return jax.process_index() == 0


def env_tools(config) -> list[dict] | None:
  """The tool schemas a run's environment shows the model through the chat template."""
  from jaxgrpo.run import build  # pylint: disable=g-import-not-at-top
  if not build.kind_of(config).episodes:
    return None
  from jaxgrpo import envs  # pylint: disable=g-import-not-at-top
  return envs.tool_schemas(config.env.name, config.env.kwargs)


def check_env(config, tokenizer) -> None:
  """Stop strings the tokenizer cannot end a turn at: one line, before compiling."""
  from jaxgrpo.run import build  # pylint: disable=g-import-not-at-top
  if not build.kind_of(config).episodes:
    return
  try:
    build.stop_ids(config, tokenizer)
  except ValueError as e:
    raise config_lib.ConfigError(f"config.env.stop_strings={config.env.stop_strings!r}: {e}"
                                 ) from None


def _no_chat_template(config) -> str:
  """Why a run renders no chat template, for the lines that need one."""
  return ("the model has no chat template (the embedded models read plain text)"
          if not config.model.hf_checkpoint else "data.use_chat_template=False")


def check_observations(config, tokenizer, template) -> None:
  """An environment that declares chat-message observations (envs.uses_chat_template: the
  tools environment unless chat='none') needs a chat template that continues a
  conversation with a tool message, within env.max_observation_tokens: one line, before
  compiling."""
  e = config.env
  if not e.name:
    return
  from jaxgrpo import envs, observations  # pylint: disable=g-import-not-at-top
  if not envs.uses_chat_template(e.name, e.kwargs):
    return
  chat = getattr(template, "chat", None)
  tools_chat = ("; allowed: '{\"chat\": \"none\"}' in env.kwargs (the parser's bare text, for "
                "a model without a chat template), or " if e.name == "tools" else "; allowed: ")
  if chat is None:
    why = _no_chat_template(config)
    raise config_lib.ConfigError(
        f"config.env.kwargs={e.kwargs!r}: environment {e.name!r} answers with chat messages, "
        f"which the model's chat template renders, and {why}{tools_chat}"
        "model.hf_checkpoint=<a Hugging Face folder> with data.use_chat_template=True")
  renderer = observations.Renderer(tokenizer, chat, getattr(template, "tools", None),
                                   max_tokens=e.max_observation_tokens)
  try:
    framing = renderer.framing("tool")
  except observations.ObservationError as err:
    raise config_lib.ConfigError(f"config.env.name={e.name!r}: {err}") from None
  env = envs.instance(e.name, e.kwargs)
  mark = getattr(getattr(env, "parser", None), "template_mark", None)
  if mark and mark not in chat.text and _primary():
    name = getattr(env, "parser_name", type(env.parser).__name__)
    family = hf.folder_family(config.model.hf_checkpoint)
    hint = (f"{family.name} models call tools as {{\"parser\": \"{family.tool_parser}\"}}"
            if family and family.tool_parser else
            "Qwen, Hermes: {\"parser\": \"hermes\"}; Llama 3.x: {\"parser\": \"llama3_json\"}")
    print(f"warning: env.kwargs: the tool-call parser {name!r} reads the format "
          f"of templates that mention {mark!r}, and the chat template of "
          f"{config.model.hf_checkpoint} does not: the model may call tools another way "
          f"({hint})", file=sys.stderr, flush=True)
  if framing >= e.max_observation_tokens:
    raise config_lib.ConfigError(
        f"config.env.max_observation_tokens={e.max_observation_tokens}: the chat template "
        f"frames a tool message with {framing} tokens, so no text would fit; allowed: more "
        f"than {framing} (the framing and the environment's text together)")


def lora_meta(config) -> dict:
  """What a checkpoint's meta says of LoRA: {'rank': 0} for full fine-tuning."""
  m = config.model
  if not m.lora_rank:
    return {"rank": 0}
  from jaxgrpo.model import lora  # pylint: disable=g-import-not-at-top
  return {"rank": m.lora_rank, "alpha": m.lora_alpha,
          "targets": ",".join(lora.parse_targets(m.lora_targets)),
          "base": m.hf_checkpoint or m.checkpoint or "random_init"}


def carried_meta(config) -> dict:
  """What a checkpoint's carried rollouts (partial rollouts) were laid out for: a resume
  continues them only with the same layout."""
  import jax  # pylint: disable=g-import-not-at-top
  g = config.grpo
  return {"processes": jax.process_count(), "max_new_tokens": config.generation.max_new_tokens,
          "rows": g.num_prompts_per_step * g.num_generations_per_prompt,
          "max_prompt_length": config.data.max_prompt_length}


def _check_carried(config, meta, where: str) -> None:
  """A checkpoint with carried rollouts resumes with partial rollouts on the same layout
  (each process's rows are its own); without partial rollouts they are left behind, said."""
  saved = meta.get("partial_rollouts")
  if saved is None:
    return  # a synchronous checkpoint: partial rollouts start with no row carried
  from jaxgrpo.run import build  # pylint: disable=g-import-not-at-top
  if not build.kind_of(config).partial:
    warnings.warn(f"{where} carries {saved['rows']} partial rollouts that this synchronous "
                  "run (generation.max_tokens_per_step=0) leaves behind", stacklevel=2)
    return
  want = carried_meta(config)
  for key, value in saved.items():
    if want.get(key) != value:
      raise config_lib.ConfigError(
          f"config.checkpoint.resume: {where} carries partial rollouts laid out for {key}="
          f"{value} ({'jax processes' if key == 'processes' else 'the config'}), this run has "
          f"{want.get(key)}; allowed: the same, or generation.max_tokens_per_step=0")


def resume_point(config, workdir: str, model_cfg, train_batches):
  """Where the run resumes from, checked on the host: (folder, step or None) or None."""
  from jaxgrpo.run import checkpoint  # pylint: disable=g-import-not-at-top
  from jaxgrpo.model import decoder as model_lib  # pylint: disable=g-import-not-at-top
  want = config.checkpoint.resume
  own = os.path.join(workdir, checkpoint.DIR_NAME)
  if want == "never":
    if checkpoint.step_dirs(own):
      raise config_lib.ConfigError(
          f"config.checkpoint.resume='never': {own} already holds checkpoints (steps "
          f"{checkpoint.step_dirs(own)}) that a fresh run would mix with; allowed: 'auto' to "
          "continue that run, or another --workdir")
    return None
  if want == "auto":
    if not checkpoint.step_dirs(own):
      return None
    directory, step = own, None
  else:
    directory, step = checkpoint.locate(want)
    steps = checkpoint.step_dirs(directory)
    if not steps or (step is not None and step not in steps):
      raise config_lib.ConfigError(
          f"config.checkpoint.resume={want!r}: no checkpoint there; allowed: 'auto', 'never', "
          "a checkpoints folder or one step's folder (<workdir>/checkpoints/<step>)")
  # The newest readable candidate's architecture must match: a mismatch is a config error
  # now, not a shape error from deep inside orbax after compilation.
  for candidate in sorted(checkpoint.step_dirs(directory), reverse=True):
    if step is not None and candidate > step:
      continue
    try:
      meta = checkpoint.read_meta(directory, candidate)
    except Exception:  # pylint: disable=broad-except
      continue  # unreadable: the restore falls back past it, with a warning
    saved = meta.get("model", {})
    for key, value in dataclasses.asdict(model_cfg).items():
      if key in saved and saved[key] != value:
        raise config_lib.ConfigError(
            f"config.model.{key}={value!r}: the checkpoint {directory}/{candidate} to resume "
            f"from has {saved[key]!r}; allowed: the checkpoint's value, or "
            "checkpoint.resume='never' with another --workdir")
    # LoRA: a checkpoint holds adapters (and their optimizer state) or every weight, and
    # only a run of the same kind can resume it.
    saved_lora = meta.get("lora") or {"rank": 0}
    want_lora = lora_meta(config)
    same = lambda d: {k: v for k, v in d.items() if k != "base"}  # a moved base folder is fine
    if same(saved_lora) != same(want_lora):
      def say(d):
        return (f"lora_rank={d['rank']}, lora_alpha={d['alpha']}, lora_targets="
                f"{d['targets']!r}" if d["rank"] else "no LoRA (lora_rank=0)")
      raise config_lib.ConfigError(
          f"config.model.lora_rank={config.model.lora_rank}: the checkpoint "
          f"{directory}/{candidate} to resume from was trained with {say(saved_lora)}; "
          "allowed: the same LoRA settings, or checkpoint.resume='never' with another "
          "--workdir (python -m jaxgrpo.export writes a LoRA run merged, to start from)")
    if meta.get("layout") != model_lib.PARAM_LAYOUT:
      raise config_lib.ConfigError(
          f"config.checkpoint.resume: {directory}/{candidate} holds per-layer parameters "
          "(written before jaxgrpo stacked its layers) and cannot be resumed; allowed: "
          f"export it (python -m jaxgrpo.export {os.path.dirname(directory)} --out=DIR) and "
          "start a run from it with --config.model.hf_checkpoint=DIR, or a newer checkpoint")
    _check_carried(config, meta, f"{directory}/{candidate}")
    try:  # same data, seed, batch size and hosts, or the resumed data order would differ
      train_batches.set_state(meta["data"])
    except data_lib.DataError as e:
      raise config_lib.ConfigError(f"config.checkpoint.resume: {directory}/{candidate}: "
                                   f"{e}") from None
    break
  return directory, step


# config.model keys that are not the network's architecture (model.ModelConfig's fields).
NOT_ARCHITECTURE = ("checkpoint", "hf_checkpoint", "remat", "scan_layers", "attention",
                    "moe_matmul", "router_dtype", "lora_rank", "lora_alpha", "lora_targets")
# ModelConfig fields the run config sets whatever a checkpoint says: how it is computed.
EXECUTION_FIELDS = ("dtype", "moe_matmul", "router_dtype")


def with_execution(cfg, m, param_dtype: bool = False):
  """A checkpoint's ModelConfig computed as config.model `m` asks (EXECUTION_FIELDS, and
  param_dtype when the weights are cast here: a jaxgrpo checkpoint's)."""
  values = {k: m[k] for k in EXECUTION_FIELDS}
  if param_dtype:
    values["param_dtype"] = m.param_dtype
  return dataclasses.replace(cfg, **values)


def architecture(config) -> dict:
  """config.model's architecture keys, as model.ModelConfig.from_dict takes them."""
  return {k: v for k, v in config.model.items() if k not in NOT_ARCHITECTURE}


def load_policy(config, checks: bool = True):
  """(ModelConfig, host params or None, Tokenizer), all checked on the host. checks: the
  checks registered for the loaded model (config_checks.register_model) run too; a run's
  own recorded config (export, serve) was checked when it ran, and skips them.

  A Hugging Face folder's weights are not read here: build.training streams them straight
  onto their shardings (host params None); their names and shapes are checked now.
  """
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jaxgrpo.model import decoder as model_lib
  from jaxgrpo.model.tokenizer import Tokenizer
  m = config.model
  arch = architecture(config)
  source = m.checkpoint or m.hf_checkpoint
  if source:
    if m.hf_checkpoint:
      cfg, tokenizer = hf.inspect_hf(m.hf_checkpoint, dtype=m.param_dtype)
      cfg, params = with_execution(cfg, m), None
      for end_id, path in tokenizer.unusable_end_ids if _primary() else ():
        print(f"warning: {path} lists end token id {end_id!r} (eos_token_id), which the "
              f"tokenizer cannot produce (its ids are 0-{tokenizer.vocab_size - 1}); it is "
              f"ignored: completions end only at {list(tokenizer.stop_ids)} (transformers "
              "would also stop at it)", file=sys.stderr, flush=True)
      _check_end_of_turn(config, tokenizer)
    else:
      cfg, params, tokenizer = hf.load_pretrained(m.checkpoint)
      cfg = with_execution(cfg, m, param_dtype=True)
      np_dtype = np.dtype(model_lib.DTYPES[m.param_dtype])
      params = jax.tree.map(lambda x: np.asarray(x).astype(np_dtype), params)
    check_architecture(config, cfg, checks)
    return cfg, params, tokenizer
  alphabet = "0123456789+=" if config.data.source == "arithmetic" else _PRINTABLE
  tokenizer = Tokenizer.char_level(alphabet)
  if m.vocab_size < tokenizer.vocab_size:
    raise config_lib.ConfigError(
        f"config.model.vocab_size={m.vocab_size}: the character tokenizer for "
        f"data.source={config.data.source!r} needs at least {tokenizer.vocab_size}")
  try:
    cfg = model_lib.ModelConfig.from_dict(
        {**arch, **{k: m[k] for k in EXECUTION_FIELDS}})
  except ValueError as e:
    raise config_lib.ConfigError(f"config.{e}") from None
  if checks:  # the checks that need the model (config_checks.py)
    config_checks.run_model(config, cfg)
  return cfg, None, tokenizer


def _check_end_of_turn(config, tokenizer) -> None:
  """A chat run of a folder whose end ids miss the token its family's template ends an
  assistant turn with (a base model's generation_config lists only <|endoftext|>): the
  sampler would run past every answer to max_tokens, which the user never meant. Warned."""
  family = hf.folder_family(config.model.hf_checkpoint)
  end = (tokenizer.hf.token_to_id(family.end_of_turn)
         if family and family.end_of_turn else None)
  if end is None or end in tokenizer.stop_ids or not config.data.get("use_chat_template"):
    return
  if _primary():
    print(f"warning: {config.model.hf_checkpoint}: {family.name}'s chat template ends an "
          f"assistant turn with {family.end_of_turn!r} (id {end}), and the folder's end ids "
          f"{list(tokenizer.stop_ids)} (tokenizer_config.json's eos_token, eos_token_id in "
          "config.json and generation_config.json) leave it out: completions run on past "
          f"the turn's end to max_tokens; add {end} to generation_config.json's "
          "eos_token_id (an instruct model's folder lists it)", file=sys.stderr, flush=True)


def check_architecture(config, cfg, checks: bool = True) -> None:
  """The config against a checkpoint's model `cfg`: the architecture keys it sets match,
  the checkpoint's shapes split over the mesh (named as its file spells them), and every
  check registered for the loaded model (config_checks.register_model) passes (checks)."""
  m = config.model
  key = "hf_checkpoint" if m.hf_checkpoint else "checkpoint"
  for name, value in dataclasses.asdict(cfg).items():
    if name not in NOT_ARCHITECTURE and m[name] is not None and m[name] != value:
      spelled = (f" (its {hf.HF_CONFIG}'s {hf.hf_key(name, m.hf_checkpoint)})"
                 if m.hf_checkpoint and name in hf.HF_KEYS else "")
      raise config_lib.ConfigError(
          f"config.model.{name}={m[name]!r}: the checkpoint {m[key]} has {value!r}{spelled}; "
          f"allowed: {value!r} or None (take the checkpoint's), or model.{key}='' for a "
          "random init")
  # The checkpoint's own values against the mesh (the config check saw only the keys set),
  # named as its file spells them.
  from jaxgrpo.model import sharding  # pylint: disable=g-import-not-at-top
  for name, value, allowed in sharding.shape_problems(config.mesh, dataclasses.asdict(cfg))[:1]:
    if m.hf_checkpoint:
      where = f"{os.path.join(m.hf_checkpoint, hf.HF_CONFIG)}: {hf.hf_key(name, m.hf_checkpoint)}"
    else:
      where = f"{m.checkpoint} (its model.json): {name}"
    raise config_lib.ConfigError(f"{where}={value!r} does not split over the mesh; allowed: "
                                 f"{allowed} (the checkpoint's value is fixed: change config.mesh)")
  if checks:
    config_checks.run_model(config, cfg)


_PRINTABLE = "".join(chr(i) for i in range(32, 127)) + "\n"
