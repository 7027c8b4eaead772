"""Rollout engines: token ids in, token ids + log-probs out. See base.py for the protocol."""
