"""Where each expert's weights sit: the slot layout (layout.py: SlotLayout, one expert per slot,
spare slots holding copies; a layout without copies is the identity case), the copies'
gradient guard (guard.py), and the placements (placement.py: which expert goes to
which slot; replica_placement.py: which experts get copies). Leaf modules: they import no stage
above them (moe.parallel.replicas and moe.dispatch.replica_split use them)."""
