"""Checkpoint folders: round trip, the shipped warm-start, and one-line errors naming the file."""

import dataclasses
import json
import os
import re
import shutil

import jax
import numpy as np
import pytest

from jaxgrpo import config as config_lib
from jaxgrpo.run import artifacts
from jaxgrpo.model import hf
from jaxgrpo.model import decoder as model_lib
from jaxgrpo.model.tokenizer import Tokenizer

CFG = model_lib.ModelConfig(vocab_size=16, d_model=16, num_layers=1, num_heads=2,
                            num_kv_heads=1, head_dim=8, mlp_dim=32)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("ckpt"))
  import flax.linen as nn
  params = nn.unbox(model_lib.init_params(CFG, jax.random.key(0)))
  hf.save_pretrained(path, CFG, params, Tokenizer.char_level("0123456789+="))
  return path, params


def test_round_trip(saved):
  path, params = saved
  cfg, loaded, tok = hf.load_pretrained(path)
  assert cfg == CFG and tok.vocab_size == 16 and tok.eos_id == 2
  assert jax.tree.structure(loaded) == jax.tree.structure(params)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(loaded)):
    np.testing.assert_array_equal(np.asarray(a), b)
  # In memory the layers are stacked ([num_layers, ...] under "layers"); on disk each
  # layer's tensors are named apart, the format the shipped checkpoint has always had.
  import safetensors.numpy  # pylint: disable=g-import-not-at-top
  names = set(safetensors.numpy.load_file(os.path.join(path, hf.WEIGHTS_FILE)))
  assert "layer_0/attn/q" in names and not any(n.startswith("layers/") for n in names)
  assert loaded["layers"]["attn"]["q"].shape == (1, 16, 2, 8)


def test_shipped_warmstart_loads():
  cfg, params, tok = hf.load_pretrained("@embedded/arith3")
  assert cfg.d_model == 128 and tok.decode(tok.encode("123+456=")) == "123+456="
  # A few MB at most: it ships inside the package.
  size = os.path.getsize(os.path.join(hf.resolve("@embedded/arith3"), hf.WEIGHTS_FILE))
  assert size < 4 * 2**20


def test_errors_name_the_file(saved, tmp_path):
  with pytest.raises(hf.PretrainedError, match="nope: no such checkpoint folder"):
    hf.load_pretrained(str(tmp_path / "nope"))
  bad = tmp_path / "bad"
  bad.mkdir()
  for name in os.listdir(saved[0]):
    (bad / name).write_bytes(open(os.path.join(saved[0], name), "rb").read())
  config = json.load(open(bad / hf.MODEL_FILE))
  config["d_model"] = 32  # the weights were saved for d_model 16
  json.dump(config, open(bad / hf.MODEL_FILE, "w"))
  with pytest.raises(hf.PretrainedError, match=r"model.safetensors: embedding has shape"):
    hf.load_pretrained(str(bad))
  config["d_model"], config["colour"] = 16, "blue"
  json.dump(config, open(bad / hf.MODEL_FILE, "w"))
  with pytest.raises(hf.PretrainedError, match=r"model.json: .*unknown keys \['colour'\]"):
    hf.load_pretrained(str(bad))
  config.pop("colour")
  json.dump(config, open(bad / hf.MODEL_FILE, "w"))
  Tokenizer.char_level("0123456789+=abcdefgh").save(str(bad))  # 24 tokens, vocab_size 16
  with pytest.raises(hf.PretrainedError, match=r"bad: tokenizer has 24 tokens but the "
                     r"model's vocab_size is 16"):
    hf.load_pretrained(str(bad))
  os.remove(bad / hf.WEIGHTS_FILE)
  with pytest.raises(hf.PretrainedError, match="model.safetensors: missing"):
    hf.load_pretrained(str(bad))


# ------------------------------------------------------------ Hugging Face model folders

from numpy_params import random_params  # noqa: E402  tests/numpy_params.py

FAMILIES = {  # the architectures' structural switches
    "Qwen2ForCausalLM": dict(qkv_bias=True),
    "Qwen3ForCausalLM": dict(qk_norm=True),
    "Qwen3MoeForCausalLM": dict(qk_norm=True, num_experts=4, num_experts_per_tok=2,
                                moe_mlp_dim=16, norm_topk_prob=False),
    "LlamaForCausalLM": dict(tie_embeddings=False, rope_scaling_factor=8.0,
                             rope_original_max_positions=64),
}


