"""Public helpers for testing code built on moeviz: `moeviz.testing.tiny_models` makes tiny random-weight
MoE models of every supported family (see the README, "Testing helpers")."""
