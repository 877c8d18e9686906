"""The policy as a function: the decoder (decoder, attention), its token-by-token step
(decode), sampling distributions (distribution), per-token log-probs for the loss (scoring),
how parameters and activations lie on a mesh (sharding), Hugging Face checkpoints (hf) and
text <-> tokens (tokenizer, chat). Imports only runtime/."""