def hf_folder(path, arch="Qwen2ForCausalLM"):
  cfg = model_lib.ModelConfig(vocab_size=16, d_model=32, num_layers=2, num_heads=4,
                              num_kv_heads=2, head_dim=8, mlp_dim=64,
                              **{"tie_embeddings": True, **FAMILIES[arch]})
  params = random_params(cfg, 0)
  artifacts.save_hf(str(path), cfg, params, Tokenizer.char_level("0123456789+="))
  return cfg, params


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_hf_save_load_round_trip_is_bitwise(tmp_path, arch):
  cfg, params = hf_folder(tmp_path, arch)
  config = json.load(open(tmp_path / "config.json"))
  assert config["architectures"] == [arch]
  loaded_cfg, loaded, tok = hf.load_hf(str(tmp_path))
  assert loaded_cfg == cfg and tok.eos_id == 2
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(loaded)):
    np.testing.assert_array_equal(a, b, err_msg=str(path))


def test_hf_load_places_each_tensor_on_its_sharding(tmp_path):
  from jaxgrpo.model import sharding
  cfg, _ = hf_folder(tmp_path)
  mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  _, params, _ = hf.load_hf(str(tmp_path), mesh=mesh)
  want = sharding.param_shardings(cfg, mesh)
  for got, spec in zip(jax.tree.leaves(params), jax.tree.leaves(want)):
    assert got.sharding == spec


def edit_json(path, **changes):
  values = json.load(open(path))
  values.update(changes)
  json.dump(values, open(path, "w"))


@pytest.mark.parametrize("breakage,fragments", [
    ("no_weights", ["no model.safetensors or model.safetensors.index.json"]),
    ("no_tokenizer", ["tokenizer.json: missing"]),
    ("small_embedding", ["tokenizer.json: 16 tokens", "vocab_size=8"]),
    ("architecture", ["architecture 'GPT2LMHeadModel' is not supported", "Qwen2ForCausalLM"]),
    ("int8", ["is stored as I8", "allowed: F32, BF16, F16"]),
    ("shape", ["model.norm.weight has shape (31,)", "implies (32,)"]),
    ("rope", ["rope_scaling type 'yarn' is not supported"]),
])
def test_bad_hf_folders_name_the_file(tmp_path, breakage, fragments):
  import safetensors.numpy
  hf_folder(tmp_path)
  weights = str(tmp_path / "model.safetensors")
  if breakage == "no_weights":
    os.remove(weights)
  elif breakage == "no_tokenizer":
    os.remove(tmp_path / "tokenizer.json")
  elif breakage == "small_embedding":
    edit_json(tmp_path / "config.json", vocab_size=8)
  elif breakage == "architecture":
    edit_json(tmp_path / "config.json", architectures=["GPT2LMHeadModel"])
  elif breakage == "rope":
    edit_json(tmp_path / "config.json", rope_scaling={"rope_type": "yarn", "factor": 4.0})
  else:
    tensors = safetensors.numpy.load_file(weights)
    if breakage == "int8":
      tensors["model.norm.weight"] = tensors["model.norm.weight"].astype(np.int8)
    else:
      tensors["model.norm.weight"] = tensors["model.norm.weight"][:31]
    safetensors.numpy.save_file(tensors, weights)
  with pytest.raises(hf.PretrainedError) as e:
    hf.load_hf(str(tmp_path))
  message = str(e.value)
  assert "\n" not in message and str(tmp_path) in message
  for fragment in fragments:
    assert fragment in message, message


def test_generation_config_sampling_defaults_are_never_read(tmp_path):
  # A model folder's sampling defaults must not leak into jaxgrpo: nothing reads the file.
  hf_folder(tmp_path)
  json.dump({"do_sample": True, "temperature": 0.01, "top_k": 1},
            open(tmp_path / "generation_config.json", "w"))
  before = hf.load_hf(str(tmp_path))[0]
  os.remove(tmp_path / "generation_config.json")
  assert hf.load_hf(str(tmp_path))[0] == before


# ------------------------------------------------ parity with transformers (tests/fixtures/hf)

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "hf")


