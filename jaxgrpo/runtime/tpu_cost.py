"""What a compiled TPU program contains and costs, read from its own HLO text.

`compiled.cost_analysis()` counts a loop body once (a scanned 8-layer stack reports one
layer), gives collectives no interconnect time and Pallas kernels no cost. The compiled HLO
(`compiled.as_text()`) carries what is needed instead:

  * each op's `estimated_cycles` in its backend_config: the TPU compiler's own cost model
    (a large matmul comes within 4% of the MXU peak). An op without one that does work is
    costed by a roofline of its bytes over HBM bandwidth, and counted (`roofline_ops`);
  * loops as jax writes them: a counted loop's trip count from its induction variable
    (constant start, step and bound); a loop whose condition also reads data (decode until
    every row ended) runs at its bound and is flagged (`bounded_loops`); XLA's
    `known_trip_count` where present;
  * conditionals: the costliest branch;
  * collectives with their bytes and replica groups: a ring over the group at
    `Chip.ici_link_bytes_s` each way (two directions), plus `COLLECTIVE_LATENCY_S` a step;
  * Pallas kernels (`tpu_custom_call`, named by the kernel): no cost in the HLO; splash
    attention kernels by their flops at the MXU peak (4 N H T S D, halved for the causal
    mask; its backward kernels 2x), any kernel at least its bytes over HBM bandwidth.

Prediction: `serial` sums every op's time (nothing overlaps), `overlapped` is the lower
bound max(compute, collectives) (all communication hidden). What the model cannot know:
how much communication overlaps compute, host time between programs, and calibration of
the cost model on a real chip.

Bytes are per chip (the compiled program is SPMD, shapes per chip; a collective's input and
output count as HBM traffic beside its ring time), padded to the layout's
tiles (T(8,128): a [..., 128, 1] array takes 128x its elements), and only buffers in HBM
(S(1) is VMEM: a prefetched weight is counted at its copy-start). A fusion that only
slices an operand (the layer of a stacked cache) reads the slice; an in-place
dynamic-update-slice writes the update, not the buffer.
"""

from __future__ import annotations

import dataclasses
import math
import re

# The chip's clock, bf16 MXU peak, HBM bandwidth and one ICI link's one-way bandwidth, by
# device_kind. Public figures: v5p 459 TFLOP/s, 2.765 TB/s, 4,800 Gbit/s ICI per chip over
# 6 links; v5e 197 TFLOP/s, 819 GB/s, 1,600 Gbit/s over 4; v4 275 TFLOP/s, 1.2 TB/s,
# 2,400 Gbit/s over 6; v6e 918 TFLOP/s, 1.64 TB/s, 3,584 Gbit/s over 4. Clocks: v5p 1.75
# GHz and v5e 1.5 GHz (a large matmul's estimated_cycles reproduce the peak at these).


@dataclasses.dataclass(frozen=True)
class Chip:
  clock_hz: float
  peak_flops: float
  hbm_bytes_s: float
  ici_link_bytes_s: float


CHIPS = {"TPU v5": Chip(1.75e9, 459e12, 2.765e12, 100e9),
         "TPU v5 lite": Chip(1.5e9, 197e12, 0.819e12, 50e9),
         "TPU v4": Chip(1.05e9, 275e12, 1.228e12, 50e9),
         "TPU v6 lite": Chip(1.75e9, 918e12, 1.64e12, 112e9)}
COLLECTIVE_LATENCY_S = 1e-6  # per ring step (stated, not measured)

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4,
          "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "s4": 0.5, "u4": 0.5,
          "f8e4m3fn": 1, "f8e5m2": 1, "token": 0}
# Ops that move or compute nothing (views, bookkeeping, async halves counted at the start).
_FREE = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all",
         "partition-id", "replica-id", "opt-barrier", "copy-done", "all-gather-done",
         "all-reduce-done", "collective-permute-done", "async-done", "send-done", "recv-done",
         "call-done",
         "iota", "add-dependency", "domain"}
_COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all",
                "collective-permute")
# Custom calls that only reserve or annotate buffers.
_FREE_TARGETS = {"AllocateBuffer", "AssumeGatherIndicesInBound", "GatherScatterIndicesBitpacked"}
# An op without estimated_cycles this small (scalar bookkeeping) is taken as free, unflagged.
_SMALL = 64 * 1024
_CONTROL = {"while", "conditional", "call", "call-start", "async-start", "async-update"}
_ARRAY = re.compile(r"([a-z0-9]+)\[([\d,]*)\](?:\{([^}]*)\})?")


