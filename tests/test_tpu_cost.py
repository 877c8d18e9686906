"""runtime/tpu_cost.py on hand-written HLO (the compiled TPU programs' own text is checked in
tests/test_compile_check.py, with libtpu): loops, conditionals, collectives, kernels and
bytes, each against numbers worked out by hand below."""

import pytest

from jaxgrpo.runtime import tpu_cost

CHIP = tpu_cost.Chip(clock_hz=1e9, peak_flops=1e12, hbm_bytes_s=1e9, ici_link_bytes_s=1e9)

# A counted loop (i from 0 while i < 8, step 1) around a body of one 1000-cycle fusion that
# reads layer i of a stacked [8, 128, 128] f32 weight (a dynamic-slice inside the fusion)
# and a data-dependent loop (i < 4 and not done) around a 500-cycle op; a conditional
# whose branches cost 100 and 300 cycles; an all-gather of f32[256, 128] over 4 chips.
HLO = """HloModule jit_f, is_scheduled=true

%slice_layer (p0: f32[8,128,128], p1: s32[], p2: f32[128,128]) -> f32[128,128] {
  %p0 = f32[8,128,128]{2,1,0:T(8,128)} parameter(0)
  %p1 = s32[] parameter(1)
  %p2 = f32[128,128]{1,0:T(8,128)} parameter(2)
  %c0 = s32[] constant(0)
  %ds = f32[1,128,128]{2,1,0:T(8,128)} dynamic-slice(%p0, %p1, %c0, %c0), dynamic_slice_sizes={1,128,128}
  %b = f32[128,128]{1,0:T(8,128)} bitcast(%ds)
  ROOT %dot = f32[128,128]{1,0:T(8,128)} convolution(%p2, %b), dim_labels=bf_io->bf
}

%body (param: (s32[], f32[128,128], f32[8,128,128])) -> (s32[], f32[128,128], f32[8,128,128]) {
  %param = (s32[], f32[128,128]{1,0:T(8,128)}, f32[8,128,128]{2,1,0:T(8,128)}) parameter(0)
  %i = s32[] get-tuple-element(%param), index=0
  %x = f32[128,128]{1,0:T(8,128)} get-tuple-element(%param), index=1
  %w = f32[8,128,128]{2,1,0:T(8,128)} get-tuple-element(%param), index=2
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  %y = f32[128,128]{1,0:T(8,128)} fusion(%w, %i, %x), kind=kOutput, calls=%slice_layer, metadata={op_name="jit(f)/while/body/decode_step/dot_general"}, backend_config={"window_config":{"estimated_cycles":"1000"}}
  ROOT %t = (s32[], f32[128,128]{1,0:T(8,128)}, f32[8,128,128]{2,1,0:T(8,128)}) tuple(%next, %y, %w)
}

%cond (param.1: (s32[], f32[128,128], f32[8,128,128])) -> pred[] {
  %param.1 = (s32[], f32[128,128]{1,0:T(8,128)}, f32[8,128,128]{2,1,0:T(8,128)}) parameter(0)
  %i.1 = s32[] get-tuple-element(%param.1), index=0
  %eight = s32[] constant(8)
  ROOT %lt = pred[] compare(%i.1, %eight), direction=LT
}

%body2 (param.2: (s32[], pred[])) -> (s32[], pred[]) {
  %param.2 = (s32[], pred[]) parameter(0)
  %j = s32[] get-tuple-element(%param.2), index=0
  %d = pred[] get-tuple-element(%param.2), index=1
  %one.2 = s32[] constant(1)
  %jn = s32[] add(%j, %one.2)
  %work = f32[128,128]{1,0:T(8,128)} iota(), iota_dimension=0
  %e = f32[128,128]{1,0:T(8,128)} exponential(%work), backend_config={"estimated_cycles":"500"}
  ROOT %t2 = (s32[], pred[]) tuple(%jn, %d)
}

%cond2 (param.3: (s32[], pred[])) -> pred[] {
  %param.3 = (s32[], pred[]) parameter(0)
  %j.3 = s32[] get-tuple-element(%param.3), index=0
  %d.3 = pred[] get-tuple-element(%param.3), index=1
  %four = s32[] constant(4)
  %lt.3 = pred[] compare(%j.3, %four), direction=LT
  %nd = pred[] not(%d.3)
  ROOT %and = pred[] and(%lt.3, %nd)
}

%cheap (a: f32[128,128]) -> f32[128,128] {
  %a = f32[128,128]{1,0:T(8,128)} parameter(0)
  ROOT %n = f32[128,128]{1,0:T(8,128)} negate(%a), backend_config={"estimated_cycles":"100"}
}

%dear (a.1: f32[128,128]) -> f32[128,128] {
  %a.1 = f32[128,128]{1,0:T(8,128)} parameter(0)
  ROOT %n.1 = f32[128,128]{1,0:T(8,128)} negate(%a.1), backend_config={"estimated_cycles":"300"}
}

ENTRY %main (w.0: f32[8,128,128], x.0: f32[128,128], s.0: f32[64,128]) -> f32[128,128] {
  %w.0 = f32[8,128,128]{2,1,0:T(8,128)} parameter(0)
  %x.0 = f32[128,128]{1,0:T(8,128)} parameter(1)
  %s.0 = f32[64,128]{1,0:T(8,128)} parameter(2)
  %zero = s32[] constant(0)
  %start = s32[] copy(%zero)
  %init = (s32[], f32[128,128]{1,0:T(8,128)}, f32[8,128,128]{2,1,0:T(8,128)}) tuple(%start, %x.0, %w.0)
  %loop = (s32[], f32[128,128]{1,0:T(8,128)}, f32[8,128,128]{2,1,0:T(8,128)}) while(%init), condition=%cond, body=%body, metadata={op_name="jit(f)/while"}
  %f = pred[] constant(false)
  %init2 = (s32[], pred[]) tuple(%zero, %f)
  %loop2 = (s32[], pred[]) while(%init2), condition=%cond2, body=%body2
  %out = f32[128,128]{1,0:T(8,128)} get-tuple-element(%loop), index=1
  %k = s32[] constant(1)
  %branch = f32[128,128]{1,0:T(8,128)} conditional(%k, %out, %out), branch_computations={%cheap, %dear}
  %ag = f32[256,128]{1,0:T(8,128)} all-gather(%s.0), channel_id=1, replica_groups=[1,4]<=[4], dimensions={0}
  ROOT %r = f32[128,128]{1,0:T(8,128)} copy(%branch), backend_config={"estimated_cycles":"50"}
}
"""