def reference(name):
  folder = os.path.join(FIXTURES, name)
  return (folder, dict(np.load(os.path.join(folder, "reference.npz"))),
          json.load(open(os.path.join(folder, "reference.json"))))


@pytest.fixture(scope="module", params=["qwen2", "qwen3", "qwen3_moe", "gemma3", "llama"])
def pretrained(request):
  from jaxgrpo.rollout import policy
  folder, arrays, facts = reference(request.param)
  return request.param, folder, arrays, facts, policy.Policy.from_pretrained(folder)


def test_logits_match_transformers(pretrained):
  # transformers' float32 eager logits for 3 prompts, two of them left-padded, positions
  # counted from each row's first real token; padded query positions are not compared.
  name, _, arrays, _, policy = pretrained
  mask = arrays["attention_mask"].astype(bool)
  logits = np.asarray(policy.logits(arrays["input_ids"], mask))
  assert np.abs(logits - arrays["logits"])[mask].max() <= 1e-4, name


def test_greedy_generation_matches_transformers(pretrained):
  from jaxgrpo.rollout import sampling
  name, _, arrays, facts, policy = pretrained
  ids, mask = arrays["input_ids"], arrays["attention_mask"].astype(bool)
  policy.eos_id = None  # transformers generated exactly 16 tokens, no end token
  # transformers ran each prompt alone; here the three go as one left-padded batch.
  prompts = [ids[row][mask[row]].tolist() for row in range(len(ids))]
  out = policy.generate(prompts, sampling.SamplingParams(0.0, 1.0, 0), num_samples=1,
                        max_new_tokens=facts["max_new_tokens"], seed=0)
  np.testing.assert_array_equal(np.asarray(out.tokens_NxT), arrays["greedy_tokens"],
                                err_msg=name)


@pytest.mark.parametrize("name", ["qwen3_moe", "gemma3"])
def test_the_updates_logprobs_equal_the_samplers(name):
  # The update's teacher-forced forward (each prompt once, its G completions over its K/V:
  # grpo.completion_logprobs) and the sampler's decode steps compute one function: Gemma 3's
  # window (4 here, shorter than the prompts and the 10 sampled tokens) in both, a mixture's
  # routing in both. (The dense families: tests/test_sampling.py.)
  from jaxgrpo.algo import grpo
  from jaxgrpo.rollout import policy as policy_lib
  from jaxgrpo.rollout import sampling
  folder, arrays, _ = reference(name)
  policy = policy_lib.Policy.from_pretrained(folder)
  policy.eos_id = None
  ids, mask = arrays["input_ids"], arrays["attention_mask"].astype(bool)
  prompts = [ids[row][mask[row]].tolist() for row in range(len(ids))]
  sp = sampling.SamplingParams(1.0, 1.0, 0)
  out = policy.generate(prompts, sp, num_samples=2, max_new_tokens=10, seed=4)
  tokens_BxL, mask_BxL = policy_lib._as_batch(prompts, None, policy.pad_id)
  batch = {"prompt_tokens_BxL": tokens_BxL, "prompt_mask_BxL": mask_BxL,
           "completion_tokens_NxT": out.tokens_NxT, "completion_mask_NxT": out.mask_NxT}
  update = grpo.completion_logprobs(policy.params, policy.cfg, batch, 2, sp)
  np.testing.assert_allclose(out.logp_NxT, update, atol=1e-4, err_msg=name)


def test_tokenizer_and_chat_template_match_transformers(pretrained):
  from jaxgrpo.model import chat
  name, folder, _, facts, policy = pretrained
  tok = policy.tokenizer
  assert (tok.eos_token, tok.eos_id, tok.pad_id) == (facts["eos_token"], facts["eos_token_id"],
                                                     facts["pad_token_id"]), name
  for case in facts["encodings"]:
    assert tok.encode(case["text"], add_bos=False) == case["ids"], case["text"]
    assert tok.encode(case["text"], add_bos=True) == case["ids_add_special_tokens"]
  template = chat.ChatTemplate.from_folder(folder)
  assert template.render(facts["chat_messages"]) == facts["chat_prompt"]
  assert template.render(facts["chat_messages_multi"]) == facts["chat_prompt_multi"]