@dataclasses.dataclass
class Op:
  name: str
  shape: str      # the result's type text: `bf16[2,128]{1,0:T(8,128)(2,1)}` or a tuple
  opcode: str
  operands: list  # names of the operand instructions
  text: str       # the whole instruction (attributes, metadata, backend_config)

  def attr(self, key: str) -> str | None:
    m = re.search(r"\b" + re.escape(key) + r"=(%?[\w.\-]+)", self.text)
    return m.group(1).lstrip("%") if m else None

  @property
  def op_name(self) -> str:
    m = re.search(r'op_name="([^"]*)"', self.text)
    return m.group(1) if m else ""

  @property
  def cycles(self) -> int | None:
    m = re.search(r'"estimated_cycles":"(\d+)"', self.text)
    # INT64_MAX is the compiler's "no estimate" (SparseCore offloads): taken as absent.
    return int(m.group(1)) if m and int(m.group(1)) < 2**62 else None

  @property
  def target(self) -> str | None:
    m = re.search(r'custom_call_target="([^"]*)"', self.text)
    return m.group(1) if m else None


@dataclasses.dataclass
class Module:
  computations: dict  # name -> list of Op, in order
  entry: str
  _by_name: dict = dataclasses.field(default_factory=dict)

  def ops(self, name: str) -> dict:
    if name not in self._by_name:
      self._by_name[name] = {op.name: op for op in self.computations[name]}
    return self._by_name[name]

  def root(self, name: str) -> Op:
    return next(o for o in self.computations[name] if o.text.startswith("ROOT "))


_HEAD = re.compile(r"^(ENTRY )?%([\w.\-]+) .*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT )?%([\w.\-]+) = (.*)$")
# A computation's end: `}`, or `}, execution_thread="sparsecore"` (an offloaded one).
_END = re.compile(r'^\}(, execution_thread="[^"]*")?\s*$')


def parse(text: str) -> Module:
  """The computations of an HLO module's text. An instruction may span lines (a kernel's
  metadata holds newlines): it runs until the next instruction or the computation's end."""
  comps, entry, current, buf = {}, None, None, []

  def flush():
    if buf and current is not None:
      comps[current].append(_op(" ".join(buf)))
    buf.clear()

  for line in text.splitlines():
    if current is None:
      m = _HEAD.match(line)
      if m and not line.startswith(" "):
        current = m.group(2)
        comps[current] = []
        if m.group(1):
          entry = current
      continue
    if _END.match(line):
      flush()
      current = None
      continue
    if _INSTR.match(line):
      flush()
    buf.append(line.strip())
  if entry is None:
    raise ValueError("no ENTRY computation in the HLO text")
  return Module(comps, entry)


def _op(text: str) -> Op:
  m = _INSTR.match(text)
  name, rest = m.group(2), m.group(3)
  # The result type: a tuple "(...)" (balanced) or one array type, then the opcode.
  if rest.startswith("("):
    end = _closing(rest, 1)
    shape, rest = rest[:end + 1], rest[end + 1:].lstrip()
  else:
    shape, _, rest = rest.partition(" ")
  opcode, _, args = rest.partition("(")
  operands = re.findall(r"%([\w.\-]+)", args[:_closing(args, 0)])
  return Op(name, shape, opcode.strip(), operands, text)


def _closing(text: str, start: int) -> int:
  """The index of the ")" that closes a "(" open before text[start] (the one at start-1,
  or one outside text when start is 0)."""
  depth = 1
  for i in range(start, len(text)):
    depth += text[i] == "("
    depth -= text[i] == ")"
    if depth == 0:
      return i
  return len(text)


def _off_hbm(shape: str) -> bool:
  """An array type laid out in another memory space than HBM (S(n), n > 0)."""
  return re.search(r"S\([1-9]", shape) is not None


def _arrays(shape: str):
  """(dtype, dims, layout text) of each array in a type (a tuple's elements)."""
  for dtype, dims, layout in _ARRAY.findall(shape):
    if dtype in _BYTES:
      yield dtype, [int(d) for d in dims.split(",") if d], layout or ""