def test_loops_conditionals_and_collectives_by_hand():
  cost = tpu_cost.program_cost(HLO, CHIP)
  # Cycles at 1 GHz: the counted loop 8 x 1000, the data-dependent one at its bound 4 x 500,
  # the dearer branch 300, the final copy 50: 10,350 cycles = 10.35 us.
  assert cost.compute_s == pytest.approx(10.35e-6)
  assert (cost.bounded_loops, cost.unknown_loops) == (1, 0)
  # The all-gather's output is 256 x 128 f32 = 131,072 bytes; a ring of 4 puts 3/4 of it,
  # 98,304 bytes, on the wire, both directions of a 1 GB/s link: 49.152 us, plus 3 ring
  # steps of 1 us.
  assert cost.collective_s == pytest.approx(49.152e-6 + 3e-6)
  assert cost.serial_s == pytest.approx(cost.compute_s + cost.collective_s)
  assert cost.overlapped_s == pytest.approx(cost.collective_s)


def test_a_fusion_that_slices_a_stacked_weight_reads_one_layer():
  module = tpu_cost.parse(HLO)
  body = module.ops("body")
  shapes = {n: o.shape for n, o in body.items()}
  # Layer i of the [8, 128, 128] f32 weight (65,536 bytes, not 524,288), x (65,536), the
  # result (65,536) and the 4-byte index.
  assert tpu_cost.op_bytes(module, body["y"], shapes) == 3 * 65536 + 4
  # One token-step of the loop whose body runs decode_step: that fusion, and the counter's
  # add (two 4-byte operands, a 4-byte result).
  step, bound = tpu_cost.decode_step_cost(HLO, CHIP)
  assert bound == 8 and step.bytes == 3 * 65536 + 4 + 12
  assert step.compute_s == pytest.approx(1e-6)


def test_collective_time_follows_its_bytes():
  one = tpu_cost.collective_seconds("all-gather", 1e6, 4, CHIP)
  four = tpu_cost.collective_seconds("all-gather", 4e6, 4, CHIP)
  latency = 3 * tpu_cost.COLLECTIVE_LATENCY_S
  assert (four - latency) == pytest.approx(4 * (one - latency))
  # An all-reduce sends twice an all-gather's bytes; one chip sends nothing.
  assert tpu_cost.collective_seconds("all-reduce", 1e6, 4, CHIP) - latency == pytest.approx(
      2 * (one - latency))
  assert tpu_cost.collective_seconds("all-gather", 1e6, 1, CHIP) == 0


@pytest.mark.parametrize("shape, expected", [
    # A new token's key [4, 128, 1] bf16 laid out with its 1 most minor: tiles of (8, 128)
    # pad that 1 to 128: 4 x 128 x 128 x 2 bytes, 128x the 1,024 it holds.
    ("bf16[4,128,1]{2,1,0:T(8,128)(2,1)}", 4 * 128 * 128 * 2),
    # The same along the second-minor axis: [4, 1, 128] pads 1 -> 8 only.
    ("bf16[4,1,128]{2,1,0:T(8,128)(2,1)}", 4 * 8 * 128 * 2),
    # A VMEM buffer (S(1)) is no HBM traffic; a tuple sums its elements.
    ("f32[8,128]{1,0:T(8,128)S(1)}", 0),
    ("(f32[8,128]{1,0:T(8,128)}, s32[16]{0})", 8 * 128 * 4 + 16 * 4),
])
def test_bytes_are_padded_to_the_layout_tiles(shape, expected):
  assert tpu_cost.array_bytes(shape) == expected