def test_a_dated_chat_template_renders_the_runs_date_on_any_day(tmp_path):
  """Issue 60: Llama 3.1's template writes `Today Date: <strftime_now>` into every prompt, so
  a resume or an evaluation on another day rendered other prompts. The run fixes the date
  when it starts (data.chat_template_date, kept in its config.json) and reuses it."""
  import datetime  # pylint: disable=g-import-not-at-top
  import ml_collections  # pylint: disable=g-import-not-at-top
  from jaxgrpo.model import chat  # pylint: disable=g-import-not-at-top
  from jaxgrpo.run import loading, setup  # pylint: disable=g-import-not-at-top
  folder = os.path.join(FIXTURES, "..", "templates", "llama3.1")
  messages = [{"role": "user", "content": "1+1?"}]
  dated = chat.ChatTemplate.from_folder(folder, datetime.date(2026, 12, 5))
  assert dated.reads_date and "05 Dec 2026" in dated.render(messages)
  today = datetime.date.today().strftime("%d %b %Y")
  assert today in chat.ChatTemplate.from_folder(folder).render(messages)  # transformers' way
  # '' is fixed at the start: today for a new run, the recorded date for a resumed one.
  values = {"data": {"use_chat_template": True, "chat_template_date": ""},
            "checkpoint": {"resume": "auto"}}
  assert loading.chat_template_date(json.loads(json.dumps(values)))["data"][
      "chat_template_date"] == datetime.date.today().isoformat()
  (tmp_path / "config.json").write_text(json.dumps(
      {"data": {"use_chat_template": True, "chat_template_date": "2026-12-05"}}))
  resumed = setup._with_chat_template_date(ml_collections.ConfigDict(values), str(tmp_path))  # pylint: disable=protected-access
  assert resumed.data.chat_template_date == "2026-12-05"
  # Without a chat template nothing is dated (the key stays '', config.json unchanged).
  values["data"]["use_chat_template"] = False
  assert loading.chat_template_date(values)["data"]["chat_template_date"] == ""


def test_transformers_4_config_layout_reads_the_same(pretrained, tmp_path):
  # transformers 5 writes rope_parameters; hub checkpoints carry rope_theta / rope_scaling.
  name, folder, _, _, policy = pretrained
  shutil.copytree(folder, tmp_path / name)
  os.replace(tmp_path / name / "legacy_config.json", tmp_path / name / "config.json")
  assert hf.hf_model_config(str(tmp_path / name)) == policy.cfg


def test_load_export_load_is_bitwise(pretrained, tmp_path):
  name, folder, _, _, policy = pretrained
  _, params, tok = hf.load_hf(folder)
  written = artifacts.save_hf(str(tmp_path), policy.cfg, params, tok, source=folder)
  assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
          "generation_config.json"} <= set(written)
  cfg, again, _ = hf.load_hf(str(tmp_path))
  assert cfg == policy.cfg, name
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(again)):
    np.testing.assert_array_equal(a, b)


def test_export_files_all_follow_the_umask_and_are_all_listed(tmp_path):
  # safetensors writes its file 0600 whatever the umask; under 022 every file of an export
  # (jaxgrpo's own tokenizer files, or those copied from a Hugging Face source) is 0644,
  # and the returned list, which export's message prints, names every file in the folder.
  cfg, params = hf_folder(tmp_path / "unused")
  qwen_cfg, qwen_params, qwen_tok = hf.load_hf(os.path.join(FIXTURES, "qwen2"))
  char_tok = Tokenizer.char_level("0123456789+=")
  umask = os.umask(0o022)
  try:
    written = {
        "own": artifacts.save_hf(str(tmp_path / "own"), cfg, params, char_tok),
        "from_hf": artifacts.save_hf(str(tmp_path / "from_hf"), qwen_cfg, qwen_params, qwen_tok,
                              source=os.path.join(FIXTURES, "qwen2"))}
    hf.save_pretrained(str(tmp_path / "pretrained"), cfg, params, char_tok)
  finally:
    os.umask(umask)
  for name in ("own", "from_hf", "pretrained"):
    folder = tmp_path / name
    modes = {f: oct(os.stat(folder / f).st_mode & 0o777) for f in os.listdir(folder)}
    assert set(modes.values()) == {"0o644"}, (name, modes)
  for name, files in written.items():
    assert sorted(files) == sorted(os.listdir(tmp_path / name)), name
  assert "jaxgrpo_special_tokens.json" in written["own"]


