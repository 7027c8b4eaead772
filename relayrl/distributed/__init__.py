"""Execution modes: launch role workers in-process or as Ray actors in a placement group (launch.py)."""
