"""Planning: which tensors a run reads (selection), the parsed checkpoint they come from, the blocks
and segments they are cut into, slices of a tensor, and read-ahead windows. Pure, no I/O."""
