"""Public helpers for testing code built on moeviz (see the README, "Testing helpers"):
`moeviz.testing.tiny_models` makes tiny random-weight MoE models of every supported family,
`moeviz.testing.scale_traces` synthetic traces shaped like DeepSeek-V3 / Kimi K2 without a model, and
`moeviz.testing.quantized` FP8-block and MXFP4 copies of a tiny model."""
