"""A run's assembly, for the commands: setup (the command line, the validated config, the
policy and data loaded on the host: `prepare(argv) -> Setup`), loading (the host-side
loading shared by every command), build (the device side: mesh, parameters, the rollout
engine, the update), sizing (the 'auto' batch sizes, from the compiler's memory figures),
rollouts (the rollout seam: a step's scored batch from one sampler call, dynamic sampling or
episodes), trainer (the training loop), evaluator (evaluation outside training), checkpoint
(orbax checkpoints), artifacts (a run read back, and exported) and serving (a run behind
JetStream's server). The commands (train, evaluate, export, serve, plot) are thin mains
over it; nothing here imports a command."""
