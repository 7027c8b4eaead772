"""Execution modes: launch role workers in-process or as Ray actors in placement groups (launch/)."""
