"""Sampling completions from the policy: the native engine with its two compiled profiles
(sampling, with compaction of finished rows), the notebook API (policy), and JetStream as an
optional backend (jetstream_engine, jetstream_rollouts). Imports model/ and runtime/.

`jetstream_*` import google-jetstream and, through it, TensorFlow, so nothing imports them
unless config.generation.backend='jetstream' asks for it (build.make_engine), or
`python -m jaxgrpo.serve` runs."""
