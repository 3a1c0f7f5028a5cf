"""Playbook training service: the Deep Learning Tuning Playbook's practices on Ray."""

__version__ = "0.1.0"
