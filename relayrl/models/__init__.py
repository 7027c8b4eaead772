"""Model loading (policy, critic, reward model), value heads, LoRA, chunked log-probs, tiny local models."""