def array_bytes(shape: str, hbm_only: bool = True) -> float:
  """Bytes of every array in a type, padded to its layout's tile (the first T(a,b,...):
  its last dim pads the most minor dimension, and so on); hbm_only: arrays in another
  memory space (S(n), n > 0: VMEM, SMEM, sync flags) count 0."""
  total = 0.0
  for dtype, dims, layout in _arrays(shape):
    if hbm_only and _off_hbm(layout):
      continue
    dims = list(dims)
    order, _, tiling = layout.partition(":")
    minor = [int(x) for x in order.split(",") if x.strip().isdigit()]
    tile = re.search(r"T\(([\d,]+)\)", tiling)
    if tile and minor and len(minor) == len(dims):
      sizes = [int(x) for x in tile.group(1).split(",")]
      for t, axis in zip(reversed(sizes), minor):
        dims[axis] = -(-dims[axis] // t) * t
    elif tile and not dims:
      dims = [int(tile.group(1).split(",")[-1])] if dtype != "pred" else []
    total += math.prod(dims) * _BYTES[dtype]
  return total


# ---- what an op reads and writes in HBM ----------------------------------------------------

def _param_reads(module: Module, comp: str, index: int) -> float | None:
  """Bytes a fused computation reads of its parameter `index` when it only slices it (the
  slices' sizes; through nested fusions), or None when it reads the whole operand."""
  ops = module.computations[comp]
  param = next((o for o in ops if o.opcode == "parameter"
                and re.search(r"parameter\(" + str(index) + r"\)", o.text)), None)
  if param is None:
    return None
  total = 0.0
  for user in ops:
    if param.name not in user.operands:
      continue
    if user.opcode in ("dynamic-slice", "slice", "gather") and user.operands[0] == param.name:
      total += array_bytes(user.shape, hbm_only=False)
    elif user.opcode == "dynamic-update-slice" and user.operands[0] == param.name:
      continue  # in place: written, not read (the write is the update's)
    elif user.opcode == "fusion":
      inner = _param_reads(module, user.attr("calls"), user.operands.index(param.name))
      if inner is None:
        return None
      total += inner
    else:  # any other use (a bitcast included) reads the whole operand
      return None
  return total


def _in_place_write(module: Module, op: Op, shapes: dict) -> float | None:
  """Bytes an in-place dynamic-update-slice (or a fusion whose root is one, or a tuple of
  them) writes: its updates; None for an op that writes its whole output."""
  if op.opcode == "dynamic-update-slice":
    return array_bytes(shapes.get(op.operands[1], ""), hbm_only=False)
  if op.opcode != "fusion":
    return None
  ops = module.ops(op.attr("calls"))
  root = module.root(op.attr("calls"))
  roots = [ops[n] for n in root.operands] if root.opcode == "tuple" else [root]
  total = 0.0
  for r in roots:
    while r.opcode == "bitcast":
      r = ops[r.operands[0]]
    if r.opcode not in ("dynamic-update-slice", "scatter"):
      return None
    update = ops.get(r.operands[2 if r.opcode == "scatter" else 1])
    total += array_bytes(update.shape, hbm_only=False) if update else 0.0
  return total


def op_bytes(module: Module, op: Op, shapes: dict) -> float:
  """HBM bytes `op` reads and writes (module docstring): operands, then the result."""
  if op.opcode in _FREE or op.opcode in _CONTROL:
    return 0.0
  in_place = _in_place_write(module, op, shapes)
  read = 0.0
  for i, name in enumerate(op.operands):
    if op.opcode in ("dynamic-slice", "slice") and i == 0:
      read += 0.0 if _off_hbm(shapes.get(name, "")) else array_bytes(op.shape, False)
      continue
    if i == 0 and in_place is not None and op.opcode == "dynamic-update-slice":
      continue
    if op.opcode == "fusion":
      sliced = _param_reads(module, op.attr("calls"), i)
      if sliced is not None:
        read += 0.0 if _off_hbm(shapes.get(name, "")) else sliced
        continue
    read += array_bytes(shapes.get(name, ""))
  write = in_place if in_place is not None else array_bytes(op.shape)
  if op.opcode in ("dynamic-slice", "slice", "gather") and _off_hbm(op.shape):
    write = 0.0
  return read + write


# ---- time --------------------------------------------------------------------------------

@dataclasses.dataclass
class Cost:
  """Seconds by kind, HBM bytes and flags, for one execution of a computation."""
  compute_s: float = 0.0     # ops by their estimated_cycles (or roofline), kernels by model
  collective_s: float = 0.0  # collectives by the ring model
  bytes: float = 0.0
  kernel_flops: float = 0.0
  roofline_ops: int = 0
  bounded_loops: int = 0
  unknown_loops: int = 0

  def add(self, other: "Cost", times: float = 1.0) -> None:
    self.compute_s += other.compute_s * times
    self.collective_s += other.collective_s * times
    self.bytes += other.bytes * times
    self.kernel_flops += other.kernel_flops * times
    self.roofline_ops += other.roofline_ops
    self.bounded_loops += other.bounded_loops
    self.unknown_loops += other.unknown_loops

  @property
  def serial_s(self) -> float:
    return self.compute_s + self.collective_s

  @property
  def overlapped_s(self) -> float:
    return max(self.compute_s, self.collective_s)


def group_size(op: Op) -> int:
  """Chips in each replica group of a collective (every format XLA prints)."""
  text = op.text
  m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", text)
  if m:
    sizes = dict(re.findall(r"'(\w+)'=(\d+)", m.group(1)))
    return math.prod(int(sizes[a]) for a in re.findall(r"'(\w+)'", m.group(2)) if a in sizes)
  m = re.search(r"replica_groups=\[([\d,]+)\]<=", text)
  if m:
    return int(m.group(1).split(",")[-1])
  m = re.search(r"replica_groups=\{\{([\d,]*)\}", text)
  if m:
    return len([x for x in m.group(1).split(",") if x])
  m = re.search(r"source_target_pairs=\{(.*?)\}\s*[,}]", text)
  if m or "collective-permute" in op.opcode:
    return 2
  return 1


def collective_seconds(kind: str, nbytes: float, n: int, chip: Chip) -> float:
  """A ring over n chips, both directions of one link each way: the bytes on the wire
  (all-gather: the output's (n-1)/n, reduce-scatter: the input's, all-reduce: twice) over
  2 x the link's bandwidth, plus a latency per ring step."""
  if n <= 1:
    return 0.0
  if kind == "collective-permute":
    return nbytes / chip.ici_link_bytes_s + COLLECTIVE_LATENCY_S
  wire = nbytes * (n - 1) / n * (2 if kind == "all-reduce" else 1)
  return wire / (2 * chip.ici_link_bytes_s) + (n - 1) * COLLECTIVE_LATENCY_S


def kernel_flops(op: Op, shapes: dict) -> float:
  """A splash attention kernel's flops from its q, k, v operands ([N, H, T, D] per chip):
  4 N H T S D, halved (causal), x2 for a backward kernel. 0 for other kernels."""
  name = op.name.lower() + op.op_name.lower()
  if "splash" not in name and "flash" not in name:
    return 0.0
  arrays = [a for n in op.operands for a in _arrays(shapes.get(n, ""))]
  big = [dims for dtype, dims, _ in arrays if len(dims) == 4 and dtype in ("bf16", "f32", "f16")]
  if len(big) < 3:
    return 0.0
  q, k = big[0], big[1]
  flops = 4 * q[0] * q[1] * q[2] * k[2] * q[3] / 2
  return flops * (2 if "bwd" in name or "dq" in name or "dkv" in name else 1)


def _trip_count(module: Module, op: Op, caller: dict):
  """(trips, kind) of a while op: kind 'counted', 'bounded' (the condition also reads data:
  its bound) or 'unknown' (1 assumed)."""
  known = re.search(r'"known_trip_count":\{"n":"(\d+)"', op.text)
  if known:
    return int(known.group(1)), "counted"
  cond_name, body_name = op.attr("condition"), op.attr("body")
  cond = module.ops(cond_name)
  root = module.root(cond_name)
  compares = [o for o in cond.values() if o.opcode == "compare"]
  for cmp in compares:
    args = [cond.get(n) for n in cmp.operands]
    if len(args) != 2 or None in args:
      continue
    gte, const = args
    if gte.opcode != "get-tuple-element" or const.opcode != "constant":
      continue
    index = int(gte.attr("index"))
    bound = _constant(const)
    start = _init_value(module, op, index, caller)
    step = _step_value(module, body_name, index)
    if bound is None or start is None or not step:
      continue
    direction = cmp.attr("direction")
    trips = max(0, -(-(bound - start) // step) + (1 if direction == "LE" else 0))
    return trips, "counted" if root is cmp else "bounded"
  return 1, "unknown"


def _constant(op: Op):
  m = re.search(r"constant\((-?\d+)\)", op.text)
  return int(m.group(1)) if m else None


def _follow(ops: dict, op: Op) -> Op:
  while op is not None and op.opcode in ("copy", "bitcast", "convert") and op.operands:
    op = ops.get(op.operands[0])
  return op


def _init_value(module: Module, op: Op, index: int, caller: dict):
  init = caller.get(op.operands[0])
  if init is None or init.opcode != "tuple" or index >= len(init.operands):
    return None
  value = _follow(caller, caller.get(init.operands[index]))
  return _constant(value) if value is not None and value.opcode == "constant" else None


def _step_value(module: Module, body: str, index: int):
  ops = module.ops(body)
  root = module.root(body)
  if root.opcode != "tuple" or index >= len(root.operands):
    return None
  nxt = _follow(ops, ops.get(root.operands[index]))
  if nxt is None or nxt.opcode != "add":
    return None
  for name in nxt.operands:
    c = _follow(ops, ops.get(name))
    if c is not None and c.opcode == "constant":
      return _constant(c)
  return None


def computation_cost(module: Module, name: str, chip: Chip, memo=None) -> Cost:
  """The cost of one execution of computation `name` (loops by their trip counts)."""
  memo = {} if memo is None else memo
  if name in memo:
    return memo[name]
  ops = module.ops(name)
  shapes = {n: o.shape for n, o in ops.items()}
  cost = Cost()
  for op in module.computations[name]:
    kind = op.opcode.replace("-start", "")
    if op.opcode == "while":
      trips, how = _trip_count(module, op, ops)
      body = computation_cost(module, op.attr("body"), chip, memo)
      cost.add(body, trips)
      cost.bounded_loops += how == "bounded"
      cost.unknown_loops += how == "unknown"
    elif op.opcode == "conditional":
      branches = re.search(r"branch_computations=\{([^}]*)\}", op.text)
      names = re.findall(r"%([\w.\-]+)", branches.group(1)) if branches else []
      names += [n for n in (op.attr("true_computation"), op.attr("false_computation")) if n]
      costs = [computation_cost(module, n, chip, memo) for n in names]
      if costs:
        cost.add(max(costs, key=lambda c: c.serial_s))
    elif op.opcode in ("call", "call-start", "async-start"):  # call-start: an offload
      called = op.attr("to_apply") or op.attr("calls")
      if called:
        cost.add(computation_cost(module, called, chip, memo))
    elif kind in _COLLECTIVES:
      nbytes = max((array_bytes(f"{d}[{','.join(map(str, s))}]", False)
                    for d, s, _ in _arrays(op.shape)), default=0.0)
      cost.collective_s += collective_seconds(kind, nbytes, group_size(op), chip)
      # What it reads and writes in HBM (an async start's type holds both): the gathered
      # weights of an FSDP decode step are written and read again every token-step.
      cost.bytes += array_bytes(op.shape) + (0.0 if op.opcode.endswith("-start") else sum(
          array_bytes(shapes.get(n, "")) for n in op.operands))
    elif op.opcode in _FREE or op.opcode == "async-update" or op.target in _FREE_TARGETS:
      continue
    else:
      nbytes = op_bytes(module, op, shapes)
      cost.bytes += nbytes
      if op.target == "tpu_custom_call":
        flops = kernel_flops(op, shapes)
        cost.kernel_flops += flops
        cost.compute_s += max(flops / chip.peak_flops, nbytes / chip.hbm_bytes_s)
      elif op.cycles is not None:
        cost.compute_s += op.cycles / chip.clock_hz
      elif op.opcode not in ("copy-start",) and nbytes >= _SMALL:
        cost.compute_s += nbytes / chip.hbm_bytes_s
        cost.roofline_ops += 1
  memo[name] = cost
  return cost


def program_cost(text: str, chip: Chip) -> Cost:
  module = parse(text)
  return computation_cost(module, module.entry, chip)


def kernels(text: str) -> dict:
  """The Pallas kernels a compiled program contains: kernel name -> count of its
  tpu_custom_call ops (named by the kernel, as the op's metadata names it)."""
  found = {}
  for m in re.finditer(r"%([\w.\-]+) = [^\n]*?custom_call_target=\"tpu_custom_call\"", text):
    base = re.sub(r"\.\d+$", "", m.group(1))
    found[base] = found.get(base, 0) + 1
  return found


def interpreted_kernels(text: str) -> int:
  """Ops that came from a Pallas kernel run in interpret mode: a program that would crawl
  on a TPU. Compiled, a kernel is one tpu_custom_call whose metadata reads
  `.../<kernel>/<kernel>/pallas_call`; interpreted, its body becomes ordinary ops under
  `.../<kernel>/<kernel>/while/...` (the kernel's name scope twice, then Pallas'
  interpreter loop) and no pallas_call."""
  count = 0
  for m in re.finditer(r'op_name="([^"]*)"', text):
    name = m.group(1)
    if "pallas_call" not in name and re.search(r"/([A-Za-z_][\w]*)/\1/while/", name):
      count += 1
  return count


def decode_loops(module: Module) -> list:
  """(caller, while op) of each token loop: a while whose own ops are outside a decode step
  (jax.named_scope "decode_step", decode.step) but whose body runs one. Outermost first."""
  def runs_step(comp: str, seen=None) -> bool:
    seen = set() if seen is None else seen
    if comp in seen:
      return False
    seen.add(comp)
    for o in module.computations[comp]:
      if "decode_step" in o.op_name:
        return True
      for key in ("body", "calls", "to_apply"):
        called = o.attr(key)
        if called and called in module.computations and runs_step(called, seen):
          return True
    return False

  found = []
  for comp, ops in module.computations.items():
    for o in ops:
      if o.opcode == "while" and "decode_step" not in o.op_name and runs_step(o.attr("body")):
        found.append((comp, o))
  return found


def decode_step_cost(text: str, chip: Chip):
  """(Cost of one token-step of the program's first decode loop, its trip bound), or None
  for a program without one."""
  module = parse(text)
  loops = decode_loops(module)
  if not loops:
    return None
  comp, op = loops[0]
  trips, _ = _trip_count(module, op, module.ops(comp))
  return computation_cost(module, op.attr("body"), chip), trips


def chip_for(device_kind: str) -> Chip | None:
  return CHIPS.get(device_kind)


def describe_kernels(found: dict) -> str:
  return ", ".join(f"{k} x{v}" for k, v in sorted(found.items())) or "none"



# ---- floors --------------------------------------------------------------------------------

_DTYPE_BYTES = {"bfloat16": 2, "float32": 4}


def decode_weight_bytes(cfg, tensor: int = 1, expert: int = 1) -> float:
  """Bytes of the weights one decode step reads on a chip, in the compute dtype (what
  decode.prepare casts them to): every layer's attention and MLP (a mixture's: the chip's
  experts, E / expert, all of which a batch of rows touches) split over `tensor`, and the
  output head [V, d]; the embedding's few gathered rows are left out."""
  d, h, hk, hd = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  attn = d * (h + 2 * hk) * hd + h * hd * d
  if cfg.num_experts:
    mlp = d * cfg.num_experts + cfg.num_experts // expert * 3 * d * cfg.moe_mlp_dim
  else:
    mlp = 3 * d * cfg.mlp_dim
  return (cfg.num_layers * (attn + mlp) + cfg.vocab_size * d) / tensor * _DTYPE_BYTES[cfg.dtype]


def decode_kv_bytes(cfg, *, prompts: int, samples: int, prompt_len: int, slots: int,
                    tensor: int = 1) -> float:
  """Bytes of the K/V a decode step reads on a chip when every slot is live (its last step):
  `prompts` prompts' keys and values once each (shared by their samples) and each of their
  `samples` samples' `slots` generated ones, KV heads split over `tensor` where they
  divide."""
  heads = cfg.num_kv_heads // tensor if cfg.num_kv_heads % tensor == 0 else cfg.num_kv_heads
  per_token = 2 * cfg.num_layers * heads * cfg.head_dim * _DTYPE_BYTES[cfg.dtype]
  return prompts * (prompt_len + samples * slots) * per_token
