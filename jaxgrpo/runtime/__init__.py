"""What every command runs on and nothing model-specific: processes of a pod (distributed),
XLA's options and compilation cache (compile_options), faults and preemption (faults), and
the run's logs (metrics). Imports nothing else from jaxgrpo."""