def test_bfloat16_weights_load_in_the_run_dtype(tmp_path):
  # Hub checkpoints are stored in bfloat16; the run's param_dtype decides what is loaded.
  import ml_dtypes
  cfg, params = hf_folder(tmp_path / "f32")
  bf16 = jax.tree.map(lambda x: np.asarray(x).astype(ml_dtypes.bfloat16), params)
  artifacts.save_hf(str(tmp_path / "bf16"), cfg, bf16, Tokenizer.char_level("0123456789+="))
  loaded_cfg, loaded, _ = hf.load_hf(str(tmp_path / "bf16"), dtype="float32")
  assert loaded_cfg.param_dtype == "float32"
  for a, b in zip(jax.tree.leaves(bf16), jax.tree.leaves(loaded)):
    assert b.dtype == np.float32
    np.testing.assert_array_equal(np.asarray(a, np.float32), b)
  assert jax.tree.leaves(hf.load_hf(str(tmp_path / "bf16"), dtype="bfloat16")[1])[0].dtype \
      == ml_dtypes.bfloat16


def test_every_end_id_of_the_model_stops_a_completion(pretrained):
  # generation_config / config list the ids that end a turn (qwen: <|im_end|> and
  # <|endoftext|>; llama: <|eot_id|> and <|end_of_text|>); the sampler stops on any of them
  # and decoding ends there. eos_id (the tokenizer config's) comes first.
  from jaxgrpo.rollout import sampling
  name, _, arrays, facts, policy = pretrained
  tok = policy.tokenizer
  assert tok.stop_ids[0] == tok.eos_id
  assert set(tok.stop_ids) == set(facts["generation_eos_token_ids"]) | {tok.eos_id}
  other = [i for i in tok.stop_ids if i != tok.eos_id][0]
  assert tok.decode([5, 6, other, 7, tok.eos_id, 8]) == tok.decode([5, 6])
  # Make a greedy token that first appears at position p > 0 an end id (beside one that
  # never appears): the row stops right there, after p + 1 tokens.
  ids, mask = arrays["input_ids"], arrays["attention_mask"].astype(bool)
  greedy = [int(t) for t in arrays["greedy_tokens"][0]]
  p = next(i for i in range(1, len(greedy)) if greedy[i] not in greedy[:i])
  policy.eos_id = (tok.vocab_size - 1, greedy[p])
  out = policy.generate([ids[0][mask[0]].tolist()], sampling.SamplingParams(0.0, 1.0, 0),
                        num_samples=1, max_new_tokens=16, seed=0)
  assert int(out.lengths_N[0]) == p + 1 and not bool(out.truncated_N[0]), name


def test_an_end_id_the_tokenizer_cannot_produce_is_named_at_start_up(tmp_path, capsys,
                                                                    monkeypatch):
  """Issue 60: an eos_token_id beyond the tokenizer's ids was dropped in silence (where
  transformers stops there). It is still left out of the stop ids (it decodes to nothing),
  and the start-up says so, naming the id and the file."""
  from jaxgrpo.run import loading  # pylint: disable=g-import-not-at-top
  import ml_collections  # pylint: disable=g-import-not-at-top
  folder = tmp_path / "qwen2"
  shutil.copytree(os.path.join(FIXTURES, "qwen2"), folder)
  path = folder / "generation_config.json"
  generation = json.loads(path.read_text())
  listed = generation["eos_token_id"]
  generation["eos_token_id"] = (listed if isinstance(listed, list) else [listed]) + [999_999]
  path.write_text(json.dumps(generation))
  tok = hf.hf_tokenizer(str(folder))
  assert tok.unusable_end_ids == [(999_999, str(path))] and 999_999 not in tok.stop_ids
  config = ml_collections.ConfigDict({"model": {
      "checkpoint": "", "hf_checkpoint": str(folder), "param_dtype": "float32",
      "dtype": "float32", "moe_matmul": "auto", "router_dtype": "float32"}, "data": {"source": "jsonl"}})
  monkeypatch.setattr(loading, "check_architecture", lambda *a: None)  # no keys set here
  loading.load_policy(config)
  err = capsys.readouterr().err
  assert (f"warning: {path} lists end token id 999999 (eos_token_id), which the tokenizer "
          f"cannot produce (its ids are 0-{tok.vocab_size - 1}); it is ignored") in err


