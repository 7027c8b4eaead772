"""Agents: executors that turn a prompt into trajectories on a rollout engine, and reward sources."""
