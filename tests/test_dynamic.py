"""Dynamic sampling's choice of groups, on hand-built rewards."""

import numpy as np
import pytest

from jaxgrpo.algo import dynamic


def test_generation_batches_are_oversampled_and_split_over_the_devices():
  assert dynamic.generation_prompts(32, 2.0, 1) == 64
  assert dynamic.generation_prompts(32, 1.0, 8) == 32
  # ceil(1.3 x 32) = 42, rounded up to a multiple of 8 data-parallel devices: 48.
  assert dynamic.generation_prompts(32, 1.3, 8) == 48
  assert dynamic.generation_prompts(10, 1.5, 1) == 15


def test_a_group_is_informative_when_its_scored_rewards_differ():
  # G = 3. Group 0 differs; group 1 is flat; group 2 differs only through an unscored row
  # (the 5.0), so it is flat; group 3 has one scored row: flat; group 4 differs by 1 ulp.
  values = [1, 0, 0, 0.5, 0.5, 0.5, 1, 1, 5, 2, 9, 9, 1, 1, np.nextafter(1, 2, dtype=np.float32)]
  scored = [1, 1, 1, 1, 1, 1, 1, 1, 0, 1, 0, 0, 1, 1, 1]
  np.testing.assert_array_equal(dynamic.informative(values, scored, 3),
                                [True, False, False, False, True])


def test_the_first_b_informative_groups_in_data_order_then_flat_ones_fill():
  # Two generation batches of 4 groups: informative groups 1, 3 | 4, 6, 7.
  flags = [np.array([0, 1, 0, 1], bool), np.array([1, 0, 1, 1], bool)]
  chosen, filled = dynamic.choose(flags, 4)
  np.testing.assert_array_equal(chosen, [1, 3, 4, 6])  # 7 is informative but not needed
  assert filled == 0
  # One batch only, 2 informative of 4 needed: the first two flat groups fill, and the
  # update sees them in data order.
  chosen, filled = dynamic.choose(flags[:1], 4)
  np.testing.assert_array_equal(chosen, [0, 1, 2, 3])
  assert filled == 2
  chosen, filled = dynamic.choose([np.array([0, 0, 1, 0, 0], bool)], 3)
  np.testing.assert_array_equal(chosen, [0, 1, 2])
  assert filled == 2
  with pytest.raises(ValueError, match="fewer than the 6"):
    dynamic.choose(flags[:1], 6)