@pytest.mark.parametrize("change,message", [
    # A key the family needs, missing: named as the file spells it, not as ours (moe_mlp_dim).
    ({"moe_intermediate_size": None}, "missing key 'moe_intermediate_size'"),
    # A value the model refuses: its key and the one it is checked against, spelled alike.
    ({"num_experts_per_tok": 9}, "num_experts_per_tok=9: must be 1 to num_experts=4"),
    ({"num_attention_heads": 3}, "num_attention_heads=3 must be a multiple of "
                                 "num_key_value_heads=2"),
])
def test_errors_about_a_folder_name_its_config_json_keys(tmp_path, change, message):
  """Issue 60: a Qwen3-MoE config.json without moe_intermediate_size said `missing key
  'moe_mlp_dim'`, and too many experts per token `model.num_experts_per_tok ... model.
  num_experts`, keys the user's file does not have."""
  folder = tmp_path / "moe"
  shutil.copytree(os.path.join(FIXTURES, "qwen3_moe"), folder)
  config = json.loads((folder / "config.json").read_text())
  config.update(change)
  (folder / "config.json").write_text(json.dumps({k: v for k, v in config.items()
                                                  if v is not None}))
  with pytest.raises(hf.PretrainedError) as e:
    hf.hf_model_config(str(folder))
  assert str(e.value).startswith(f"{folder / 'config.json'}: ") and message in str(e.value)
  assert "model." not in str(e.value) and "moe_mlp_dim" not in str(e.value)


def test_a_checkpoint_value_that_does_not_split_over_the_mesh_names_its_key():
  """The config check sees only the architecture keys a config sets; a Hugging Face
  folder's own values were not checked against the mesh (a traceback from device_put). The
  qwen2 fixture has 2 KV heads: mesh.tensor=4 cannot split them."""
  from jaxgrpo.run import loading  # pylint: disable=g-import-not-at-top
  import ml_collections  # pylint: disable=g-import-not-at-top
  folder = os.path.join(FIXTURES, "qwen2")
  cfg, _ = hf.inspect_hf(folder, need_weights=False)
  assert cfg.num_kv_heads == 2
  model = {name: None for name in dataclasses.asdict(cfg)}
  model.update(hf_checkpoint=folder, checkpoint="", lora_rank=0, attention=None,
               moe_matmul="auto", router_dtype="float32")
  config = ml_collections.ConfigDict({"model": model, "grpo": {"router_aux_loss_coef": 0.0},
                                      "mesh": {"data": 1, "dcn_data": 1, "fsdp": 1,
                                               "expert": 1, "context": 1, "tensor": 4}})
  with pytest.raises(config_lib.ConfigError, match=re.escape(
      f"{folder}/config.json: num_key_value_heads=2 does not split over the mesh; allowed: "
      "a multiple of mesh.tensor=4")):
    loading.check_architecture(config, cfg)
  config.mesh.tensor = 2
  loading.check_architecture(config, cfg)  # 2 heads over 2 chips
  # A config key that disagrees with the folder names the file's key beside its own.
  config.model.num_kv_heads = 4
  with pytest.raises(config_lib.ConfigError, match=re.escape(
      f"config.model.num_kv_heads=4: the checkpoint {folder} has 2 (its config.json's "
      "num_key_value_heads)")):
    loading.check_architecture(config, cfg)


def test_a_shard_named_in_the_index_but_missing_is_one_line(tmp_path):
  # An interrupted download: the index names model-00002-of-00002.safetensors, which is not
  # there. The check names the file instead of failing inside safetensors.
  folder = tmp_path / "qwen2"
  shutil.copytree(os.path.join(FIXTURES, "qwen2"), folder)
  os.rename(folder / "model.safetensors", folder / "model-00001-of-00002.safetensors")
  import safetensors  # pylint: disable=g-import-not-at-top
  with safetensors.safe_open(folder / "model-00001-of-00002.safetensors", "numpy") as f:
    names = sorted(f.keys())
  weight_map = {n: "model-00001-of-00002.safetensors" for n in names}
  weight_map[names[-1]] = "model-00002-of-00002.safetensors"
  with open(folder / "model.safetensors.index.json", "w") as f:
    json.dump({"metadata": {}, "weight_map": weight_map}, f)
  with pytest.raises(hf.PretrainedError) as e:
    hf.inspect_hf(str(folder))
  assert str(e.value) == (f"{folder}/model-00002-of-00002.safetensors: no such file; "
                          f"model.safetensors.index.json names it for {names[-1]} (an "
                          "incomplete download?)")
  assert hf.inspect_hf(str(folder), need_weights=False)[0].num_layers > 0  # no tensor read


