"""The math of a step: attention (its ops, Triton kernel and plain-torch reference), the paged KV
cache, fused projections and the deferred rotary embedding. Nothing here imports the engine's
control code (scheduler, batch builder, runner, loop): the arrows point from there to here."""