def test_replica_groups_in_every_format():
  op = lambda text: tpu_cost._op(f"%a = f32[8]{{0}} all-reduce(%b), {text}")
  assert tpu_cost.group_size(op("replica_groups={{0,1},{2,3}}")) == 2
  assert tpu_cost.group_size(op("replica_groups=[2,4]<=[8]")) == 4
  assert tpu_cost.group_size(op("replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0'}")) == 4
  assert tpu_cost.group_size(op(
      "replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0','axis_1'}")) == 8


KERNELS = """HloModule m

ENTRY %main (q: f32[2,4,128,128]) -> f32[2,4,128,128] {
  %q = f32[2,4,128,128]{3,2,1,0:T(8,128)} parameter(0)
  %splash_mha_fwd.1 = f32[2,4,128,128]{3,2,1,0:T(8,128)} custom-call(%q, %q, %q), custom_call_target="tpu_custom_call", metadata={op_name="jit(f)/splash_mha_fwd/splash_mha_fwd/pallas_call"}
  %splash_mha_fwd.2 = f32[2,4,128,128]{3,2,1,0:T(8,128)} custom-call(%q, %q, %q), custom_call_target="tpu_custom_call", metadata={op_name="jit(f)/splash/pallas_call"}
  ROOT %r = f32[2,4,128,128]{3,2,1,0:T(8,128)} add(%splash_mha_fwd.1, %splash_mha_fwd.2)
}
"""

INTERPRETED = """HloModule m

ENTRY %main (q: f32[2,4,128,128]) -> f32[2,4,128,128] {
  %q = f32[2,4,128,128]{3,2,1,0:T(8,128)} parameter(0)
  ROOT %dot = f32[2,4,128,128]{3,2,1,0:T(8,128)} multiply(%q, %q), metadata={op_name="jit(f)/splash_mha_fwd/splash_mha_fwd/while/body/dot_general"}
}
"""


def test_kernels_are_counted_by_name_and_interpreted_ones_found():
  assert tpu_cost.kernels(KERNELS) == {"splash_mha_fwd": 2}
  assert tpu_cost.interpreted_kernels(KERNELS) == 0
  assert tpu_cost.kernels(INTERPRETED) == {}
  assert tpu_cost.interpreted_kernels(INTERPRETED) == 1
  # A kernel's cost: 4 N H T S D / 2 flops (causal) at the peak: 4 x 2 x 4 x 128 x 128 x 128
  # / 2 = 33,554,432 flops = 33.6 us at 1e12; its bytes (3 inputs and the output, 2 x 4 x 128
  # x 128 f32 = 524,288 each, = 2,097,152) take 2.1 ms at 1 GB/s, the larger of the two.
  # The add after them has no estimated_cycles: its 3 x 524,288 bytes at HBM bandwidth,
  # flagged as costed by a roofline.
  cost = tpu_cost.program_cost(KERNELS, CHIP)
  assert cost.kernel_flops == 2 * 33554432
  assert cost.compute_s == pytest.approx((2 * 2097152 + 3 * 524288) / 1e9)
  assert cost.roofline_ops == 1


OFFLOAD = """HloModule m

%offloaded (p: s32[16]) -> s32[16] {
  %p = s32[16]{0:T(128)} parameter(0)
  ROOT %n = s32[16]{0:T(128)} negate(%p), backend_config={"estimated_cycles":"40"}
}, execution_thread="sparsecore"

%scatter (q: f32[256,128]) -> f32[256,128] {
  %q = f32[256,128]{1,0:T(8,128)} parameter(0)
  ROOT %m = f32[256,128]{1,0:T(8,128)} negate(%q)
}

ENTRY %main (a: s32[16], b: f32[256,128]) -> f32[256,128] {
  %a = s32[16]{0:T(128)} parameter(0)
  %b = f32[256,128]{1,0:T(8,128)} parameter(1)
  %start = ((s32[16]{0:T(128)}), s32[16]{0:T(128)}, u32[]{:S(8)}) call-start(%a), async_execution_thread="sparsecore", to_apply=%offloaded
  %done = s32[16]{0:T(128)} call-done(%start)
  ROOT %f = f32[256,128]{1,0:T(8,128)} fusion(%b), kind=kLoop, calls=%scatter, backend_config={"estimated_cycles":"9223372036854775807"}
}
"""


def test_offloaded_computations_and_the_no_estimate_sentinel_are_read():
  # A SparseCore computation ends `}, execution_thread="sparsecore"`: its own computation
  # (the next is not swallowed as its instruction); the offloaded call costs its 40 cycles
  # (40 ns at 1 GHz). A fusion whose estimate is INT64_MAX (the compiler's "none") is
  # costed by its bytes instead, and flagged: 256 x 128 f32 read and written, 262,144
  # bytes at 1 GB/s = 262.144 us.
  module = tpu_cost.parse(OFFLOAD)
  assert sorted(module.computations) == ["main", "offloaded", "scatter"]
  cost = tpu_cost.program_cost(OFFLOAD, CHIP)
  assert cost.compute_s == pytest.approx(40e-9 + 262.144e-6)
  assert cost.roofline_ops == 1