@pytest.mark.parametrize("prefix", ["language_model.model.", "model.language_model."])
def test_gemma3_text_and_vision_folder_loads_its_language_model(tmp_path, prefix):
  # Gemma 3's 4B-27B checkpoints are Gemma3ForConditionalGeneration: the text model's config
  # under text_config (keys it leaves out take Gemma3TextConfig's defaults) and its tensors
  # under a prefix (the hub's 4.x files: language_model.model.; transformers 5:
  # model.language_model.), beside a vision tower that is not read. The fixture rearranged
  # so gives the fixture's logits; an export writes the text model back.
  import safetensors.numpy  # pylint: disable=g-import-not-at-top
  folder, arrays, _ = reference("gemma3")
  shutil.copytree(folder, tmp_path / "mm")
  text = json.load(open(os.path.join(folder, "config.json")))
  for key in ("architectures", "hidden_activation", "rms_norm_eps", "tie_word_embeddings"):
    text.pop(key)  # left to the defaults, as the hub's text_config blocks do
  json.dump({"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
             "text_config": text, "vision_config": {"hidden_size": 8}},
            open(tmp_path / "mm" / "config.json", "w"))
  tensors = safetensors.numpy.load_file(os.path.join(folder, "model.safetensors"))
  tensors = {prefix + k[len("model."):]: v for k, v in tensors.items()}
  tensors["vision_tower.vision_model.embeddings.patch_embedding.weight"] = np.zeros(
      (8, 3), np.float32)
  safetensors.numpy.save_file(tensors, str(tmp_path / "mm" / "model.safetensors"))
  from jaxgrpo.rollout import policy  # pylint: disable=g-import-not-at-top
  loaded = policy.Policy.from_pretrained(str(tmp_path / "mm"))
  assert loaded.cfg == hf.hf_model_config(folder)
  mask = arrays["attention_mask"].astype(bool)
  logits = np.asarray(loaded.logits(arrays["input_ids"], mask))
  assert np.abs(logits - arrays["logits"])[mask].max() <= 1e-4
  _, params, tok = hf.load_hf(str(tmp_path / "mm"))
  artifacts.save_hf(str(tmp_path / "out"), loaded.cfg, params, tok, source=str(tmp_path / "mm"))
  written = json.load(open(tmp_path / "out" / "config.json"))
  assert written["architectures"] == ["Gemma3ForCausalLM"] and "vision_config" not in written
  # transformers' strict Gemma3TextConfig refuses a float here (a trained run's export,
  # loaded in transformers 5.24, matched jaxgrpo's logits within 3.5e-6 once it was an int).
  assert written["query_pre_attn_scalar"] == 24 and isinstance(written["query_pre_attn_scalar"], int)
  assert hf.hf_model_config(str(tmp_path / "out")) == loaded.cfg


