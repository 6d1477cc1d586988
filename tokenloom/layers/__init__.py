"""Building blocks the model families share: norms, rotary embedding, MLPs, fused CPU ops, the op tape,
prepacked linears, and ``CustomOp`` (one forward per device)."""
