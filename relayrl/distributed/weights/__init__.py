"""Weight transport from the trainer to the rollout engine: one seam (base.py), one file per transport
(local.py: same process; broadcast.py: a process group to separate engine actors; vllm.py: into vLLM's
worker processes). See base.py."""
