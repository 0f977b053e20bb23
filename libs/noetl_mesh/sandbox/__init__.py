"""Sandboxed tasks (D33): user code runs with only what its playbook gave it.

``policy`` (pure) reads a worker pool's policy; the rest confines user code in child processes.
"""
