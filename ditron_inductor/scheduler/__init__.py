"""Scheduler: per match, whether to fuse and how (Task -> Decision with a typed plan, plan.py)."""
