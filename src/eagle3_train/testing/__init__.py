"""Builders of the tiny models the tests, benchmarks and docs use (random weights of the real architectures, a
Kimi-style tokenizer), shipped with the package so a user can rehearse a run on them; never imported by a stage."""
