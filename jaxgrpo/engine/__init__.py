"""Rollout backends other than the native sampler (jaxgrpo.sampling).

Nothing here is imported by `jaxgrpo.train`: `jetstream_engine` imports google-jetstream and,
through it, TensorFlow, so it is imported only when config.generation.backend='jetstream'
asks for it (build.make_engine) or by `python -m jaxgrpo.serve`.
"""