def test_a_family_registered_outside_the_package_loads_and_exports_as_itself(tmp_path):
  """Issue 61: a model family is one module (model/families/): registering a Family is all
  that reading and writing its folders needs. Mistral (docs/architecture.md's worked
  example) computes what Llama computes; a folder that says MistralForCausalLM loads, and
  its export keeps saying so (the source's family, while it still computes the same)."""
  from jaxgrpo.model.families import base  # pylint: disable=g-import-not-at-top
  mistral = base.Family(
      architecture="MistralForCausalLM", model_type="mistral", name="Mistral",
      layout={**base.LLAMA_SHAPED, "qk_norm": False, "qkv_bias": False, "num_experts": False},
      read=base.read_llama_shaped, write=base.write_llama_shaped,
      layer_names=base.llama_layer_names, end_of_turn="</s>")
  cfg, params = hf_folder(tmp_path / "llama", "LlamaForCausalLM")
  config = json.load(open(tmp_path / "llama" / "config.json"))
  config.update(architectures=["MistralForCausalLM"], model_type="mistral")
  shutil.copytree(tmp_path / "llama", tmp_path / "mistral")
  (tmp_path / "mistral" / "config.json").write_text(json.dumps(config))
  with pytest.raises(hf.PretrainedError, match="'MistralForCausalLM' is not supported"):
    hf.load_hf(str(tmp_path / "mistral"))
  base.register(mistral)
  try:
    assert "MistralForCausalLM" in base.architectures()
    loaded_cfg, loaded, tok = hf.load_hf(str(tmp_path / "mistral"))
    assert loaded_cfg == cfg
    artifacts.save_hf(str(tmp_path / "out"), loaded_cfg, loaded, tok,
                      source=str(tmp_path / "mistral"))
    written = json.load(open(tmp_path / "out" / "config.json"))
    assert written["architectures"] == ["MistralForCausalLM"]
    assert written["model_type"] == "mistral"
    # Without a source folder the same weights export as the first family with the layout.
    artifacts.save_hf(str(tmp_path / "bare"), loaded_cfg, loaded, tok)
    assert json.load(open(tmp_path / "bare" / "config.json"))["architectures"] == [
        "LlamaForCausalLM"]
  finally:
    del base.FAMILIES["MistralForCausalLM"]


def test_a_model_no_family_computes_is_refused_naming_the_layouts(tmp_path):
  # q/k norms and q/k/v biases together: no transformers class has both.
  cfg = model_lib.ModelConfig(vocab_size=16, d_model=32, num_layers=1, num_heads=4,
                              num_kv_heads=2, head_dim=8, mlp_dim=64, qk_norm=True,
                              qkv_bias=True)
  with pytest.raises(hf.PretrainedError) as e:
    artifacts.save_hf(str(tmp_path), cfg, random_params(cfg, 0),
                      Tokenizer.char_level("0123456789+="))
  message = str(e.value)
  assert "no Hugging Face architecture computes this model (" in message
  assert "qk_norm=True" in message and "qkv_bias=True" in message
  assert "Qwen2ForCausalLM: qkv_bias=True, qk_norm=False, num_experts=False" in message


@pytest.mark.parametrize("name,end", [("qwen2", "<|im_end|>"), ("gemma3", "<end_of_turn>")])
def test_a_chat_run_whose_end_ids_miss_the_turns_end_is_warned(tmp_path, capsys, monkeypatch,
                                                               name, end):
  """A folder whose end ids leave out the token its family's chat template ends a turn
  with (a base model's: only <|endoftext|>) would sample past every answer to max_tokens.
  The family names that token (Family.end_of_turn); the start-up warns, naming it."""
  from jaxgrpo.run import loading  # pylint: disable=g-import-not-at-top
  import ml_collections  # pylint: disable=g-import-not-at-top
  folder = tmp_path / name
  shutil.copytree(os.path.join(FIXTURES, name), folder)
  end_id = hf.hf_tokenizer(str(folder)).hf.token_to_id(end)
  config = ml_collections.ConfigDict({"model": {
      "checkpoint": "", "hf_checkpoint": str(folder), "param_dtype": "float32",
      "dtype": "float32", "moe_matmul": "auto", "router_dtype": "float32"},
      "data": {"source": "jsonl", "use_chat_template": True}})
  monkeypatch.setattr(loading, "check_architecture", lambda *a: None)  # no keys set here
  loading.load_policy(config)
  assert "chat template ends an assistant turn" not in capsys.readouterr().err
  for file in ("config.json", "generation_config.json"):  # as a base model's folder
    values = json.loads((folder / file).read_text())
    values["eos_token_id"] = [i for i in np.atleast_1d(values["eos_token_id"]).tolist()
                              if i != end_id]
    (folder / file).write_text(json.dumps(values))
  settings = json.loads((folder / "tokenizer_config.json").read_text())
  if settings.get("eos_token") == end:
    settings["eos_token"] = "<|endoftext|>"
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
  loading.load_policy(config)
  err = capsys.readouterr().err
  assert f"ends an assistant turn with {end!r} (id {end_id})" in err
  assert f"add {end_id} to generation_config.json's eos_token_id" in err
  config.data.use_chat_template = False  # plain text: the template's end is not the end
  loading.load_policy(config)
  assert "ends an assistant turn" not in capsys.readouterr().err
