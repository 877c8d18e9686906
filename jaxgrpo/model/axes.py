"""The mesh's named axes and the rules that map the model code's logical axis names to them.

Model code names axes logically (`embed`, `q_heads`, `mlp`, `batch`, ...); `RULES` maps those
names to mesh axes in one place, the way maxtext and t5x do, so a new layout is a rules
change, not a model change. Its own module because both sides read it: model/decoder.py
pins activations by these names (passing the rules explicitly, never through flax's
ambient rules context) and model/sharding.py builds the shardings of parameters, batches
and caches from them.
"""

from __future__ import annotations

from typing import Any

# tensor innermost: the fastest links. `expert` splits a mixture's experts (model/moe.py)
# and, for everything else, is one more data axis (MaxText's layout).
MESH_AXES = ("data", "fsdp", "expert", "context", "tensor")
BATCH_AXES = ("data", "fsdp", "expert")

# Logical name -> mesh axis (or axes, or None for replicated).
RULES: tuple[tuple[str, Any], ...] = (
    # Parameters.
    ("vocab", "tensor"),
    # A dense weight's model dimension is split over fsdp and expert (with expert=1 this is
    # fsdp); an expert's over fsdp only, since its expert axis already takes `expert`.
    ("embed", ("fsdp", "expert")),
    ("expert_embed", "fsdp"),
    ("expert", "expert"),
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("head_dim", None),
    ("norm", None),
    ("layers", None),  # the stacked layers' leading axis: every chip holds every layer's share
    # Activations and caches. The model dimension of an activation has no name (whole on
    # every chip): under FSDP each chip gathers a layer's weights and computes its own rows.
    ("batch", BATCH_AXES),
    ("act_length", "context"),  # a packed row's positions (decoder.constrain_rows)
    ("act_heads", "tensor"),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
    ("samples", None),
    ("cache_heads", "tensor"),
    ("length", None),
)
